"""The run's NATS servers: one embedded server, or several on this machine joined by
routes into one JetStream cluster (``run.nats_servers``).

Each server of a cluster has its own name (``nats-<i>``), its own JetStream store
(``<run>/nats/nats-<i>/``) and log (``<run>/logs/nats-server-<i>.log``), and routes to
all the others, on ports picked here and kept for the run, so that a server started
again after a death rejoins where the others look for it. ``nats.json`` lists every
server's URL: clients connect to any and fail over to the others, and with
``run.nats_replicas`` = 3 every stream and object store of the run keeps a copy on each
server, so the loss of any one server loses nothing.

Readiness: every server accepts clients, and then the cluster has elected its JetStream
meta leader (until then the JetStream API answers "temporarily unavailable", and no
stream can be created): :meth:`NatsCluster.start` returns only after a JetStream request
has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors

from asyncrl.config.run import RunConfig
from asyncrl.runtime.nats_server import (
    NATS_JSON,
    WILDCARD_HOSTS,
    ClusterRoutes,
    EmbeddedNats,
    NatsInfo,
)

JETSTREAM_READY_TIMEOUT_S = 60.0


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now (the kernel's picks: every socket is
    held until all are bound, so no port comes twice)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def cluster_info(infos: Sequence[NatsInfo], replicas: int) -> NatsInfo:
    """The connection info of started servers as one run's: the first server's URL and
    credentials (every server has the same), every URL when there are several (actors fail
    over between them), and the run's replica count."""
    urls = tuple(i.url for i in infos) if len(infos) > 1 else ()
    return dataclasses.replace(infos[0], urls=urls, replicas=replicas)


class NatsCluster:
    """The servers of a run: ``start()`` (returns the run's :class:`NatsInfo`, written to
    ``<run>/nats.json``), ``keep_alive()`` (starts each dead server again), ``stop()``."""

    def __init__(self, run_dir: Path, servers: list[EmbeddedNats], *, replicas: int = 1) -> None:
        if not servers:
            raise ValueError("a cluster needs at least one server")
        if replicas > len(servers):
            raise ValueError(f"{replicas} replicas need as many servers, not {len(servers)}")
        self.run_dir = Path(run_dir)
        self.servers = servers
        self.replicas = replicas
        self._info: NatsInfo | None = None

    @classmethod
    def for_run(cls, run: RunConfig, run_dir: Path) -> NatsCluster:
        """``run.nats_servers`` servers as ``[run]`` asks (credentials as
        :meth:`EmbeddedNats.for_run`). With a fixed ``run.listen`` port P, server i
        listens on P + i."""
        logs = Path(run_dir) / "logs"
        n = run.nats_servers
        if n == 1:
            one = EmbeddedNats.for_run(run, run_dir, log_file=logs / "nats-server.log")
            one.write_info = False
            return cls(run_dir, [one], replicas=run.nats_replicas)
        first = EmbeddedNats.for_run(run, run_dir, log_file=logs / "nats-server-0.log")
        # every server logs clients in alike: with the first one's credentials
        login = first._credentials()
        # the servers share this machine: routes need no wider address than the clients'
        route_host = "127.0.0.1" if first.host in WILDCARD_HOSTS else first.host
        ports = free_ports(route_host, n)
        route_password = secrets.token_hex(16)
        servers = []
        for i in range(n):
            others = tuple(f"{route_host}:{p}" for j, p in enumerate(ports) if j != i)
            server = EmbeddedNats(
                run_dir,
                max_payload=first.max_payload,
                log_file=logs / f"nats-server-{i}.log",
                listen=run.listen,
                token=login.token,
                user=login.user,
                password=login.password,
                tls_cert=first.tls_cert,
                tls_key=first.tls_key,
                tls_ca=first.tls_ca,
                store_dir=Path(run_dir) / "nats" / f"nats-{i}",
                server_name=f"nats-{i}",
                cluster=ClusterRoutes(
                    f"asyncrl-{run.name}", route_host, ports[i], others, "route", route_password
                ),
                write_info=False,
            )
            if server.port:
                server.port += i
            servers.append(server)
        return cls(run_dir, servers, replicas=run.nats_replicas)

    @property
    def info(self) -> NatsInfo:
        if self._info is None:
            raise RuntimeError("the NATS servers are not started")
        return self._info

    async def start(self, *, ready_timeout: float = JETSTREAM_READY_TIMEOUT_S) -> NatsInfo:
        """Starts every server, waits for JetStream, writes ``<run>/nats.json``. Raises
        RuntimeError (with the server's log) when a server does not come up, or when
        JetStream is not ready within ``ready_timeout`` seconds; nothing is left running."""
        try:
            infos = await asyncio.gather(*(s.start() for s in self.servers))
            info = cluster_info(infos, self.replicas)
            if len(self.servers) > 1:
                await wait_for_jetstream(info, time.monotonic() + ready_timeout)
        except BaseException:
            await self.stop()
            raise
        info.write(self.run_dir / NATS_JSON)
        self._info = info
        return info

    async def keep_alive(self, on_restart: Callable[[str, int | None], Any] | None = None) -> None:
        """Watches every server until cancelled and starts each one that exits again (same
        ports, credentials and store: it rejoins the cluster and catches up).
        ``on_restart`` gets the server's name and exit status. Raises RuntimeError when a
        server cannot be started again."""

        def watch(server: EmbeddedNats) -> Any:
            name = server.server_name or "nats-server"

            def died(code: int | None) -> None:
                if on_restart is not None:
                    on_restart(name, code)

            return server.keep_alive(died)

        try:
            async with asyncio.TaskGroup() as tg:
                for server in self.servers:
                    tg.create_task(watch(server))
        except* RuntimeError as group:
            raise group.exceptions[0] from None

    async def stop(self) -> None:
        """Stops every server. Idempotent."""
        await asyncio.gather(*(s.stop() for s in self.servers))


async def wait_for_jetstream(info: NatsInfo, deadline: float) -> None:
    """Returns once a JetStream request through ``info`` is answered (a cluster has its
    meta leader); raises RuntimeError at ``deadline``."""
    delay = 0.05
    last: BaseException | None = None
    nc = await nats.connect(**info.connect_kwargs(), connect_timeout=5)
    try:
        js = nc.jetstream()
        while time.monotonic() < deadline:
            try:
                await js.account_info()
                return
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                last = exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await nc.close()
    raise RuntimeError(f"the NATS cluster's JetStream was not ready in time: {last!r}")
