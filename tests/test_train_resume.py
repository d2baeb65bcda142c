"""Resume: 3 steps, save, restore in a fresh process, 2 more steps == 5 uninterrupted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_helpers.tiny import full_weights, one_torch_thread, random_batch, resume_engine

WORKER = Path(__file__).parent / "train_helpers" / "worker.py"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.mark.slow
def test_resume_in_fresh_process_matches_uninterrupted(tmp_path: Path) -> None:
    straight = resume_engine()
    straight_losses = [straight.train_step(random_batch(step))["loss"] for step in range(5)]
    expected = full_weights(straight)

    first = resume_engine()
    for step in range(3):
        first.train_step(random_batch(step))
    first.save_checkpoint(tmp_path / "ckpt", {"dataset_pos": 3, "note": "after 3"})
    assert (tmp_path / "ckpt" / "trainer_state.json").is_file()

    out = tmp_path / "resumed.pt"
    subprocess.run(
        [
            sys.executable,
            str(WORKER),
            "resume",
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--out",
            str(out),
        ],
        check=True,
        timeout=240,
    )
    resumed = torch.load(out, weights_only=True)

    assert resumed["extra"] == {"dataset_pos": 3, "note": "after 3"}
    assert resumed["step"] == 5
    assert resumed["losses"] == pytest.approx(straight_losses[3:], abs=1e-6)
    assert resumed["weights"].keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_step_after_restore_differs_without_the_rng(tmp_path: Path) -> None:
    """The dropout in resume_engine() draws from the RNG, so the resume test above would
    fail if the RNG were not restored; this checks that premise."""
    engine = resume_engine()
    engine.train_step(random_batch(0))
    engine.save_checkpoint(tmp_path / "ckpt", {})
    a = engine.train_step(random_batch(1))["loss"]
    engine.load_checkpoint(tmp_path / "ckpt")
    b = engine.train_step(random_batch(1))["loss"]
    engine.load_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(12345)
    c = engine.train_step(random_batch(1))["loss"]
    assert a == b
    assert a != c


def test_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    engine = resume_engine()
    (tmp_path / "ckpt" / "dcp").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_the_latest_checkpoint_is_read_without_torch(tmp_path: Path) -> None:
    """``up`` and the buffer read the latest checkpoint's progress (from the checkpoint
    the engine wrote; ``latest.json`` only names it) without loading torch."""
    ckpt = tmp_path / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"step": 3, "version": 4, "extra_state": {}}')
    code = (
        "import sys; from pathlib import Path\n"
        "from asyncrl.train.checkpoint import latest_checkpoint_meta, write_checkpoint_meta\n"
        f"run = Path({str(tmp_path)!r})\n"
        "assert latest_checkpoint_meta(run) is None\n"
        f"write_checkpoint_meta(run, Path({str(ckpt)!r}))\n"
        f"assert latest_checkpoint_meta(run) == {{'path': {str(ckpt.resolve())!r}, 'step': 3, 'version': 4}}\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
