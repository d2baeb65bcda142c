"""``collective``: weights broadcast from the trainer's rank 0 to each engine over
torch.distributed (NCCL between GPUs, gloo on the CPU), with every step bounded in time.

**One group per engine.** Each engine forms a two-rank group with the trainer's rank 0
(rank 0 the trainer, rank 1 the engine) through a rendezvous store the trainer hosts;
its address goes out over NATS in the join grant (:class:`~asyncrl.wire.messages.WeightsGrant`).
A rebuilt group of all engines would send the bytes once, but every join (an actor
attached mid-run, a restarted one) would stop every engine to re-form it, and one engine
that dies would break the broadcast for all. With one group per engine an engine joins
without disturbing the others, and a dead one costs only its own group. The trainer sends
to the engines concurrently, one thread per group.

**A version on the wire**: an ``int64`` header (magic, version, epoch, manifest bytes),
the manifest (JSON: each tensor's name, dtype, shape and place in its bucket), then the
buckets: flat ``uint8`` tensors of at most ``weights.bucket_mb`` MiB holding the tensors
in the engine's dtype. The receiver's tensors are views of the received buckets.

**Versions an engine does not load.** An engine names the versions it loads in its join
(``WeightsJoin.every`` and ``last``: the eval actor's due versions); the trainer sends it
no other, and lists it under ``skipped`` in their announcements, so that it knows it was
not dropped. A rollout engine loads every version.

**No hangs.** Every group is created with ``weights.timeout_s``, so a rendezvous or a
broadcast that a peer does not complete fails within it, and the trainer waits for each
engine's thread no longer than that either. An engine whose send fails or times out is
dropped from the broadcast and the trainer goes on; the engine notices (the next
announcement does not list it), joins again and gets the current weights at once. An
engine that cannot form its group (a firewall, an address it cannot reach) asks for the
current weights in the object store instead (:class:`~asyncrl.wire.messages.WeightsFallback`),
and the log says why. Groups that failed are never destroyed (a gloo group's destructor
joins its worker threads, which a stuck peer could hold): they are kept aside until the
process exits.

**Server protocols.** A server engine joins with the protocol it speaks
(``WeightsJoin.protocol``): ``"asyncrl"`` is the layout above; ``"sglang"`` is SGLang's
own (:mod:`asyncrl.weights.sglang_wire`: its group, one broadcast per tensor, the tensor
list in the object store). The trainer forms each member's group and sends each version
the way that member speaks; timeouts and drops are the same for all.

**A missed announcement.** Announcements are plain NATS messages: one published while an
engine's connection is being re-established (a nats-server restarted, a network blip) never
reaches it, and that engine's send would then wait out the whole ``weights.timeout_s``
(two minutes by default) before the engine is dropped and joins again. So while a
version's sends are under way its announcement goes out again every ``REANNOUNCE_S``
seconds; an engine takes the first copy it hears and ignores the rest (by ``seq``).

**Ordering.** The trainer announces a version (``WeightsUpdated`` listing the engines it is
sent to) before it sends; an engine queues one job per announcement, in arrival order, on
the one thread that owns its group, so receives match sends one for one. Joins are
ordered with broadcasts by the publisher's sequence number: an engine takes part in the
broadcasts after the ``since_seq`` of its grant.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.weights import WeightPublisher, Weights
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.log import get_logger
from asyncrl.weights import sglang_wire
from asyncrl.weights.config import WeightsConfig
from asyncrl.weights.version import Wanted
from asyncrl.weights.wire import (
    Lane,
    Packed,
    bury,
    open_pair,
    open_store,
    pack,
    recv_version,
    send_version,
    unpack,
)
from asyncrl.wire.messages import (
    WeightsFallback,
    WeightsGrant,
    WeightsJoin,
    WeightsUpdated,
)
from asyncrl.wire.subjects import Subjects

REANNOUNCE_S = 2.0
"""Seconds between the copies of a version's announcement while its sends are under way
(see "A missed announcement" above)."""


def rendezvous_host(config: WeightsConfig, nats_url: str) -> str:
    """The address engines reach the trainer's store at (``weights.address``)."""
    if config.address:
        return config.address
    local = ("127.0.0.1", "localhost", "[::1]")
    if not nats_url or any(h in nats_url for h in local):
        return "127.0.0.1"
    return socket.gethostname()


# -- the trainer side -------------------------------------------------------------------------


@dataclass
class _Member:
    actor_id: str
    prefix: str
    lane: Lane
    protocol: str = "asyncrl"
    wants: Wanted = field(default_factory=Wanted)
    """The versions it loads (its join's ``every`` and ``last``): it is sent no other."""
    group: Any = None
    alive: bool = True


@dataclass
class CollectiveStats:
    """What the trainer's records show of the broadcast."""

    sent: int = 0
    dropped: int = 0
    joins: int = 0
    fallbacks: int = 0
    repeats: int = 0
    """Announcements sent again while a version's sends were under way."""
    last_send_s: float = 0.0
    last_bytes: int = 0
    last_members: int = 0
    delivered: list[str] = field(default_factory=list)
    """The engines the last version reached."""
    skipped: list[str] = field(default_factory=list)
    """The engines the last version was not sent to: they do not load it."""
    dropped_now: list[str] = field(default_factory=list)
    """The engines dropped since the version before (a failed send or join)."""


class CollectivePublisher(WeightPublisher):
    """Rank 0's side: hosts the rendezvous store, grants joins, broadcasts each version
    to the engines joined, drops an engine that fails, serves the fallback."""

    kind = "collective"

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        config: WeightsConfig,
        *,
        host: str,
        dtype: str,
        backend: str,
        device: str,
        fallback: Callable[[Packed, int], Awaitable[WeightsUpdated]],
    ) -> None:
        super().__init__(bus, subjects)
        self.config = config
        self.host, self.dtype, self.backend, self.device = host, dtype, backend, device
        self.group_id = uuid.uuid4().hex[:12]
        self.store: Any = None
        self.members: dict[str, _Member] = {}
        self.seq = 0
        self.current: Packed | None = None
        self.current_step = 0
        self._spare: Packed | None = None
        self._fallback = fallback
        self._fallback_msg: WeightsUpdated | None = None
        self._lock = asyncio.Lock()
        self._tensor_lists: list[str] = []
        """Keys of the tensor lists in the object store (SGLang members read them)."""
        self._sending: asyncio.Task[None] | None = None
        """The sends of the version :meth:`begin` announced last, until :meth:`settle`."""
        self._joins: set[asyncio.Task[bool]] = set()
        """Joins whose group formation and first send are under way (kept referenced; each
        ends within the timeout, and :meth:`close` cancels what is left)."""
        self.stats = CollectiveStats()
        self.log = get_logger(role="trainer", part="weights")

    async def start(self) -> None:
        self.store = await asyncio.to_thread(open_store, self.host, self.config.timeout_s)
        await self.bus.serve(self.subjects.weights_join, WeightsJoin, self.on_join)
        await self.bus.serve(self.subjects.weights_fallback, WeightsFallback, self.on_fallback)
        self.log.info(
            "weight broadcast ready",
            group=self.group_id,
            rendezvous=f"{self.host}:{self.store.port}",
            backend=self.backend,
        )

    async def publish(self, weights: Weights) -> WeightsUpdated:
        msg = await self.begin(weights)
        await self.settle()
        return msg

    async def begin(self, weights: Weights) -> WeightsUpdated:
        """Copies ``weights`` into buckets, announces them and starts the sends; returns
        without waiting for them (:meth:`settle` does). The buckets are a copy, so the
        trainer's next step may change its parameters meanwhile; a version's sends wait
        for the version before's to settle."""
        await self.settle()
        tensors = await asyncio.to_thread(weights.tensors, self.dtype)
        # the buckets of the version before last, when no send reads them any more: fresh
        # pages cost more than the copy into them
        spare, self._spare = self._spare, None
        into = spare.buckets if spare is not None and spare.readers == 0 else None
        packed = await asyncio.to_thread(
            functools.partial(
                pack,
                tensors,
                self.config.bucket_mb << 20,
                weights.version,
                weights.epoch,
                into=into,
            )
        )
        del tensors  # some are the trainer's live parameters
        async with self._lock:
            self.seq += 1
            self._spare = self.current  # retired: a spare once its sends are done
            self.current, self.current_step = packed, weights.step
            self._fallback_msg = None
            alive = [m for m in self.members.values() if m.alive]
            wanted = [m.wants(packed.version) for m in alive]
            members = [m for m, w in zip(alive, wanted, strict=True) if w]
            skipped = sorted(m.actor_id for m, w in zip(alive, wanted, strict=True) if not w)
            if any(m.protocol == sglang_wire.PROTOCOL for m in members):
                await self._put_tensor_list(packed)
            msg = await self.announce(
                weights,
                self.group_id,
                members=[m.actor_id for m in members],
                seq=self.seq,
                skipped=skipped,
            )
            jobs = [(m, m.lane.submit(self._sender(m, packed))) for m in members]
        self._sending = asyncio.create_task(self._deliver(msg, jobs, skipped, packed.nbytes))
        return msg

    async def settle(self) -> None:
        task, self._sending = self._sending, None
        if task is not None:
            await task

    async def _deliver(
        self,
        msg: WeightsUpdated,
        jobs: list[tuple[_Member, concurrent.futures.Future[Any]]],
        skipped: list[str],
        nbytes: int,
    ) -> None:
        """Waits for one version's sends (each bounded by the timeout; a failed one drops
        its engine), announcing the version again meanwhile; then its figures."""
        t0 = time.monotonic()
        repeat = asyncio.create_task(self._announce_again(msg)) if jobs else None
        try:
            done = await asyncio.gather(*(self._settle(m, job) for m, job in jobs))
        finally:
            if repeat is not None:
                repeat.cancel()
        self.stats.delivered = [m.actor_id for (m, _), ok in zip(jobs, done, strict=True) if ok]
        self.stats.skipped = skipped
        self.stats.last_send_s = time.monotonic() - t0
        self.stats.last_bytes = nbytes
        self.stats.last_members = len(jobs)

    async def _announce_again(self, msg: WeightsUpdated) -> None:
        """Puts ``msg`` on the weights subject again every ``REANNOUNCE_S`` s until
        cancelled (its sends have settled)."""
        while True:
            await asyncio.sleep(REANNOUNCE_S)
            try:
                await self.bus.publish(self.subjects.weights, msg)
            except Exception as exc:  # disconnected: the next copy, or the timeout, decides
                self.log.debug("announcement not repeated", error=f"{type(exc).__name__}: {exc}")
            else:
                self.stats.repeats += 1

    def record(self) -> dict[str, float]:
        """The figures of the last version settled: in a step's record, with the sends
        going on while the next step trains, the version before the step's own."""
        s = self.stats
        return {
            "weights/engines": float(s.last_members),
            "weights/broadcast_s": s.last_send_s,
            "weights/bytes": float(s.last_bytes),
            "weights/sent": float(s.sent),
            "weights/dropped": float(s.dropped),
            "weights/joins": float(s.joins),
            "weights/fallbacks": float(s.fallbacks),
            "weights/repeats": float(s.repeats),
        }

    def delivery(self) -> dict[str, Any]:
        s = self.stats
        out = {
            "sent_to": sorted(s.delivered),
            "skipped": s.skipped,
            "dropped": s.dropped_now,
            "broadcast_s": round(s.last_send_s, 4),
            "bytes": s.last_bytes,
        }
        s.dropped_now = []
        return out

    def _sender(self, member: _Member, packed: Packed) -> Callable[[], None]:
        packed.reading(+1)

        def send() -> None:
            try:
                if member.group is None:
                    raise RuntimeError("its group was never formed")
                self._send(member, packed)
            finally:
                packed.reading(-1)

        return send

    def _form(self, member: _Member) -> Any:
        if member.protocol == sglang_wire.PROTOCOL:
            return sglang_wire.open_group(
                self.store, member.prefix, self.backend, self.config.timeout_s, self.device
            )
        return open_pair(
            self.store, member.prefix, 0, self.backend, self.config.timeout_s, self.device
        )

    def _send(self, member: _Member, packed: Packed) -> None:
        speak = (
            sglang_wire.send_version if member.protocol == sglang_wire.PROTOCOL else send_version
        )
        speak(member.group, packed, self.device, self.config.timeout_s)

    async def _put_tensor_list(self, packed: Packed) -> None:
        """The version's tensor list where SGLang members read it (once per version)."""
        await sglang_wire.put_tensor_list(
            self.bus, self.subjects.weights_bucket, self.group_id, packed, self._tensor_lists
        )

    async def _settle(self, member: _Member, job: concurrent.futures.Future[Any]) -> bool:
        """Waits for one engine's job, at most the timeout (plus a margin for the
        backend's own); a failure drops the engine from the broadcast."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(job), self.config.timeout_s + 5.0)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._drop(member, reason[:300])
            return False
        self.stats.sent += 1
        return True

    def _drop(self, member: _Member, reason: str) -> None:
        if not member.alive:
            return
        member.alive = False
        self.members.pop(member.actor_id, None)
        bury(member.group)
        self.stats.dropped += 1
        self.stats.dropped_now.append(member.actor_id)
        self.log.warning(
            "engine dropped from the weight broadcast", actor=member.actor_id, reason=reason
        )

    async def on_join(self, req: WeightsJoin) -> WeightsGrant:
        if req.protocol not in ("asyncrl", sglang_wire.PROTOCOL):
            raise ValueError(f"no broadcast protocol {req.protocol!r} (asyncrl, sglang)")
        async with self._lock:
            old = self.members.pop(req.actor_id, None)
            if old is not None:  # it re-joins: its group is gone on its side
                old.alive = False
                bury(old.group)
            member = _Member(
                req.actor_id,
                prefix=f"{self.group_id}/{req.actor_id}/{uuid.uuid4().hex[:8]}/",
                lane=Lane(f"weights-{req.actor_id}"),
                protocol=req.protocol,
                wants=Wanted(req.every, req.last),
            )
            self.members[req.actor_id] = member
            current = self.current
            if current is not None and member.protocol == sglang_wire.PROTOCOL:
                await self._put_tensor_list(current)
            grant = WeightsGrant(
                group=self.group_id,
                host=self.host,
                port=int(self.store.port),
                prefix=member.prefix,
                backend=self.backend,  # type: ignore[arg-type]
                timeout_s=self.config.timeout_s,
                since_seq=self.seq,
                version=current.version if current is not None else -1,
                epoch=current.epoch if current is not None else 0,
            )

            if current is not None:
                current.reading(+1)

            def form_and_send() -> None:
                try:
                    member.group = self._form(member)
                    if current is not None:
                        self._send(member, current)
                finally:
                    if current is not None:
                        current.reading(-1)

            job = member.lane.submit(form_and_send)
        self.stats.joins += 1
        self.log.info("engine joins the weight broadcast", actor=req.actor_id, since=self.seq)
        task = asyncio.get_running_loop().create_task(self._settle(member, job))
        self._joins.add(task)
        task.add_done_callback(self._joins.discard)
        return grant

    async def close(self) -> None:
        """Leaves what is still under way: a send stuck on a dead peer ends with its
        lane's daemon thread at exit (the trainer settles its last version before)."""
        tasks = [*self._joins, *([self._sending] if self._sending is not None else [])]
        self._sending = None
        for task in tasks:
            task.cancel()

    async def on_fallback(self, req: WeightsFallback) -> WeightsUpdated:
        """The current weights in the object store (uploaded once per version)."""
        async with self._lock:
            current = self.current
            if current is None:
                raise RuntimeError("no weights published yet")
            if self._fallback_msg is None or self._fallback_msg.version != current.version:
                self._fallback_msg = await self._fallback(current, self.current_step)
            msg = self._fallback_msg
        self.stats.fallbacks += 1
        self.log.info("engine takes the object store", actor=req.actor_id, reason=req.reason)
        return msg


__all__ = [
    "CollectivePublisher",
    "Packed",
    "pack",
    "recv_version",
    "send_version",
    "unpack",
]
