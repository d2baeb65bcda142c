"""Running untrusted Python code: one fresh, limited subprocess per run.

Each run gets:

- a fresh interpreter (``-I -S``: no site-packages, no user site, ``PYTHON*`` variables
  ignored) started with an EMPTY environment (no NATS credentials, no run token, no
  ``ASYNCRL_*`` variables) and stdin closed;
- a fresh scratch directory as its cwd, removed afterwards;
- resource limits (``setrlimit``): CPU seconds, address space, processes, file size,
  open files, no core files;
- a wall-clock timeout after which its whole process group is killed;
- when the parent runs as root: a distinct unprivileged uid/gid per run (so the process
  limit holds, which Linux never enforces for root; files private to root, such as a run
  folder's 0600 ``nats.json``, are unreadable; and concurrent runs cannot touch each
  other), a network namespace of its own (no interface but a down loopback: no network),
  and at the end every process left under that uid is killed, including any that left
  the process group;
- when not root: the same limits and empty environment, but the code runs as the
  parent's user, so it can read that user's other files; a network namespace is tried
  through an unprivileged user namespace and skipped if the machine forbids it.

:func:`probe` says, once per process, which of these the machine allows (the ``python``
tool repeats it in its description). The limits are set by a small launcher (a separate
``python -I -S -c``), not by ``preexec_fn``: ``preexec_fn`` is unsafe in a process with
threads, and a rollout actor has many.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SANDBOX_UID_BASE = 0x50000000
"""First uid (and gid) of the per-run users; far above any real account's id."""
RUNS_PER_PROCESS = 256
"""Runs of one process whose uids differ: more concurrent runs than this would share."""
SANDBOX_UID_SPAN = (1 << 22) * RUNS_PER_PROCESS
"""Linux pids are below 2**22, so ``pid * RUNS_PER_PROCESS + run`` is unique per process."""

LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
netns = False
if cfg["netns"]:
    flags = CLONE_NEWNET if os.getuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    netns = libc.unshare(flags) == 0
if cfg["require_netns"] and not netns:
    sys.exit(97)
for name, (soft, hard) in cfg["limits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
os.execv(cfg["python"], [cfg["python"], "-I", "-S", *cfg["argv"]])
"""
"""Runs as the parent's user: unshares the network, sets the limits, drops to the run's
uid, then execs the sandboxed interpreter. Exit status 97: a required namespace failed."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. ``cpu_s`` is CPU time per process (the kernel sends SIGXCPU,
    then SIGKILL a second later); ``wall_s`` bounds the whole run."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 16
    file_mb: int = 16
    open_files: int = 64
    output_chars: int = 4000

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """``(soft, hard)`` per limit; the CPU's hard limit is a second later, so the
        kernel's SIGXCPU says why before its SIGKILL."""
        return {
            "RLIMIT_CPU": (self.cpu_s, self.cpu_s + 1),
            "RLIMIT_AS": (self.memory_mb << 20,) * 2,
            "RLIMIT_NPROC": (self.processes,) * 2,
            "RLIMIT_FSIZE": (self.file_mb << 20,) * 2,
            "RLIMIT_NOFILE": (self.open_files,) * 2,
            "RLIMIT_CORE": (0, 0),
        }


@dataclass(frozen=True)
class Capabilities:
    """What the machine lets the sandbox do (see :func:`probe`)."""

    python: str
    separate_user: bool
    network_isolated: bool

    def describe(self) -> str:
        user = (
            "as a separate unprivileged user"
            if self.separate_user
            else "as the same user (other files of that user are readable)"
        )
        net = "without network" if self.network_isolated else "WITH network access"
        return f"in a fresh limited subprocess, {user}, {net}"


@dataclass(frozen=True)
class RunResult:
    """How a run ended: ``exit_status`` (None if killed by a signal, then ``signal``),
    whether the wall clock ran out, and the tail of stdout and stderr together."""

    output: str
    exit_status: int | None
    signal: int | None
    timed_out: bool


_uids = itertools.count()


def _run_uid() -> int | None:
    if os.getuid() != 0:
        return None
    slot = (os.getpid() % (1 << 22)) * RUNS_PER_PROCESS + next(_uids) % RUNS_PER_PROCESS
    return SANDBOX_UID_BASE + slot


def _config(python: str, uid: int | None, limits: Limits, argv: list[str], netns: bool) -> str:
    return json.dumps(
        {
            "python": python,
            "uid": uid,
            "limits": limits.rlimits(),
            "argv": argv,
            "netns": netns,
            "require_netns": False,
        }
    )


def _candidates() -> list[str]:
    found = [os.path.realpath(sys.executable)]
    for name in ("/usr/bin/python3", shutil.which("python3")):
        if name and os.path.realpath(name) not in found:
            found.append(os.path.realpath(name))
    return found


@functools.cache
def probe() -> Capabilities:
    """Which interpreter the sandbox user can run, and whether a network namespace can be
    made, found by trying both once (about 0.1 s per candidate)."""
    uid = _run_uid()
    netns_ok = False
    python = ""
    for candidate in _candidates():
        for require_netns in (True, False):
            cfg = json.loads(_config(candidate, uid, Limits(), ["-c", "pass"], netns=True))
            cfg["require_netns"] = require_netns
            done = subprocess.run(
                [sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(cfg)],
                env={},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd="/",
                timeout=30,
                check=False,
            )
            if done.returncode == 0:
                python, netns_ok = candidate, require_netns
                break
        if python:
            break
    if not python:
        raise RuntimeError("no Python interpreter can run inside the sandbox")
    return Capabilities(python, uid is not None, netns_ok)


async def run_python(code: str, limits: Limits = Limits()) -> RunResult:
    """Runs ``code`` in the sandbox (see the module docstring) and returns how it ended.

    Never raises for anything the code does; the run's processes are gone when it returns.
    """
    caps = probe()
    uid = _run_uid()
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
    try:
        (scratch / "main.py").write_text(code)
        if uid is not None:
            for path in (scratch, scratch / "main.py"):
                os.chown(path, uid, uid)
        config = _config(caps.python, uid, limits, ["main.py"], caps.network_isolated)
        # Output goes to an unlinked file, not a pipe: children left behind would hold a
        # pipe open, and the file's size is bounded by the run's own file-size limit.
        with tempfile.TemporaryFile() as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                "-c",
                LAUNCHER,
                config,
                cwd=scratch,
                env={},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
            timed_out = False
            try:
                async with asyncio.timeout(limits.wall_s):
                    await proc.wait()
            except TimeoutError:
                timed_out = True
            finally:
                # The run ends with its main process; what it left behind goes with it.
                _kill_group(proc.pid)
                if uid is not None:
                    await _kill_user(uid)
                await proc.wait()
            output = _tail(out, 4 * limits.output_chars).decode(errors="replace")
        status = proc.returncode
        if len(output) > limits.output_chars:
            output = "[...]\n" + output[-limits.output_chars :]
        return RunResult(
            output,
            status if status is not None and status >= 0 else None,
            -status if status is not None and status < 0 else None,
            timed_out,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _tail(file: BinaryIO, keep: int) -> bytes:
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - keep))
    return file.read()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


KILL_USER = "import os, sys; u = int(sys.argv[1]); os.setgid(u); os.setuid(u); os.kill(-1, 9)"
"""Kills every process of a uid: ``kill(-1)`` from a process running as that uid reaches
exactly the processes it may signal, i.e. those of the same uid."""


async def _kill_user(uid: int) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        "-c",
        KILL_USER,
        str(uid),
        env={},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await proc.wait()
