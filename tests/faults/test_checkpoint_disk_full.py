"""A full disk while checkpointing: a clear error, and the previous checkpoint intact and
still the latest (each checkpoint is written under a temporary name, then renamed).

The disk fills for real as far as the code can tell: every file opened for writing under
the new checkpoint's folder gets a byte budget, and the write that crosses it writes what
fits and raises ``OSError(ENOSPC)``, as a full filesystem does."""

from __future__ import annotations

import builtins
import errno
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers.tiny import full_weights, one_torch_thread, random_batch, resume_engine

from asyncrl.train.checkpoint import CheckpointError, commit_checkpoint, latest_checkpoint_meta
from asyncrl.train.engine import TrainEngine


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


class _Quota:
    """A writable file that shares its disk's byte budget."""

    def __init__(self, f: Any, disk: FullDisk, name: str) -> None:
        self._f, self._disk, self._name = f, disk, name

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        room = self._disk.budget - self._disk.used
        if n > room:
            self._f.write(memoryview(data).cast("B")[: max(0, room)])
            self._disk.used = self._disk.budget
            self._disk.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)
        self._disk.used += n
        return int(self._f.write(data))

    def __enter__(self) -> _Quota:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class FullDisk:
    """``open`` for files under ``root``, with ``budget`` bytes left on the disk."""

    def __init__(self, root: Path, budget: int, real_open: Callable[..., Any]) -> None:
        self.root, self.budget, self.used, self.refused = root, budget, 0, 0
        self._real_open = real_open

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self._real_open(file, mode, *args, **kwargs)
        writing = any(c in mode for c in "wax+")
        if writing and isinstance(file, str | os.PathLike) and Path(file).is_relative_to(self.root):
            return _Quota(f, self, os.fspath(file))
        return f


def save(engine: TrainEngine, step: int) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        engine.save_checkpoint(folder, {"step": step})
        engine.export_hf(folder / "hf")

    return write


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_full_disk_mid_checkpoint_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    engine = resume_engine()
    engine.train_step(random_batch(0))
    first = ckpts / "step_000001"
    commit_checkpoint(run_dir, first, 1, save(engine, 1))
    weights_at_1 = full_weights(engine)
    before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}

    engine.train_step(random_batch(1))
    second = ckpts / "step_000002"
    # room for about half of what a checkpoint of this model takes
    disk = FullDisk(ckpts / "step_000002.partial", folder_bytes(first) // 2, io.open)
    monkeypatch.setattr(io, "open", disk.open)
    monkeypatch.setattr(builtins, "open", disk.open)
    with pytest.raises(CheckpointError) as err:
        commit_checkpoint(run_dir, second, 2, save(engine, 2))
    monkeypatch.undo()
    assert disk.refused >= 1 and disk.used == disk.budget  # it did fill up part way
    text = str(err.value)
    assert "could not write the checkpoint of step 2" in text and str(second) in text
    assert "No space left on device" in text
    assert f"{first.resolve()} is intact and still the latest" in text

    # the previous checkpoint: still the latest, byte for byte, and it loads
    assert latest_checkpoint_meta(run_dir) == {
        "path": str(first.resolve()),
        "step": 1,
        "version": 1,
    }
    assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step_000001"]
    fresh = resume_engine()
    assert fresh.load_checkpoint(first) == {"step": 1}
    restored = full_weights(fresh)
    for name, tensor in weights_at_1.items():
        torch.testing.assert_close(restored[name], tensor, rtol=0, atol=0, msg=name)

    # with room again, the same step saves and becomes the latest
    commit_checkpoint(run_dir, second, 2, save(engine, 2))
    assert latest_checkpoint_meta(run_dir) == {
        "path": str(second.resolve()),
        "step": 2,
        "version": 2,
    }
    assert (second / "trainer_state.json").is_file() and (second / "hf").is_dir()
