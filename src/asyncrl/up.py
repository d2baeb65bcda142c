"""``asyncrl up``: one run on one machine, start to finish.

Writes the run folder (resolved recipe, NATS connection info, a log per actor), starts an
embedded nats-server unless the recipe names one, creates the durable trajectory stream,
spawns every actor, shows a progress line per trainer step, and exits 0 when the trainer
reached ``trainer.max_steps`` and every process is gone.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from asyncrl.checks import enforce_recipe
from asyncrl.config import Recipe, RecipeError, dump_recipe
from asyncrl.messages import Metrics
from asyncrl.runtime.log import configure_logging, get_logger
from asyncrl.runtime.loop import run_async
from asyncrl.subjects import Subjects

TRAJECTORY_STREAM_MAX_BYTES = 2 * 1024**3
"""The trajectory stream's disk bound: far above what a run keeps in flight (the staleness
rule limits it to (η + 1)·B episodes), small enough never to fill a disk. It is a work
queue: a message leaves the stream once its consumer acknowledged it, and a full stream
refuses new messages (the publisher sees an error) rather than dropping unread ones."""


RESTARTS = 3
"""Replacements per stateless actor before its deaths end the run."""


def prepare_run_dir(recipe: Recipe, *, resume: bool, overwrite: bool) -> Path:
    run_dir = recipe.run.path
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        if not overwrite:
            raise RecipeError(
                f"run folder {run_dir} exists: use --resume to continue it, --overwrite to "
                f"replace it, or --set run.name=<new name>"
            )
        shutil.rmtree(run_dir)
    if resume and not (run_dir / "checkpoints").is_dir():
        raise RecipeError(f"--resume: {run_dir} has no checkpoints/ folder to resume from")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    (run_dir / "config.toml").write_text(dump_recipe(recipe))
    return run_dir


def actor_specs(recipe: Recipe, run_dir: Path) -> list:
    from asyncrl.runtime.supervisor import ActorSpec, actor_argv

    specs = [ActorSpec("buffer", "buffer-0", actor_argv("buffer", run_dir, "buffer-0"))]
    # reward and rollout actors hold nothing that is not also on the stream or in the
    # buffer's leases, so one that dies is simply replaced
    for i in range(recipe.reward.actors):
        aid = f"reward-{i}"
        specs.append(
            ActorSpec("reward", aid, actor_argv("reward", run_dir, aid), restarts=RESTARTS)
        )
    for i in range(recipe.rollout.actors):
        aid = f"rollout-{i}"
        specs.append(
            ActorSpec("rollout", aid, actor_argv("rollout", run_dir, aid), restarts=RESTARTS)
        )
    trainer_argv = actor_argv("trainer", run_dir, "trainer-0")
    if recipe.trainer.nproc > 1:
        trainer_argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={recipe.trainer.nproc}",
            *trainer_argv[1:],
        ]
    specs.append(ActorSpec("trainer", "trainer-0", trainer_argv, primary=True))
    return specs


def format_progress(recipe: Recipe, m: Metrics) -> str:
    v = m.values

    def g(key: str, fmt: str = ".3f") -> str:
        return format(v[key], fmt) if key in v else "-"

    return (
        f"step {m.step}/{recipe.trainer.max_steps}  v{int(v.get('version', 0))}  "
        f"reward {g('reward_mean')}  staleness {g('staleness_mean', '.2f')}/{g('staleness_max', '.0f')}"
        f"  accepted {g('accepted', '.0f')} rejected {g('rejected', '.0f')}  "
        f"{g('samples_per_s', '.2f')} samples/s  loss {g('loss', '.4f')}"
    )


async def _up(recipe: Recipe, run_dir: Path, quiet: bool, resume: bool) -> int:
    from asyncrl.runtime.bus import Bus
    from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo
    from asyncrl.runtime.supervisor import Supervisor

    log = get_logger(role="up", run=recipe.run.name)
    subjects = Subjects(recipe.run.name)
    server: EmbeddedNats | None = None
    if recipe.run.nats_url:
        info = NatsInfo(url=recipe.run.nats_url, token=None)
        info.write(run_dir / "nats.json")
    else:
        server = EmbeddedNats(
            run_dir,
            max_payload=recipe.run.max_payload_mb * 1024 * 1024,
            log_file=run_dir / "logs" / "nats-server.log",
        )
        info = await server.start()
    try:
        bus = await Bus.connect(info, name="asyncrl-up")
        try:
            if resume:
                # what was in flight when the run stopped is discarded, exactly as the
                # accounting assumes (accepted = v·B): a resumed run starts clean
                await bus.delete_stream(subjects.stream)
            await bus.ensure_stream(
                subjects.stream,
                [subjects.trajectories, subjects.scored],
                max_bytes=TRAJECTORY_STREAM_MAX_BYTES,
                retention="workqueue",
            )

            async def show(m: Metrics) -> None:
                if not quiet:
                    print(format_progress(recipe, m), flush=True)

            await bus.subscribe(subjects.metrics("trainer"), Metrics, show)
            sup = Supervisor(
                bus,
                subjects,
                run_dir,
                actor_specs(recipe, run_dir),
                startup_timeout=recipe.run.startup_timeout,
                on_started=lambda: None if quiet else print("all actors started", flush=True),
            )
            code = await sup.run()
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


def up(
    recipe: Recipe, *, resume: bool = False, overwrite: bool = False, quiet: bool = False
) -> int:
    for warning in enforce_recipe(recipe):  # a recipe that cannot run fails here, first
        print(f"asyncrl: warning: {warning}", file=sys.stderr, flush=True)
    run_dir = prepare_run_dir(recipe, resume=resume, overwrite=overwrite)
    with open(run_dir / "logs" / "up.log", "a") as up_log:
        configure_logging("INFO", stream=up_log)
        return run_async(_up(recipe, run_dir, quiet, resume))
