"""TrainerActor: the step loop. Fetch a batch, train on it, publish the weights, record.

Under torchrun every rank builds the FSDP engine, but only rank 0 is an actor (on NATS):
it fetches each batch from the buffer and leads the other ranks through the engine's
collective commands (:mod:`asyncrl.train.commands`; the other ranks follow). Torch work
runs in a worker thread so that rank 0 keeps heartbeating while it trains.

Per step: train samples with group advantages (:func:`~asyncrl.train.batch.build_samples`)
→ ``train`` (``ppo_minibatches`` optimizer steps; the engine's version + 1) → every
``update_every`` steps the weights go out (:mod:`asyncrl.weights`) with
``WeightsUpdated``; a broadcast's sends go on while the next step trains (the buckets are a
copy), and a version's delivery is settled before the next is published and at the end →
the step's records (:mod:`asyncrl.observe.records`, and the
batch itself for ``asyncrl replay``, :mod:`asyncrl.train.replay_log`) → a checkpoint
every ``checkpoint_every`` steps and at the end, with the SHA-256 of its weights. The
first batch sampled wholly at version 0 passes the rollout–trainer mismatch gate
(``trainer.mismatch_limit``), or the trainer fails with the
:class:`~asyncrl.algo.mismatch.MismatchError` message that names the likely causes,
fatally (:mod:`asyncrl.runtime.exits`: a replacement would trip it again, so the run ends
instead of restarting the trainer). The engine owns the progress (step and version),
saved with its checkpoint; a restarted trainer goes on from there.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from pathlib import Path
from typing import Any

from asyncrl.actors.colocation import Colocation
from asyncrl.algo.mismatch import MismatchError, check_mismatch, gate_applies
from asyncrl.api.train_engine import TrainEngineProtocol
from asyncrl.api.weights import WeightPublisher
from asyncrl.observe.fleet import FleetView
from asyncrl.observe.records import StepRecords
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.bus import BusTimeout, RemoteError
from asyncrl.runtime.exits import FatalError
from asyncrl.runtime.supervisor import RESTART_ENV
from asyncrl.train import trainer_threads
from asyncrl.train.batch import build_samples
from asyncrl.train.checkpoint import WEIGHTS_SHA256, commit_checkpoint, latest_checkpoint_meta
from asyncrl.train.commands import Leader
from asyncrl.train.engine import build_train_engine
from asyncrl.train.replay_log import ReplayLog
from asyncrl.weights.build import build_publisher
from asyncrl.weights.choose import choose
from asyncrl.weights.files import export_name, link_export
from asyncrl.weights.version import PolicyWeights
from asyncrl.wire.codec import decode
from asyncrl.wire.messages import (
    ActorInfo,
    BatchRequest,
    Metrics,
    TrainBatchRef,
)

BATCH_REQUEST_TIMEOUT = 15.0
"""Seconds to wait for the buffer's answer; the buffer answers "not ready" after 5 s."""

STOP_RANKS_WITHIN_S = 5.0
"""Seconds rank 0, asked to stop, gives the other ranks to take its stop command."""

BATCH_WAIT_LOG_EVERY = 30.0
"""Seconds between two log lines that say what a batch request waits for."""

EVAL_WAIT_S = 120.0
"""Seconds the first step waits for the eval actor of a run with ``eval.every`` (see
:meth:`TrainerActor._wait_for_eval`): a model server's start takes about as long; an eval
actor that is not coming (one attached by hand later) costs a run this once."""


class TrainerActor(Actor):
    role = "trainer"

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        self.engine: TrainEngineProtocol | None = None
        self._ranks: Leader | None = None
        self.published_version = 0  # rollouts start from the initial weights, version 0
        self.epoch = int(os.environ.get(RESTART_ENV, "0"))
        """How many times ``up`` restarted the trainer in this run: its weights and batch
        requests carry it, so the buffer and the rollouts know the versions after the
        checkpoint it restarted from were rolled back."""
        self.checkpoint_step = 0
        """The step of the latest checkpoint: a restarted trainer goes on from there."""
        self.weights_dir = ctx.run_dir / "weights"
        self.transport: WeightPublisher | None = None
        self.last_export: Path | None = None  # the newest published export on disk
        self._delivering: dict[str, Any] | None = None
        """The ``weights.jsonl`` line of a version whose delivery is under way."""
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self.records = StepRecords(self.recipe, ctx.run_dir)
        self.replay_log = ReplayLog(ctx.run_dir, self.recipe)
        self.fleet = FleetView(self.recipe.trainer.nodes * self.recipe.trainer.nproc)
        self.colocation: Colocation | None = None

    @property
    def step(self) -> int:
        """Train steps taken: the engine's (it saves them with its checkpoint); 0 before
        the engine is built."""
        return self.engine.step if self.engine is not None else 0

    @property
    def version(self) -> int:
        """Policy version of the current weights: the engine's; 0 before it is built."""
        return self.engine.version if self.engine is not None else 0

    @version.setter
    def version(self, value: int) -> None:
        raise AttributeError("the train engine owns the trainer's version")

    @property
    def ranks(self) -> Leader:
        """The engine on every rank (rank 0 leads the others through each command); built in
        :meth:`setup`."""
        if self._ranks is None:
            raise RuntimeError("the train engine is built in setup")
        return self._ranks

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        meta = latest_checkpoint_meta(self.ctx.run_dir)
        self.records.open(kept_step=int(meta["step"]) if meta is not None else 0)
        await self.bus.subscribe(self.subjects.heartbeat("*"), ActorInfo, self.fleet.on_heartbeat)
        await self.bus.subscribe(
            self.subjects.metrics("rollout"), Metrics, self.fleet.on_rollout_metrics
        )
        if self.recipe.rollout.colocate:
            self.colocation = Colocation(
                self.bus, self.subjects, self.recipe.rollout.lease_ttl, self.log
            )
            await self.colocation.subscribe()
        self.engine = await asyncio.to_thread(build_train_engine, self.recipe)
        self._ranks = Leader(self.engine)
        self.replay_log.open(
            int(meta["step"]) if meta is not None else 0,
            world_size=self.ranks.world_size,
            threads=trainer_threads(self.recipe.trainer.threads),  # as the engine set them
        )
        kind, why = choose(self.recipe)
        self.transport = build_publisher(
            self.recipe, kind, self.bus, self.subjects, self.weights_dir, self.ctx.nats.url
        )
        await self.transport.start()
        self.log.info("weights transport", transport=kind, why=why)
        if meta is not None:
            await asyncio.to_thread(self.ranks.load, meta["path"])
            self.checkpoint_step = self.step
            self.log.info("resumed", step=self.step, version=self.version, epoch=self.epoch)
        if meta is not None or self.epoch:
            # the rollouts may hold weights of versions this trainer never reached; the
            # checkpoint's own export is these weights
            await self._publish_weights(Path(meta["path"]) / "hf" if meta else None)

    async def teardown(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        if self._ranks is not None:
            await self._stop_other_ranks()
        self.records.close()

    async def _stop_other_ranks(self) -> None:
        """Ends the other ranks' loop. After a finished run they all wait for it; asked to
        stop (a signal, or up's stop, which signals every rank at once) they may be gone
        or stopping on their own, which is all that stop asks of them: then rank 0 gives
        them :data:`STOP_RANKS_WITHIN_S` and goes on."""
        asked = self._stop_reason not in ("", "finished")
        within = STOP_RANKS_WITHIN_S if asked else None
        try:
            taken = await asyncio.to_thread(self.ranks.stop, within)
        except RuntimeError as exc:  # what gloo and NCCL raise for a peer gone
            if not asked:
                raise
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.log.info("other trainer ranks stopped first", error=first[:200])
            return
        if not taken:
            self.log.info("other trainer ranks did not take the stop", waited_s=within)

    # -- the step loop ----------------------------------------------------------------------

    async def run(self) -> None:
        cfg = self.recipe.trainer
        if self.recipe.eval.every and self.step < cfg.max_steps:
            await self._wait_for_eval()
        mark = (time.monotonic(), time.process_time())  # for cores/trainer
        while self.step < cfg.max_steps:
            t0 = time.monotonic()
            with self.tracer.span("wait batch", step=self.step + 1):
                batch = await self._fetch_batch(self.step)
            trained = batch.groups
            t_batch = time.monotonic() - t0
            samples, stats = build_samples(
                trained, self.recipe.trainer.loss, turn_discount=self.recipe.rollout.turn_discount
            )
            if self.colocation is not None:
                stats.update(await self._take_the_device())
            gate = gate_applies(self.version, (g.newest_version for g in trained))
            t1 = time.monotonic()
            with self.tracer.span("train", step=self.step + 1, samples=len(samples)):
                train_stats = await asyncio.to_thread(self.ranks.train, samples)
            t_train = time.monotonic() - t1
            if gate:  # a setup error shows here; it ends the run, which no restart mends
                try:
                    check_mismatch(train_stats, cfg.mismatch_limit)
                except MismatchError as exc:
                    raise FatalError(str(exc)) from exc
            await asyncio.to_thread(
                self.replay_log.write, self.step, self.epoch, trained, train_stats
            )
            t2 = time.monotonic()
            last = self.step == cfg.max_steps
            if self.step % cfg.update_every == 0 or last:
                with self.tracer.span("publish weights", step=self.step):
                    # the sends go on while the next step trains; the last version, and
                    # one whose engines wait for the device, is delivered before going on
                    await self._publish_weights(settle=last or self.colocation is not None)
            elif self.colocation is not None:  # no new weights to bring the memory back
                await self.colocation.resume(self.step)
            if self.colocation is not None:
                stats.update(await self._give_the_device())
            times = {
                "time_wait_batch_s": t_batch,
                "time_train_s": t_train,
                "time_weights_s": time.monotonic() - t2,
            }
            if self.transport is not None:
                stats.update(self.transport.record())
            live = self.fleet.stats(self.actor_id, self.dropped())
            # this process's CPU seconds (the step's threads, the weight sends) over the
            # seconds since the last record: the cores the trainer kept busy
            now = (time.monotonic(), time.process_time())
            live["cores/trainer"] = (now[1] - mark[1]) / max(now[0] - mark[0], 1e-9)
            mark = now
            values = self.records.step(
                self.step,
                self.version,
                trained,
                batch.counters,
                stats,
                train_stats,
                times,
                live,
            )
            await self.emit_metrics(values, step=self.step)
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last:
                await self._checkpoint()

    async def _wait_for_eval(self) -> None:
        """Holds the first step until the eval actor is up (its first heartbeat, at most
        :data:`EVAL_WAIT_S`). It listens for weights only once its engine is loaded, and a
        version announced before that never reaches it: on a small model the trainer could
        otherwise publish the first due versions (``eval.every``) before the eval actor
        hears of them. Where its first batch takes longer than the eval actor's start, as
        on any real model, this costs nothing."""
        if await self.fleet.wait_for("eval", 0):
            return
        self.log.info("waiting for the eval actor before the first step", limit_s=EVAL_WAIT_S)
        t0 = time.monotonic()
        if await self.fleet.wait_for("eval", EVAL_WAIT_S):
            self.log.info("the eval actor is up", waited_s=round(time.monotonic() - t0, 2))
        else:
            self.log.warning(
                "no eval actor yet: training on; it evaluates the due versions published "
                "after it starts",
                waited_s=EVAL_WAIT_S,
            )

    async def _take_the_device(self) -> dict[str, float]:
        """Colocation, before a step: the engines free their memory, then the trainer
        brings its parameters and optimizer state back; what each hand-over freed or took
        and how long it took."""
        assert self.colocation is not None
        t0 = time.monotonic()
        freed = await self.colocation.release(self.step)
        t1 = time.monotonic()
        taken, onload_s = await asyncio.to_thread(self.ranks.onload)
        return {
            "rollout_freed_bytes": freed,
            "colocate/engines_released_gib": freed / 2**30,
            "colocate/engines_release_s": t1 - t0,
            "colocate/trainer_retaken_gib": taken / 2**30,
            "colocate/trainer_onload_s": onload_s,
        }

    async def _give_the_device(self) -> dict[str, float]:
        """Colocation, after a step and its weights: the trainer's parameters and optimizer
        state go to host memory while the engines generate (on a CPU: nothing moves)."""
        freed, seconds = await asyncio.to_thread(self.ranks.offload)
        return {
            "colocate/trainer_released_gib": freed / 2**30,
            "colocate/trainer_offload_s": seconds,
        }

    async def _fetch_batch(self, step: int) -> TrainBatchRef:
        """Asks the buffer until it has the batch, and logs (rate-limited) what it waits
        for. The request names the published version too: the buffer judges staleness
        against the weights rollouts can have, not against steps whose weights were never
        sent (``update_every`` > 1)."""
        req = BatchRequest(
            step=step,
            version=self.version,
            published_version=self.published_version,
            epoch=self.epoch,
            checkpoint_step=self.checkpoint_step,
        )
        last_log = -BATCH_WAIT_LOG_EVERY
        while True:
            try:
                reply = await self.bus.request(
                    self.subjects.batch, req, TrainBatchRef, timeout=BATCH_REQUEST_TIMEOUT
                )
            except (BusTimeout, RemoteError) as exc:
                detail = str(exc)  # no buffer yet, or it failed: ask again
            else:
                if reply.waiting is None:
                    break
                detail = reply.waiting.describe()
            if time.monotonic() - last_log >= BATCH_WAIT_LOG_EVERY:
                last_log = time.monotonic()
                self.log.info("waiting for a batch", step=step, detail=detail)
        if not reply.blob_key:
            return reply
        buf = io.BytesIO()
        await self.bus.get_blob(self.subjects.batch_bucket, reply.blob_key, buf)
        # the batch is in hand: its blob would only pile up (a repeated request puts it back)
        await self.bus.delete_blob(self.subjects.batch_bucket, reply.blob_key)
        return decode(buf.getvalue(), TrainBatchRef)

    # -- weights and checkpoints -----------------------------------------------------------------

    async def _publish_weights(self, source: Path | None = None, *, settle: bool = True) -> None:
        """Gets the current weights to the engines through the run's transport
        (:mod:`asyncrl.weights`), which announces them; ``source`` is an export of the same
        weights already on disk (a checkpoint's). ``settle=False``: returns once the
        weights are copied out and announced, their delivery (and its line in
        ``weights.jsonl``) settled before the next version's."""
        assert self.transport is not None
        await self._settle_weights()
        weights = PolicyWeights(
            self.version,
            self.epoch,
            self.step,
            self.weights_dir / export_name(self.epoch, self.version),
            export=self.ranks.export,
            gather=self.ranks.gather,
            source=source,
        )
        t0 = time.monotonic()
        msg = await self.transport.begin(weights)
        self._delivering = {
            "step": self.step,
            "version": msg.version,
            "epoch": msg.epoch,
            "transport": msg.kind,
            "publish_s": round(time.monotonic() - t0, 4),  # what the trainer waited for
        }
        self.published_version = self.version
        self.last_export = weights.folder if weights.exported else None
        if settle:
            await self._settle_weights()

    async def _settle_weights(self) -> None:
        """Waits for the delivery of the version published last, then records it."""
        line, self._delivering = self._delivering, None
        if line is None:
            return
        assert self.transport is not None
        await self.transport.settle()
        await asyncio.to_thread(self.records.published, {**line, **self.transport.delivery()})

    async def _checkpoint(self) -> None:
        path = self.ckpt_dir / f"step_{self.step:06d}"
        # the weights of this step, when just published, are exported already
        published = self.last_export if self.published_version == self.version else None

        def write(folder: Path) -> None:
            # what asyncrl replay checks its own weights against at this step
            self.ranks.save(folder, {WEIGHTS_SHA256: self.ranks.weights_sha256()})
            # the policy of this checkpoint as plain HF weights: what rollout actors load
            # on --resume, before the trainer has published anything
            if published is not None and published.is_dir():
                link_export(published, folder / "hf")
            else:
                self.ranks.export(folder / "hf")

        # a failure (a full disk) ends the trainer with a CheckpointError that names the
        # checkpoint still in place: training on past it would risk more than it saves
        await asyncio.to_thread(commit_checkpoint, self.ctx.run_dir, path, self.step, write)
        self.checkpoint_step = self.step
        self.log.info("checkpoint", step=self.step, path=str(path))


__all__ = ["TrainerActor"]
