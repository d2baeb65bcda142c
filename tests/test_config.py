"""Recipe loading: defaults, overrides, and bad recipes that name the key."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from asyncrl.config.recipe import Recipe, RecipeError, apply_overrides, dump_recipe, load_recipe


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.toml"
    p.write_text(text)
    return p


def test_defaults_validate() -> None:
    r = load_recipe(None)
    assert r.buffer.max_head_offpolicyness == 2
    assert r.data.type == "arithmetic"


def test_overrides_are_typed() -> None:
    r = load_recipe(
        None,
        [
            "trainer.optim.lr=3e-5",
            "buffer.dynamic_filter=true",
            "run.name=abc",
            "rollout.sampling.top_k=5",
        ],
    )
    assert r.trainer.optim.lr == 3e-5
    assert r.buffer.dynamic_filter is True
    assert r.run.name == "abc"
    assert r.rollout.sampling.top_k == 5


def test_unknown_key_names_path_and_allowed(tmp_path: Path) -> None:
    p = write(tmp_path, "[trainer]\nmax_step = 3\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(p)
    msg = str(info.value)
    assert "trainer.max_step" in msg and "unknown key" in msg and "max_steps" in msg


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    p = write(tmp_path, '[buffer]\nbatch_size = "many"\n')
    with pytest.raises(RecipeError, match=r"buffer\.batch_size"):
        load_recipe(p)


def test_bad_literal_lists_allowed_values() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(None, ["trainer.loss.loss_agg=mean"])
    assert "trainer.loss.loss_agg" in str(info.value) and "token-mean" in str(info.value)


def test_discriminated_data_union(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1", "answer": "#### 2"}\n')
    r = load_recipe(None, ["data.type=jsonl", f"data.path={data}"])
    assert r.data.type == "jsonl"
    with pytest.raises(RecipeError, match=r"data"):
        load_recipe(None, ["data.type=parquet"])


def test_missing_local_paths_fail_early(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"model\.path"):
        load_recipe(None, [f"model.path={tmp_path}/nope"])
    with pytest.raises(RecipeError, match=r"data\.path"):
        load_recipe(None, ["data.type=jsonl", f"data.path={tmp_path}/missing.jsonl"])
    with pytest.raises(RecipeError, match=r"model\.path"):
        load_recipe(None, ["model.path="])


def test_bad_override_syntax() -> None:
    with pytest.raises(RecipeError, match=r"key\.path=value"):
        apply_overrides({}, ["trainer.lr"])


def test_dump_round_trips(tmp_path: Path) -> None:
    r = load_recipe(None, ["run.name=x", "trainer.max_steps=7"])
    again = Recipe.model_validate(tomllib.loads(dump_recipe(r)))
    assert again == r


def test_every_field_is_documented() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, f in model.model_fields.items():  # type: ignore[attr-defined]
            if not f.description:
                missing.append(f"{model.__name__}.{name}")
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(Recipe) == []


def test_shipped_recipes_validate() -> None:
    recipes = sorted(Path(__file__).parent.parent.joinpath("recipes").glob("*.toml"))
    for p in recipes:
        if "[sft]" in p.read_text():
            continue  # SFT: tests/test_sft.py
        load_recipe(p)


def test_cli_starts_without_torch() -> None:
    code = "import sys, asyncrl.entry.cli; assert 'torch' not in sys.modules; assert 'nats' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_check_reports_bad_key(tmp_path: Path) -> None:
    p = write(tmp_path, "[rollout]\ngroup_sise = 4\n")
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", str(p)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "rollout.group_sise" in out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", "--set", "trainer.max_steps=3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "max_steps = 3" in ok.stdout


def test_role_cpus_must_exist_on_the_machine() -> None:
    count = os.cpu_count() or 1
    r = load_recipe(None, ["rollout.cpus=[0]", f"trainer.cpus=[{count - 1}]"])
    assert r.rollout.cpus == [0] and r.trainer.cpus == [count - 1] and r.eval.cpus == []
    with pytest.raises(RecipeError, match=rf"trainer\.cpus: \[{count}\] not on this machine"):
        load_recipe(None, ["rollout.cpus=[0]", f"trainer.cpus=[0, {count}]"])
    with pytest.raises(RecipeError, match=r"eval\.cpus\.0"):
        load_recipe(None, ["eval.cpus=[-1]"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pin_cpus_sets_the_affinity_or_names_the_key() -> None:
    code = (
        "import os; from asyncrl.runtime.cores import pin_cpus; "
        "pin_cpus('rollout', [0]); print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0]"
    bad = "from asyncrl.runtime.cores import pin_cpus; pin_cpus('trainer', [4096])"
    out = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True)
    assert out.returncode == 1 and "trainer.cpus = [4096]: cannot pin" in out.stderr
