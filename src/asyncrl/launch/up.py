"""``asyncrl up``: one run on one machine, start to finish.

Writes the run folder (resolved recipe, NATS connection info, a log per actor), starts an
embedded nats-server (or a cluster of them, ``run.nats_servers``) unless the recipe names
one, creates the durable trajectory stream,
spawns every actor (the eval actor too when ``eval.every`` is set) on the GPUs that
``<role>.gpus`` gives it (:func:`asyncrl.config.placement.assign_gpus`), shows the live
dashboard on a terminal or a progress line per trainer step and per evaluation otherwise,
and exits 0 when the trainer reached ``trainer.max_steps``, the eval actor scored the last
version, and every process is gone, grandchildren included (the supervisor's stop).
A recipe this machine cannot run (a CUDA device where there is none, more GPUs than it
has) is refused before anything starts. At the end it draws the plots into ``<run>/plots`` and,
with ``--trace``, merges the actors' spans into ``<run>/trace.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any

from asyncrl.actors.buffer.durable import forget as forget_buffer_state
from asyncrl.actors.buffer.durable import keep_for_resume as keep_buffer_position
from asyncrl.config.checks import enforce_machine, enforce_recipe
from asyncrl.config.placement import assign_gpus
from asyncrl.config.recipe import Recipe, RecipeError, dump_recipe
from asyncrl.launch.core_placement import CorePlacement, auto_placement
from asyncrl.launch.ray_cluster import ray_launch, require_ray
from asyncrl.observe.dashboard import start_dashboard
from asyncrl.observe.plot import plot_run
from asyncrl.runtime.allocator import mimalloc_preload, system_malloc_reason
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.cores import VISIBLE_ENV
from asyncrl.runtime.forks import ForkServer, fork_server_reason, server_env
from asyncrl.runtime.log import configure_logging, get_logger
from asyncrl.runtime.loop import run_async
from asyncrl.runtime.nats_cluster import NatsCluster
from asyncrl.runtime.nats_server import external_info
from asyncrl.runtime.supervisor import ActorSpec, Supervisor, actor_argv
from asyncrl.runtime.trace import merge_traces
from asyncrl.train.checkpoint import latest_checkpoint_meta
from asyncrl.train.torchrun import LOOPBACK, UP_NODE_ENV, free_port, torchrun_argv
from asyncrl.wire.messages import Metrics
from asyncrl.wire.subjects import Subjects

TRAJECTORY_STREAM_MAX_BYTES = 2 * 1024**3
"""The trajectory stream's disk bound: far above what a run keeps in flight (the staleness
rule limits it to (η + 1)·B episodes), small enough never to fill a disk. It is a work
queue: a message leaves the stream once its consumer acknowledged it, and a full stream
refuses new messages (the publisher sees an error) rather than dropping unread ones."""


async def ensure_trajectory_stream(bus: Any, subjects: Subjects) -> None:
    """Creates the run's trajectory stream (raw and scored trajectories, a work queue
    bounded by ``TRAJECTORY_STREAM_MAX_BYTES``), or checks the one that exists."""
    await bus.ensure_stream(
        subjects.stream,
        subjects.trajectory_subjects,
        max_bytes=TRAJECTORY_STREAM_MAX_BYTES,
        retention="workqueue",
    )


def prepare_run_dir(recipe: Recipe, *, resume: bool, overwrite: bool) -> Path:
    run_dir = recipe.run.path
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        if not overwrite:
            raise RecipeError(
                f"run folder {run_dir} exists: use --resume to continue it, --overwrite to "
                f"replace it, or --set run.name=<new name>"
            )
        shutil.rmtree(run_dir)
    if resume and latest_checkpoint_meta(run_dir) is None:
        if not (run_dir / "recipe.json").is_file():
            raise RecipeError(
                f"--resume: {run_dir} is not the folder of a run (it has no recipe.json); "
                f"check run.dir and run.name, or start a new run without --resume"
            )
        # killed before its first checkpoint: what it had done is dropped (the trainer
        # drops its records after step 0) and it starts again from the initial weights
        print(
            f"asyncrl: warning: --resume: {run_dir} has no checkpoint yet; "
            f"the run starts again from the initial weights",
            file=sys.stderr,
            flush=True,
        )
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    (run_dir / "config.toml").write_text(dump_recipe(recipe))
    return run_dir


def actor_specs(
    recipe: Recipe,
    run_dir: Path,
    placement: CorePlacement | None = None,
    gpus: list[str] | None = None,
) -> list[ActorSpec]:
    """One spec per actor process. Every role is replaced when it dies in mid-run (up to
    ``run.max_restarts`` times each): rollout, reward and eval actors hold nothing that is
    not also on the stream or in the buffer's leases, the buffer restores its durable
    state, and the trainer its latest checkpoint. With a ``placement``, each process is
    started on its role's cores; with ``gpus`` (the machine's, :func:`asyncrl.runtime.cores.node_gpus`)
    each process that ``<role>.gpus`` gives GPUs sees only those (``CUDA_VISIBLE_DEVICES``),
    and one of ``gpus = 0`` sees the machine's. A replacement keeps its predecessor's."""
    sets = assign_gpus(recipe)

    def spec(
        role: str, index: int, actor_id: str, argv: list[str] | None = None, **kw: Any
    ) -> ActorSpec:
        argv = argv or actor_argv(role, run_dir, actor_id)
        restarts, backoff = recipe.run.max_restarts, recipe.run.restart_backoff
        env = dict(placement.env(role)) if placement is not None else {}
        if gpus is not None and sets[role][index]:
            env[VISIBLE_ENV] = ",".join(gpus[i] for i in sets[role][index])
        kw["env"] = {**env, **kw.get("env", {})}
        return ActorSpec(role, actor_id, argv, restarts=restarts, backoff=backoff, **kw)

    specs = [spec("buffer", 0, "buffer-0")]
    specs += [spec("reward", i, f"reward-{i}") for i in range(recipe.reward.actors)]
    specs += [spec("rollout", i, f"rollout-{i}") for i in range(recipe.rollout.actors)]
    if recipe.eval.every:
        # primary: the run ends only once the last version is evaluated too
        specs.append(spec("eval", 0, "eval-0", primary=True))
    # every trainer node is primary: the run ends once each has finished
    specs += [
        spec("trainer", k, node_id, argv, primary=True, **options)
        for k, (node_id, argv, options) in enumerate(trainer_nodes(recipe, run_dir))
    ]
    return specs


def trainer_nodes(recipe: Recipe, run_dir: Path) -> list[tuple[str, list[str], dict[str, Any]]]:
    """The trainer processes ``up`` starts, as (id, argv, spec options): one process for
    one rank; one torchrun for one node; for ``trainer.nodes`` > 1 a gang of one torchrun
    per node (every node here, on loopback and a free port, or with
    ``trainer.rendezvous`` only the first, which hosts it; the others join from their
    machines). Each node runs the same ``--actor-id trainer-0``: the rendezvous decides
    which holds global rank 0 (:mod:`asyncrl.train.torchrun`)."""
    t, actor_id = recipe.trainer, "trainer-0"
    target = actor_argv("trainer", run_dir, actor_id)[1:]  # after the interpreter
    # a CPU trainer starts with its allocator preloaded, rather than executing itself
    # again once its imports are done (asyncrl.runtime.allocator.use_mimalloc)
    preload = {} if system_malloc_reason(t) else mimalloc_preload()
    if t.nodes == 1:
        if t.nproc == 1:
            return [(actor_id, [sys.executable, *target], {"env": preload})]
        return [(actor_id, torchrun_argv(target, nproc=t.nproc), {"env": preload})]
    local = not t.rendezvous
    endpoint = t.rendezvous or f"{LOOPBACK}:{free_port()}"
    return [
        (
            actor_id if k == 0 else f"{actor_id}-node{k}",
            torchrun_argv(
                target,
                nproc=t.nproc,
                nodes=t.nodes,
                endpoint=endpoint,
                run_id=recipe.run.name,
                is_host=k == 0,
                local_addr=LOOPBACK if local else "",
            ),
            {"gang": actor_id, "env": {**preload, UP_NODE_ENV: str(k)}},
        )
        for k in range(t.nodes if local else 1)
    ]


def format_progress(recipe: Recipe, m: Metrics) -> str:
    v = m.values

    def g(key: str, fmt: str = ".3f") -> str:
        return format(v[key], fmt) if key in v else "-"

    if m.role == "eval":
        scores = "  ".join(
            f"{k.removeprefix('eval/')} {g(k)}" for k in v if k == "eval/accuracy" or "@" in k
        )
        return f"eval v{int(v.get('version', 0))}  {scores}  ({g('eval/seconds', '.1f')} s)"
    return (
        f"step {m.step}/{recipe.trainer.max_steps}  v{int(v.get('version', 0))}  "
        f"reward {g('reward_mean')}  staleness {g('staleness_mean', '.2f')}/{g('staleness_max', '.0f')}"
        f"  accepted {g('accepted', '.0f')} rejected {g('rejected', '.0f')}  "
        f"{g('samples_per_s', '.2f')} samples/s  loss {g('loss', '.4f')}"
    )


def finish_run_folder(run_dir: Path, recipe: Recipe) -> list[str]:
    """What ``up`` leaves after the actors are gone: the merged timeline (with
    ``--trace``) and the plots. Returns lines to print; a failure here never fails a run
    that trained."""
    lines = []
    if recipe.run.trace_steps:
        trace = merge_traces(run_dir)
        lines.append(
            f"timeline: {trace} (open in https://ui.perfetto.dev)"
            if trace
            else "timeline: no spans recorded"
        )
    if recipe.run.tensorboard:
        lines.append(f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if not recipe.run.plots:
        return lines
    try:
        pngs = plot_run(run_dir)
        if pngs:
            lines.append(f"plots: {pngs[0].parent}/ ({', '.join(p.name for p in pngs)})")
    except ImportError as exc:
        lines.append(f"plots skipped: {exc}")
    except Exception as exc:  # plotting must not turn a finished run into a failed one
        get_logger(role="up").warning("plotting failed", error=repr(exc))
        lines.append(f"plots failed: {exc!r}")
    return lines


async def _up(
    recipe: Recipe,
    run_dir: Path,
    quiet: bool,
    resume: bool,
    placement: CorePlacement | None,
    ray: Any = None,
    gpus: list[str] | None = None,
) -> int:
    log = get_logger(role="up", run=recipe.run.name)
    specs = actor_specs(recipe, run_dir, placement, gpus)
    forks = None
    if (why := fork_server_reason(recipe.run.actor_start, ray=ray is not None)) is None:
        # started first: it imports while NATS starts and the stream is made
        trainer = [s for s in specs if s.role == "trainer" and s.can_fork]
        forks = await ForkServer.start(run_dir, server_env(trainer[0].env if trainer else {}))
        log.info("actors are forked", server_pid=forks.proc.pid)
    else:
        log.info("actors are executed", reason=why)
    try:
        return await _run_actors(recipe, run_dir, quiet, resume, specs, forks, ray)
    finally:
        if forks is not None:
            await forks.close()


async def _run_actors(
    recipe: Recipe,
    run_dir: Path,
    quiet: bool,
    resume: bool,
    specs: list[ActorSpec],
    forks: ForkServer | None,
    ray: Any,
) -> int:
    log = get_logger(role="up", run=recipe.run.name)
    subjects = Subjects(recipe.run.name)
    server: Any = None
    # credentials come from the environment or are made here, and live in nats.json only
    if recipe.run.nats_url:
        info = external_info(recipe.run)
        info.write(run_dir / "nats.json")
    else:
        # under Ray (a RayLaunch), the servers run on the cluster's nodes
        server = ray.nats(recipe.run, run_dir) if ray else NatsCluster.for_run(recipe.run, run_dir)
        info = await server.start()
    log.info("NATS", url=info.redacted_url, tls=info.tls, replicas=info.replicas)
    try:
        bus = await Bus.connect(info, name="asyncrl-up")
        try:
            if resume:
                # what was in flight when the run stopped is discarded, exactly as the
                # accounting assumes (accepted = v·B): a resumed run starts clean
                await bus.delete_stream(subjects.stream)
            meta = latest_checkpoint_meta(run_dir) if resume else None
            if meta is not None:
                # the buffer's state keeps only the dataset position of the checkpoint
                await keep_buffer_position(
                    bus,
                    subjects.buffer_bucket,
                    step=int(meta["step"]),
                    version=int(meta["version"]),
                    batch_size=recipe.buffer.batch_size,
                )
            else:  # the buffer's durable state is for replacements within one run only
                await forget_buffer_state(bus, subjects.buffer_bucket)
            await ensure_trajectory_stream(bus, subjects)

            live = None
            if not quiet and sys.stdout.isatty():
                live = await start_dashboard(bus, subjects, recipe)
            else:

                async def show(m: Metrics) -> None:
                    if not quiet:
                        print(format_progress(recipe, m), flush=True)

                await bus.subscribe(subjects.metrics("trainer"), Metrics, show)
                await bus.subscribe(subjects.metrics("eval"), Metrics, show)

            def started() -> None:
                if not quiet and live is None:
                    print("all actors started", flush=True)

            sup = Supervisor(
                bus,
                subjects,
                run_dir,
                ray.specs(specs) if ray else specs,
                startup_timeout=recipe.run.startup_timeout,
                on_started=started,
                forks=forks,
            )
            watcher = None
            if server is not None:
                watcher = asyncio.create_task(keep_server_alive(server, sup, quiet))
            try:
                code = await sup.run()
            finally:
                if watcher is not None:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                if live is not None:
                    live.stop()
            if code == 0 and not quiet:
                for line in finish_run_folder(run_dir, recipe):
                    print(line, flush=True)
            elif code == 0 or recipe.run.trace_steps:
                finish_run_folder(run_dir, recipe)
            print(
                f"asyncrl up: {sup.reason or 'done'} (exit {code}); run folder {run_dir}",
                file=sys.stderr if code else sys.stdout,
                flush=True,
            )
            log.info("run ended", code=code, reason=sup.reason)
            return code
        finally:
            await bus.close()
    finally:
        if server is not None:
            await server.stop()


async def keep_server_alive(server: Any, sup: Any, quiet: bool) -> None:
    """Starts each embedded nats-server again whenever it dies (same port, credentials and
    JetStream store): the actors reconnect (to another server of a cluster meanwhile) and
    go on. A server that cannot be started again ends the run with the reason."""
    log = get_logger(role="up")

    def died(name: str, code: int | None) -> None:
        log.warning("nats-server died, starting it again", server=name, code=code)
        if not quiet:
            print(f"asyncrl up: {name} exited ({code}); restarting it", file=sys.stderr)

    try:
        await server.keep_alive(died)
    except RuntimeError as exc:
        sup.fail(f"the embedded nats-server died and could not be started again: {exc}")


def up(
    recipe: Recipe,
    *,
    resume: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    ray: str = "",
) -> int:
    """Runs ``recipe`` to the end; with ``ray`` (a Ray cluster's address, or ``auto``) its
    processes and nats-servers are placed on that cluster (:mod:`asyncrl.launch.ray_cluster`)."""
    for warning in enforce_recipe(recipe):  # a recipe that cannot run fails here, first
        print(f"asyncrl: warning: {warning}", file=sys.stderr, flush=True)
    if ray:  # no ray, no run folder touched
        require_ray()
        gpus = None  # Ray hands out the cluster's GPUs itself
    else:
        gpus = enforce_machine(recipe)  # no CUDA here, too few GPUs: nothing started yet
    # the cores of this machine: not where the roles of a run on Ray go
    placement = None if ray else auto_placement(recipe)
    run_dir = prepare_run_dir(recipe, resume=resume, overwrite=overwrite)
    if placement is not None:
        # said first: it decides every figure the run reports
        if not quiet:
            print(f"asyncrl up: {placement.describe()}", flush=True)
        (run_dir / "placement.json").write_text(placement.to_json())
    with open(run_dir / "logs" / "up.log", "a") as up_log:
        configure_logging("INFO", stream=up_log)
        if placement is not None:
            get_logger(role="up").info(placement.describe())
        if not ray:
            return run_async(_up(recipe, run_dir, quiet, resume, placement, gpus=gpus))
        with ray_launch(recipe, run_dir, ray) as launch:
            return run_async(_up(recipe, run_dir, quiet, resume, None, launch))
