"""The shared part of server engines (vLLM, SGLang): servers, routing, HTTP, pausing.

A :class:`RemoteEngine` either starts ``servers`` servers as guarded children of this
process (:mod:`asyncrl.engines.server`) or joins ``urls`` of servers started elsewhere.
A backend subclass says how to start one server and how to speak to it; this class does
the rest:

- **Routing.** Each segment goes to one server: the server already holding the request's
  group (its routing key, the rid up to the first ``/``: the prompt uid, shared by a GRPO
  group's samples and a multi-turn episode's turns), so the server's prefix cache serves
  the shared prompt; otherwise the least-loaded server, which then holds the group.
- **Errors.** Connection errors are retried ``retries`` times with a doubling back-off;
  every failure raises :class:`~asyncrl.engines.server.ServerError` carrying the server's
  own text (HTTP status and body, or the end of its log when it died or hung).
- **Pausing.** ``_interrupt`` closes a gate (no new request is sent), pauses every server
  in abort mode — running requests come back with ``finish_reason="abort"`` and their
  partial tokens — and waits for every request in flight to return. A request that was
  sent before the gate closed but reached the server after the pause is queued there, not
  run; it is aborted explicitly, so it also returns. Hence no segment spans a weight
  update, and stamping a segment's tokens with the version current when it returns is
  exact. :class:`~asyncrl.api.inference.InferenceEngine` then resubmits prompt + partial.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from transformers import AutoTokenizer

from asyncrl.api.inference import (
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    WeightSource,
)
from asyncrl.config.schema import resolve_device
from asyncrl.engines.config import ServerEngineConfig
from asyncrl.engines.server import ServerError, ServerProcess, free_port, tail
from asyncrl.models.resolve import ModelConfig, resolve_dtype, resolve_model_path

AFFINITY_SLOTS = 4096
"""Routing keys remembered. Groups in flight are bounded by the actor's concurrency (tens
to hundreds); older keys are forgotten first and only lose their cache affinity."""

STRAGGLER_WAIT_S = 1.0
"""Seconds to wait, after pausing, for in-flight requests to return before aborting the
ones the servers queued instead of running."""


@dataclass
class Server:
    """One server as the router sees it."""

    url: str
    process: ServerProcess | None = None
    inflight: int = 0
    served: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return self.url if self.process is None else f"{self.url} (log {self.process.log_path})"


class Router:
    """Least-loaded choice with group affinity: a key seen before goes where it went."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self.servers = list(servers)
        self._home: OrderedDict[str, Server] = OrderedDict()

    def pick(self, key: str | None) -> Server:
        if key is not None and key in self._home:
            self._home.move_to_end(key)
            return self._home[key]
        server = min(self.servers, key=lambda s: (s.inflight, s.served))
        if key is not None:
            self._home[key] = server
            if len(self._home) > AFFINITY_SLOTS:
                self._home.popitem(last=False)
        return server

    def forget(self, key: str | None) -> None:
        """Drops a key's home (after its server failed), so a retry may go elsewhere."""
        if key is not None:
            self._home.pop(key, None)


def routing_key(rid: str) -> str | None:
    """The group a request belongs to: its rid up to the first ``/`` (workflows build rids
    as ``<prompt uid>/<sample>[/<turn>]``); None for an empty rid."""
    return rid.split("/", 1)[0] or None


class RemoteEngine(InferenceEngine):
    """An :class:`InferenceEngine` over HTTP servers. Subclasses implement the ``_server_*``
    hooks and :meth:`_complete`.

    ``model`` is the recipe's model section (or its ``path`` alone): its path gives the
    tokenizer here and the model directory the started servers load, its dtype theirs.
    ``config`` is the recipe's ``rollout.engine`` section; ``log_dir`` receives the
    started servers' logs.
    """

    kind = "remote"
    health_path = "/health"

    def __init__(
        self,
        model: ModelConfig | str,
        config: ServerEngineConfig,
        *,
        log_dir: str | Path | None = None,
        version: int = 0,
    ) -> None:
        super().__init__(version)
        model = model if isinstance(model, ModelConfig) else ModelConfig(path=model)
        self.config = config
        self.model_spec = model.path
        # a server started here runs on CUDA where there is one, else on this CPU
        device = resolve_device("auto") if model.dtype == "auto" else "cpu"
        self.dtype = resolve_dtype(model.dtype, device)
        self.urls = [u.rstrip("/") for u in config.urls]
        self.n_servers = config.servers
        self.log_dir = Path(log_dir) if log_dir is not None else Path("logs")
        self.model_path = ""
        self.servers: list[Server] = []
        self.router = Router([])
        self._tokenizer: Any = None
        self._session: Any = None
        self._gate = asyncio.Event()  # set: requests may be sent
        self._gate.set()
        self._outstanding = 0
        self._idle = asyncio.Event()  # set: no request in flight
        self._idle.set()
        self._loading_version: int | None = None

    # --- the backend's part -----------------------------------------------------------------

    def server_command(self) -> list[str]:
        """The program that starts one server (``command`` from the recipe, or a default)."""
        return self.config.command

    @abstractmethod
    def server_argv(self, port: int) -> list[str]:
        """The whole command line of one server listening on ``port``."""

    def server_env(self) -> dict[str, str]:
        return dict(self.config.env)

    async def _server_ready(self, server: Server) -> None:
        """Called once per server after it is healthy (e.g. to read its limits)."""

    @abstractmethod
    async def _complete(self, server: Server, request: GenerateRequest) -> GenerateResponse:
        """One generation request to ``server``; versions are stamped by the caller."""

    @abstractmethod
    async def _server_pause(self, server: Server) -> None:
        """Pauses in abort mode: running requests return with their partial output."""

    @abstractmethod
    async def _server_abort_all(self, server: Server) -> None:
        """Aborts every request the server holds (running or queued)."""

    @abstractmethod
    async def _server_resume(self, server: Server) -> None: ...

    @abstractmethod
    async def _server_load(self, server: Server, path: Path, version: int) -> None:
        """Loads the weights in directory ``path`` and reports ``version`` to the server."""

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def start(self) -> None:

        self.model_path = await asyncio.to_thread(resolve_model_path, self.model_spec)
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # concurrency is bounded by the callers
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout),
        )
        try:
            if self.urls:
                self.servers = [Server(url) for url in self.urls]
            else:
                self.servers = [self._launch(i) for i in range(self.n_servers)]
            self.router = Router(self.servers)
            await self._each(self._await_ready)
        except BaseException:
            await self.stop()
            raise

    def _launch(self, index: int) -> Server:
        port = free_port(self.config.host, *self.config.ports)
        url = f"http://{self.config.host}:{port}"
        log = self.log_dir / f"{self.kind}-{os.getpid()}-{index}.log"
        process = ServerProcess(
            self.server_argv(port), url=url, log_path=log, env=self.server_env()
        )
        process.start()
        return Server(url, process)

    async def _await_ready(self, server: Server) -> None:
        async def probe() -> bool:
            try:
                async with self._session.get(server.url + self.health_path, timeout=5) as resp:
                    return bool(resp.status == 200)
            except (OSError, TimeoutError, self._client_errors()):
                return False  # not up yet

        if server.process is not None:
            await server.process.wait_healthy(probe, self.config.startup_timeout)
        else:
            deadline = time.monotonic() + self.config.startup_timeout
            while not await probe():
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"{server.url}{self.health_path} did not answer 200 within "
                        f"{self.config.startup_timeout:.0f} s"
                    )
                await asyncio.sleep(0.5)
        await self._server_ready(server)

    async def stop(self) -> None:
        if self._stopping and self._session is None:
            return
        self._stopping = True
        self._gate.set()  # segments waiting to be sent see the stop and return
        self._resumed.set()
        if self._session is not None and self.servers:
            async with asyncio.TaskGroup() as tg:
                for server in self.servers:
                    if server.process is None or server.process.returncode is None:
                        tg.create_task(self._quietly(self._server_abort_all(server)))
        if self._session is not None:
            await self._session.close()
            self._session = None
        async with asyncio.TaskGroup() as tg:
            for server in self.servers:
                if server.process is not None:
                    tg.create_task(server.process.stop())

    @staticmethod
    async def _quietly(call: Any) -> None:
        try:
            async with asyncio.timeout(5):
                await call
        except Exception:  # best effort while stopping: the server goes down anyway
            pass

    # --- HTTP -------------------------------------------------------------------------------

    @staticmethod
    def _client_errors() -> type[Exception]:

        return aiohttp.ClientError

    async def _call(
        self,
        server: Server,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        params: dict[str, str] | None = None,
        limit_s: float | None = None,
    ) -> Any:
        """One JSON call with retries on connection errors; returns the decoded body (or the
        text when it is not JSON). Raises :class:`ServerError` with the server's words.
        ``limit_s`` replaces ``request_timeout`` for this call."""

        url = server.url + path
        limit = self.config.request_timeout if limit_s is None else limit_s
        # aiohttp reads timeout=None as "no limit": pass one only when given
        per_call = {} if limit_s is None else {"timeout": aiohttp.ClientTimeout(total=limit_s)}
        delay = self.config.retry_backoff
        for attempt in range(self.config.retries + 1):
            if self._session is None:
                raise ServerError(f"{method} {url}: the engine is stopped")
            try:
                async with self._session.request(
                    method, url, json=payload, params=params, **per_call
                ) as r:
                    body = await r.text()
                    if r.status >= 400:
                        # a 5xx points at the log for the cause (vLLM: "see stack trace above")
                        more = self._server_state(server) if r.status >= 500 else ""
                        raise ServerError(f"{method} {url} -> HTTP {r.status}: {body[:4000]}{more}")
                    if r.content_type == "application/json" and body:
                        return await r.json(content_type=None)
                    return body
            except TimeoutError as exc:
                raise ServerError(
                    f"{method} {url}: no answer within {limit:.0f} s{self._server_state(server)}"
                ) from exc
            except aiohttp.ClientConnectionError as exc:
                if server.process is not None and server.process.returncode is not None:
                    raise ServerError(f"{method} {url}: {server.process.describe_exit()}") from exc
                if attempt == self.config.retries or self._stopping:
                    raise ServerError(
                        f"{method} {url}: connection failed {attempt + 1} times, last: "
                        f"{type(exc).__name__}: {exc}{self._server_state(server)}"
                    ) from exc
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    @staticmethod
    def _server_state(server: Server) -> str:
        if server.process is None:
            return ""
        return f"; its log {server.process.log_path} ends with:\n{tail(server.process.log_path)}"

    # --- InferenceEngine --------------------------------------------------------------------

    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        key = routing_key(request.rid)
        while True:
            await self._gate.wait()
            if self._stopping:
                return GenerateResponse(
                    rid=request.rid, input_ids=request.input_ids, finish_reason="abort"
                )
            server = self.router.pick(key)
            server.inflight += 1
            server.served += 1
            self._outstanding += 1
            self._idle.clear()
            try:
                response = await self._complete(server, request)
            except ServerError:
                if self._stopping:
                    return GenerateResponse(
                        rid=request.rid, input_ids=request.input_ids, finish_reason="abort"
                    )
                self.router.forget(key)
                raise
            finally:
                server.inflight -= 1
                self._outstanding -= 1
                if not self._outstanding:
                    self._idle.set()
            response.output_versions = [self._version] * len(response.output_ids)
            return response

    async def _interrupt(self) -> None:
        self._gate.clear()
        await self._each(self._server_pause)
        while self._outstanding:
            try:
                async with asyncio.timeout(STRAGGLER_WAIT_S):
                    await self._idle.wait()
            except TimeoutError:
                await self._each(self._server_abort_all)

    async def _continue(self) -> None:
        await self._each(self._server_resume)
        self._gate.set()

    async def _each(self, action: Any) -> None:
        """``action(server)`` on every server at once. A failure cancels the others and is
        raised as itself (the first one), not wrapped in an exception group, so callers
        see the server's error."""
        try:
            async with asyncio.TaskGroup() as tg:
                for server in self.servers:
                    tg.create_task(action(server))
        except BaseExceptionGroup as group:
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from group

    async def update_weights(self, source: WeightSource, version: int) -> None:
        self._loading_version = version  # the servers are told the version they load
        try:
            await super().update_weights(source, version)
        finally:
            self._loading_version = None

    async def _load_weights(self, source: WeightSource) -> None:
        if not isinstance(source, str | Path):
            raise TypeError(
                f"{type(self).__name__} loads weights from a directory of safetensors files "
                f"that its servers can read, not from {type(source).__name__}"
            )
        path = Path(os.path.abspath(source))  # noqa: ASYNC240 - string work, no I/O
        version = self._loading_version if self._loading_version is not None else self._version
        await self._each(lambda server: self._server_load(server, path, version))

    def new_request_id(self, rid: str) -> str:
        """A unique server-side id that still shows the workflow's rid in server logs."""
        return f"{rid or 'req'}-{uuid.uuid4().hex[:12]}"
