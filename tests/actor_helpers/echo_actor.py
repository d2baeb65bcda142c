"""A small actor for runtime tests, runnable as a process:

    python tests/actor_helpers/echo_actor.py RUN_DIR ACTOR_ID BEHAVIOUR

BEHAVIOUR: ``serve`` (answers echo requests until stopped), ``finish`` (returns after
its first echo request), ``crash`` (raises after start), ``fatal`` (raises a
:class:`~asyncrl.runtime.exits.FatalError` after start), ``die`` (exits before start).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from asyncrl.config.recipe import Recipe
from asyncrl.runtime.actor import Actor, ActorContext
from asyncrl.runtime.exits import FatalError
from asyncrl.runtime.loop import run_async
from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.wire.messages import Ack


class EchoActor(Actor):
    role = "echo"

    def __init__(self, ctx: ActorContext, behaviour: str = "serve") -> None:
        super().__init__(ctx)
        self.behaviour = behaviour
        self.requests = 0
        self.finished = asyncio.Event()
        self.torn_down = False

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        await self.bus.serve(f"{self.subjects.prefix}.echo.{self.actor_id}", Ack, self.on_echo)

    async def on_echo(self, msg: Ack) -> Ack:
        self.requests += 1
        if self.behaviour == "finish":
            self.finished.set()
        return Ack(ok=True, error=f"echo {msg.error}")

    async def run(self) -> None:
        if self.behaviour == "crash":
            raise RuntimeError("boom on purpose")
        if self.behaviour == "fatal":
            raise FatalError("a setup no restart mends")
        if self.behaviour == "finish":
            await self.finished.wait()
            return
        await super().run()

    async def teardown(self) -> None:
        self.torn_down = True


def main() -> int:
    run_dir, actor_id, behaviour = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if behaviour == "die":
        return 2
    ctx = ActorContext(
        run_name="t",
        run_dir=run_dir,
        nats=nats_info_for_run(run_dir),
        recipe=Recipe(),
        actor_id=actor_id,
        heartbeat_interval=0.2,
    )
    return run_async(EchoActor(ctx, behaviour).main())


if __name__ == "__main__":
    sys.exit(main())
