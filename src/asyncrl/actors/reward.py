"""RewardActor: scores raw trajectories and republishes them as scored (without the prompt
record and the completion text, which only scoring reads). A group that came as one
message (:class:`~asyncrl.wire.messages.TrajectoryGroup`) is scored whole and goes on as
one message.

Every reward actor of a run pulls from one durable JetStream consumer, so the actors
share the work like a queue group: add more for more throughput. The reward function runs
in ``reward.workers`` worker processes with a hard timeout, and the actor scores that many
trajectories at once, one per worker; a reward that raises, hangs or returns no finite
number scores 0 and the reason is counted, never the actor's death. A trajectory is acknowledged only after its
scored copy is stored on the stream (published with an idempotent id), so a reward actor
killed mid-way loses nothing: the unacknowledged trajectory is redelivered to another.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from asyncrl.api.reward import RewardScorer
from asyncrl.rewards import build_reward_pool
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.wire.messages import Trajectory, TrajectoryGroup

METRICS_EVERY = 5.0
"""Seconds between metrics records: often enough to watch, rare enough to be free."""

PREFETCH_PER_WORKER = 2
"""Trajectories fetched (held unacked) per reward worker: the one it scores, one next."""


class RewardActor(Actor):
    role = "reward"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.counters: Counter[str] = Counter()
        self.pool: RewardScorer | None = None

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        cfg = self.recipe.reward
        self.pool = pool = build_reward_pool(self.recipe)
        await pool.start()
        s = self.subjects
        consumer = await self.bus.js_consume(
            s.stream,
            s.trajectories,
            "reward",
            Trajectory,
            lambda traj: self.on_trajectory(pool, traj),
            ack_wait=max(30.0, 3 * cfg.timeout),
            # one handler per worker: more would only queue inside the pool
            concurrency=cfg.workers,
            # one fetched message waiting per worker hides the pull round trip; holding
            # more would keep them from the other reward actors sharing this consumer
            batch=PREFETCH_PER_WORKER * cfg.workers,
        )
        tg.create_task(consumer.run(), name="trajectory-consumer")
        # a group keeps up to group_size workers busy: fewer groups at once do, and one
        # more waits so that the next group's scoring overlaps this one's publish
        groups_at_once = -(-cfg.workers // self.recipe.rollout.group_size) + 1
        group_consumer = await self.bus.js_consume(
            s.stream,
            s.trajectory_groups,
            "reward_groups",
            TrajectoryGroup,
            lambda group: self.on_group(pool, group),
            ack_wait=max(30.0, 3 * cfg.timeout),
            concurrency=groups_at_once,
            batch=PREFETCH_PER_WORKER * groups_at_once,
        )
        tg.create_task(group_consumer.run(), name="group-consumer")
        tg.create_task(self._report(), name="metrics")

    async def teardown(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    async def on_trajectory(self, pool: RewardScorer, traj: Trajectory) -> None:
        scored = await self._score(pool, traj, traj.data)
        await self.bus.js_publish(self.subjects.scored, scored, msg_id=scored.msg_id("scored"))

    async def on_group(self, pool: RewardScorer, group: TrajectoryGroup) -> None:
        """Scores every sample of the group at once (the pool runs as many as it has
        workers) and publishes them as one scored group."""
        samples = await asyncio.gather(*(self._score(pool, t, group.data) for t in group.samples))
        scored = group.model_copy(update={"data": {}, "samples": samples})
        await self.bus.js_publish(
            self.subjects.scored_groups, scored, msg_id=scored.msg_id("scored")
        )

    async def _score(
        self, pool: RewardScorer, traj: Trajectory, data: dict[str, Any]
    ) -> Trajectory:
        """``traj`` scored against the prompt record ``data``, past scoring."""
        if traj.reward is None:
            t0 = time.monotonic()
            # the newest version in the sample: what the tracer's window compares with
            self.version = int(traj.versions.numpy().max(initial=-1))
            with self.tracer.span("score", sample=traj.uid):
                result = await pool.score(traj.completion, data)
            self.counters["score_seconds_x1000"] += int(1000 * (time.monotonic() - t0))
            if not result.ok:
                self.counters[f"failed:{result.reason.split(':')[0]}"] += 1
                self.log.warning("reward failed", sample=traj.uid, reason=result.reason)
            self.counters["scored"] += 1
            # scored and past scoring in one copy
            return traj.past_scoring(
                reward=float(result.reward),
                reward_info={**traj.reward_info, "ok": result.ok, "reason": result.reason},
            )
        self.counters["prescored"] += 1
        self.counters["scored"] += 1
        return traj.past_scoring()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(METRICS_EVERY)
            await self.emit_metrics({k: float(v) for k, v in self.counters.items()})
