"""``asyncrl up RECIPE --ray ADDRESS|auto``: the same run, its processes placed on a Ray
cluster.

Ray only places and hosts processes; the run is the local one. ``up`` runs where it is
started (a Ray driver: the placement group, the nats-servers) and its supervisor
(:mod:`asyncrl.runtime.supervisor`) starts, watches and restarts the same actor specs as
a local run, under the same restart policy. Each spec's command is wrapped in a *proxy*
(``python -m asyncrl.launch.ray_cluster ... -- <command>``), a small process beside the supervisor
that

- creates one :class:`RoleHost` Ray actor with the role's resources (``<role>.ray_cpus``,
  ``<role>.gpus``) on the node that ``<role>.node`` names (a soft node affinity: a node
  that is gone is skipped, so a replacement lands on another that fits), or for a trainer
  node in bundle k of the run's trainer placement group;
- has that actor run the role's own command as a child process on its node (its output
  appended to ``<run>/logs/<id>.log``, so the run folder is that of a local run: the run
  folder must be on a file system every node shares, as for Slurm);
- exits with the child's exit status, or 1 when the Ray actor died (its node died).

The supervisor sees the proxy as the actor's process: a proxy that exits non-zero is a
crashed actor, restarted (a new proxy, a new Ray actor) within ``run.max_restarts``; its
SIGTERM becomes the child's SIGTERM; a proxy killed outright takes its Ray actor with it
(Ray ends the actors of a driver that is gone), and the role's processes die with the
actor (a reaper holding a lifeline to it, :func:`start_reaper`). At the end ``up`` removes the placement group and the nats-server
actors: nothing of the run stays on the cluster.

NATS: ``run.nats_servers`` servers (one JetStream cluster joined by routes, as on one
machine) spread round robin over the nodes the recipe names, the trainer's and the
buffer's first, so that with three servers on two nodes the trainer's node holds two of
them: a JetStream cluster lives while a majority of its servers does, and the run's
state (``run.nats_replicas`` = 3) survives the death of the other node. A node without a
server reaches the others' URLs (``nats.json`` lists them all). With no node named, the
servers run on ``up``'s node. ``run.nats_url`` (an external cluster) is used as it is.

Importing this module does not import ray; running it needs the ``ray`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.config.placement import ROLES, node_for, process_gpus, role_processes
from asyncrl.config.recipe import Recipe, RunConfig
from asyncrl.runtime.log import get_logger
from asyncrl.runtime.nats_cluster import (
    JETSTREAM_READY_TIMEOUT_S,
    cluster_info,
    free_ports,
    wait_for_jetstream,
)
from asyncrl.runtime.nats_server import NATS_JSON, ClusterRoutes, EmbeddedNats
from asyncrl.runtime.supervisor import actor_argv
from asyncrl.train.torchrun import UP_NODE_ENV, free_port, torchrun_argv

VISIBILITY_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "NEURON_RT_VISIBLE_CORES",
    "TPU_VISIBLE_CHIPS",
)
"""Set by Ray on the worker that hosts an actor with GPUs (the ones it was given); the
role's process takes them from there, everything else from the proxy's environment."""

STATE_ROLES = ("trainer", "buffer", "reward", "eval", "rollout")
"""The order in which the nodes of the roles get nats-servers: the run's state first."""


def require_ray() -> Any:
    try:
        import ray  # noqa: PLC0415 - optional: the ray extra
    except ImportError:
        raise SystemExit(
            'asyncrl up --ray needs Ray: pip install -e ".[ray]" (or make test-ray)'
        ) from None
    return ray


def namespace(run_name: str) -> str:
    """The Ray namespace of a run: its actors' names are the run's actor ids."""
    return f"asyncrl-{run_name}"


def trainer_group_name(run_name: str) -> str:
    return f"asyncrl-{run_name}-trainer"


# ---------------------------------------------------------------------------------------
# Nodes


def find_node(name: str, nodes: list[dict[str, Any]]) -> str | None:
    """The id of the first alive node that ``name`` names: a custom resource it declares,
    the value of one of its labels, its hostname or its IP. None when no alive node does."""
    for n in nodes:
        if not n.get("Alive"):
            continue
        labels = n.get("Labels") or {}
        names = (n.get("NodeManagerHostname"), n.get("NodeManagerAddress"))
        if name in (n.get("Resources") or {}) or name in labels.values() or name in names:
            return str(n["NodeID"])
    return None


def nodes_used(recipe: Recipe, nodes: list[dict[str, Any]]) -> list[str]:
    """The alive node ids that the recipe's ``<role>.node`` keys name, the trainer's and
    the buffer's first (where the nats-servers go, in that order)."""
    counts, found = role_processes(recipe), []
    for role in STATE_ROLES:
        if not counts[role]:
            continue
        for name in getattr(recipe, role).node:
            node_id = find_node(name, nodes)
            if node_id is not None and node_id not in found:
                found.append(node_id)
    return found


# ---------------------------------------------------------------------------------------
# The Ray actors (plain classes: ``ray.remote`` is applied where ray is imported)


def start_reaper(
    argv: list[str], env: dict[str, str] | None, log: str, cwd: str | None
) -> tuple[int, int, int]:
    """Starts ``argv`` under a reaper (:func:`reap_main`) in a session of its own; returns
    (the session's process group, the read end of the reaper's status pipe, the write end
    of its lifeline). Whoever calls this holds the lifeline: when that process dies, its
    end closes and the reaper kills the whole group."""
    status_r, status_w = os.pipe()
    life_r, life_w = os.pipe()
    try:
        with open(log, "ab") as out:
            reaper = [argv[0], "-m", "asyncrl.entry.ray_role", "--reap", str(status_w), str(life_r)]
            first = subprocess.Popen(
                [*reaper, "--", *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                pass_fds=(status_w, life_r),
            )
        first.wait()  # it forks the reaper and leaves at once
    finally:
        os.close(status_w)
        os.close(life_r)
    return first.pid, status_r, life_w


def reap_main(status_fd: int, life_fd: int, command: list[str]) -> int:
    """Runs ``command`` in this process's group (a session of its own) and writes its exit
    status to ``status_fd``. Forks first, so that the reaper is no child of whoever started
    it (Ray kills a dead worker's children, and a reaper killed outright reaps nothing).
    When ``life_fd`` reads end-of-file (its holder died: the Ray actor's worker) the whole
    group is killed, grandchildren too (torchrun's ranks, reward workers). A SIGTERM to
    the group is a stop, for the command to answer: the reaper waits for it."""
    if os.fork() > 0:
        os._exit(0)
    signal.signal(signal.SIGTERM, lambda *_: None)
    child = subprocess.Popen(command)

    def watch() -> None:
        while os.read(life_fd, 1):
            pass
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    code = child.wait()
    code = code if code >= 0 else 128 - code
    os.write(status_fd, str(code).encode())
    return code


def read_status(status_fd: int) -> int:
    """The exit status a reaper writes (blocks until it exits); 1 if it died unwritten."""
    data = b""
    while chunk := os.read(status_fd, 64):
        data += chunk
    os.close(status_fd)
    return int(data) if data.strip() else 1


class RoleHost:
    """Hosts one role's command as a child process on the node Ray put this actor on.

    ``start`` returns once the command is running (its node, host name and process
    group); ``wait`` returns its exit status; ``signal`` signals its process group. The
    command runs under a reaper (:func:`start_reaper`) whose lifeline this actor's
    process holds: when the actor dies, however it dies, the role's processes go too."""

    def __init__(self) -> None:
        self._pgid = 0
        self._status_fd = -1
        self._life_fd = -1
        self._done = False

    def start(self, argv: list[str], env: dict[str, str], log: str, cwd: str) -> dict[str, Any]:
        ray = require_ray()  # in the Ray worker that hosts this actor

        env = {**env, **{k: os.environ[k] for k in VISIBILITY_ENV if k in os.environ}}
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        self._pgid, self._status_fd, self._life_fd = start_reaper(
            argv, env, log, cwd if os.path.isdir(cwd) else None
        )
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
            "pid": self._pgid,
        }

    def wait(self) -> int:
        code = read_status(self._status_fd)
        self._done = True
        # whatever the role started and left (torchrun's ranks, reward workers) goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pgid, signal.SIGKILL)
        os.close(self._life_fd)
        return code

    def signal(self, sig: int) -> None:
        if self._pgid and not self._done:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, sig)


class NatsHost:
    """Hosts one nats-server of the run on the node Ray put this (async) actor on."""

    def __init__(self) -> None:
        self._server: Any = None

    async def where(self) -> tuple[str, int]:
        """This node's address and a port free on it, for the server's routes."""
        ray = require_ray()  # in the Ray worker that hosts this actor
        ip = ray.util.get_node_ip_address()
        return ip, free_ports(ip, 1)[0]

    async def start(self, server: Any) -> Any:
        self._server = server
        return await server.start()

    async def keep_alive(self) -> None:
        """Starts the server again whenever its process dies on this (live) node."""
        await self._server.keep_alive()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()


# ---------------------------------------------------------------------------------------
# The run's side: placement group, nats-servers, wrapped specs


class RayNats:
    """The run's nats-servers on the cluster's nodes; the interface of
    :class:`asyncrl.runtime.nats_cluster.NatsCluster` (``start``, ``keep_alive``,
    ``stop``) so that ``up`` runs them alike."""

    def __init__(self, ray: Any, run: RunConfig, run_dir: Path, node_ids: list[str]) -> None:
        self.ray, self.run, self.run_dir = ray, run, Path(run_dir)
        self.node_ids = node_ids
        self.hosts: list[Any] = []
        self.names: list[str] = []
        self._info: Any = None

    async def start(self) -> Any:
        from ray.util.scheduling_strategies import (  # noqa: PLC0415 - optional: the ray extra
            NodeAffinitySchedulingStrategy,
        )

        ray, run, n = self.ray, self.run, self.run.nats_servers
        host_cls = ray.remote(num_cpus=0, max_restarts=0)(NatsHost)
        for i in range(n):
            node = self.node_ids[i % len(self.node_ids)]
            self.names.append(f"nats-{i}" if n > 1 else "nats-server")
            self.hosts.append(
                host_cls.options(
                    name=f"{self.names[-1]}",
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote()
            )
        try:
            where = await asyncio.to_thread(ray.get, [h.where.remote() for h in self.hosts])
            logs = self.run_dir / "logs"
            first = EmbeddedNats.for_run(run, self.run_dir, log_file=logs / "nats-server.log")
            login = first._credentials()  # every server logs clients in alike
            route_password = secrets.token_hex(16)
            servers = []
            for i, (ip, route_port) in enumerate(where):
                routes = None
                if n > 1:
                    others = tuple(f"{h}:{p}" for j, (h, p) in enumerate(where) if j != i)
                    routes = ClusterRoutes(
                        f"asyncrl-{run.name}", ip, route_port, others, "route", route_password
                    )
                servers.append(
                    EmbeddedNats(
                        self.run_dir,
                        max_payload=first.max_payload,
                        log_file=logs / f"{self.names[i]}.log",
                        listen=f"{ip}:0",  # reachable from the other nodes
                        token=login.token,
                        user=login.user,
                        password=login.password,
                        tls_cert=first.tls_cert,
                        tls_key=first.tls_key,
                        tls_ca=first.tls_ca,
                        store_dir=self.run_dir / "nats" / self.names[i],
                        server_name=self.names[i] if n > 1 else "",
                        cluster=routes,
                        write_info=False,
                    )
                )
            refs = [h.start.remote(s) for h, s in zip(self.hosts, servers, strict=True)]
            infos = await asyncio.to_thread(ray.get, refs)
            info = cluster_info(infos, run.nats_replicas)
            if n > 1:
                await wait_for_jetstream(info, time.monotonic() + JETSTREAM_READY_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise
        info.write(self.run_dir / NATS_JSON)
        self._info = info
        return info

    async def keep_alive(self, on_restart: Callable[[str, int | None], Any] | None = None) -> None:
        """Each server's actor starts its server again when its process dies on a live
        node; a server whose node died is gone for good, and the cluster goes on with the
        others (said on stderr; ``on_restart`` is for restarts, which happen inside the
        actors here). Raises RuntimeError when no server is left, or one could not be
        started again."""
        ray = self.ray
        pending = {
            h.keep_alive.remote(): name for h, name in zip(self.hosts, self.names, strict=True)
        }
        while pending:
            ready, _ = await asyncio.to_thread(ray.wait, list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                name = pending.pop(ref)
                try:
                    await asyncio.to_thread(ray.get, ref)
                except ray.exceptions.RayActorError:
                    # its node is gone: the others hold the run's state (run.nats_replicas)
                    get_logger(role="up").warning("nats-server lost with its node", server=name)
                    print(
                        f"asyncrl up: {name} is gone with its node; the NATS cluster goes "
                        f"on with the other {len(pending)}",
                        file=sys.stderr,
                        flush=True,
                    )
                except ray.exceptions.RayTaskError as exc:
                    raise RuntimeError(f"{name}: {exc}") from None
        raise RuntimeError("every nats-server of the run is gone")

    async def stop(self) -> None:
        ray = self.ray
        refs = [h.stop.remote() for h in self.hosts]
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=15.0)
        for h in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(h)
        self.hosts = []


class RayLaunch:
    """What ``up --ray`` adds to a run: connected to the cluster (``__enter__``), it makes
    the trainer's placement group, the run's nats-servers (:meth:`nats`) and the wrapped
    actor specs (:meth:`specs`); ``__exit__`` removes what it made."""

    def __init__(self, recipe: Recipe, run_dir: Path, address: str) -> None:
        self.recipe, self.run_dir = recipe, Path(run_dir)
        self.address = address
        self.ray = require_ray()
        self.group: Any = None
        self.gcs_address = ""

    def __enter__(self) -> RayLaunch:
        ray = self.ray
        ray.init(
            address=self.address,
            namespace=namespace(self.recipe.run.name),
            log_to_driver=False,
            logging_level="ERROR",
        )
        try:
            self.gcs_address = ray.get_runtime_context().gcs_address
            self.group = self._trainer_group()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        ray = self.ray
        if self.group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.group)
            self.group = None
        ray.shutdown()

    def _trainer_group(self) -> Any:
        """One bundle per trainer node (its ranks' CPUs and GPUs, and a sliver of the
        custom resource its ``trainer.node`` names, if it is one), spread one per node."""
        from ray.util.placement_group import placement_group  # noqa: PLC0415 - the ray extra

        t, ray = self.recipe.trainer, self.ray
        nodes = ray.nodes()
        bundles = []
        for k in range(t.nodes):
            bundle: dict[str, float] = {"CPU": t.ray_cpus}
            if t.gpus:
                bundle["GPU"] = process_gpus(self.recipe, "trainer")
            name = node_for(self.recipe, "trainer", k)
            if name and any(name in (n.get("Resources") or {}) for n in nodes if n["Alive"]):
                bundle[name] = 0.001
            bundles.append(bundle)
        group = placement_group(
            bundles,
            strategy="STRICT_SPREAD" if t.nodes > 1 else "PACK",
            name=trainer_group_name(self.recipe.run.name),
        )
        timeout = self.recipe.run.startup_timeout
        try:
            ray.get(group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise SystemExit(
                f"the trainer's placement group ({bundles}) did not fit the cluster within "
                f"run.startup_timeout = {timeout}s: check trainer.node, trainer.gpus, "
                "trainer.ray_cpus and trainer.nodes against the cluster (ray status)"
            ) from None
        return group

    def nats(self, run: RunConfig, run_dir: Path) -> RayNats:
        node_ids = nodes_used(self.recipe, self.ray.nodes())
        if not node_ids:
            node_ids = [self.ray.get_runtime_context().get_node_id()]
        return RayNats(self.ray, run, run_dir, node_ids)

    def specs(self, specs: list[Any]) -> list[Any]:
        """The specs of a local run with each command wrapped in a proxy (a trainer
        across nodes: every node's, rendezvous on the node of bundle 0)."""
        if self.recipe.trainer.nodes > 1:
            specs = [s for s in specs if s.role != "trainer"] + self._trainer_specs(specs)
        return [self.wrap(spec) for spec in specs]

    def _trainer_specs(self, specs: list[Any]) -> list[Any]:
        """One torchrun per trainer node, each in its bundle of the placement group and
        known by that node's address; the rendezvous is ``trainer.rendezvous`` or, empty,
        a port on the node of bundle 0 (which hosts it)."""
        t, ray, actor_id = self.recipe.trainer, self.ray, "trainer-0"
        on = ray.util.placement_group_table(self.group)["bundles_to_node_id"]
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        hosts = [address[on[k]] for k in range(t.nodes)]
        # a port free here; the node of bundle 0 is most likely this one or alike
        endpoint = t.rendezvous or f"{hosts[0]}:{free_port()}"
        target = actor_argv("trainer", self.run_dir, actor_id)[1:]  # after the interpreter
        template = next(s for s in specs if s.role == "trainer")
        return [
            replace(
                template,
                actor_id=actor_id if k == 0 else f"{actor_id}-node{k}",
                argv=torchrun_argv(
                    target,
                    nproc=t.nproc,
                    nodes=t.nodes,
                    endpoint=endpoint,
                    run_id=self.recipe.run.name,
                    is_host=k == 0,
                    local_addr=hosts[k],
                ),
                gang=actor_id,
                env={UP_NODE_ENV: str(k)},
                primary=True,
            )
            for k in range(t.nodes)
        ]

    def wrap(self, spec: Any) -> Any:
        role, recipe = spec.role, self.recipe
        if role == "trainer":
            index = int(spec.env.get(UP_NODE_ENV, "0"))
        else:
            found = re.search(r"-([0-9]+)$", spec.actor_id)
            index = int(found.group(1)) if found else 0
        p = getattr(recipe, role)
        argv = [
            sys.executable,
            "-m",
            "asyncrl.entry.ray_role",
            "--address",
            self.gcs_address,
            "--namespace",
            namespace(recipe.run.name),
            "--role",
            role,
            "--log-id",
            spec.actor_id,  # renamed with the actor when it is replaced
            "--run-dir",
            str(self.run_dir),
            "--node",
            node_for(recipe, role, index),
            "--gpus",
            str(process_gpus(recipe, role)),
            "--cpus",
            str(p.ray_cpus),
        ]
        if role == "trainer":
            argv += ["--group", trainer_group_name(recipe.run.name), "--bundle", str(index)]
        return replace(spec, argv=[*argv, "--", *spec.argv])


@contextlib.contextmanager
def ray_launch(recipe: Recipe, run_dir: Path, address: str) -> Iterator[RayLaunch]:
    with RayLaunch(recipe, run_dir, address) as launch:
        yield launch


# ---------------------------------------------------------------------------------------
# The proxy: one per role process, run by the supervisor


def _child_env(env: dict[str, str]) -> dict[str, str]:
    """The proxy's environment for the role's process, less what Ray sets per process."""
    return {k: v for k, v in env.items() if not k.startswith("RAY_") and k not in VISIBILITY_ENV}


def proxy_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.entry.ray_role")
    parser.add_argument("--address", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--role", required=True)
    parser.add_argument("--log-id", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--node", default="")
    parser.add_argument("--gpus", type=float, default=0.0)
    parser.add_argument("--cpus", type=float, default=1.0)
    parser.add_argument("--group", default="")
    parser.add_argument("--bundle", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = _child_env(dict(os.environ))  # before ray.init adds its own
    stop = threading.Event()
    ray = require_ray()
    from ray.util.scheduling_strategies import (  # noqa: PLC0415 - optional: the ray extra
        NodeAffinitySchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    ray.init(
        address=args.address,
        namespace=args.namespace,
        log_to_driver=False,
        logging_level="ERROR",
    )
    # the supervisor's SIGTERM is for the role's process; the proxy stays to report its
    # exit. Set after ray.init, whose own handler would end the proxy at once.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    say = lambda text: print(f"ray: {text}", flush=True)  # noqa: E731
    options: dict[str, Any] = {
        "name": args.log_id,
        "num_cpus": args.cpus,
        "num_gpus": args.gpus,
        "max_concurrency": 4,  # wait() blocks one thread; signal() needs another
        "max_restarts": 0,  # the supervisor replaces it, under the run's restart policy
    }
    if args.group:
        from ray.util.placement_group import get_placement_group  # noqa: PLC0415 - ray extra

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            get_placement_group(args.group), placement_group_bundle_index=args.bundle
        )
    elif args.node:
        node_id = find_node(args.node, ray.nodes())
        if node_id is None:
            say(f"{args.role}.node {args.node!r}: no such node alive; any node that fits")
        else:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=True)
    host = ray.remote(RoleHost).options(**options).remote()
    log = str(Path(args.run_dir) / "logs" / f"{args.log_id}.log")
    try:
        started = host.start.remote(command, env, log, os.getcwd())
        while not ray.wait([started], timeout=0.5)[0]:
            if stop.is_set():
                return 143  # stopped before it was placed
        info = ray.get(started)
        say(f"{args.log_id} on node {info['node_id']} ({info['host']}), pid {info['pid']}")
        done, signalled = host.wait.remote(), False
        while not ray.wait([done], timeout=0.5)[0]:
            if stop.is_set() and not signalled:
                host.signal.remote(int(signal.SIGTERM))
                signalled = True
        return int(ray.get(done))
    except ray.exceptions.RayActorError as exc:
        say(f"the Ray actor of {args.log_id} died (its node is gone?): {exc}")
        return 1
    finally:
        with contextlib.suppress(Exception):
            ray.kill(host)


__all__ = [
    "ROLES",
    "NatsHost",
    "RayLaunch",
    "RoleHost",
    "find_node",
    "namespace",
    "nodes_used",
    "proxy_main",
    "ray_launch",
]
