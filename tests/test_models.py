"""Model resolution and the once-only, crash-safe cache builds."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.models.resolve import (
    SMOLLM2_NAME,
    TINY_NAME,
    cache_root,
    materialize,
    resolve_model_path,
    smollm2_gguf_path,
)


def test_resolution_of_local_dirs_hub_ids_and_aliases(tmp_path: Path, monkeypatch):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    tiny = Path(resolve_model_path(TINY_NAME))
    assert (tiny / "config.json").is_file()
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"


def test_smollm2_gguf_ships_with_the_package():
    path = smollm2_gguf_path()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000


BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from asyncrl.models.resolve import materialize

    target, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        (tmp / "part1").write_text("a")
        time.sleep(0.3)  # widen the window in which a reader could see a half-built dir
        (tmp / "part2").write_text("b")

    out = materialize(target, build)
    print(sorted(p.name for p in out.iterdir()))
    """
)


def test_concurrent_processes_build_once_and_never_see_half_a_build(tmp_path: Path):
    target, log = tmp_path / "cache" / "thing", tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(target), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs == ["['part1', 'part2']"] * 4
    assert len(log.read_text().split()) == 1  # one process built, the others waited
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_failed_build_leaves_no_target_and_no_temp_dir(tmp_path: Path):
    target = tmp_path / "cache" / "broken"

    def build(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        materialize(target, build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == ["broken.lock"]
    assert materialize(target, lambda tmp: (tmp / "ok").write_text("y")) == target
    assert (target / "ok").read_text() == "y"


@pytest.mark.slow
def test_smollm2_loads_offline_with_its_chat_template():
    from asyncrl.models.resolve import load_causal_lm, load_tokenizer

    path = Path(resolve_model_path(SMOLLM2_NAME))
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    tok = load_tokenizer(SMOLLM2_NAME)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    model = load_causal_lm(SMOLLM2_NAME, "float32")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None
