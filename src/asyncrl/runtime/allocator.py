"""mimalloc for the processes that train a torch model on the CPU.

glibc's malloc serves each block above its mmap threshold with an ``mmap`` of its own and
unmaps it when freed, and a worker thread's arena does so for every block over 64 MB
whatever the settings. A CPU train step allocates its activations and gradients afresh
each time, so the kernel zeroes and faults in about a million pages a step (a fifth of a
SmolLM2 step's CPU time; ``bench/trainer.py --compare-malloc``). mimalloc keeps what the
process frees in its own arenas and hands it back lazily (``MADV_FREE``): the pages stay
mapped, and a later step reuses them without a fault unless the kernel took them back for
someone else in between.

A process cannot change its allocator once it runs, so :func:`use_mimalloc` executes the
same command again with mimalloc preloaded (``LD_PRELOAD``); the process id stays, so
supervisors, torchrun and Ray see nothing. ``asyncrl up`` and ``asyncrl sft`` spare their
trainers that second start: they preload it in the child's environment
(:func:`mimalloc_preload`). The library comes from the ``cmeel-mimalloc``
wheel (a dependency on Linux x86_64 and aarch64); without it, or elsewhere, the process
keeps the C library's malloc."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.runtime.cores import is_cpu_device

if TYPE_CHECKING:
    from asyncrl.train.config import TrainerConfig

REEXEC_ENV = "ASYNCRL_MIMALLOC"
"""Set (to the library's path) in the command that :func:`use_mimalloc` runs again, so
that a preload the dynamic loader refused cannot start a loop of executions."""

PURGE_ENV = "MIMALLOC_PURGE_DECOMMITS"
"""0: mimalloc gives freed memory back with ``MADV_FREE`` (reclaimed by the kernel only
under memory pressure, reused without a page fault otherwise) instead of decommitting it
(zeroed pages again on reuse). A user's own setting, like any ``MIMALLOC_*``, is kept."""


def wheel_platform() -> bool:
    """Whether ``cmeel-mimalloc`` is a dependency here (pyproject's marker: Linux on x86_64
    or aarch64), so that a missing library is a broken install, not a platform without
    it."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def mimalloc_library() -> Path | None:
    """The shared mimalloc library of the installed ``cmeel-mimalloc`` wheel, or None."""
    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "libmimalloc.so":
            path = Path(str(file.locate())).resolve()
            return path if path.is_file() else None
    return None


def loaded_mimalloc() -> bool:
    """Whether mimalloc is mapped into this process (Linux; False elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libmimalloc" in maps


def preload_vars(library: Path) -> dict[str, str]:
    """The variables that, added to this process's environment, preload ``library`` first
    (before any preload the user set) and have freed memory given back lazily unless the
    user said otherwise."""
    others = [p for p in os.environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    out = {"LD_PRELOAD": ":".join([str(library), *others])}
    if PURGE_ENV not in os.environ:
        out[PURGE_ENV] = "0"
    return out


def preload_env(library: Path) -> dict[str, str]:
    """This process's environment with :func:`preload_vars` applied."""
    return {**os.environ, **preload_vars(library)}


def _library_or_why() -> Path | str:
    """The library to preload here, or why there is none (not Linux, no wheel)."""
    if not wheel_platform():
        return (
            "the C library's malloc (mimalloc is preloaded on Linux x86_64 and aarch64 only, "
            f"not {sys.platform} {platform.machine()})"
        )
    library = mimalloc_library()
    if library is None:
        return "the C library's malloc (the cmeel-mimalloc wheel is not installed)"
    return library


def mimalloc_preload() -> dict[str, str]:
    """The variables a child process needs, beside this process's environment, to start
    with mimalloc preloaded; none where it cannot (not Linux, no wheel) or this process has
    it already (a child then inherits it). A trainer started so skips
    :func:`use_mimalloc`'s second execution."""
    if loaded_mimalloc():
        return {}
    library = _library_or_why()
    return preload_vars(library) if isinstance(library, Path) else {}


def mimalloc_env() -> dict[str, str] | None:
    """The whole environment in which a child process starts with mimalloc preloaded, or
    None (see :func:`mimalloc_preload`)."""
    extra = mimalloc_preload()
    return {**os.environ, **extra} if extra else None


def use_mimalloc() -> str:
    """Runs this process's command again with mimalloc preloaded, unless it has it already
    (then returns ``"mimalloc"``) or cannot: not Linux, no ``cmeel-mimalloc`` wheel, or a
    preload that already failed once (then returns why, and the process carries on with
    the C library's malloc). Call it first thing, before threads or open resources that
    the new image would lose. Does not return when it executes the command again."""
    if loaded_mimalloc():
        return "mimalloc"
    library = _library_or_why()
    if isinstance(library, str):
        return library
    if os.environ.get(REEXEC_ENV):
        return f"the C library's malloc (the dynamic loader did not preload {library})"
    env = preload_env(library)
    env[REEXEC_ENV] = str(library)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")  # pragma: no cover


def system_malloc_reason(trainer: TrainerConfig) -> str | None:
    """Why a trainer process with these settings keeps the C library's malloc, or None
    when it runs under mimalloc."""
    if trainer.allocator == "system":
        return "the C library's malloc (trainer.allocator = system)"
    if not is_cpu_device(trainer.device):
        return "the C library's malloc (the trainer computes on a GPU)"
    return None
