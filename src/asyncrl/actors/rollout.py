"""RolloutActor: leases prompts, runs episodes concurrently, publishes trajectories.

Three loops share one TaskGroup:

- **leases**: while the runner has free slots, ask the buffer for that many episodes;
  an empty lease means the staleness budget is spent, so wait for new weights (or the
  buffer's retry hint) before asking again. A request that times out is repeated with
  its request id, so a lost reply yields the same lease, never a second one. Heartbeats
  list the prompts the actor holds: the buffer frees a lease the actor does not know of.
  With ``rollout.deterministic`` a lease's episodes start only once the engine holds the
  weights of the lease's version;
- **results**: every finished episode's trajectories go onto the JetStream stream with
  idempotent ids: unscored ones to the raw subject (the reward actors score them), those
  the workflow scored straight to the scored subject, which the buffer reads; an episode that failed or produced nothing is reported to the buffer
  (repeated until the buffer acknowledges it) so its prompt returns to the pool;
- **weights**: on ``WeightsUpdated`` the engine pauses (in-flight sequences stop between
  decode steps), loads the new weights, takes the new version and resumes; tokens carry
  the version that produced them.

With ``rollout.endpoint`` (on by default for agent code) the actor also serves an
OpenAI-compatible endpoint from its engine on 127.0.0.1 (:mod:`asyncrl.endpoint`). Its API
key is the run's NATS token, or in a run without one a token the actor makes; the URL and
the key are in ``<run>/endpoints/<actor id>.json`` (mode 0600, removed when the actor
ends), and the URL in the actor's log, so that agent code outside the run can use it too.
The workflow is built from its config (:func:`asyncrl.actors.generation.build_workflow`),
as the eval actor builds it; the ``agent`` workflow's MCP servers (``rollout.agent.mcp``)
start with the actor and end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections import Counter, deque
from pathlib import Path

import numpy as np

from asyncrl.actors.generation import build_workflow, latest_weights, serve_endpoint, supersedes
from asyncrl.api.inference import InferenceEngine
from asyncrl.api.workflow import RolloutWorkflow
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.engines import build_engine
from asyncrl.rewards.pool import RewardPool, build_reward_pool
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, PayloadTooLarge
from asyncrl.runtime.runner import AsyncTaskRunner, TaskResult
from asyncrl.weights.build import build_receiver
from asyncrl.weights.receiver import EngineWeights
from asyncrl.wire.messages import (
    Ack,
    EpisodeAborted,
    Lease,
    LeaseRequest,
    MemoryControl,
    MemoryReleased,
    Prompt,
    Trajectory,
    TrajectoryGroup,
    WeightsUpdated,
)
from asyncrl.wire.unchecked import updated

LEASE_TIMEOUT = 5.0
"""Seconds to wait for the buffer's answer to a lease request (or an abort report)
before asking again."""

LEASE_WAIT = 2.0
"""Seconds the buffer may hold a lease request while it has nothing to lease (a long
poll: it answers as soon as capacity frees); well below :data:`LEASE_TIMEOUT`, so a held
request is answered before its asker gives up on it."""

RETRY_PAUSE = 0.5
"""Seconds between a request to the buffer that timed out and its repeat."""

METRICS_EVERY = 2.0
"""Seconds between progress records (generation rate, episodes done): often enough for
the dashboard's "generating" line, rare enough to cost nothing."""


class EpisodeProducedNothing(RuntimeError):
    pass


def _generated_tokens(t: Trajectory) -> int:
    """The tokens ``t`` trains on (its loss mask's ones): a bool mask's bytes are 0 and 1,
    counted without making an array."""
    mask = t.loss_mask
    if mask.dtype == "bool":
        return mask.data.count(1)
    return int(np.count_nonzero(mask.numpy()))


class RolloutActor(Actor):
    role = "rollout"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: InferenceEngine | None = None
        self.workflow: RolloutWorkflow | None = None
        self.reward_pool: RewardPool | None = None
        self.counters: Counter[str] = Counter()
        self._pending_weights: WeightsUpdated | None = None
        self.weights_epoch = 0
        """The trainer epoch of the loaded weights; samples carry it."""
        self.receiver: EngineWeights | None = None
        self._version_changed = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._t0 = time.monotonic()
        self.held: set[str] = set()
        """Prompt uids leased to this actor whose episodes are not finished (heartbeats)."""
        # Several heartbeats name each delivered prompt while at most this many episodes
        # end between two of them; the buffer needs to see it only once.
        self.delivered: deque[str] = deque(maxlen=4 * self.recipe.rollout.max_concurrent)
        self._last_pause: float | None = None
        self._runner: AsyncTaskRunner[list[Trajectory]] | None = None
        self.endpoint: OpenAIEndpoint | None = None
        self.endpoint_file: Path | None = None
        self._whole_groups = self.recipe.rollout.workflow.whole_groups
        """Whether episodes go on the stream as one group message (see :meth:`_publish`)."""
        self._resources = contextlib.AsyncExitStack()
        """What setup opened beside the engine (MCP servers, the endpoint); closed in
        teardown, in the same task, as the MCP transport requires."""

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        r = self.recipe.rollout
        engine = self.engine = build_engine(self.recipe)
        await engine.start()
        if r.workflow.scores_inline(r):
            self.reward_pool = build_reward_pool(self.recipe)
            await self.reward_pool.start()
        tools = await r.workflow.open_tools(r, self._resources)
        if tools is not None:
            self.log.info("tools", tools=[t.name for t in tools])
        if r.serves_endpoint:
            await self._serve_endpoint(engine)
        # deterministic: every sample's seed comes from the run's, its prompt id, its index
        # and its attempt (the workflows' sample_seed); else each draws freshly
        seed = self.recipe.run.seed if r.deterministic else None
        self.workflow = build_workflow(
            self,
            engine,
            r.sampling.params(seed=seed),
            r.group_size,
            reward=self.reward_pool,
            endpoint=self.endpoint,
            tools=tools,
        )
        self.version = engine.version
        self.receiver = build_receiver(self.recipe, engine, self.bus, self.subjects, self.actor_id)
        await self.bus.subscribe(self.subjects.weights, WeightsUpdated, self.on_weights)
        if r.colocate:
            await self.bus.subscribe(self.subjects.memory, MemoryControl, self.on_memory)
        await self._query_weights()
        tg.create_task(self._weights_loop(), name="weights")
        tg.create_task(self._report(), name="metrics")

    @property
    def _engine(self) -> InferenceEngine:
        assert self.engine is not None, "the engine starts in setup"
        return self.engine

    def _known_version(self) -> int:
        pending = self._pending_weights.version if self._pending_weights is not None else -1
        return max(int(self._engine.version), pending)

    async def _query_weights(self) -> None:
        """Loads the latest weights the buffer knows of, if any (an actor that joins a live
        run, or one that missed a broadcast)."""
        latest = await latest_weights(self)
        if latest is not None:
            await self.on_weights(latest)

    async def _serve_endpoint(self, engine: InferenceEngine) -> None:
        """Starts the endpoint and writes where it is (see the module docstring)."""
        r = self.recipe.rollout
        endpoint = self.endpoint = await serve_endpoint(
            self, engine, r.sampling.params(), self._resources, port=r.endpoint_port
        )
        folder = self.ctx.run_dir / "endpoints"
        folder.mkdir(parents=True, exist_ok=True)
        self.endpoint_file = folder / f"{self.actor_id}.json"
        about = {
            "url": endpoint.base_url,
            "model": endpoint.model_name,
            "api_key": endpoint.token,
            "api_key_is_run_token": endpoint.token == self.ctx.nats.token,
        }
        # written whole under another name, then renamed: a reader never sees half of it
        partial = folder / f".{self.actor_id}.json.tmp"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(about, f)
        os.replace(partial, self.endpoint_file)
        self.log.info("endpoint", url=endpoint.base_url, key_file=str(self.endpoint_file))

    async def teardown(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.endpoint_file is not None:
            self.endpoint_file.unlink(missing_ok=True)
        # the engine first: requests still in the endpoint then end at once (503) instead
        # of holding its shutdown
        if self.engine is not None:
            await self.engine.stop()
        await self._resources.aclose()
        if self.reward_pool is not None:
            await self.reward_pool.aclose()

    async def run(self) -> None:
        runner: AsyncTaskRunner[list[Trajectory]] = AsyncTaskRunner(
            max_concurrent=self.recipe.rollout.max_concurrent
        )
        async with runner, asyncio.TaskGroup() as tg:
            self._runner = runner  # entered: its idle clock runs
            tg.create_task(self._lease_loop(runner), name="leases")
            tg.create_task(self._result_loop(runner), name="results")

    # -- leases and episodes -----------------------------------------------------------------

    def lease_report(self) -> dict[str, list[str]]:
        return {"holding": sorted(self.held), "delivered": list(self.delivered)}

    async def _ask_for_lease(self, n: int) -> Lease:
        """Asks the buffer for up to ``n`` episodes until it answers. Every repeat carries
        the first request's id: if the buffer granted a lease whose reply was lost, the
        repeat gets that lease again instead of a second one."""
        req = LeaseRequest(
            actor_id=self.actor_id,
            max_episodes=n,
            request_id=uuid.uuid4().hex,
            wait=LEASE_WAIT,
        )
        while True:
            try:
                with self.tracer.span("lease", max_episodes=n):
                    lease = await self.bus.request(
                        self.subjects.lease, req, Lease, timeout=LEASE_TIMEOUT
                    )
            except BusTimeout:
                self.counters["lease_timeouts"] += 1
                await asyncio.sleep(RETRY_PAUSE)
                continue
            self.held.update(p.uid for p in lease.prompts)
            return lease

    async def _report_abort(self, prompt: Prompt, lease_id: str, reason: str) -> None:
        """Tells the buffer an episode produced nothing, until it acknowledges (a repeat
        is harmless: the buffer returns only the named lease, once)."""
        msg = EpisodeAborted(
            actor_id=self.actor_id, prompt_uid=prompt.uid, reason=reason, lease_id=lease_id
        )
        while True:
            try:
                await self.bus.request(
                    self.subjects.episode_aborted, msg, Ack, timeout=LEASE_TIMEOUT
                )
            except BusTimeout:
                self.counters["abort_timeouts"] += 1
                await asyncio.sleep(RETRY_PAUSE)
                continue
            self.held.discard(prompt.uid)
            return

    async def _lease_loop(self, runner: AsyncTaskRunner[list[Trajectory]]) -> None:
        while True:
            free = runner.max_concurrent - runner.running - runner.queued
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            lease = await self._ask_for_lease(free)
            if (
                lease.epoch > self.weights_epoch
                or lease.version > self._known_version() + self.recipe.buffer.max_head_offpolicyness
            ):
                # the run is ahead of our weights (a missed broadcast, a resume): ask for them
                await self._query_weights()
            if lease.prompts:
                await self._weights_of(lease, strict=self.recipe.rollout.deterministic)
            for prompt in lease.prompts:
                await runner.submit(
                    self._episode, prompt, lease.lease_id, tag=(prompt, lease.lease_id)
                )
            self.counters["leased"] += len(lease.prompts)
            if not lease.prompts:
                self._version_changed.clear()
                try:
                    async with asyncio.timeout(max(lease.retry_after, 0.05)):
                        await self._version_changed.wait()
                except TimeoutError:
                    pass

    async def _weights_of(self, lease: Lease, *, strict: bool = True) -> None:
        """Waits until the engine holds the weights of the lease's version (or newer).

        ``strict`` (``rollout.deterministic``): until it does, asking for weights not
        announced to us (a missed broadcast), so that the episodes start under the weights
        the buffer leased them at, not under those a broadcast is still replacing: a weight
        load in mid-episode would make their tokens depend on when it landed.

        Otherwise only for weights announced and not loaded yet, and at most
        :data:`LEASE_TIMEOUT` in all. A request held at the buffer is granted the moment a
        trainer step frees capacity, which is when that step's weights are on their way
        here: episodes started at once would begin with the old ones (their samples a
        version staler, more of them refused as stale)."""
        wanted = (lease.epoch, lease.version)
        deadline = None if strict else time.monotonic() + LEASE_TIMEOUT
        while supersedes(*wanted, (self.weights_epoch, self._engine.version)):
            self._version_changed.clear()
            pending = self._pending_weights
            if pending is None or supersedes(*wanted, (pending.epoch, pending.version)):
                if not strict:
                    return  # not announced: the episodes start with the weights there are
                await self._query_weights()  # not announced to us: a missed broadcast
            wait = LEASE_TIMEOUT if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._version_changed.wait()

    async def _episode(self, prompt: Prompt, lease_id: str) -> list[Trajectory]:
        epoch = self.weights_epoch  # the buffer refuses samples of a rolled-back lineage
        assert self.workflow is not None, "the workflow is built in setup"
        with self.tracer.span("generate", prompt=prompt.uid):
            trajectories = await self.workflow.arun_episode(
                self._engine, {**prompt.data, "uid": prompt.uid, "attempt": prompt.attempt}
            )
        if not trajectories:
            raise EpisodeProducedNothing("the workflow returned no trajectory")
        stamp = {"actor_id": self.actor_id, "prompt_uid": prompt.uid, "attempt": lease_id}
        stamped = [
            updated(t, {**stamp, "epoch": epoch, "data": prompt.data})
            if t.reward is None
            else t.past_scoring(**stamp, epoch=epoch)
            for t in trajectories
        ]
        await self._publish(stamped)
        return stamped

    async def _publish(self, samples: list[Trajectory]) -> None:
        """Puts an episode's samples on the stream: unscored ones for the reward actors,
        those its workflow scored straight for the buffer (one stream hop, not two). A
        whole group of a workflow that makes them (``whole_groups``) goes as one message;
        a group too large for one goes sample by sample, as other workflows' do."""
        s = self.subjects
        unscored = samples[0].reward is None
        if (
            self._whole_groups
            and len(samples) == self.recipe.rollout.group_size
            and all((t.reward is None) == unscored for t in samples)
        ):
            group = TrajectoryGroup.of(samples)
            subject, stage = (
                (s.trajectory_groups, "raw") if unscored else (s.scored_groups, "scored")
            )
            if not unscored:
                group = group.past_scoring()
            try:
                await self.bus.js_publish(subject, group, msg_id=group.msg_id(stage))
            except PayloadTooLarge:
                self.counters["groups_too_large"] += 1
            else:
                return
        for t in samples:
            if t.reward is None:
                await self.bus.js_publish(s.trajectories, t, msg_id=t.msg_id("raw"))
            else:
                await self.bus.js_publish(s.scored, t, msg_id=t.msg_id("scored"))

    async def _result_loop(self, runner: AsyncTaskRunner[list[Trajectory]]) -> None:
        while True:
            (result,) = await runner.wait(1)
            self._slot_freed.set()
            await self._account(result)

    async def _account(self, result: TaskResult[list[Trajectory]]) -> None:
        prompt, lease_id = result.tag
        if result.ok and result.value:
            self.held.discard(prompt.uid)
            self.delivered.append(prompt.uid)
            self.counters["episodes"] += 1
            self.counters["samples"] += len(result.value)
            self.counters["tokens"] += sum(_generated_tokens(t) for t in result.value)
            # samples whose generated tokens came from more than one policy version: a
            # weight update landed while they were being generated
            self.counters["mixed_version_samples"] += sum(
                t.versions_spanned > 1 for t in result.value
            )
            return
        self.counters["failed_episodes"] += 1
        reason = f"{type(result.error).__name__}: {result.error}"
        self.log.warning("episode failed", prompt=prompt.uid, error=reason)
        await self._report_abort(prompt, lease_id, reason)

    # -- weights --------------------------------------------------------------------------------

    async def on_weights(self, msg: WeightsUpdated) -> None:
        """Every announcement goes to the receiver at once (a broadcast is received as it
        is sent); the weights loop loads the newest."""
        assert self.receiver is not None
        self.receiver.announce(msg)
        # a newer trainer epoch (a trainer restarted from its checkpoint) wins over a
        # higher version of the lineage it rolled back
        pending = self._pending_weights
        if pending is None or supersedes(msg.epoch, msg.version, (pending.epoch, pending.version)):
            self._pending_weights = msg

    async def on_memory(self, msg: MemoryControl) -> None:
        """Colocation: give the accelerator to the trainer for a step, or take it back."""
        if msg.action == "release":
            freed = await self._engine.release_memory()
            self.log.info("memory released", step=msg.step, freed_bytes=freed)
            await self.bus.publish(
                self.subjects.memory_released,
                MemoryReleased(actor_id=self.actor_id, step=msg.step, freed_bytes=freed),
            )
        else:
            await self._engine.resume_memory()
            await self._engine.resume()

    async def _weights_loop(self) -> None:
        """Receives and stages each new version while generation goes on, then pauses
        only for the load itself (``rollout/pause_s``; receiving and staging is
        ``rollout/weights_fetch_s``)."""
        assert self.receiver is not None
        engine = self._engine
        while True:
            async with self.receiver.receive() as got:
                if not supersedes(got.epoch, got.version, (self.weights_epoch, engine.version)):
                    continue
                t1 = time.monotonic()
                await engine.pause()
                try:
                    with self.tracer.span("load weights", to_version=got.version):
                        await engine.update_weights(got.source, got.version)
                finally:
                    await engine.resume()
                pause_s = self._last_pause = time.monotonic() - t1
            self.weights_epoch = got.epoch
            self.version = got.version
            self._version_changed.set()
            self.log.info(
                "weights updated",
                version=got.version,
                via=got.via,
                fetch_s=round(got.fetch_s, 3),
                pause_s=round(pause_s, 3),
            )
            await self.emit_metrics(
                {
                    **self._rates(),
                    "version": got.version,
                    "rollout/pause_s": pause_s,
                    "rollout/weights_fetch_s": got.fetch_s,
                    "rollout/weights_fallbacks": float(self.receiver.counters["fallbacks"]),
                },
                step=got.version,
            )

    def _rates(self) -> dict[str, float]:
        """Counters and rates, with the engine's own counters (``engine/...``: the hf
        engine's prompt tokens computed and taken from its prefix cache, say); ``idle_s``
        is the time with no episode running since the actor began to lease (waiting on the
        staleness budget or for new weights), out of ``run_s``. A pause to load weights
        does not count: its episodes are still running. ``cpu_s`` is this process's CPU
        time (every thread: an in-process engine's model thread, the weights' receive),
        ``cores_total`` that over the actor's age: the cores it kept busy."""
        age = time.monotonic() - self._t0
        cpu = time.process_time()
        values = {
            "version": float(self._engine.version),
            **{k: float(v) for k, v in self.counters.items()},
            "samples_per_s": self.counters["samples"] / age,
            "cpu_s": cpu,
            "cores_total": cpu / age,
            **{f"engine/{k}": v for k, v in self._engine.metrics().items()},
        }
        if self._runner is not None:
            values["idle_s"] = self._runner.idle_s
            values["run_s"] = self._runner.age_s
        return values

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
            await self.emit_metrics(values, step=int(self._engine.version))
