"""The actor base and the supervisor against a real nats-server and real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from actor_helpers.echo_actor import EchoActor

from asyncrl.config.recipe import Recipe
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.exits import FATAL_EXIT
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.runtime.supervisor import ActorSpec, Supervisor
from asyncrl.wire.messages import Ack, ActorExit, ActorInfo, Control
from asyncrl.wire.subjects import Subjects

HELPER = str(Path(__file__).parent / "actor_helpers" / "echo_actor.py")
SUBJECTS = Subjects("t")


def _ctx(server: EmbeddedNats, actor_id: str) -> ActorContext:
    return ActorContext(
        run_name="t",
        run_dir=server.run_dir,
        nats=server.info,
        recipe=Recipe(),
        actor_id=actor_id,
        heartbeat_interval=0.05,
    )


async def _collect(bus: Bus, subject: str, cls: type, into: list) -> None:
    async def keep(m: object) -> None:
        into.append(m)

    await bus.subscribe(subject, cls, keep)


async def test_started_after_subscriptions_then_heartbeats_then_stop(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    started: list[ActorInfo] = []
    beats: list[ActorInfo] = []
    exits: list[ActorExit] = []
    got_started = asyncio.Event()
    two_beats = asyncio.Event()

    async def on_beat(info: ActorInfo) -> None:
        beats.append(info)
        if len(beats) >= 2:
            two_beats.set()

    async def on_started(info: ActorInfo) -> None:
        started.append(info)
        # the actor's subscriptions must already answer when "started" arrives
        reply = await bus.request(f"{SUBJECTS.prefix}.echo.a1", Ack(error="hi"), Ack, timeout=2)
        assert reply.error == "echo hi"
        got_started.set()

    await bus.subscribe(SUBJECTS.started, ActorInfo, on_started)
    await bus.subscribe(SUBJECTS.heartbeat("echo"), ActorInfo, on_beat)
    await _collect(bus, SUBJECTS.exited, ActorExit, exits)
    actor = EchoActor(_ctx(embedded_nats, "a1"))
    async with asyncio.TaskGroup() as tg:
        main = tg.create_task(actor.main())
        await asyncio.wait_for(got_started.wait(), 10)
        await asyncio.wait_for(two_beats.wait(), 10)
        await bus.publish(SUBJECTS.control, Control(command="stop", target="echo", reason="test"))
    assert main.result() == 0
    assert started[0].actor_id == "a1" and started[0].role == "echo"
    assert {b.actor_id for b in beats} == {"a1"} and beats[0].pid > 0
    assert actor.torn_down
    await bus.nc.flush()
    assert exits and exits[-1].ok and "test" in exits[-1].reason


async def test_control_for_another_actor_is_ignored_and_run_return_ends_cleanly(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    actor = EchoActor(_ctx(embedded_nats, "a2"), behaviour="finish")
    ready = asyncio.Event()

    async def on_started(info: ActorInfo) -> None:
        ready.set()

    await bus.subscribe(SUBJECTS.started, ActorInfo, on_started)
    async with asyncio.TaskGroup() as tg:
        main = tg.create_task(actor.main())
        await asyncio.wait_for(ready.wait(), 10)
        await bus.publish(SUBJECTS.control, Control(command="stop", target="someone-else"))
        await bus.request(f"{SUBJECTS.prefix}.echo.a2", Ack(), Ack, timeout=2)
    assert main.result() == 0 and actor.requests == 1


async def test_failing_run_gives_exit_code_1_and_a_failed_exit_message(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    exits: list[ActorExit] = []
    await _collect(bus, SUBJECTS.exited, ActorExit, exits)
    actor = EchoActor(_ctx(embedded_nats, "a3"), behaviour="crash")
    assert await actor.main() == 1
    assert actor.torn_down
    await bus.nc.flush()
    await asyncio.sleep(0.05)
    assert exits and not exits[0].ok and "boom on purpose" in exits[0].reason


async def test_a_fatal_error_gives_its_exit_code_and_says_fatal(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    exits: list[ActorExit] = []
    await _collect(bus, SUBJECTS.exited, ActorExit, exits)
    actor = EchoActor(_ctx(embedded_nats, "a4"), behaviour="fatal")
    assert await actor.main() == FATAL_EXIT
    await bus.nc.flush()
    await asyncio.sleep(0.05)
    assert exits and exits[0].fatal and not exits[0].ok
    assert "a setup no restart mends" in exits[0].reason


def _spec(run_dir: Path, actor_id: str, behaviour: str, primary: bool = False) -> ActorSpec:
    return ActorSpec(
        "echo", actor_id, [sys.executable, HELPER, str(run_dir), actor_id, behaviour], primary
    )


async def test_supervisor_finishes_when_the_primary_actor_returns(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    run_dir = embedded_nats.run_dir
    specs = [_spec(run_dir, "p", "finish", primary=True), _spec(run_dir, "s", "serve")]
    started = asyncio.Event()
    sup = Supervisor(
        bus, SUBJECTS, run_dir, specs, startup_timeout=60, grace=10, on_started=started.set
    )
    async with asyncio.TaskGroup() as tg:
        result = tg.create_task(sup.run())
        await asyncio.wait_for(started.wait(), 60)
        await bus.request(f"{SUBJECTS.prefix}.echo.p", Ack(), Ack, timeout=5)
    assert result.result() == 0, sup.reason
    assert all(p.exit_code == 0 for p in sup.procs.values())
    assert (run_dir / "logs" / "s.log").is_file()


async def test_supervisor_names_the_actor_that_died(embedded_nats: EmbeddedNats, bus: Bus) -> None:
    run_dir = embedded_nats.run_dir
    specs = [_spec(run_dir, "p", "serve", primary=True), _spec(run_dir, "bad", "crash")]
    sup = Supervisor(bus, SUBJECTS, run_dir, specs, startup_timeout=60, grace=10)
    assert await sup.run() == 1
    assert "bad" in sup.reason and "bad.log" in sup.reason
    assert all(p.exit_code is not None for p in sup.procs.values())


async def test_supervisor_does_not_restart_a_fatal_error(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    """An actor with restarts left fails fatally once the run is up: it is not replaced
    (a crash would be), and its reason ends the run."""
    run_dir = embedded_nats.run_dir
    fatal = _spec(run_dir, "f", "fatal")
    fatal.restarts, fatal.backoff = 3, 0.5
    specs = [_spec(run_dir, "p", "serve", primary=True), fatal]
    sup = Supervisor(bus, SUBJECTS, run_dir, specs, startup_timeout=60, grace=10)
    assert await sup.run() == 1
    assert "actor f (echo)" in sup.reason and "fatal: not restarted" in sup.reason
    assert "a setup no restart mends" in sup.reason
    assert list(sup.procs) == ["p", "f"]
    assert sup.procs["f"].exit_code == FATAL_EXIT


async def test_supervisor_fails_on_an_actor_that_never_starts(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    run_dir = embedded_nats.run_dir
    specs = [_spec(run_dir, "p", "serve", primary=True), _spec(run_dir, "early", "die")]
    sup = Supervisor(bus, SUBJECTS, run_dir, specs, startup_timeout=60, grace=10)
    assert await sup.run() == 1
    assert "early" in sup.reason and "before it started" in sup.reason


async def test_a_gang_starts_as_one_actor_and_is_replaced_as_a_whole(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    """A trainer across nodes is a gang: the member that holds rank 0 reports started
    for all, and the death of any member replaces every member together."""
    run_dir = embedded_nats.run_dir
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    specs = [
        ActorSpec("echo", "g", _spec(run_dir, "g", "finish").argv, True, gang="g", restarts=1),
        ActorSpec("echo", "g-node1", sleeper, gang="g", restarts=1, backoff=0),
    ]
    specs[0].backoff = 0
    seen: dict[str, asyncio.Event] = {"g": asyncio.Event(), "g-r1": asyncio.Event()}

    async def on_started(info: ActorInfo) -> None:
        if info.actor_id in seen:
            seen[info.actor_id].set()

    await bus.subscribe(SUBJECTS.started, ActorInfo, on_started)
    all_started = asyncio.Event()
    sup = Supervisor(
        bus, SUBJECTS, run_dir, specs, startup_timeout=60, grace=10, on_started=all_started.set
    )
    async with asyncio.TaskGroup() as tg:
        result = tg.create_task(sup.run())
        # the sleeper never says started: the gang's one started message counts for it
        await asyncio.wait_for(all_started.wait(), 60)
        first = dict(sup.procs)
        os.kill(first["g-node1"].proc.pid, signal.SIGKILL)
        await asyncio.wait_for(seen["g-r1"].wait(), 60)
        await bus.request(f"{SUBJECTS.prefix}.echo.g-r1", Ack(), Ack, timeout=5)
    assert result.result() == 0, sup.reason
    assert set(sup.procs) == {"g", "g-node1", "g-r1", "g-node1-r1"}
    assert first["g"].exit_code == -signal.SIGKILL, "the live member went with the dead one"
    assert sup.procs["g-r1"].spec.argv[-2] == "g-r1" and sup.procs["g-r1"].exit_code == 0
