"""BufferActor: leases, admission and batches, wired to NATS.

- **Leases** (:mod:`.leases`): a rollout actor asks for up to k episodes and gets
  min(k, capacity) prompts (returned prompts first, then the dataset in a seeded order).
  A request that finds no capacity may be held (its ``wait``, a long poll) and is granted
  as soon as capacity frees, the requests held longest first: the actors do not poll.
- **Admission** (:mod:`.admission`): scored samples arrive on JetStream and are judged,
  one message a sample or one a group (:class:`~asyncrl.wire.messages.TrajectoryGroup`).
- **Batches** (:mod:`.batching`): the trainer asks for the batch of step s.

The version is the staleness manager's, and it is the newest *published* version (the
weights rollouts can have): the trainer's batch requests and ``WeightsUpdated`` advance
it. The dataset position lives in the buffer's durable state only (:mod:`.durable`): the
position at each served step is recorded there, and ``asyncrl up --resume`` keeps the one
that goes with the trainer's checkpoint. A batch carries what training reads: whole
:class:`~asyncrl.wire.messages.Group` s, their rewards shaped here at admission; the prompt
records stay here, by prompt id.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.actors.buffer.admission import Admission
from asyncrl.actors.buffer.batching import BLOB_FRACTION, Batcher, as_reference
from asyncrl.actors.buffer.durable import DurableState, EncodedParts, capture, restore
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook, PromptSource
from asyncrl.algo.shaping import shaped_sample_rewards
from asyncrl.config.recipe import sample_budget
from asyncrl.data import load_prompt_records
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import Encoded
from asyncrl.runtime.connection import worth_logging
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.runtime.trace import now_us
from asyncrl.train.checkpoint import latest_checkpoint_meta
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import (
    Ack,
    ActorExit,
    ActorInfo,
    BatchRequest,
    EpisodeAborted,
    Lease,
    LeaseRequest,
    Message,
    TrainBatchRef,
    Trajectory,
    TrajectoryGroup,
    WeightsQuery,
    WeightsUpdated,
)

SCORED_CONCURRENCY = 256
"""Scored samples handled at once: each waits for the state write that holds it before
its ack, and the waits of many share one write."""

SCORED_GROUPS_CONCURRENCY = 64
"""Scored groups (one message each) handled at once, as :data:`SCORED_CONCURRENCY`."""

BATCH_WAIT = 5.0
"""Seconds a batch request waits for enough groups before answering "not ready"; well
below the trainer's request timeout, so an answer always reaches a live trainer."""


class BufferActor(Actor):
    role = "buffer"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        r = self.recipe
        self.staleness = StalenessManager(
            batch_size=r.buffer.batch_size,
            max_concurrent=r.buffer.max_concurrent,
            max_head_offpolicyness=r.buffer.max_head_offpolicyness,
            update_every=r.trainer.update_every,
        )
        self.journal = Journal(ctx.run_dir / "buffer_events.jsonl")
        self.leases = LeaseBook(
            PromptSource(load_prompt_records(r), r.run.seed),
            self.staleness,
            self.journal,
            ttl=r.rollout.lease_ttl,
            incarnation=uuid.uuid4().hex[:8],
        )
        self.admission = Admission(
            self.staleness,
            self.leases,
            self.journal,
            group_size=r.rollout.group_size,
            dynamic_filter=r.buffer.dynamic_filter,
            shape=lambda samples: shaped_sample_rewards(
                samples, r.trainer.shaping, lambda replies: sample_budget(r, replies)
            ),
        )
        self.batcher = Batcher(
            self.admission,
            self.staleness,
            self.journal,
            batch_size=r.buffer.batch_size,
            ordered=r.rollout.deterministic,
        )
        self.ready_changed = asyncio.Event()
        self.stopping = False
        self.weights: WeightsUpdated | None = None
        self.durable: DurableState | None = None
        self._encoded = EncodedParts()
        # lease requests held until capacity frees, by actor, the oldest first
        self._held: dict[str, tuple[LeaseRequest, asyncio.Future[Lease | None]]] = {}
        meta = latest_checkpoint_meta(ctx.run_dir)
        if meta is not None:
            self.staleness.restore(int(meta["version"]))
            hf_dir = Path(meta["path"]) / "hf"
            if hf_dir.is_dir():
                self.weights = WeightsUpdated(
                    version=self.version, kind="dir", location=str(hf_dir), step=int(meta["step"])
                )
            self.log.info("resumed", version=self.version, step=int(meta["step"]))

    @property
    def version(self) -> int:
        """The newest published version: the staleness manager's, the only copy."""
        return self.staleness.version

    @version.setter
    def version(self, value: int) -> None:
        self.staleness.set_version(value)
        self._grant_held()  # a newer version frees capacity

    @property
    def counters(self) -> Counter[str]:
        return self.journal.counters

    @property
    def epoch(self) -> int:
        """The trainer's epoch: how often it restarted from its checkpoint in this run."""
        return self.admission.epoch

    def _snapshot(self) -> Any:
        return capture(
            self.leases,
            self.admission,
            self.batcher,
            epoch=self.epoch,
            weights=self.weights,
            parts=self._encoded,
        )

    def _changed(self, urgent: bool = False) -> None:
        """The state changed: it is written (see :mod:`.durable`), and capacity it freed
        goes to the held lease requests."""
        if self.durable is not None:  # None before setup()
            self.durable.touch(urgent)
        self._grant_held()

    async def _persisted(self) -> None:
        """Waits until the state as it is now is written (see :mod:`.durable`)."""
        if self.durable is not None:
            await self.durable.persisted()

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        s = self.subjects
        self.durable = DurableState(
            self.bus,
            s.buffer_bucket,
            self._snapshot,
            enabled=self.recipe.buffer.durable,
            parts=self._encoded,
        )
        if self.durable.enabled:
            snap = await self.durable.load()
            if snap is not None:
                restore(
                    snap,
                    self.leases,
                    self.admission,
                    self.batcher,
                    time.monotonic(),
                    run_dir=self.ctx.run_dir,
                    parts=await self.durable.load_parts(snap),
                    encoded=self._encoded,
                )
                self.admission.epoch = snap.epoch
                if snap.weights is not None:  # else those of the checkpoint, if any
                    self.weights = snap.weights
                self.log.info(
                    "restored",
                    version=self.version,
                    epoch=self.epoch,
                    data=self.leases.source.state(),
                    leased=len(self.leases.leased),
                    ready_groups=len(self.admission.ready),
                    served=sorted(self.batcher.served),
                )
            tg.create_task(self.durable.run(), name="state-writer")
        await self.bus.serve(s.lease, LeaseRequest, self.on_lease, concurrent=True)
        await self.bus.serve(s.batch, BatchRequest, self.on_batch_request)
        await self.bus.serve(s.weights_query, WeightsQuery, self.on_weights_query)
        await self.bus.serve(s.episode_aborted, EpisodeAborted, self.on_aborted)
        await self.bus.subscribe(s.weights, WeightsUpdated, self.on_weights)
        await self.bus.subscribe(s.heartbeat("rollout"), ActorInfo, self.on_heartbeat)
        await self.bus.subscribe(s.exited, ActorExit, self.on_exit)
        consumer = await self.bus.js_consume(
            s.stream,
            s.scored,
            "buffer",
            Trajectory,
            self.on_scored,
            ack_wait=10.0,  # a dead buffer's unacked samples reach its replacement soon
            batch=2 * SCORED_CONCURRENCY,
            concurrency=SCORED_CONCURRENCY,
        )
        tg.create_task(consumer.run(), name="scored-consumer")
        groups = await self.bus.js_consume(
            s.stream,
            s.scored_groups,
            "buffer_groups",
            TrajectoryGroup,
            self.on_scored_group,
            ack_wait=10.0,
            batch=2 * SCORED_GROUPS_CONCURRENCY,
            concurrency=SCORED_GROUPS_CONCURRENCY,
        )
        tg.create_task(groups.run(), name="scored-group-consumer")
        tg.create_task(self._expire_leases(), name="lease-expiry")

    async def teardown(self) -> None:
        # Requests still being answered end now (a batch request that waits answers "not
        # ready"), and what changed since the last write is written once more: the
        # connection's drain waits for every handler, and none may wait on a writer that
        # the stop has cancelled.
        self.stopping = True
        self.ready_changed.set()
        for actor_id in list(self._held):  # answered now, with nothing
            self._unhold(actor_id)
        if self.durable is not None:
            await self.durable.close()
        self.journal.event("stop", **self._state_summary())
        self.journal.close()

    def _state_summary(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "accepted": self.staleness.accepted,
            "rejected": self.staleness.rejected,
            "running": self.staleness.running,
            "leased": sorted(self.leases.leased),
            "pool": [p.uid for p in self.leases.source.pool],
            "ready_groups": len(self.admission.ready),
            "ready": [g.prompt_uid for g in self.admission.ready],
            "partial": sorted(self.admission.groups),
            "epoch": self.epoch,
            "state_writes": self.durable.writes if self.durable else 0,
            **{f"n_{k}": v for k, v in self.journal.counters.items()},
        }

    # -- leases ----------------------------------------------------------------------------

    async def on_lease(self, req: LeaseRequest) -> Message:
        t0 = now_us()
        self._grant_held()  # those who waited longer come first
        lease = self.leases.grant(req, time.monotonic())
        if not lease.prompts and req.wait > 0 and not self.stopping:
            lease = await self._held_until_free(req, lease)
        if lease.prompts:
            # not awaited: a lease the buffer forgets in a crash only runs its prompts once
            # more (the dataset position rewinds), and the duplicate samples are dropped
            self._changed()
        self.tracer.complete("grant lease", t0, actor=req.actor_id, prompts=len(lease.prompts))
        return lease.model_copy(update={"epoch": self.epoch}) if self.epoch else lease

    async def _held_until_free(self, req: LeaseRequest, empty: Lease) -> Lease:
        """Holds a request that found no capacity until capacity frees (it is granted
        then, see :meth:`_grant_held`) or its ``wait`` ends (it is answered with nothing,
        to be asked again at once)."""
        self._unhold(req.actor_id)  # the actor asks anew: it gave that request up
        held: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
        self._held[req.actor_id] = (req, held)
        try:
            await asyncio.wait([held], timeout=req.wait)
        finally:
            if self._held.get(req.actor_id, (req, None))[1] is held:
                del self._held[req.actor_id]
        granted = held.result() if held.done() else None
        held.cancel()
        if granted is None:
            return empty.model_copy(update={"retry_after": 0.0})
        self.journal.count("held_leases")
        return granted

    def _unhold(self, actor_id: str) -> None:
        """Answers the request ``actor_id`` has held, if any, with nothing."""
        held = self._held.pop(actor_id, None)
        if held is not None and not held[1].done():
            held[1].set_result(None)

    def _grant_held(self) -> None:
        """Grants free capacity to the held lease requests, the longest held first, each
        as much as it asked for and capacity allows."""
        while self._held and self.staleness.capacity() > 0:
            req, held = self._held.pop(next(iter(self._held)))
            if not held.done():
                held.set_result(self.leases.grant(req, time.monotonic()))

    async def on_heartbeat(self, info: ActorInfo) -> None:
        # what an actor holds is settled only while it runs (not while it starts or stops)
        holding = info.holding if info.status == "running" else None
        freed = self.leases.reconcile(
            info.actor_id, holding, time.monotonic(), self.admission.reported, info.delivered
        )
        if freed:
            self._changed()
            self.log.info("unheld leases returned", actor=info.actor_id, prompts=len(freed))

    async def on_exit(self, msg: ActorExit) -> None:
        if msg.role == "rollout":
            self._unhold(msg.actor_id)  # granted nothing: nobody would run it
            n = self.leases.release_actor(msg.actor_id, "actor exited")
            if n:
                self._changed()
                self.log.info("leases returned", actor=msg.actor_id, prompts=n)

    async def on_aborted(self, msg: EpisodeAborted) -> Message:
        """Idempotent: only the named lease of the prompt is returned, once."""
        if self.leases.return_prompt(
            msg.prompt_uid, f"aborted: {msg.reason}", lease_id=msg.lease_id
        ):
            self.journal.count("aborted")
            # not awaited: a forgotten return leaves the lease out until the actor's
            # heartbeats, which no longer list it, free it
            self._changed()
        return Ack(ok=True)

    async def _expire_leases(self) -> None:
        ttl = self.leases.ttl
        while True:
            await asyncio.sleep(min(1.0, ttl / 4))
            for actor_id in self.leases.expire(time.monotonic()):
                self._changed()
                self.log.info("leases expired", actor=actor_id)
            self._grant_held()  # capacity freed by a path that does not say so

    # -- scored samples ----------------------------------------------------------------------

    async def on_scored(self, traj: Trajectory) -> None:
        self._took([self.admission.on_scored(traj)], traj)
        # acked on the stream only once written: a buffer killed now gets it again
        await self._persisted()

    async def on_scored_group(self, group: TrajectoryGroup) -> None:
        """A group that came as one message: each sample judged as if it came alone
        (:meth:`Admission.on_scored_group`), then one write and one ack for them all."""
        self._took(self.admission.on_scored_group(group.samples), group.samples[-1])
        await self._persisted()

    def _took(self, outcomes: list[str], last: Trajectory) -> None:
        self._changed()
        if "invalid" in outcomes:
            n = self.journal.counters["invalid_samples"]
            if worth_logging(n):
                self.log.warning("invalid trajectories refused", count=n, last=last.uid)
        if "admitted" in outcomes:
            self.ready_changed.set()

    # -- batches and weights --------------------------------------------------------------------

    async def on_batch_request(self, req: BatchRequest) -> Message | Encoded:
        if req.epoch > self.epoch:  # it may come before the restarted trainer's weights
            published = req.published_version if req.published_version >= 0 else req.version
            self._roll_back(published, req.epoch)
        self.batcher.checkpointed(req.checkpoint_step)
        batch = self.batcher.served.get(req.step)
        t_request = now_us()
        if batch is None:
            published = req.published_version if req.published_version >= 0 else req.version
            self.version = published
            try:
                async with asyncio.timeout(BATCH_WAIT):
                    while True:
                        if self.stopping:  # a stopping buffer serves no new batch
                            raise TimeoutError
                        if self.batcher.ready():
                            break
                        self.ready_changed.clear()
                        await self.ready_changed.wait()
            except TimeoutError:
                return TrainBatchRef(
                    step=req.step, version=self.version, waiting=self.batcher.waiting()
                )
            batch = self.batcher.take(req.step, self.leases.source.state())
            self._changed(urgent=True)  # the trainer waits for this write
            await self._persisted()
            self.tracer.complete("serve batch", t_request, step=req.step)
            await self.emit_metrics({k: float(v) for k, v in batch.counters.items()}, step=req.step)
        data = encode(batch, self._encoded.fields)  # its groups' fields encoded once
        if len(data) <= BLOB_FRACTION * self.bus.max_payload:
            return Encoded(data)
        # put again on a repeated request: the trainer deletes a blob once it has it
        ref = as_reference(batch)
        await self.bus.put_blob(self.subjects.batch_bucket, ref.blob_key, data)
        return ref

    async def on_weights(self, msg: WeightsUpdated) -> None:
        if msg.epoch < self.epoch:
            return  # the rolled-back lineage's last word
        if msg.epoch > self.epoch:
            self._roll_back(msg.version, msg.epoch)
        w = self.weights
        if w is None or (msg.epoch, msg.version) >= (w.epoch, w.version):
            self.weights = msg
        self.version = msg.version
        self._changed()

    async def on_weights_query(self, q: WeightsQuery) -> Message:
        return self.weights if self.weights is not None else Ack(ok=False, error="no weights yet")

    def _roll_back(self, version: int, epoch: int) -> None:
        """The trainer restarted from its checkpoint at ``version``: see
        :meth:`Admission.roll_back`. The batches served for later steps are judged again
        and forgotten; the restarted trainer asks for those steps anew."""
        groups = [
            group
            for step, batch in sorted(self.batcher.served.items())
            if step >= version  # the batch of step s is trained as step s + 1
            for group in batch.groups
        ]
        # older batches since the checkpoint: only their prompt ids are kept, to run again
        rerun = [
            uid
            for step, uids in sorted(self.batcher.since_checkpoint.items())
            if step >= version and step not in self.batcher.served
            for uid in uids
        ]
        self.batcher.served = {}
        self.batcher.since_checkpoint = {}
        before = self.version
        dropped = self.admission.roll_back(version, epoch, groups, rerun)
        self._changed()
        self.ready_changed.set()
        self.log.warning(
            "trainer restarted: versions rolled back",
            from_version=before,
            to_version=version,
            epoch=epoch,
            dropped_groups=dropped,
            kept_groups=len(self.admission.ready),
        )
