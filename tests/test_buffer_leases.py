"""A budget that never leaks: lost lease replies, lost aborts, and leases an actor does
not know of all end with the buffer's ``running`` back at 0."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actor_helpers.buffer_kit import LossyBus, context, recipe, running_buffer
from test_buffer import lease, make_buffer

from asyncrl.actors.rollout import RolloutActor
from asyncrl.config.recipe import Recipe
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.messages import (
    Ack,
    ActorExit,
    ActorInfo,
    EpisodeAborted,
    Lease,
    LeaseRequest,
    WeightsUpdated,
)


async def test_a_repeated_request_id_gets_the_same_lease(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    req = LeaseRequest(actor_id="r0", max_episodes=3, request_id="q1")
    first = await buf.on_lease(req)
    again = await buf.on_lease(req)
    assert again == first and buf.staleness.running == 3
    assert buf.counters["lease_repeats"] == 1
    other = await buf.on_lease(LeaseRequest(actor_id="r0", max_episodes=3, request_id="q2"))
    assert other != first and buf.staleness.running == 4  # capacity (1+0+1)·2 = 4


async def test_an_abort_returns_only_the_lease_it_names(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    old = await lease(buf, 1)
    uid = old.prompts[0].uid
    await buf.on_aborted(EpisodeAborted(actor_id="r0", prompt_uid=uid, lease_id=old.lease_id))
    new = await lease(buf, 1)
    assert [p.uid for p in new.prompts] == [uid] and buf.staleness.running == 1
    # a late repeat of the first abort must not take the new lease away
    await buf.on_aborted(EpisodeAborted(actor_id="r0", prompt_uid=uid, lease_id=old.lease_id))
    assert buf.leases.leased[uid].lease_id == new.lease_id and buf.staleness.running == 1
    assert buf.counters["aborted"] == 1


def test_a_lease_its_live_actor_does_not_hold_comes_back_after_the_grace(
    tmp_path: Path,
) -> None:
    buf = make_buffer(tmp_path, "rollout.lease_ttl=10")
    book = buf.leases
    got = book.grant(LeaseRequest(actor_id="r0", max_episodes=2), now=0.0)
    held, lost = (p.uid for p in got.prompts)
    never = lambda uid: False  # noqa: E731 - no scored sample arrived
    assert book.reconcile("r0", [held], 1.0, never) == []  # lost: missing since t=1
    assert book.reconcile("r0", [held], 11.0, never) == []  # 10 s: not yet beyond the grace
    assert book.reconcile("r0", [held], 11.5, never) == [lost]
    assert buf.staleness.running == 1 and list(book.leased) == [held]
    # a prompt whose samples are under way is not the actor's any more, and stays leased
    assert book.reconcile("r0", [], 20.0, lambda uid: uid == held) == []
    assert book.reconcile("r0", [], 40.0, lambda uid: uid == held) == []
    # a heartbeat that says nothing (None) changes nothing
    assert book.reconcile("r0", None, 99.0, never) == []
    assert list(book.leased) == [held]


def test_a_delivered_prompt_keeps_its_lease_while_its_scores_are_on_the_way(
    tmp_path: Path,
) -> None:
    buf = make_buffer(tmp_path, "rollout.lease_ttl=10")
    book = buf.leases
    got = book.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
    uid = got.prompts[0].uid
    never = lambda uid: False  # noqa: E731 - the reward actors are behind
    assert book.reconcile("r0", [], 1.0, never, delivered=[uid]) == []
    # it falls out of the actor's short list of recent deliveries; the lease stays
    assert book.reconcile("r0", [], 60.0, never) == []
    assert list(book.leased) == [uid] and buf.staleness.running == 1
    # another actor's report about it counts for nothing
    other = book.grant(LeaseRequest(actor_id="r1", max_episodes=1), now=0.0).prompts[0].uid
    assert book.reconcile("r0", [], 61.0, never, delivered=[other]) == []
    assert book.reconcile("r1", [], 62.0, never) == []
    assert book.reconcile("r1", [], 73.0, never) == [other]


async def rollout_actor(tmp_path: Path, nats: NatsInfo, r: Recipe) -> RolloutActor:
    """The real rollout actor's lease and abort code, on a bus that loses messages (no
    engine: these paths do not generate)."""
    actor = RolloutActor(context(tmp_path, nats, r, "r0"))
    actor._bus = await LossyBus.connect(nats, name="r0")
    return actor


async def test_lost_lease_reply_and_lost_aborts_leak_nothing(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        actor = await rollout_actor(tmp_path, nats_server, r)
        lossy = actor.bus
        assert isinstance(lossy, LossyBus)
        s = actor.subjects
        try:
            lossy.lose_reply[s.lease] = 1
            got = await actor._ask_for_lease(3)
            assert len(got.prompts) == 3 and actor.counters["lease_timeouts"] == 1
            assert buf.staleness.running == 3, "the retry was granted a second lease"
            assert buf.counters["lease_repeats"] == 1
            assert actor.held == {p.uid for p in got.prompts}
            a, b, c = got.prompts
            lossy.lose_request[s.episode_aborted] = 1  # the abort itself is lost
            await actor._report_abort(a, got.lease_id, "test")
            lossy.lose_reply[s.episode_aborted] = 1  # its acknowledgement is lost
            await actor._report_abort(b, got.lease_id, "test")
            await actor._report_abort(c, got.lease_id, "test")
            assert actor.counters["abort_timeouts"] == 2
            assert buf.staleness.running == 0 and not buf.leases.leased
            assert buf.counters["aborted"] == 3 and not actor.held
        finally:
            await lossy.close()


async def test_a_lease_the_actor_never_got_is_freed_by_its_heartbeats(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    r = recipe("rollout.lease_ttl=0.5")
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        actor = await rollout_actor(tmp_path, nats_server, r)
        actor.ctx.heartbeat_interval = 0.05
        actor.status = "running"
        s = actor.subjects
        # the actor lives and heartbeats all along, holding nothing
        beats = asyncio.create_task(actor._heartbeats())
        try:
            # a lease it never received (a reply lost, no repeat)
            req = LeaseRequest(actor_id="r0", max_episodes=2, request_id="once")
            await bus.request(s.lease, req, Lease, timeout=10)  # the actor never sees it
            assert buf.staleness.running == 2
            async with asyncio.timeout(10):
                # the buffer's state is in this process; heartbeats every 50 ms change it
                while buf.staleness.running != 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert buf.counters["expired_leases"] == 0  # not freed for silence
            assert buf.counters["unheld_leases"] == 2 and not buf.leases.leased
            assert len(buf.leases.source.pool) == 2
        finally:
            beats.cancel()
            await actor.bus.close()


async def test_heartbeats_list_what_the_rollout_actor_holds(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    r = recipe()
    actor = RolloutActor(context(tmp_path, nats_server, r, "r0"))
    actor.held.update({"e0-3", "e0-1"})
    actor.delivered.append("e0-2")
    seen: asyncio.Queue[ActorInfo] = asyncio.Queue(maxsize=1)
    await bus.subscribe(actor.subjects.heartbeat("rollout"), ActorInfo, seen.put)
    await bus.publish(actor.subjects.heartbeat("rollout"), actor.info())
    info = await asyncio.wait_for(seen.get(), 10)
    assert info.holding == ["e0-1", "e0-3"] and info.delivered == ["e0-2"]


async def test_a_held_lease_request_is_granted_as_capacity_frees_the_longest_held_first(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """A request that finds no capacity waits at the buffer (a long poll) instead of
    coming back empty: granted the moment capacity frees, the requests held longest
    first, each at most what it asked; answered with nothing when its wait ends, when its
    actor exits, or when the buffer stops. Requests that do not wait are answered at once
    all along."""
    r = recipe()  # capacity (0 + 1 + 1)·2 = 4
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        s = buf.subjects

        def ask(actor: str, n: int, wait: float) -> asyncio.Task[Lease]:
            req = LeaseRequest(actor_id=actor, max_episodes=n, request_id=actor, wait=wait)
            return asyncio.create_task(bus.request(s.lease, req, Lease, timeout=10))

        async def held(*actors: str) -> None:
            async with asyncio.timeout(10):
                while list(buf._held) != list(actors):  # noqa: ASYNC110 - in this process
                    await asyncio.sleep(0.01)

        first = await ask("r0", 4, 30.0)
        assert len(first.prompts) == 4  # capacity there: answered at once
        r1 = ask("r1", 3, 30.0)
        await held("r1")
        r2 = ask("r2", 3, 30.0)
        await held("r1", "r2")
        now = await ask("r3", 2, 0.0)  # no wait: answered empty at once, past the held
        assert now.prompts == [] and now.retry_after > 0 and not r1.done()

        # a new version frees (1 + 1 + 1)·2 − 4 = 2: all to the longest held, r2 waits on
        await bus.publish(s.weights, WeightsUpdated(version=1, kind="dir", location="w"))
        got = await r1
        assert len(got.prompts) == 2 and got.version == 1 and not r2.done()
        assert buf.counters["held_leases"] == 1
        # an abort frees one more: r2 has it
        aborted = first.prompts[0]
        msg = EpisodeAborted(actor_id="r0", prompt_uid=aborted.uid, lease_id=first.lease_id)
        await bus.request(s.episode_aborted, msg, Ack, timeout=10)
        assert [p.uid for p in (await r2).prompts] == [aborted.uid]
        assert buf.staleness.running == 4 + 2 + 1 - 1 == len(buf.leases.leased)

        # no capacity for its whole wait: answered with nothing, to ask again at once
        late = await ask("r4", 1, 0.2)
        assert late.prompts == [] and late.retry_after == 0 and not buf._held
        # its actor exits: answered with nothing, and nothing is leased to it later
        gone = ask("r5", 2, 30.0)
        await held("r5")
        await bus.publish(s.exited, ActorExit(role="rollout", actor_id="r5", ok=True))
        assert (await gone).prompts == [] and not buf._held
        last = ask("r6", 2, 30.0)
        await held("r6")
    # the buffer stopped: the held request was answered (with nothing) first
    assert (await last).prompts == []
    assert buf.staleness.running == 6
