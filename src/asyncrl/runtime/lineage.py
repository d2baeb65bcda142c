"""Every process a run started, grandchildren included: found, stopped, waited for.

The supervisor starts each actor in a session of its own, but what an actor starts may
leave that session: an inference server runs under its guard in a session of its own
(:mod:`asyncrl.entry.server_guard`), and so may anything that calls ``setsid``. Once the
actor is dead its children are reparented, so there is no tree left to walk. Two marks
find them all instead:

- the session: the processes of an actor's session (its session id is the actor's pid,
  kept while any member lives, so never reused meanwhile);
- the environment: each actor starts with ``ASYNCRL_LINEAGE=<run token>:<actor id>``
  (:data:`LINEAGE_ENV`), which whatever it starts inherits, in any session;
  ``/proc/<pid>/environ`` keeps the environment a process started with.

A process that cleared its environment *and* left the session escapes both (a tool
sandbox does, and ends what it started itself). Linux only (``/proc``, ``pidfd_open``):
elsewhere nothing is found, and the supervisor's process-group signals are all there is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

LINEAGE_ENV = "ASYNCRL_LINEAGE"
"""``<run token>:<actor id>`` in the environment of every process an actor started with."""

KILL_WAIT_S = 10.0
"""Seconds to wait for processes sent SIGKILL to be gone (the kernel frees a GPU's memory
of a dying process before it is gone; a process stuck in the kernel may take longer, and
is then reported rather than waited for)."""

KILL_ROUNDS = 3
"""Times the marks are looked up again after a SIGKILL: a process may start another just
before it dies."""


def lineage_env(token: str, actor_id: str) -> dict[str, str]:
    """The variable that marks every process ``actor_id`` starts (see the module)."""
    return {LINEAGE_ENV: f"{token}:{actor_id}"}


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, session id) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return fields[0], int(fields[3])


def _started_with(pid: str, mark: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return mark in b"\0" + environ


def find(sessions: Iterable[int], token: str, actor_id: str | None = None) -> list[int]:
    """Live processes (zombies are dead) in one of ``sessions``, or started with the run
    ``token``'s mark (``actor_id``'s only, when given), this process excepted."""
    in_sessions = set(sessions)
    # the whole entry for one actor, the token's prefix for the run
    tail = f"{actor_id}\0" if actor_id else ""
    mark = f"\0{LINEAGE_ENV}={token}:{tail}".encode()
    me = str(os.getpid())
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or entry.name == me:
                continue
            stat = _stat(entry.name)
            if stat is None or stat[0] in "ZX":
                continue
            if stat[1] in in_sessions or _started_with(entry.name, mark):
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    stat = _stat(str(pid))
    return stat is not None and stat[0] not in "ZX"


async def _gone(pid: int) -> None:
    """Returns once ``pid`` has exited; it need not be a child (a pidfd tells)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        if alive(pid):
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def wait_gone(pids: Iterable[int], limit_s: float) -> list[int]:
    """Waits up to ``limit_s`` seconds for every one of ``pids`` to exit; returns those
    still running then."""
    pids = list(pids)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(limit_s):
            for pid in pids:
                await _gone(pid)
    return [pid for pid in pids if alive(pid)]


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


async def end(members: Callable[[], list[int]], grace: float) -> list[int]:
    """Ends every process ``members()`` finds: SIGTERM, up to ``grace`` seconds for them
    to exit (none with ``grace = 0``), then SIGKILL to whatever is found then, and a wait
    for it to be gone (:data:`KILL_WAIT_S`), looking again each round
    (:data:`KILL_ROUNDS`). Returns the processes still running at the end (none, unless a
    process is stuck in the kernel)."""
    pids = members()
    if pids and grace > 0:
        _signal_all(pids, signal.SIGTERM)
        await wait_gone(pids, grace)
    for _ in range(KILL_ROUNDS):
        pids = members()
        if not pids:
            return []
        _signal_all(pids, signal.SIGKILL)
        await wait_gone(pids, KILL_WAIT_S)
    return members()


def naming(run_dir: Path) -> list[int]:
    """Pids of the processes whose command line names ``run_dir`` as one argument: a run's
    actors, seen from outside the run (a test, a bench), which has no run token."""
    needle = str(run_dir).encode()
    pids = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue  # gone already, or not ours to read
            if needle in cmdline.split(b"\0"):
                pids.append(int(entry.name))
    return pids


def kill_run(up_pid: int, run_dir: Path) -> None:
    """SIGKILL, from outside, to what is left of the run ``run_dir`` that ``up`` (``up_pid``,
    started in a session of its own) runs: ``up``'s process group, the group of each of the
    run's actors (:func:`naming`), and each such process in the caller's own group (one the
    caller started for the run, say ``asyncrl attach``), which is spared as a group."""
    groups, own = {up_pid}, os.getpgrp()
    for pid in naming(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) != own:
                groups.add(os.getpgid(pid))
            elif pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
    groups.discard(own)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
