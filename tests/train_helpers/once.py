"""A folder made once for a whole test session, however many pytest-xdist workers ask.

A module-scoped fixture is made once per worker: with ``make test``'s two workers, the
tests that share one (a torchrun of the worker script, a dozen seconds of CPU) are dealt
to both, and both made it. ``made_once`` keeps the folder under the session's shared
temporary root: the first worker to ask makes it under a file lock, the others wait for
that lock and read what it left.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The folder ``name``, made by ``make(folder)`` once in this session. A ``make`` that
    raised leaves no folder behind: the next to ask tries again (and fails its own test)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/popen-gwK: pytest-N is shared by the workers
    folder = root / f"once-{name}"
    done = folder / ".made"
    with (root / f"once-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder
