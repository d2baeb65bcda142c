"""The colocated trainer's handshake with the rollout actors that share its accelerator:
before a train step it asks every live rollout actor to free its memory and waits for all
of them; after a step without new weights it tells them to take the memory back."""

from __future__ import annotations

import asyncio
import time

from structlog.typing import FilteringBoundLogger

from asyncrl.runtime.bus import Bus
from asyncrl.wire.messages import ActorInfo, MemoryControl, MemoryReleased
from asyncrl.wire.subjects import Subjects

RELEASE_TIMEOUT = 60.0
"""Seconds a colocated trainer waits for the rollout actors it knows to release their
memory before it steps anyway (an actor that died meanwhile never answers)."""


class Colocation:
    """The trainer's side of the handshake; :meth:`subscribe` in setup."""

    def __init__(
        self, bus: Bus, subjects: Subjects, lease_ttl: float, log: FilteringBoundLogger
    ) -> None:
        self.bus, self.subjects, self.lease_ttl, self.log = bus, subjects, lease_ttl, log
        self._seen: dict[str, float] = {}  # rollout actor id -> last heartbeat
        self._released: dict[str, MemoryReleased] = {}
        self._answered = asyncio.Event()
        self._step = -1

    async def subscribe(self) -> None:
        await self.bus.subscribe(self.subjects.heartbeat("rollout"), ActorInfo, self._on_rollout)
        await self.bus.subscribe(self.subjects.memory_released, MemoryReleased, self._on_released)

    async def _on_rollout(self, info: ActorInfo) -> None:
        if info.status == "running":
            self._seen[info.actor_id] = time.monotonic()
        else:
            self._seen.pop(info.actor_id, None)
        self._answered.set()  # a release wait re-counts who is alive

    async def _on_released(self, msg: MemoryReleased) -> None:
        if msg.step == self._step:
            self._released[msg.actor_id] = msg
            self._answered.set()

    async def release(self, step: int) -> float:
        """Asks every live rollout actor to free the accelerator before the train step
        after ``step`` and waits for all of them (or :data:`RELEASE_TIMEOUT`); returns the
        bytes they freed together."""
        live: set[str] = set()
        self._step = step
        self._released.clear()
        await self.bus.publish(self.subjects.memory, MemoryControl(action="release", step=step))
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT):
                while True:
                    now = time.monotonic()
                    live = {a for a, t in self._seen.items() if now - t < self.lease_ttl}
                    if live <= self._released.keys():
                        break
                    self._answered.clear()
                    await self._answered.wait()
        except TimeoutError:
            missing = sorted(live - self._released.keys())
            self.log.warning("rollout actors did not release memory", actors=missing)
        return float(sum(m.freed_bytes for m in self._released.values()))

    async def resume(self, step: int) -> None:
        """Tells the rollout actors to take their memory back after ``step`` (a step
        without new weights: a weight update would bring it back itself)."""
        await self.bus.publish(self.subjects.memory, MemoryControl(action="resume", step=step))


__all__ = ["RELEASE_TIMEOUT", "Colocation"]
