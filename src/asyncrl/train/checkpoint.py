"""Checkpoints of the train engine: writing and restoring them (DCP, resumable), committing
one atomically as the run's latest, and exporting the weights (HF safetensors, or a
bucketed stream of full weights for the inference side, :mod:`asyncrl.train.dcp`).

A checkpoint directory holds::

    dcp/                 model + optimizer, sharded by torch.distributed.checkpoint
                         (a checkpoint saved on N ranks loads on M)
    rng/rank<r>.pt       each rank's torch RNG state(s)
    trainer_state.json   the engine's progress (step, version) and the caller's extra_state
                         (a run's checkpoints: ``weights_sha256``, the digest of the
                         weights that ``asyncrl replay`` checks, :data:`WEIGHTS_SHA256`)
    hf/                  (a run's checkpoints) the policy as plain HF weights

A run's checkpoints live in ``<run>/checkpoints/step_<step>/``, and ``latest.json`` there
points at the newest complete one. One scheme makes that atomic
(:func:`commit_checkpoint`): a checkpoint is written under a temporary name, renamed once
whole, and only then pointed at; nothing reads a folder ``latest.json`` does not name.
The step and version live in the checkpoint alone (its ``trainer_state.json``, written by
the engine that owns them); :func:`latest_checkpoint_meta` reads them from there.

This module is the folder protocol alone and imports no torch: the run's launcher, the
buffer and eval read the latest checkpoint's progress without loading it. Writing and
reading the state itself is :mod:`asyncrl.train.dcp`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
CHECKPOINT_POINTER = "latest.json"
"""The file in ``<run>/checkpoints`` that names the newest complete checkpoint."""
WEIGHTS_SHA256 = "weights_sha256"
"""The key, in a run checkpoint's ``extra_state``, of the SHA-256 of its weights
(:func:`asyncrl.train.dcp.weights_sha256`)."""


def latest_checkpoint_meta(run_dir: Path) -> dict[str, Any] | None:
    """``{"path", "step", "version"}`` of the run's newest complete checkpoint (the step
    and version from the checkpoint itself), or None before the first."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    if not pointer.is_file():
        return None
    path = Path(json.loads(pointer.read_text())["path"])
    state = json.loads((path / STATE_FILE).read_text())
    return {"path": str(path), "step": int(state["step"]), "version": int(state["version"])}


def run_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's complete checkpoints by step, oldest first: the ``step_*`` folders with
    their state file (a ``.partial`` folder, or one a crash left without it, is none)."""
    found = {}
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.is_dir() and path.name[5:].isdigit() and (path / STATE_FILE).is_file():
            found[int(path.name[5:])] = path
    return dict(sorted(found.items()))


def checkpoint_weights_sha256(path: Path) -> str | None:
    """The SHA-256 of the weights the checkpoint at ``path`` recorded, or None (a
    checkpoint from before they were recorded)."""
    state = json.loads((path / STATE_FILE).read_text())
    digest = state.get("extra_state", {}).get(WEIGHTS_SHA256)
    return str(digest) if digest else None


def write_checkpoint_meta(run_dir: Path, path: Path) -> None:
    """Points ``latest.json`` at the finished checkpoint ``path`` (atomically: a crash
    leaves the previous pointer in place)."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"path": str(path.resolve())}))
    os.replace(tmp, pointer)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); the previous one is
    intact and still the latest."""


def commit_checkpoint(run_dir: Path, path: Path, step: int, write: Callable[[Path], None]) -> None:
    """Writes the checkpoint of ``step`` with ``write(folder)`` under a temporary name,
    renames the folder to ``path`` once it is whole, and only then points ``latest.json``
    at it.

    A ``step_*`` folder is therefore always complete. If anything fails on the way (a
    full disk: ``ENOSPC``), the half-written folder is removed to give the space back and
    :class:`CheckpointError` says what failed and which checkpoint is still the latest;
    nothing the previous checkpoint holds was touched.
    """
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left over from a crash mid-save
    try:
        write(partial)
        if path.exists():  # the same step saved again (a resumed run): replace it whole
            shutil.rmtree(path)
        partial.rename(path)
        write_checkpoint_meta(run_dir, path)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        latest = latest_checkpoint_meta(run_dir)
        kept = f"{latest['path']} is intact and still the latest" if latest else "none before"
        raise CheckpointError(
            f"could not write the checkpoint of step {step} to {path}: "
            f"{_root_cause(exc)}; the previous checkpoint: {kept}"
        ) from exc


def _root_cause(exc: BaseException) -> str:
    """The OS error under ``exc``, else ``exc`` itself, as ``Type: message``.

    A full disk rarely surfaces as itself: torch's zip writer fails on its way out with a
    ``RuntimeError`` whose context is the ``OSError``, and DCP wraps that per rank in a
    ``CheckpointException`` (its ``failures``), so the causes, contexts and failures are
    searched."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # DCP: rank -> (exception, traceback)
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(first, BaseException):
                    todo.append(first)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
