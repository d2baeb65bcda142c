"""A buffer actor running in the test's process on a real nats-server, and a bus that
loses chosen messages (real NATS underneath) to test what the protocol does about it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from nats.aio.client import Client

from asyncrl.actors.buffer import BufferActor
from asyncrl.config.recipe import Recipe, load_recipe
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.bus import Bus, BusTimeout, R
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import ActorInfo, Message
from asyncrl.wire.subjects import Subjects

BASE = [
    "run.name=t",
    "data.size=50",
    "rollout.group_size=2",
    "buffer.batch_size=2",
    "buffer.max_concurrent=10",
    "buffer.max_head_offpolicyness=1",
]


def recipe(*overrides: str) -> Recipe:
    return load_recipe(None, [*BASE, *overrides])


def context(run_dir: Path, nats: NatsInfo, r: Recipe, actor_id: str = "") -> ActorContext:
    return ActorContext(run_name="t", run_dir=run_dir, nats=nats, recipe=r, actor_id=actor_id)


@asynccontextmanager
async def running_buffer(
    run_dir: Path, nats: NatsInfo, bus: Bus, r: Recipe
) -> AsyncIterator[BufferActor]:
    """A started BufferActor (its subscriptions exist), stopped at the end."""
    subjects = Subjects("t")
    await bus.ensure_stream(subjects.stream, subjects.trajectory_subjects, retention="workqueue")
    started = asyncio.Event()

    async def on_started(info: ActorInfo) -> None:
        if info.role == "buffer":
            started.set()

    await bus.subscribe(subjects.started, ActorInfo, on_started)
    buf = BufferActor(context(run_dir, nats, r, "buffer-0"))
    task = asyncio.create_task(buf.main())
    try:
        async with asyncio.timeout(30):
            await started.wait()
        yield buf
    finally:
        buf.stop("test over")
        assert await task == 0


class LossyBus(Bus):
    """Loses the next ``lose_request[subject]`` requests on ``subject`` before they are
    sent, and the replies of the next ``lose_reply[subject]`` ones (the request reaches
    the responder, whose answer goes to an inbox nobody reads). Either way the caller
    sees what a lost message looks like: a timeout."""

    def __init__(self, nc: Client, info: NatsInfo) -> None:
        super().__init__(nc, info)
        self.lose_request: Counter[str] = Counter()
        self.lose_reply: Counter[str] = Counter()

    async def request(
        self,
        subject: str,
        msg: Message,
        reply_type: type[R],
        *,
        timeout: float,  # noqa: ASYNC109 - the Bus signature
    ) -> R:
        if self.lose_request[subject] > 0:
            self.lose_request[subject] -= 1
            raise BusTimeout(f"request on {subject!r} lost (test)")
        if self.lose_reply[subject] > 0:
            self.lose_reply[subject] -= 1
            await self.nc.publish(subject, encode(msg), reply=self.nc.new_inbox())
            await self.nc.flush()
            raise BusTimeout(f"reply on {subject!r} lost (test)")
        return await super().request(subject, msg, reply_type, timeout=timeout)
