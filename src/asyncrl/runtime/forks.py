"""``up``'s side of the fork server (:mod:`asyncrl.entry.fork_server`): it starts the
server, asks it for actor processes, and hands the supervisor a process object for each
that behaves as an ``asyncio`` subprocess does (``pid``, ``returncode``, ``wait()``).

Where it is used (``run.actor_start = "auto"``, :func:`fork_server_reason`): a run whose
actors all run on this machine's CPU. Not on a GPU machine, where a process must not
inherit a CUDA context and an import is a small part of starting; not under Ray, whose
workers start the processes. The trainer of several ranks or nodes (torchrun, or on one
CPU node :mod:`asyncrl.entry.ranks`, which forks its ranks itself) and every command that
is not an actor's are executed as before.

The server is started with the trainer's load-time variables (its allocator preload and
its OpenMP wait policy, where ``up`` gives it those), so a forked trainer runs as an
executed one would; every forked role shares them. Should the server die, the actors it
started are stopped and the run fails: their exit codes are lost with it (each is then
reported as :data:`UNKNOWN_EXIT` once its process is gone), and ``--resume`` goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.runtime import lineage
from asyncrl.runtime.cores import gpu_visible
from asyncrl.runtime.log import get_logger
from asyncrl.runtime.nats_server import PASSWORD_ENV, TOKEN_ENV, USER_ENV
from asyncrl.runtime.zygote_socket import ZYGOTE_ENV as ZYGOTE_ENV

SERVER_MODULE = "asyncrl.entry.fork_server"
ACTOR_MODULE = "asyncrl.entry.actor"

UNKNOWN_EXIT = 255
"""The return code of a forked actor that ended after the fork server that would have
told its status."""

ZYGOTE_WAIT_S = 120.0
"""Seconds ``up`` waits for a zygote's answer (it may still be importing)."""

CLOSE_WAIT_S = 10.0
"""Seconds the server gets to exit once its input is closed, before SIGKILL."""

LOAD_TIME_VARS = ("LD_PRELOAD", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables that take effect only when a process starts (the dynamic loader, GNU
OpenMP), so a forked actor has the server's: the server starts with the trainer's."""

CREDENTIAL_VARS = (TOKEN_ENV, USER_ENV, PASSWORD_ENV)
"""Kept out of the server's environment (:func:`server_env`)."""


def fork_server_reason(actor_start: str, *, ray: bool) -> str | None:
    """Why this run's actors are executed rather than forked, or None when they are
    forked (``run.actor_start``, Ray, a GPU, the platform)."""
    if actor_start == "exec":
        return "run.actor_start = exec"
    if ray:
        return "Ray starts the processes"
    if gpu_visible():
        return "a GPU is visible (a fork must not inherit CUDA)"
    if not sys.platform.startswith("linux"):
        return f"forked actors are for Linux, not {sys.platform}"
    return None


def server_env(trainer_env: dict[str, str]) -> dict[str, str]:
    """The server's environment: this process's, with the load-time variables of the
    trainer's environment ``trainer_env`` (:data:`LOAD_TIME_VARS`, ``MIMALLOC_*``), and
    without the NATS credentials, which ``up`` takes out of its own environment only
    once the server is started (a forked actor's ``/proc/<pid>/environ`` is the server's)."""
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
    return {**env, **load_time_vars(trainer_env)}


def load_time_vars(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that take effect only when a process starts."""
    return {k: v for k, v in env.items() if k in LOAD_TIME_VARS or k.startswith("MIMALLOC_")}


def forkable(argv: list[str]) -> bool:
    """Whether a command line is an actor's, which the server can run as a fork."""
    return argv[:3] == [sys.executable, "-m", ACTOR_MODULE]


class ForkedProcess:
    """An actor the server forked: what the supervisor uses of an ``asyncio`` process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode


async def _gone(pid: int) -> None:
    """Returns once ``pid``, a process this one cannot wait for (not its child), is gone."""
    while lineage.alive(pid):
        await lineage.wait_gone([pid], 3600.0)


class ZygoteServer:
    """A fork server that a zygote forked, speaking over a Unix socket: what
    :class:`ForkServer` uses of an ``asyncio`` process (``pid``, ``stdin``, ``stdout``,
    ``wait()``, ``kill()``). It is the zygote's child, not ``up``'s: its end is seen as its
    process going, and its exit status is :data:`UNKNOWN_EXIT`."""

    def __init__(
        self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.pid = pid
        self.stdout = reader
        self.stdin = writer
        self.returncode: int | None = None

    async def wait(self) -> int:
        await _gone(self.pid)
        self.returncode = UNKNOWN_EXIT
        return self.returncode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    @classmethod
    async def ask(
        cls, socket_path: str, run_dir: Path, env: dict[str, str], log_path: Path
    ) -> ZygoteServer | str:
        """The run's fork server from the zygote at ``socket_path``, or why there is none
        (the zygote refused, or cannot be reached)."""
        request = {"run_dir": str(run_dir), "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        try:
            reader, writer = await asyncio.open_unix_connection(socket_path, limit=1 << 20)
        except OSError as exc:
            return f"no zygote at {socket_path}: {exc}"
        try:
            writer.write((json.dumps(request) + "\n").encode())
            await writer.drain()
            # the first line is the server's "ready" (the zygote's imports are done)
            async with asyncio.timeout(ZYGOTE_WAIT_S):
                line = await reader.readline()
            answer = json.loads(line) if line else {"refused": "the zygote closed the connection"}
            if "ready" not in answer:
                raise ValueError(answer.get("refused", answer))
        except (OSError, ValueError, TimeoutError) as exc:
            writer.close()
            return f"the zygote at {socket_path} gave no fork server: {exc or repr(exc)}"
        return cls(int(answer["ready"]), reader, writer)


class ForkServer:
    """One fork server process and the actors it started."""

    def __init__(self, proc: asyncio.subprocess.Process | ZygoteServer, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.log = get_logger(role="up")
        self.children: dict[int, ForkedProcess] = {}
        self._asked: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._next_id = 0
        self._ready = asyncio.Event()
        self.gone = False
        self._closing = False
        self.on_death: Callable[[str], Any] | None = None
        """Called with the reason when the server exits before :meth:`close` (the
        supervisor's :meth:`~asyncrl.runtime.supervisor.Supervisor.fail`)."""
        if isinstance(proc, ZygoteServer):
            self._ready.set()  # its "ready" was the zygote's answer
        self._reader = asyncio.create_task(self._read(), name="fork-server")

    @classmethod
    async def start(cls, run_dir: Path, env: dict[str, str]) -> ForkServer:
        """Starts the server (it begins importing at once; :meth:`spawn` waits for it), or
        has the zygote that ``ZYGOTE_ENV`` names fork it."""
        log_path = run_dir / "logs" / "fork-server.log"
        if socket_path := os.environ.get(ZYGOTE_ENV):
            served = await ZygoteServer.ask(socket_path, run_dir, env, log_path)
            if isinstance(served, ZygoteServer):
                return cls(served, log_path)
            get_logger(role="up").warning("the fork server is started afresh", reason=served)
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230 - a local log file, opened once
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                SERVER_MODULE,
                "--run-dir",
                str(run_dir),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                env=env,
                start_new_session=True,
            )
        return cls(proc, log_path)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                try:
                    self._on(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:  # not from our server
                    self.log.error("the fork server said something else", line=line, error=str(exc))
        finally:
            self.gone = True
            self._ready.set()
            code = await self.proc.wait()
            if not self._closing and self.on_death is not None:
                self.on_death(f"the fork server exited with code {code}; see {self.log_path}")
            for future in self._asked.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"the fork server exited ({code})"))
            live = [c for c in self.children.values() if c.returncode is None]
            if live:
                self.log.error(
                    "the fork server exited before its actors; their exit codes are lost",
                    code=code,
                    pids=[c.pid for c in live],
                    log=str(self.log_path),
                )
            for child in live:
                task = asyncio.create_task(self._await_gone(child))
                self._watchers.add(task)
                task.add_done_callback(self._watchers.discard)

    async def _await_gone(self, child: ForkedProcess) -> None:
        await _gone(child.pid)
        child.ended(UNKNOWN_EXIT)

    def _on(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            self._ready.set()
        elif "exit" in message:
            child = self.children.get(int(message["exit"]))
            if child is not None:
                child.ended(int(message["code"]))
        elif "id" in message:
            # known from here on, so that an exit that follows at once is not missed
            child = self.children[int(message["pid"])] = ForkedProcess(int(message["pid"]))
            future = self._asked.pop(int(message["id"]), None)
            if future is not None and not future.done():
                future.set_result(child)

    async def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
        """A fork running ``argv`` (an actor's command line) with ``env``, its output
        appended to ``log_path``. Raises RuntimeError when the server is gone."""
        await self._ready.wait()
        if self.gone or self.proc.stdin is None:
            raise RuntimeError("the fork server is gone")
        self._next_id += 1
        future: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._asked[self._next_id] = future
        request = {"id": self._next_id, "argv": argv, "env": env, "log": str(log_path)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        await self.proc.stdin.drain()
        return await future

    async def close(self) -> None:
        """Ends the server (closing its input); the actors it started are not touched."""
        self._closing = True
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self.proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
