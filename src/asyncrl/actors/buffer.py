"""BufferActor: the one place that knows the policy version and counts episodes.

- **Leases.** A rollout actor asks for up to k episodes; it gets min(k, capacity) prompts
  (returned prompts first, then the dataset in a seeded order). Every leased prompt is
  remembered with its actor; when that actor stops heartbeating for ``rollout.lease_ttl``
  seconds, or says it exited, its unfinished prompts go back to the pool.
- **Admission.** Scored samples arrive on JetStream; duplicates (by sample id) are
  dropped. A group is complete when ``group_size`` distinct samples are in; it is admitted
  if v − h ≤ η (h: its oldest token's version), else rejected without using the budget.
- **Batches.** The trainer asks for the batch of step s; the reply is the oldest B
  admitted groups that are still within η of the trainer's version. A repeated request for
  the same step gets the same batch, so a lost reply loses no data.

State for resume (the dataset position) travels with each batch to the trainer, which
keeps it in its checkpoint: what was trained and where the data stood are saved together.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.actors.common import latest_checkpoint_meta, load_prompt_records
from asyncrl.data.sampler import ShardSampler
from asyncrl.messages import (
    Ack,
    ActorExit,
    ActorInfo,
    BatchRequest,
    EpisodeAborted,
    Lease,
    LeaseRequest,
    Message,
    Prompt,
    TrainBatchRef,
    Trajectory,
    WeightsQuery,
    WeightsUpdated,
    encode,
)
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.runtime.trace import now_us

MAX_EPISODE_ATTEMPTS = 3
"""A prompt whose episode fails this many times is dropped (and counted), so one poison
prompt cannot loop forever."""

BATCH_WAIT = 5.0
"""Seconds a batch request waits for enough groups before answering "not ready"; well
below the trainer's request timeout, so an answer always reaches a live trainer."""


class PromptSource:
    """The dataset in a seeded order, epoch after epoch (a :class:`ShardSampler`), plus a
    pool of returned prompts that are handed out first.

    Prompt ids are ``e<epoch>-<record index>``: unique in the run, stable across resume."""

    def __init__(self, records: list[dict[str, Any]], seed: int) -> None:
        if not records:
            raise ValueError("the dataset is empty")
        self.records = records
        self.sampler = ShardSampler(len(records), seed=seed)
        self.pool: deque[Prompt] = deque()

    def take(self) -> Prompt:
        if self.pool:
            return self.pool.popleft()
        epoch, idx = self.sampler.next()
        return Prompt(uid=f"e{epoch}-{idx}", data=self.records[idx])

    def give_back(self, prompt: Prompt) -> None:
        self.pool.appendleft(prompt)

    def discard_from_pool(self, uid: str) -> None:
        self.pool = deque(p for p in self.pool if p.uid != uid)

    def state(self) -> dict[str, Any]:
        return self.sampler.state()

    def restore(self, state: dict[str, Any]) -> None:
        if state:
            self.sampler.restore(state)


@dataclass
class _Leased:
    prompt: Prompt
    actor_id: str
    attempts: int = 1


class BufferActor(Actor):
    role = "buffer"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        r = self.recipe
        self.batch_size = r.buffer.batch_size
        self.group_size = r.rollout.group_size
        self.sm = StalenessManager(
            batch_size=r.buffer.batch_size,
            max_concurrent=r.buffer.max_concurrent,
            max_head_offpolicyness=r.buffer.max_head_offpolicyness,
        )
        self.source = PromptSource(load_prompt_records(r), r.run.seed)
        self.leased: dict[str, _Leased] = {}
        self.attempts: Counter[str] = Counter()
        self.last_seen: dict[str, float] = {}
        self.groups: dict[str, dict[str, Trajectory]] = {}
        self.seen_samples: set[str] = set()
        self.completed: set[str] = set()
        self.ready: deque[list[Trajectory]] = deque()
        self.ready_changed = asyncio.Event()
        self.served: dict[int, TrainBatchRef] = {}
        self.weights: WeightsUpdated | None = None
        self.counters: Counter[str] = Counter()
        # lease ids must not repeat across restarts of the buffer (a resumed run)
        self.incarnation = uuid.uuid4().hex[:8]
        self.events = open(ctx.run_dir / "buffer_events.jsonl", "a", buffering=1)
        meta = latest_checkpoint_meta(ctx.run_dir)
        if meta is not None:
            self.sm.restore(int(meta["version"]))
            self.source.restore(meta.get("data_state", {}))
            self.version = self.sm.version
            hf_dir = Path(meta["path"]) / "hf"
            if hf_dir.is_dir():
                self.weights = WeightsUpdated(
                    version=self.version, kind="dir", location=str(hf_dir), step=int(meta["step"])
                )
            self.log.info("resumed", version=self.sm.version, data=self.source.state())
        else:
            self.version = 0

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.write(json.dumps({"t": time.time(), "event": kind, **fields}) + "\n")

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        s = self.subjects
        await self.bus.serve(s.lease, LeaseRequest, self.on_lease)
        await self.bus.serve(s.batch, BatchRequest, self.on_batch_request)
        await self.bus.serve(s.weights_query, WeightsQuery, self.on_weights_query)
        await self.bus.subscribe(s.weights, WeightsUpdated, self.on_weights)
        await self.bus.subscribe(s.heartbeat("rollout"), ActorInfo, self.on_heartbeat)
        await self.bus.subscribe(s.exited, ActorExit, self.on_exit)
        await self.bus.subscribe(s.episode_aborted, EpisodeAborted, self.on_aborted)
        consumer = await self.bus.js_consume(
            s.stream, s.scored, "buffer", Trajectory, self.on_scored, ack_wait=30.0
        )
        tg.create_task(consumer.run(), name="scored-consumer")
        tg.create_task(self._expire_leases(), name="lease-expiry")

    async def teardown(self) -> None:
        self._event("stop", **self._state_summary())
        self.events.close()

    def _state_summary(self) -> dict[str, Any]:
        return {
            "version": self.sm.version,
            "accepted": self.sm.accepted,
            "rejected": self.sm.rejected,
            "running": self.sm.running,
            "leased": sorted(self.leased),
            "pool": [p.uid for p in self.source.pool],
            "ready_groups": len(self.ready),
            **{f"n_{k}": v for k, v in self.counters.items()},
        }

    # -- leases ----------------------------------------------------------------------------

    async def on_lease(self, req: LeaseRequest) -> Message:
        self.last_seen[req.actor_id] = time.monotonic()
        n = min(req.max_episodes, self.sm.capacity())
        self.tracer.complete("grant lease", now_us(), actor=req.actor_id, prompts=n)
        prompts = [self.source.take() for _ in range(n)]
        for p in prompts:
            self.attempts[p.uid] += 1
            self.leased[p.uid] = _Leased(p, req.actor_id, self.attempts[p.uid])
            self._event("lease", prompt=p.uid, actor=req.actor_id)
        self.sm.on_start(n)
        self.counters["leased"] += n
        return Lease(
            lease_id=f"{self.incarnation}:{req.actor_id}:{self.counters['leased']}",
            actor_id=req.actor_id,
            version=self.sm.version,
            prompts=prompts,
            retry_after=0.0 if n else 0.5,
        )

    def _return_prompt(self, uid: str, why: str) -> None:
        entry = self.leased.pop(uid, None)
        if entry is None:
            return
        self.sm.on_abort(1)
        if self.attempts[uid] >= MAX_EPISODE_ATTEMPTS:
            self.counters["dropped_prompts"] += 1
            self._event("drop", prompt=uid, why=why)
            self.log.warning("prompt dropped after repeated failures", prompt=uid, why=why)
            return
        self.source.give_back(entry.prompt)
        self.counters["returned"] += 1
        self._event("return", prompt=uid, actor=entry.actor_id, why=why)

    def _release_actor(self, actor_id: str, why: str) -> None:
        uids = [u for u, e in self.leased.items() if e.actor_id == actor_id]
        for uid in uids:
            self._return_prompt(uid, why)
        self.last_seen.pop(actor_id, None)
        if uids:
            self.log.info("leases returned", actor=actor_id, prompts=len(uids), why=why)

    async def on_heartbeat(self, info: ActorInfo) -> None:
        self.last_seen[info.actor_id] = time.monotonic()

    async def on_exit(self, msg: ActorExit) -> None:
        if msg.role == "rollout":
            self._release_actor(msg.actor_id, "actor exited")

    async def on_aborted(self, msg: EpisodeAborted) -> None:
        self.counters["aborted"] += 1
        self._return_prompt(msg.prompt_uid, f"aborted: {msg.reason}")

    async def _expire_leases(self) -> None:
        ttl = self.recipe.rollout.lease_ttl
        while True:
            await asyncio.sleep(min(1.0, ttl / 4))
            now = time.monotonic()
            holders = {e.actor_id for e in self.leased.values()}
            for actor_id in holders:
                if now - self.last_seen.get(actor_id, now) > ttl:
                    self.counters["expired_leases"] += 1
                    self._release_actor(actor_id, f"no heartbeat for {ttl:.0f}s")

    # -- scored samples ----------------------------------------------------------------------

    async def on_scored(self, traj: Trajectory) -> None:
        if traj.uid in self.seen_samples or traj.prompt_uid in self.completed:
            self.counters["duplicates"] += 1
            return
        self.seen_samples.add(traj.uid)
        group = self.groups.setdefault(traj.prompt_uid, {})
        group[traj.uid] = traj
        if len(group) < self.group_size:
            return
        del self.groups[traj.prompt_uid]
        self.completed.add(traj.prompt_uid)
        if traj.prompt_uid not in self.leased:
            # its lease had expired (a slow actor, not a dead one): it is running again
            # as far as the budget knows, and must not be leased a second time
            self.source.discard_from_pool(traj.prompt_uid)
            self.sm.on_start(1)
        self.leased.pop(traj.prompt_uid, None)
        samples = sorted(group.values(), key=lambda t: t.group_index)
        head = min(t.head_version for t in samples)
        if not self.sm.on_scored(head):
            self.counters["rejected_samples"] += len(samples)
            self._event("reject", prompt=traj.prompt_uid, head=head, version=self.sm.version)
            return
        rewards = {t.reward for t in samples}
        if self.recipe.buffer.dynamic_filter and len(rewards) == 1:
            self.sm.drop_accepted(1)
            self.counters["filtered_groups"] += 1
            self._event("filter", prompt=traj.prompt_uid)
            return
        self.ready.append(samples)
        self._event("admit", prompt=traj.prompt_uid, head=head, version=self.sm.version)
        self.ready_changed.set()

    # -- batches and weights --------------------------------------------------------------------

    def _drop_stale_ready(self) -> None:
        fresh: deque[list[Trajectory]] = deque()
        for group in self.ready:
            head = min(t.head_version for t in group)
            if self.sm.admissible(head):
                fresh.append(group)
            else:
                self.sm.drop_accepted(1)
                self.sm.rejected += 1
                self.counters["rejected_samples"] += len(group)
                self._event(
                    "reject", prompt=group[0].prompt_uid, head=head, version=self.sm.version
                )
        self.ready = fresh

    async def on_batch_request(self, req: BatchRequest) -> Message:
        if req.step in self.served:
            return self.served[req.step]
        t_request = now_us()
        if req.version > self.sm.version:
            self.sm.set_version(req.version)
            self.version = req.version
        try:
            async with asyncio.timeout(BATCH_WAIT):
                while True:
                    self._drop_stale_ready()
                    if len(self.ready) >= self.batch_size:
                        break
                    self.ready_changed.clear()
                    await self.ready_changed.wait()
        except TimeoutError:
            return Ack(ok=False, error=f"not ready: {len(self.ready)}/{self.batch_size} groups")
        self.tracer.complete("serve batch", t_request, step=req.step)
        groups = [self.ready.popleft() for _ in range(self.batch_size)]
        trajectories = [t for g in groups for t in g]
        counters = {
            "accepted": self.sm.accepted,
            "rejected": self.sm.rejected,
            "running": self.sm.running,
            **self.counters,
        }
        batch = TrainBatchRef(
            step=req.step,
            version=self.sm.version,
            trajectories=trajectories,
            data_state=self.source.state(),
            counters=counters,
        )
        if len(encode(batch)) > 0.9 * self.bus.max_payload:
            key = f"batch-{req.step}"
            await self.bus.put_blob(self.subjects.weights_bucket, key, encode(batch))
            batch = TrainBatchRef(
                step=req.step,
                version=batch.version,
                blob_key=key,
                data_state=batch.data_state,
                counters=counters,
            )
        self.served = {s: b for s, b in self.served.items() if s >= req.step - 1}
        self.served[req.step] = batch
        for g in groups:
            self._event("batch", prompt=g[0].prompt_uid, step=req.step)
        await self.emit_metrics({k: float(v) for k, v in counters.items()}, step=req.step)
        return batch

    async def on_weights(self, msg: WeightsUpdated) -> None:
        if self.weights is None or msg.version >= self.weights.version:
            self.weights = msg
        if msg.version > self.sm.version:
            self.sm.set_version(msg.version)
            self.version = msg.version

    async def on_weights_query(self, q: WeightsQuery) -> Message:
        return self.weights if self.weights is not None else Ack(ok=False, error="no weights yet")
