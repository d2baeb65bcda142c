"""RolloutActor: leases prompts, runs episodes concurrently, publishes trajectories.

Three loops share one TaskGroup:

- **leases**: while the runner has free slots, ask the buffer for that many episodes;
  an empty lease means the staleness budget is spent, so wait for new weights (or the
  buffer's retry hint) before asking again. A request that times out is repeated with
  its request id, so a lost reply yields the same lease, never a second one. Heartbeats
  list the prompts the actor holds: the buffer frees a lease the actor does not know of;
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
The ``agent`` workflow's MCP servers (``rollout.agent.mcp``) start with the actor and end
with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import Any

from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, RemoteError
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
    WeightsQuery,
    WeightsUpdated,
)

LEASE_TIMEOUT = 5.0
"""Seconds to wait for the buffer's answer to a lease request (or an abort report)
before asking again."""

RETRY_PAUSE = 0.5
"""Seconds between a request to the buffer that timed out and its repeat."""

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
        self.endpoint: Any = None
        self.endpoint_file: Path | None = None
        self._resources = contextlib.AsyncExitStack()
        """What setup opened beside the engine (MCP servers, the endpoint); closed in
        teardown, in the same task, as the MCP transport requires."""

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        from asyncrl.engines import build_engine
        from asyncrl.rewards import build_reward_pool
        from asyncrl.workflows.build import build_workflow, endpoint_wanted, workflow_scores_inline

        self.engine = build_engine(self.recipe)
        await self.engine.start()
        if workflow_scores_inline(self.recipe):
            self.reward_pool = build_reward_pool(self.recipe)
            await self.reward_pool.start()
        tools = await self._open_tools()
        if endpoint_wanted(self.recipe):
            await self._serve_endpoint()
        self.workflow = build_workflow(
            self.recipe, self.engine, self.reward_pool, endpoint=self.endpoint, tools=tools
        )
        self.version = self.engine.version
        self.receiver = build_receiver(
            self.recipe, self.engine, self.bus, self.subjects, self.actor_id
        )
        await self.bus.subscribe(self.subjects.weights, WeightsUpdated, self.on_weights)
        if self.recipe.rollout.colocate:
            await self.bus.subscribe(self.subjects.memory, MemoryControl, self.on_memory)
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

    async def _open_tools(self) -> list[Any] | None:
        """The ``agent`` workflow's tools, the MCP servers' included (started here); None
        for other workflows and for an ``agent`` whose environment brings its own."""
        from asyncrl.tools.mcp import MCPTools
        from asyncrl.workflows.build import build_agent_tools, mcp_server_specs

        r = self.recipe.rollout
        if r.workflow != "agent" or r.agent.env:
            return None
        tools = build_agent_tools(self.recipe)
        for spec in mcp_server_specs(self.recipe):
            server = await self._resources.enter_async_context(MCPTools(spec))
            tools += server.tools
            self.log.info("MCP server started", command=spec.command, tools=len(server.tools))
        return tools

    async def _serve_endpoint(self) -> None:
        """Starts the endpoint and writes where it is (see the module docstring)."""
        from asyncrl.endpoint import OpenAIEndpoint
        from asyncrl.workflows.build import sampling_params

        r = self.recipe.rollout
        token = self.ctx.nats.token or secrets.token_urlsafe(24)
        self.endpoint = OpenAIEndpoint(
            self.engine,
            model_name=self.recipe.model.path,
            token=token,
            port=r.endpoint_port,
            parser=r.agent.parser,
            sampling=sampling_params(self.recipe),
        )
        await self.endpoint.start()
        # the openai client's HTTP library (httpx, or its httpx2 fork) logs every request
        # at INFO: a line per call of every episode
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._resources.push_async_callback(self.endpoint.stop)
        folder = self.ctx.run_dir / "endpoints"
        folder.mkdir(parents=True, exist_ok=True)
        self.endpoint_file = folder / f"{self.actor_id}.json"
        about = {
            "url": self.endpoint.base_url,
            "model": self.endpoint.model_name,
            "api_key": token,
            "api_key_is_run_token": token == self.ctx.nats.token,
        }
        # written whole under another name, then renamed: a reader never sees half of it
        partial = folder / f".{self.actor_id}.json.tmp"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(about, f)
        os.replace(partial, self.endpoint_file)
        self.log.info("endpoint", url=self.endpoint.base_url, key_file=str(self.endpoint_file))

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
        req = LeaseRequest(actor_id=self.actor_id, max_episodes=n, request_id=uuid.uuid4().hex)
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

    async def _episode(self, prompt: Prompt, lease_id: str) -> list[Trajectory]:
        epoch = self.weights_epoch  # the buffer refuses samples of a rolled-back lineage
        with self.tracer.span("generate", prompt=prompt.uid):
            trajectories = await self.workflow.arun_episode(
                self.engine, {**prompt.data, "uid": prompt.uid}
            )
        if not trajectories:
            raise EpisodeProducedNothing("the workflow returned no trajectory")
        stamp = {"actor_id": self.actor_id, "prompt_uid": prompt.uid, "attempt": lease_id}
        stamped = [
            t.model_copy(update={**stamp, "epoch": epoch, "data": prompt.data})
            if t.reward is None
            else t.past_scoring().model_copy(update={**stamp, "epoch": epoch})
            for t in trajectories
        ]
        for t in stamped:
            # a sample its workflow scored skips the reward actors: one stream hop, not two
            if t.reward is None:
                await self.bus.js_publish(self.subjects.trajectories, t, msg_id=t.msg_id("raw"))
            else:
                await self.bus.js_publish(self.subjects.scored, t, msg_id=t.msg_id("scored"))
        return stamped

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
            self.counters["tokens"] += sum(int(t.loss_mask.numpy().sum()) for t in result.value)
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
        if pending is None or (msg.epoch, msg.version) > (pending.epoch, pending.version):
            self._pending_weights = msg

    async def on_memory(self, msg: MemoryControl) -> None:
        """Colocation: give the accelerator to the trainer for a step, or take it back."""
        if msg.action == "release":
            freed = await self.engine.release_memory()
            self.log.info("memory released", step=msg.step, freed_bytes=freed)
            await self.bus.publish(
                self.subjects.memory_released,
                MemoryReleased(actor_id=self.actor_id, step=msg.step, freed_bytes=freed),
            )
        else:
            await self.engine.resume_memory()
            await self.engine.resume()

    async def _weights_loop(self) -> None:
        """Receives and stages each new version while generation goes on, then pauses
        only for the load itself (``rollout/pause_s``; receiving and staging is
        ``rollout/weights_fetch_s``)."""
        assert self.receiver is not None
        while True:
            async with self.receiver.receive() as got:
                if (got.epoch, got.version) <= (self.weights_epoch, self.engine.version):
                    continue
                t1 = time.monotonic()
                await self.engine.pause()
                try:
                    with self.tracer.span("load weights", to_version=got.version):
                        await self.engine.update_weights(got.source, got.version)
                finally:
                    await self.engine.resume()
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
        """Counters and rates; ``idle_s`` is the time with no episode running since the
        actor began to lease (waiting on the staleness budget or for new weights), out of
        ``run_s``. A pause to load weights does not count: its episodes are still running."""
        values = {
            "version": float(self.engine.version),
            **{k: float(v) for k, v in self.counters.items()},
            "samples_per_s": self.counters["samples"] / (time.monotonic() - self._t0),
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
            await self.emit_metrics(values, step=int(self.engine.version))
