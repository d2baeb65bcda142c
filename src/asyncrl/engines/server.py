"""Inference servers as child processes: start, wait for health, report, stop.

Each server runs under :mod:`asyncrl.entry.server_guard` in a process group of its own,
with a pipe from this process as the guard's stdin: when this process exits or dies
(``kill -9`` included), the pipe closes and the guard takes the whole group down. Stopping
normally closes the pipe the same way, then waits for the guard.

Output of the guard and the server goes to one log file per server; every error about a
server names that file and quotes its last lines.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

GUARD = Path(__file__).parents[1] / "entry" / "server_guard.py"

STOP_GRACE_S = 20.0
"""Seconds the guard gets to take its group down before this process kills the group."""


class ServerError(RuntimeError):
    """A server answered with an error, could not be reached, did not answer in time, or
    exited. The message carries the server's own words: its HTTP status and body, or the
    end of its log."""


def tail(path: Path | None, lines: int = 25) -> str:
    """The last ``lines`` lines of ``path`` (empty if it cannot be read)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def free_port(host: str, lo: int, hi: int) -> int:
    """A port in ``[lo, hi]`` that ``host`` can bind now, probed from a random start so that
    several actors on one machine rarely probe the same ports at the same time."""
    span = hi - lo + 1
    start = random.randrange(span)
    for i in range(span):
        port = lo + (start + i) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in {lo}-{hi} on {host}")


class ServerProcess:
    """One server started as a guarded child. ``url`` is where it will answer."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.url = url
        self.log_path = log_path
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._pipe_w: int | None = None

    def start(self) -> None:
        """Starts the guard and the server. Called on the event loop's thread: the
        parent-death signal is tied to the thread that forks, which must live as long as
        the engine."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, self._pipe_w = os.pipe()  # both non-inheritable; Popen dups read_end
        try:
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(self.argv)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    [sys.executable, str(GUARD), str(os.getpid()), "--", *self.argv],
                    stdin=read_end,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                    start_new_session=True,
                )
        finally:
            os.close(read_end)

    @property
    def returncode(self) -> int | None:
        """None while the guard (and so the server) runs."""
        return None if self.proc is None else self.proc.poll()

    def describe_exit(self) -> str:
        return (
            f"the server for {self.url} has exited (guard status {self.returncode}); "
            f"its log {self.log_path} ends with:\n{tail(self.log_path)}"
        )

    async def wait_healthy(
        self, probe: Callable[[], Awaitable[bool]], limit_s: float, interval: float = 0.5
    ) -> None:
        """Returns once ``probe()`` is true. The server offers no readiness notice, so it is
        asked every ``interval`` seconds; raises :class:`ServerError`, naming the log, if it
        exits first or ``limit_s`` seconds pass."""
        deadline = time.monotonic() + limit_s
        while True:
            if self.returncode is not None:
                raise ServerError(f"while starting: {self.describe_exit()}")
            if await probe():
                return
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"the server for {self.url} was not healthy after {limit_s:.0f} s; "
                    f"see its log {self.log_path}, which ends with:\n{tail(self.log_path)}"
                )
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        """Closes the guard's pipe (the guard then ends the server's process group) and
        waits for the guard; kills the group if that takes longer than ``STOP_GRACE_S``."""
        if self._pipe_w is not None:
            os.close(self._pipe_w)
            self._pipe_w = None
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            await asyncio.to_thread(proc.wait, STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await asyncio.to_thread(proc.wait)


def resolve_interpreter(python: str, what: str, make_target: str) -> str:
    """The interpreter ``python`` of a server's virtualenv: as given if it exists (absolute,
    or relative to the working directory) or is a bare command name, else relative to the
    project checkout this package runs from (an editable install), so that a recipe's
    ``.venv-x/bin/python`` works from any directory. Raises :class:`ServerError` naming
    ``make <make_target>`` when it is nowhere."""
    path = Path(python).expanduser()
    if path.is_absolute() or path.exists() or "/" not in python:
        return str(path) if "/" in python else python
    checkout = Path(__file__).resolve().parents[3] / path
    if checkout.exists():
        return str(checkout)
    raise ServerError(
        f"the {what} interpreter {python!r} does not exist (neither in {Path.cwd()} nor in "
        f"{Path(__file__).resolve().parents[3]}); run `make {make_target}`, or set "
        "rollout.engine.python"
    )
