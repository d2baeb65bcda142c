"""What the actors build from a recipe: engines and checkpoint pointers.

Heavy imports (torch, transformers) happen inside the functions, so an actor module
loads quickly and only the roles that need a model pay for one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

CHECKPOINT_POINTER = "latest.json"


def latest_checkpoint_meta(run_dir: Path) -> dict[str, Any] | None:
    """``{"path", "step", "version", "data_state"}`` of the newest complete checkpoint."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    if not pointer.is_file():
        return None
    meta: dict[str, Any] = json.loads(pointer.read_text())
    return meta


def write_checkpoint_meta(run_dir: Path, path: Path, extra: dict[str, Any]) -> None:
    """Points ``latest.json`` at a finished checkpoint (atomically: a crash mid-save
    leaves the previous pointer in place)."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"path": str(path.resolve()), **extra}))
    os.replace(tmp, pointer)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); the previous one is
    intact and still the latest."""


def commit_checkpoint(
    run_dir: Path, path: Path, extra: dict[str, Any], write: Callable[[Path], None]
) -> None:
    """Writes a checkpoint with ``write(folder)`` under a temporary name, renames the
    folder to ``path`` once it is whole, and only then points ``latest.json`` at it.

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
        write_checkpoint_meta(run_dir, path, extra)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        latest = latest_checkpoint_meta(run_dir)
        kept = f"{latest['path']} is intact and still the latest" if latest else "none before"
        raise CheckpointError(
            f"could not write the checkpoint of step {extra.get('step')} to {path}: "
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


def dist_rank() -> int:
    """This process's rank under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0"))
