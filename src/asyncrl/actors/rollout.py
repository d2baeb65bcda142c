"""RolloutActor: leases prompts, runs episodes concurrently, publishes trajectories.

Three loops share one TaskGroup:

- **leases**: while the runner has free slots, ask the buffer for that many episodes;
  an empty lease means the staleness budget is spent, so wait for new weights (or the
  buffer's retry hint) before asking again;
- **results**: every finished episode's trajectories go onto the JetStream stream with
  idempotent ids; an episode that failed or produced nothing is reported to the buffer
  so its prompt returns to the pool;
- **weights**: on ``WeightsUpdated`` the engine pauses (in-flight sequences stop between
  decode steps), loads the new weights, takes the new version and resumes; tokens carry
  the version that produced them.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from asyncrl.actors.weights import load_published_weights
from asyncrl.messages import (
    EpisodeAborted,
    Lease,
    LeaseRequest,
    Prompt,
    Trajectory,
    WeightsQuery,
    WeightsUpdated,
)
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, RemoteError
from asyncrl.runtime.runner import AsyncTaskRunner, TaskResult

LEASE_TIMEOUT = 5.0
"""Seconds to wait for the buffer's answer to a lease request before asking again."""

METRICS_EVERY = 2.0
"""Seconds between progress records (generation rate, episodes done): often enough for
the dashboard's "generating" line, rare enough to cost nothing."""


class EpisodeProducedNothing(RuntimeError):
    pass


class RolloutActor(Actor):
    role = "rollout"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: Any = None
        self.workflow: Any = None
        self.reward_pool: Any = None
        self.counters: Counter[str] = Counter()
        self._pending_weights: WeightsUpdated | None = None
        self._weights_arrived = asyncio.Event()
        self._version_changed = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._t0 = time.monotonic()
        self._last_pause: float | None = None

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        from asyncrl.actors.common import (
            build_engine,
            build_reward_pool,
            build_workflow,
            workflow_scores_inline,
        )

        self.engine = build_engine(self.recipe)
        await self.engine.start()
        if workflow_scores_inline(self.recipe):
            self.reward_pool = build_reward_pool(self.recipe)
            await self.reward_pool.start()
        self.workflow = build_workflow(self.recipe, self.engine, self.reward_pool)
        self.version = self.engine.version
        await self.bus.subscribe(self.subjects.weights, WeightsUpdated, self.on_weights)
        await self._query_weights()
        tg.create_task(self._weights_loop(), name="weights")
        tg.create_task(self._report(), name="metrics")

    def _known_version(self) -> int:
        pending = self._pending_weights.version if self._pending_weights is not None else -1
        return max(int(self.engine.version), pending)

    async def _query_weights(self) -> None:
        """Asks the buffer for the latest weights (an actor that joins a live run, or one
        that missed a broadcast)."""
        try:
            latest = await self.bus.request(
                self.subjects.weights_query,
                WeightsQuery(actor_id=self.actor_id),
                WeightsUpdated,
                timeout=LEASE_TIMEOUT,
            )
        except (BusTimeout, RemoteError):
            return  # no weights published yet (or no buffer yet): keep the current ones
        await self.on_weights(latest)

    async def teardown(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
        if self.reward_pool is not None:
            await self.reward_pool.aclose()

    async def run(self) -> None:
        runner: AsyncTaskRunner[list[Trajectory]] = AsyncTaskRunner(
            max_concurrent=self.recipe.rollout.max_concurrent
        )
        async with runner, asyncio.TaskGroup() as tg:
            tg.create_task(self._lease_loop(runner), name="leases")
            tg.create_task(self._result_loop(runner), name="results")

    # -- leases and episodes -----------------------------------------------------------------

    async def _lease_loop(self, runner: AsyncTaskRunner[list[Trajectory]]) -> None:
        while True:
            free = runner.max_concurrent - runner.running - runner.queued
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            req = LeaseRequest(actor_id=self.actor_id, max_episodes=free)
            try:
                with self.tracer.span("lease", max_episodes=free):
                    lease = await self.bus.request(
                        self.subjects.lease, req, Lease, timeout=LEASE_TIMEOUT
                    )
            except BusTimeout:
                self.counters["lease_timeouts"] += 1
                await asyncio.sleep(0.5)
                continue
            if lease.version > self._known_version() + self.recipe.buffer.max_head_offpolicyness:
                # the run is ahead of our weights (a missed broadcast, a resume): ask for them
                await self._query_weights()
            for prompt in lease.prompts:
                await runner.submit(self._episode, prompt, lease.lease_id, tag=prompt)
            self.counters["leased"] += len(lease.prompts)
            if not lease.prompts:
                self._version_changed.clear()
                try:
                    async with asyncio.timeout(max(lease.retry_after, 0.05)):
                        await self._version_changed.wait()
                except TimeoutError:
                    pass

    async def _episode(self, prompt: Prompt, lease_id: str) -> list[Trajectory]:
        with self.tracer.span("generate", prompt=prompt.uid):
            trajectories = await self.workflow.arun_episode(
                self.engine, {**prompt.data, "uid": prompt.uid}
            )
        if not trajectories:
            raise EpisodeProducedNothing("the workflow returned no trajectory")
        stamped = [
            t.model_copy(
                update={
                    "actor_id": self.actor_id,
                    "prompt_uid": prompt.uid,
                    "data": prompt.data,
                    "attempt": lease_id,
                }
            )
            for t in trajectories
        ]
        for t in stamped:
            await self.bus.js_publish(self.subjects.trajectories, t, msg_id=t.msg_id("raw"))
        return stamped

    async def _result_loop(self, runner: AsyncTaskRunner[list[Trajectory]]) -> None:
        while True:
            (result,) = await runner.wait(1)
            self._slot_freed.set()
            await self._account(result)

    async def _account(self, result: TaskResult[list[Trajectory]]) -> None:
        prompt: Prompt = result.tag
        if result.ok and result.value:
            self.counters["episodes"] += 1
            self.counters["samples"] += len(result.value)
            self.counters["tokens"] += sum(int(t.loss_mask.numpy().sum()) for t in result.value)
            return
        self.counters["failed_episodes"] += 1
        reason = f"{type(result.error).__name__}: {result.error}"
        self.log.warning("episode failed", prompt=prompt.uid, error=reason)
        await self.bus.publish(
            self.subjects.episode_aborted,
            EpisodeAborted(actor_id=self.actor_id, prompt_uid=prompt.uid, reason=reason),
        )

    # -- weights --------------------------------------------------------------------------------

    async def on_weights(self, msg: WeightsUpdated) -> None:
        if self._pending_weights is None or msg.version > self._pending_weights.version:
            self._pending_weights = msg
            self._weights_arrived.set()

    async def _weights_loop(self) -> None:
        while True:
            await self._weights_arrived.wait()
            self._weights_arrived.clear()
            msg = self._pending_weights
            if msg is None or msg.version <= self.engine.version:
                continue
            t0 = time.monotonic()
            await self.engine.pause()
            try:
                with self.tracer.span("load weights", to_version=msg.version):
                    await load_published_weights(
                        self.engine, self.bus, self.subjects.weights_bucket, msg
                    )
            finally:
                await self.engine.resume()
            self.version = msg.version
            self._version_changed.set()
            dt = time.monotonic() - t0
            self._last_pause = dt
            self.log.info("weights updated", version=msg.version, seconds=round(dt, 3))
            await self.emit_metrics(
                {
                    "version": msg.version,
                    "weight_update_s": dt,
                    **{k: float(v) for k, v in self.counters.items()},
                    "samples_per_s": self.counters["samples"] / (time.monotonic() - self._t0),
                },
                step=msg.version,
            )

    def _rates(self) -> dict[str, float]:
        return {
            "version": float(self.engine.version),
            **{k: float(v) for k, v in self.counters.items()},
            "samples_per_s": self.counters["samples"] / (time.monotonic() - self._t0),
        }

    async def _report(self) -> None:
        """Progress every few seconds: ``gen_tokens_per_s`` is the generated tokens of
        the episodes finished in the last interval over its length."""
        last_tokens, last_t = 0, time.monotonic()
        while True:
            await asyncio.sleep(METRICS_EVERY)
            now, tokens = time.monotonic(), self.counters["tokens"]
            values = self._rates()
            values["gen_tokens_per_s"] = (tokens - last_tokens) / (now - last_t)
            values["gen_tokens_per_s_total"] = tokens / (now - self._t0)
            last_tokens, last_t = tokens, now
            if self._last_pause is not None:
                values["weight_update_s"] = self._last_pause
            await self.emit_metrics(values, step=int(self.engine.version))
