"""The engine's side of the ``collective`` transport (:mod:`asyncrl.weights.collective`
has the protocol): for each announcement, join, receive or let it pass, on the one thread
that owns the engine's group, and fall back to the object store when the group fails."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncrl.api.inference import BroadcastJoin, BroadcastStaged, InferenceEngine
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.log import get_logger
from asyncrl.weights import sglang_wire
from asyncrl.weights.version import Wanted
from asyncrl.weights.wire import BucketPool, Lane, bury, open_pair, recv_version, timeout_of
from asyncrl.wire.messages import WeightsGrant, WeightsJoin, WeightsUpdated
from asyncrl.wire.subjects import Subjects

SUPERSEDED_POLL_S = 0.5
"""How often a wait on the actor's loop looks whether another group was announced."""

SERVER_GROUP = object()
"""Stands for the group of a server engine, which the server holds itself."""


JobResult = tuple[int, int, Any, str, Callable[[], None] | None]
"""What an engine-side job gives: ``(version, epoch, what the engine loads, the transport
that brought it, what gives its buffers back once loaded)``; version -1: nothing yet."""


class CollectiveEngineSide:
    """An engine's part of the broadcast: decides for each announcement whether to join,
    receive or let it pass, and runs that on its group's one thread (a ``Lane``). Each
    job returns ``(version, epoch, tensors, via)``; a job that cannot use the group falls
    back to the object store through ``fallback``."""

    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        actor_id: str,
        *,
        device: str,
        loop: asyncio.AbstractEventLoop,
        fallback: Callable[[str], Any],
        engine: InferenceEngine,
        want: Wanted | None = None,
    ) -> None:
        self.bus, self.subjects, self.actor_id = bus, subjects, actor_id
        self.device, self.loop, self.engine = device, loop, engine
        self.want = want or Wanted()
        """The versions this engine loads, told to the trainer in the join: it sends no
        other (the announcement lists the engine under ``skipped``)."""
        self.protocol = engine.broadcast_protocol
        self._fallback = fallback
        self.lane = Lane("weights")
        self.pool = BucketPool(keep=2)
        """Receive buffers: a version received while the one before is staged needs its
        own; once loaded, a version's buffers serve a later one."""
        self.group_id = ""
        self.since_seq: int | None = None  # None while a join is under way
        self.seen_seq = 0  # the newest announcement of this group heard
        self.group: Any = None
        self.broken = False  # the group could not be formed: take the object store
        self.timeout_s = 60.0
        self._superseded = threading.Event()
        """Set when another group is announced: a wait under way gives way to the join."""
        self.log = get_logger(role="engine", part="weights")

    def announce(self, msg: WeightsUpdated) -> concurrent.futures.Future[Any] | None:
        listed = self.actor_id in msg.members
        if msg.location != self.group_id:
            self.group_id, self.since_seq, self.broken = msg.location, None, False
            self.seen_seq = msg.seq
            # a fallback under way asks the trainer that led the old group, which may be
            # dead (its replacement announced this one): it gives way to the join
            self._superseded.set()
            return self.lane.submit(lambda: self._join(msg))
        if msg.seq <= self.seen_seq:
            # heard before (the buffer's answer to "which weights are the latest?" repeats
            # an announcement): its broadcast is taken or under way, never sent twice
            return None
        self.seen_seq = msg.seq
        if self.broken:
            return self.lane.submit(lambda: self._fall_back("the group could not be formed"))
        if listed:
            return self.lane.submit(lambda: self._receive(msg.version, msg.epoch))
        if self.actor_id in msg.skipped:
            return None  # a version this engine does not load: not sent, still a member
        if self.since_seq is not None and msg.seq > self.since_seq:
            # sent after we joined, yet not to us: the trainer dropped us; join again
            self.since_seq = None
            return self.lane.submit(lambda: self._join(msg))
        return None  # announced before our join: the join brings these weights or newer

    def _giver(self, buckets: list[Any]) -> Callable[[], None]:
        """Gives ``buckets`` back to the pool, once however often it is called."""
        given = False

        def give() -> None:
            nonlocal given
            if not given:
                given = True
                self.pool.give(buckets)

        return give

    def _await(self, coro: Any, timeout: float) -> Any:
        """Runs ``coro`` on the actor's loop and waits for it, at most ``timeout`` s; gives
        up (raising) as soon as another group is announced: what the old group's trainer
        was asked may never come (it may be dead; its replacement announced the new one),
        and the join waits behind this on the lane."""
        asked = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + timeout
        while not concurrent.futures.wait([asked], timeout=SUPERSEDED_POLL_S).done:
            if self._superseded.is_set():
                asked.cancel()
                raise TimeoutError("given up: another group was announced")
            if time.monotonic() >= deadline:
                asked.cancel()
                raise TimeoutError
        return asked.result()  # or what it raised

    def _forget_group(self) -> None:
        if self.group is not SERVER_GROUP:
            bury(self.group)
        self.group = None

    def _join(self, msg: WeightsUpdated) -> JobResult:
        self._superseded.clear()
        self._forget_group()
        try:
            grant: WeightsGrant = self._await(
                self.bus.request(
                    self.subjects.weights_join,
                    WeightsJoin(
                        actor_id=self.actor_id,
                        group=msg.location,
                        protocol=self.protocol or "asyncrl",
                        every=self.want.every,
                        last=self.want.last,
                    ),
                    WeightsGrant,
                    timeout=30.0,
                ),
                35.0,
            )
        except Exception as exc:
            # not in the group: the next announcement asks again
            self.group_id = ""
            return self._fall_back(f"no join grant ({type(exc).__name__}: {exc})")
        self.timeout_s = grant.timeout_s
        try:
            if self.protocol:  # a server joins the group itself
                where = BroadcastJoin(
                    grant.host, grant.port, grant.prefix, grant.backend, grant.timeout_s
                )
                self._await(self.engine.join_broadcast(where), grant.timeout_s + 30)
                self.group = SERVER_GROUP
            else:
                import torch.distributed as dist  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

                store = dist.TCPStore(
                    grant.host,
                    grant.port,
                    None,
                    False,
                    timeout=timeout_of(grant.timeout_s),
                    wait_for_workers=False,
                )
                self.group = open_pair(
                    store, grant.prefix, 1, grant.backend, grant.timeout_s, self.device
                )
        except Exception as exc:
            self.broken = True
            self._forget_group()
            return self._fall_back(
                f"forming the {grant.backend} group at {grant.host}:{grant.port} failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            )
        self.since_seq = grant.since_seq
        self.log.info(
            "joined the weight broadcast", at=f"{grant.host}:{grant.port}", since=grant.since_seq
        )
        if grant.version < 0:
            return (-1, grant.epoch, None, "collective", None)  # nothing published yet
        return self._receive(grant.version, grant.epoch)

    def _receive(self, version: int, epoch: int) -> JobResult:
        """One version from the group: into this process (the tensors), or into the
        server (what the engine's load then swaps in)."""
        if self.group is None:
            return self._fall_back("not in a group")
        try:
            if self.group is SERVER_GROUP:
                staged = self._await(self._server_receive(version, epoch), self.timeout_s * 2 + 30)
                return staged.version, staged.epoch, staged, "collective", None
            version, epoch, tensors, buckets = recv_version(
                self.group, self.device, self.timeout_s, self.pool
            )
        except Exception as exc:
            self._forget_group()
            self.group_id = ""
            return self._fall_back(f"receive failed ({type(exc).__name__}: {exc})"[:300])
        return version, epoch, tensors, "collective", self._giver(buckets)

    async def _server_receive(self, version: int, epoch: int) -> BroadcastStaged:
        if self.protocol != sglang_wire.PROTOCOL:
            return await self.engine.receive_broadcast(version, epoch)
        key = sglang_wire.tensors_key(self.group_id, epoch, version)
        tensors = await sglang_wire.get_tensor_list(self.bus, self.subjects.weights_bucket, key)
        return await self.engine.receive_broadcast(version, epoch, tensors)

    def _fall_back(self, reason: str) -> JobResult:
        """The current weights from the object store, asked of the trainer (given up once
        another group is announced: :meth:`_await`)."""
        self.log.warning("weights from the object store instead of the broadcast", reason=reason)
        version, epoch, tensors = self._await(self._fallback(reason), self.timeout_s * 2 + 30)
        return version, epoch, tensors, "object_store", None


__all__ = ["SERVER_GROUP", "CollectiveEngineSide", "JobResult"]
