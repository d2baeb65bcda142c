"""One buffer, 1 to 64 rollout actors: admitted samples/s, lease round trips, buffer CPU.

    .venv/bin/python bench/scale.py            # 1, 2, 4, ..., 64 actors, about 6 minutes
    .venv/bin/python bench/scale.py --quick    # 1, 8, 64 actors, short levels
    .venv/bin/python bench/scale.py --profile  # + cProfile of the buffer and a rollout host
    .venv/bin/python bench/scale.py --producers light  # the buffer's own limit (see below)

Everything but the model is real: an embedded nats-server, the JetStream trajectory
stream, the real :class:`BufferActor` in its own process, the real :class:`RewardActor`
(its worker pool scoring with :func:`contains_answer`, a trivial function: what is
measured is the reward *path*, not a reward), and real :class:`RolloutActor` objects
running the real RLVR workflow on the ``instant`` engine (no model: every response is
``--tokens`` tokens at once). The trainer is null: :class:`NullTrainer` asks the buffer
for batches exactly as the real trainer does (``TrainerActor._fetch_batch``), advances
its version and broadcasts ``WeightsUpdated`` after every ``update_every`` steps (so
every rollout actor pauses, "loads" and takes the version), and computes nothing.
With ``--reward null`` the rollout actors score inline (reward 0) and publish straight to
the scored subject: no reward actor, one stream hop less.

Each level is a fresh run (server, stream, buffer, trainer, reward): start, ``--warmup``
seconds, then a window of ``--seconds`` over which it counts

- admitted samples/s: ``admit`` events in the buffer's ``buffer_events.jsonl`` whose
  time falls in the window, times the group size;
- lease round trip p50/p99: every lease request of every rollout actor that ended in
  the window, timed around ``RolloutActor._ask_for_lease``. A request that finds the
  staleness budget spent is held at the buffer until capacity frees (a long poll, at most
  ``LEASE_WAIT``), so the round trip includes that wait: with many actors it is mostly
  the time to the next trainer step. "empty" is the share answered with nothing (a
  whole wait without capacity);
- buffer CPU per sample: the buffer process's user + system CPU time over the window
  (``psutil``) divided by the admitted samples, and the same for the other processes, so
  one sees which part of the machine the run saturates;
- wire bytes per sample: the mean payload of the first ``WIRE_SAMPLES`` messages of the
  window on the raw subjects and on the scored subjects (as JetStream stores them; a
  group message, one per group for the RLVR workflow, counts its size over its samples),
  and the encoded size of the first ``WIRE_STEPS`` batches the trainer received (inline
  or by the object store) divided by their samples.

The rollout actors of a level live in at most ``--hosts`` processes (default 2), each
actor an asyncio task in its host's loop with its *own* NATS connection, actor id,
leases, heartbeats and weight subscription: the buffer sees N distinct actors. 64
processes on a 2-core machine would measure process scheduling (and 64 interpreters'
memory), not the buffer; with the engine instant an actor is only its protocol, which
is exactly what one event loop can host many of. The price: actors of one host share a
core, so at high counts the rollout side itself may be what saturates (its CPU share is
printed). The buffer's CPU per sample does not depend on that: 1 / (CPU s per sample)
is what the buffer alone could admit on one core, the "buffer ceiling" column.

On a machine of few cores the rollout hosts' CPU (185–250 µs a sample on a 2-core Xeon,
more than the buffer's) is what bounds a level, not the buffer. ``--producers light``
puts :class:`LightProducer` in the rollout actors' place: the same lease protocol and the
same scored group messages, made at about a third of the CPU; everything else is as
above. Its levels show what the buffer admits once it is the busiest process (its CPU
share near one core), not what a rollout fleet produces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the scripts beside this one
from flops import cpu_line

from asyncrl.actors.buffer import BufferActor
from asyncrl.actors.generation import build_workflow
from asyncrl.actors.reward import RewardActor
from asyncrl.actors.rollout import RolloutActor
from asyncrl.actors.trainer import TrainerActor
from asyncrl.config.recipe import Recipe, load_recipe
from asyncrl.engines import build_engine
from asyncrl.engines.instant import RESPONSE_TOKEN
from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.log import configure_logging
from asyncrl.runtime.loop import raise_if_cancelled, run_async
from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import (
    ActorInfo,
    Array,
    Control,
    Lease,
    Prompt,
    Trajectory,
    TrajectoryGroup,
    WeightsUpdated,
)
from asyncrl.wire.subjects import Subjects

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
RUN = "scale"
WIRE_SAMPLES = 256
"""Trajectories per subject whose payload sizes a level averages (then it unsubscribes:
the count costs the server one more delivery per message only that long)."""
WIRE_STEPS = 8
"""Trainer steps per process whose batch the null trainer encodes again to measure its size
(-1 in ``trainer-steps.jsonl`` for the steps after)."""
STOP_GRACE = 15.0
"""Seconds an actor process has to stop after the level's ``stop``; then it is killed and
named in ``killed_at_stop``. Before ``Bus.request`` kept its own deadline, actors now and
then missed their stop (nats-py's ``asyncio.wait_for`` swallowed the cancellation on
Python 3.11); the kill stays as a safety net. The figures are taken before the stop, so
a kill costs nothing."""


def contains_answer(completion: str, data: dict[str, Any]) -> float:
    """The reward the reward actor's workers run: trivial, so the path is measured."""
    return float(str(data.get("answer", "")) in completion)


# -- the actors (in child processes) ---------------------------------------------------------


class NullTrainer(TrainerActor):
    """The trainer's batch protocol and version broadcasts, without an engine: each batch
    is fetched with the real ``_fetch_batch``, the version advances, and every
    ``update_every`` steps ``WeightsUpdated`` goes out (``dir`` weights that are never
    read: the instant engine loads nothing)."""

    step = 0  # no engine to own the progress: the actor counts itself
    version = 0

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        pass

    async def run(self) -> None:
        location = str(self.ctx.run_dir / "weights")
        while True:
            batch = await self._fetch_batch(self.step)
            self.step += 1
            self.version += 1
            samples = sum(len(g.samples) for g in batch.groups)
            # sizes settle within a few steps; encoding a batch again to measure it costs the
            # machine what a step's decode does, so only the first steps are measured
            size = len(encode(batch)) if self.step <= WIRE_STEPS else -1
            self._note_step(samples, size)
            if self.step % self.recipe.trainer.update_every == 0:
                msg = WeightsUpdated(
                    version=self.version, kind="dir", location=location, step=self.step
                )
                await self.bus.publish(self.subjects.weights, msg)
                self.published_version = self.version

    async def teardown(self) -> None:
        pass

    def _note_step(self, samples: int, wire_bytes: int) -> None:
        # a line per step as it happens: the process may have to be killed at the end
        with open(self.ctx.run_dir / "trainer-steps.jsonl", "a") as f:
            f.write(json.dumps([time.time(), samples, wire_bytes]) + "\n")


@dataclass(frozen=True)
class ZeroScore:
    reward: float = 0.0
    ok: bool = True
    reason: str = ""


class ZeroScorer:
    """An inline scorer for the workflow: reward 0 at no cost (``--reward null``)."""

    async def score(self, completion: str, data: dict[str, Any]) -> ZeroScore:
        return ZeroScore()


class TimedRollout(RolloutActor):
    """The real rollout actor; it also notes each lease request's round trip."""

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.leases_timed: list[tuple[float, float, int]] = []
        """(wall time at the answer, round trip in ms, prompts granted) per request."""
        # scored in the workflow, its samples go straight to the scored subject
        self.score_inline = bool(ctx.extra.get("null_reward"))

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        await super().setup(tg)
        if self.score_inline:
            self.workflow.reward = ZeroScorer()

    async def _ask_for_lease(self, n: int) -> Lease:
        t0 = time.perf_counter()
        lease = await super()._ask_for_lease(n)
        rtt_ms = (time.perf_counter() - t0) * 1e3
        self.leases_timed.append((time.time(), rtt_ms, len(lease.prompts)))
        return lease


class LightProducer(TimedRollout):
    """The rollout side at the least CPU it can take (``--producers light``): the rollout
    actor's own lease protocol (its ``_ask_for_lease``: the held request, the same request
    id on a repeat; its heartbeats, listing what it holds and delivered), and for each
    leased prompt at once the scored :class:`TrajectoryGroup` that a rollout actor scoring
    inline publishes: ``group_size`` samples of the prompt's ids (the recipe's workflow
    makes them, as the rollout actor's does) and ``--tokens`` generated tokens at the
    lease's version, reward 0; no engine calls, no episode runner, no weights loop. The
    buffer, the stream, NATS and the trainer are what they are with rollout actors; what is
    left out is what a rollout actor spends per sample, so a level shows what the buffer
    admits when the cores are not spent on producing."""

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        r = self.recipe.rollout
        self.workflow = build_workflow(
            self, build_engine(self.recipe), r.sampling, r.group_size,
            reward=None, endpoint=None, tools=None,
        )  # fmt: skip

    def group(self, prompt: Prompt, lease: Lease) -> TrajectoryGroup:
        """The scored group of ``prompt`` under ``lease``, as the rollout actor sends it."""
        assert self.workflow is not None, "the workflow is built in setup"
        r = self.recipe.rollout
        prompt_ids, _ = self.workflow.prompt(prompt.data)  # the RLVR workflow's
        p, n = len(prompt_ids), r.sampling.max_new_tokens
        arrays = {
            "input_ids": Array.of(prompt_ids + [RESPONSE_TOKEN] * n, "int32"),
            "loss_mask": Array.of([False] * p + [True] * n, "bool"),
            "logprobs": Array.of([0.0] * p + [-1.0] * n, "float32"),
            "versions": Array.of([-1] * p + [lease.version] * n, "int32"),
        }
        samples = [
            Trajectory(
                uid=f"{prompt.uid}/{i}",
                prompt_uid=prompt.uid,
                group_index=i,
                group_size=r.group_size,
                actor_id=self.actor_id,
                attempt=lease.lease_id,
                reward=0.0,
                finish_reason="length",
                epoch=lease.epoch,
                **arrays,
            )
            for i in range(r.group_size)
        ]
        return TrajectoryGroup(prompt_uid=prompt.uid, attempt=lease.lease_id, samples=samples)

    async def run(self) -> None:
        subject = self.subjects.scored_groups
        while True:
            lease = await self._ask_for_lease(self.recipe.rollout.max_concurrent)
            raise_if_cancelled()
            for p in lease.prompts:
                group = self.group(p, lease)
                await self.bus.js_publish(subject, group, msg_id=group.msg_id("scored"))
                raise_if_cancelled()
                self.held.discard(p.uid)
                self.delivered.append(p.uid)
            if not lease.prompts:
                await asyncio.sleep(max(lease.retry_after, 0.05))


def make_context(spec: dict[str, Any], actor_id: str) -> ActorContext:
    return ActorContext(
        run_name=RUN,
        run_dir=Path(spec["run_dir"]),
        nats=NatsInfo(url=spec["url"], token=spec["token"]),
        recipe=Recipe.model_validate_json(spec["recipe"]),
        actor_id=actor_id,
        extra={"null_reward": spec["null_reward"]},
    )


def actor_process(spec: dict[str, Any], role: str, profile: str) -> None:
    """One buffer, trainer or reward actor in this process (cProfile'd if ``profile``)."""
    configure_logging(os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    cls = {"buffer": BufferActor, "trainer": NullTrainer, "reward": RewardActor}[role]
    actor = cls(make_context(spec, f"{role}-0"))
    # CPU time, not wall time: on a busy machine a call that wakes another process (a
    # socket write to the server) would otherwise be charged for the time it waits
    profiler = cProfile.Profile(time.process_time) if profile else None
    if profiler is not None:
        profiler.enable()
    code = run_async(actor.main())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    sys.exit(code)


def rollout_host(
    spec: dict[str, Any],
    actor_ids: list[str],
    out: str,
    window_over: MpEvent,
    dumped: MpEvent,
    profile: str,
) -> None:
    """Several rollout actors, each with its own NATS connection, in one event loop. The
    lease timings are written once ``window_over`` is set, then ``dumped`` is set (before
    the actors are told to stop: an actor that does not stop in time is killed). The host
    is cProfile'd into ``profile`` if it is given."""
    configure_logging(os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    kind = LightProducer if spec["producers"] == "light" else TimedRollout
    actors = [kind(make_context(spec, a)) for a in actor_ids]

    async def dump() -> None:
        await asyncio.to_thread(window_over.wait)
        timed = [x for a in actors for x in a.leases_timed]
        await asyncio.to_thread(Path(out).write_text, json.dumps(timed))
        dumped.set()

    async def main() -> list[int]:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(dump())
            tasks = [tg.create_task(a.main()) for a in actors]
        return [t.result() for t in tasks]

    profiler = cProfile.Profile(time.process_time) if profile else None
    if profiler is not None:
        profiler.enable()
    codes = run_async(main())
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    sys.exit(max(codes))


# -- one level ----------------------------------------------------------------------------------


def level_recipe(args: argparse.Namespace) -> Recipe:
    return load_recipe(
        None,
        [
            f"run.name={RUN}",
            "eval.every=0",
            f"data.size={args.prompts}",
            "rollout.engine.type=instant",
            f"rollout.engine.response_tokens={args.tokens}",
            f"rollout.sampling.max_new_tokens={args.tokens}",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_concurrent={args.episodes_per_actor}",
            f"buffer.batch_size={args.batch_size}",
            f"buffer.max_head_offpolicyness={args.eta}",
            f"buffer.max_concurrent={args.max_concurrent}",
            f"buffer.durable={str(not args.volatile).lower()}",
            f"reward.fn={HERE}:contains_answer",
            f"reward.workers={args.reward_workers}",
        ],
    )


def cpu_seconds(proc: psutil.Process, with_children: bool = False) -> float:
    try:
        procs = [proc, *(proc.children(recursive=True) if with_children else [])]
        total = 0.0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total
    except psutil.NoSuchProcess:
        return 0.0


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank); NaN when there are no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def read_window(
    run_dir: Path, lease_files: list[Path], t0: float, t1: float
) -> tuple[
    Counter[str], list[tuple[float, float, int]], list[tuple[Any, ...]], list[tuple[Any, ...]]
]:
    """Buffer events by kind, lease timings and trainer steps of the window [t0, t1), and
    the steps whose batch size was measured (the first ``WIRE_STEPS``, in or before it)."""
    events: Counter[str] = Counter()
    with open(run_dir / "buffer_events.jsonl") as f:
        for line in f:
            e = json.loads(line)
            if t0 <= e["t"] < t1:
                events[e["event"]] += 1
    leases = [
        (t, ms, n)
        for path in lease_files
        for t, ms, n in json.loads(path.read_text())
        if t0 <= t < t1
    ]
    with open(run_dir / "trainer-steps.jsonl") as f:
        every = [tuple(json.loads(line)) for line in f]
    steps = [(t, n, b) for t, n, b in every if t0 <= t < t1]
    measured = [(t, n, b) for t, n, b in every if b >= 0]  # the first WIRE_STEPS, whenever
    return events, leases, steps, measured


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


async def run_level(n_actors: int, args: argparse.Namespace, recipe: Recipe) -> dict[str, Any]:
    subjects = Subjects(RUN)
    null_reward = args.reward == "null"
    with tempfile.TemporaryDirectory(prefix="asyncrl-scale-") as tmp:
        run_dir = Path(tmp)
        async with EmbeddedNats(run_dir) as server:
            info = server.info
            assert server.pid is not None
            spec = {
                "run_dir": str(run_dir),
                "url": info.url,
                "token": info.token,
                "recipe": recipe.model_dump_json(),
                "null_reward": null_reward,
                "producers": args.producers,
            }
            bus = await Bus.connect(info, name="bench-scale")
            await ensure_trajectory_stream(bus, subjects)
            started: Counter[str] = Counter()
            changed = asyncio.Event()

            async def on_started(msg: ActorInfo) -> None:
                started[msg.role] += 1
                changed.set()

            await bus.subscribe(subjects.started, ActorInfo, on_started)
            ctx = mp.get_context("spawn")
            profile = str(RESULTS / f"scale-buffer-{n_actors}.prof") if args.profile else ""
            procs: dict[str, Any] = {}
            window_over = ctx.Event()

            def spawn(name: str, target: Callable[..., None], *a: Any) -> None:
                p = ctx.Process(target=target, args=a, name=name, daemon=True)
                p.start()
                procs[name] = p

            spawn("buffer", actor_process, spec, "buffer", profile)
            spawn("trainer", actor_process, spec, "trainer", "")
            if not null_reward:
                spawn("reward", actor_process, spec, "reward", "")
            hosts = min(n_actors, args.hosts)
            ids = iter(f"rollout-{i}" for i in range(n_actors))
            lease_files = []
            dumped = []
            for h, k in enumerate(split(n_actors, hosts)):
                lease_files.append(run_dir / f"leases-{h}.json")
                dumped.append(ctx.Event())
                actor_ids = [next(ids) for _ in range(k)]
                spawn(
                    f"rollout-host-{h}",
                    rollout_host,
                    spec,
                    actor_ids,
                    str(lease_files[-1]),
                    window_over,
                    dumped[-1],
                    str(RESULTS / f"scale-rollout-{n_actors}.prof")
                    if args.profile and h == 0
                    else "",
                )
            want = {"buffer": 1, "trainer": 1, "rollout": n_actors}
            if not null_reward:
                want["reward"] = 1
            t_spawn = time.monotonic()
            async with asyncio.timeout(180):
                while any(started[r] < n for r, n in want.items()):
                    changed.clear()
                    await changed.wait()
            startup_s = time.monotonic() - t_spawn
            await asyncio.sleep(args.warmup)

            ps = {name: psutil.Process(p.pid) for name, p in procs.items()}
            ps["nats-server"] = psutil.Process(server.pid)

            def snapshot() -> dict[str, float]:
                cpu = {
                    name: cpu_seconds(p, with_children=name == "reward") for name, p in ps.items()
                }
                machine = psutil.cpu_times()
                cpu["machine_busy"] = machine.user + machine.system + machine.nice
                return cpu

            wire: dict[str, list[float]] = {"raw": [], "scored": []}
            g = recipe.rollout.group_size
            for stage, subject, per in (
                ("raw", subjects.trajectories, 1),
                ("raw", subjects.trajectory_groups, g),
                ("scored", subjects.scored, 1),
                ("scored", subjects.scored_groups, g),
            ):

                async def on_traj(
                    msg: Any, sizes: list[float] = wire[stage], per: int = per
                ) -> None:
                    sizes.append(len(msg.data) / per)

                sub = await bus.nc.subscribe(subject, cb=on_traj)
                await sub.unsubscribe(limit=WIRE_SAMPLES)
            cpu0, t0 = snapshot(), time.time()
            await asyncio.sleep(args.seconds)
            cpu1, t1 = snapshot(), time.time()
            window_over.set()
            for d in dumped:
                if not await asyncio.to_thread(d.wait, 60):
                    raise RuntimeError("a rollout host did not write its lease timings")
            await bus.publish(subjects.control, Control(command="stop", reason="bench level over"))
            killed = []
            for name, p in procs.items():
                await asyncio.to_thread(p.join, STOP_GRACE)
                if p.exitcode is None:
                    # see STOP_GRACE: a missed stop, not a failure of the level
                    p.kill()
                    p.join()
                    killed.append(name)
                elif p.exitcode != 0:
                    raise RuntimeError(f"{name} exited with {p.exitcode}")
            await bus.close()
            events, leases, steps, measured = read_window(run_dir, lease_files, t0, t1)
    window = t1 - t0
    admitted = events["admit"] * recipe.rollout.group_size
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
    rollout_cpu = sum(v for k, v in cpu.items() if k.startswith("rollout-host"))
    buffer_cpu_per_sample = cpu["buffer"] / admitted if admitted else float("nan")
    rtts = [ms for _, ms, _ in leases]
    return {
        "actors": n_actors,
        "hosts": hosts,
        "window_s": window,
        "startup_s": startup_s,
        "admitted_samples_per_s": admitted / window,
        "trained_samples_per_s": sum(n for _, n, _ in steps) / window,
        "trainer_steps_per_s": len(steps) / window,
        "lease_requests_per_s": len(leases) / window,
        "empty_lease_share": sum(n == 0 for _, _, n in leases) / max(1, len(leases)),
        "lease_rtt_ms_p50": pct(rtts, 0.5),
        "lease_rtt_ms_p99": pct(rtts, 0.99),
        "buffer_cpu_s_per_sample": buffer_cpu_per_sample,
        "buffer_ceiling_samples_per_s": 1 / buffer_cpu_per_sample if admitted else 0.0,
        "cpu_share": {
            "buffer": cpu["buffer"] / window,
            "trainer": cpu["trainer"] / window,
            "reward": cpu.get("reward", 0.0) / window,
            "rollout": rollout_cpu / window,
            "nats-server": cpu["nats-server"] / window,
            "machine": cpu["machine_busy"] / window,
        },
        "wire_bytes_per_sample": {
            "raw": mean(wire["raw"]),
            "scored": mean(wire["scored"]),
            "batch": sum(b for _, _, b in measured) / max(1, sum(n for _, n, _ in measured)),
        },
        "events": dict(events),
        "killed_at_stop": killed,
    }


# -- orchestration --------------------------------------------------------------------------------


def print_profile(what: str, path: Path, top: int) -> None:
    stats = pstats.Stats(str(path))
    print(f"\n{what} profile ({path.name}), top {top} by own time:")
    stats.sort_stats("tottime").print_stats(top)
    print(f"top {top} by cumulative time:")
    stats.sort_stats("cumulative").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1, 8, 64 actors; 2 s warm-up, 6 s each")
    p.add_argument("--actors", default="1,2,4,8,16,32,64", help="actor counts, comma-separated")
    p.add_argument("--seconds", type=float, default=15.0, help="measured window per level")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the window")
    p.add_argument("--hosts", type=int, default=2, help="processes the rollout actors share")
    p.add_argument("--reward", choices=["actor", "null"], default="actor")
    p.add_argument(
        "--producers",
        choices=["rollout", "light"],
        default="rollout",
        help="rollout: real RolloutActors on the instant engine; light: the lease protocol "
        "and pre-built scored groups (LightProducer; implies --reward null)",
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens per response")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32, help="groups per trainer step (B)")
    p.add_argument("--eta", type=int, default=2, help="buffer.max_head_offpolicyness")
    p.add_argument("--max-concurrent", type=int, default=4096, help="buffer.max_concurrent")
    p.add_argument(
        "--volatile",
        action="store_true",
        help="buffer.durable = false: no state writes (what durability costs, by difference)",
    )
    p.add_argument("--episodes-per-actor", type=int, default=4, help="rollout.max_concurrent")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=20_000, help="dataset size")
    p.add_argument(
        "--stop-below",
        type=float,
        default=0.25,
        help="stop once a level admits less than this share of the peak (0: never)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the buffer process and the first rollout host",
    )
    args = p.parse_args()
    if args.quick:
        args.actors, args.seconds, args.warmup = "1,8,64", 6.0, 2.0
    if args.producers == "light":
        args.reward = "null"  # its groups are scored: no reward actor on the path
    levels = [int(x) for x in args.actors.split(",")]
    recipe = level_recipe(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = {
        "cpu": cpu_line(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "load_average": os.getloadavg()[0],
        "args": vars(args),
    }
    print(
        f"{header['cpu']}, {header['cpus']} CPUs, load average {header['load_average']:.1f}; "
        f"group {args.group_size} x {args.tokens} tokens, B = {args.batch_size} groups, "
        f"eta = {args.eta}, {args.episodes_per_actor} episodes per actor, "
        f"reward: {'null (inline)' if args.reward == 'null' else 'reward actor'}, "
        f"producers: {args.producers}, {args.seconds:.0f} s per level"
    )
    cols = (
        f"{'actors':>6}{'admitted/s':>11}{'lease p50':>10}{'p99 ms':>8}{'empty':>7}"
        f"{'buf us/sample':>14}{'buf ceiling/s':>14}"
        f"{'  cpu: buffer reward rollout nats trainer machine':<50}"
        f"{'  bytes/sample: raw scored batch'}"
    )
    print(cols)
    results = []
    peak = 0.0
    for n in levels:
        r = asyncio.run(run_level(n, args, recipe))
        results.append(r)
        c, w = r["cpu_share"], r["wire_bytes_per_sample"]
        print(
            f"{n:>6}{r['admitted_samples_per_s']:>11,.0f}{r['lease_rtt_ms_p50']:>10.2f}"
            f"{r['lease_rtt_ms_p99']:>8.1f}{r['empty_lease_share']:>7.0%}"
            f"{r['buffer_cpu_s_per_sample'] * 1e6:>14.0f}{r['buffer_ceiling_samples_per_s']:>14,.0f}"
            f"{'':>8}{c['buffer']:>6.2f}{c['reward']:>7.2f}{c['rollout']:>8.2f}"
            f"{c['nats-server']:>5.2f}{c['trainer']:>8.2f}{c['machine']:>8.2f}"
            f"{w['raw']:>18,.0f}{w['scored']:>7,.0f}{w['batch']:>6,.0f}",
            flush=True,
        )
        rate = r["admitted_samples_per_s"] or float("nan")
        per = {k: v / rate * 1e6 for k, v in c.items()}
        print(
            f"{'':>6}  us CPU per admitted sample: buffer {per['buffer']:.0f}, reward "
            f"{per['reward']:.0f}, rollout {per['rollout']:.0f}, nats-server "
            f"{per['nats-server']:.0f}, trainer {per['trainer']:.0f}; machine {per['machine']:.0f}",
            flush=True,
        )
        peak = max(peak, r["admitted_samples_per_s"])
        if args.stop_below and r["admitted_samples_per_s"] < args.stop_below * peak:
            print(f"stopping: below {args.stop_below:.0%} of the peak")
            break
    best = max(results, key=lambda r: r["admitted_samples_per_s"])
    last = results[-1]
    held = last["admitted_samples_per_s"] / best["admitted_samples_per_s"]
    per_sample = [r["buffer_cpu_s_per_sample"] for r in results]
    summary = (
        f"summary: peak {best['admitted_samples_per_s']:,.0f} admitted samples/s at "
        f"{best['actors']} actors (goal 5,000); {last['actors']} actors hold {held:.0%} of it "
        f"(goal 80%); buffer {min(per_sample) * 1e6:.0f}-{max(per_sample) * 1e6:.0f} us CPU "
        f"per sample, a one-core ceiling of "
        f"{1 / max(per_sample):,.0f}-{1 / min(per_sample):,.0f} samples/s"
    )
    print(summary)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"scale-{stamp}.json"
    out.write_text(json.dumps({**header, "levels": results, "summary": summary}, indent=2))
    print(f"wrote {out.relative_to(HERE.parent.parent)}")
    if args.profile:
        for what in ("buffer", "rollout"):
            print_profile(what, RESULTS / f"scale-{what}-{last['actors']}.prof", 25)


if __name__ == "__main__":
    main()
