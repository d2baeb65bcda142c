"""Bus contract tests against a real nats-server (the ``nats_server`` fixture, port 0)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import signal
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack
import nats
import nats.errors
import numpy as np
import pytest
from nats.aio.subscription import Subscription

from asyncrl.runtime.bus import Bus, BusTimeout, Encoded, PayloadTooLarge, RemoteError
from asyncrl.runtime.jetstream import StreamStorageError
from asyncrl.runtime.loop import run_async
from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo, nats_info_for_run
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import (
    SCHEMA_VERSION,
    Ack,
    Array,
    Lease,
    LeaseRequest,
    Metrics,
    Prompt,
    Trajectory,
)

# Guards against a hang, never a measurement: every wait below ends on an event.
WAIT = 10.0


def metrics(step: int, role: str = "trainer") -> Metrics:
    return Metrics(role=role, actor_id="t0", step=step, values={"loss": 0.5, "n": step})


class Inbox:
    """Collects what a handler receives; ``wait(n)`` returns once n have arrived."""

    def __init__(self) -> None:
        self.items: list[Metrics] = []
        self._changed = asyncio.Condition()

    async def __call__(self, msg: Metrics) -> None:
        async with self._changed:
            self.items.append(msg)
            self._changed.notify_all()

    async def wait(self, n: int) -> list[Metrics]:
        async with asyncio.timeout(WAIT), self._changed:
            await self._changed.wait_for(lambda: len(self.items) >= n)
        return self.items


# -- plain subjects ---------------------------------------------------------------------------


async def test_publish_subscribe_typed_round_trip(bus: Bus) -> None:
    inbox = Inbox()
    await bus.subscribe("t.metrics.>", Metrics, inbox)
    sent = [metrics(1), metrics(2, role="rollout")]
    await bus.publish("t.metrics.trainer", sent[0])
    await bus.publish("t.metrics.rollout", sent[1])
    assert await inbox.wait(2) == sent
    assert not bus.errors


async def test_queue_group_delivers_each_message_once(nats_server: NatsInfo, bus: Bus) -> None:
    members = [Inbox(), Inbox()]
    everyone = Inbox()
    async with (
        await Bus.connect(nats_server, name="m0") as b0,
        await Bus.connect(nats_server, name="m1") as b1,
    ):
        await b0.subscribe("t.work", Metrics, members[0], queue="workers")
        await b1.subscribe("t.work", Metrics, members[1], queue="workers")
        await bus.subscribe("t.work", Metrics, everyone)
        for i in range(100):
            await bus.publish("t.work", metrics(i))
        await everyone.wait(100)
        # Each connection delivers in order, so a flush round trip on each member's
        # connection means all its messages have been handed to it.
        await b0.nc.flush()
        await b1.nc.flush()
        steps = sorted(m.step for inbox in members for m in inbox.items)
        assert steps == list(range(100))
        assert all(inbox.items for inbox in members), "the group should share the work"


async def test_bad_payloads_are_counted_and_dropped_subscription_lives(bus: Bus) -> None:
    inbox = Inbox()
    await bus.subscribe("t.in", Metrics, inbox)
    bad = {
        "garbage": b"\xc1 not msgpack",
        "schema_version": msgpack.packb({"k": "metrics", "v": SCHEMA_VERSION + 1, "d": {}}),
        "kind": encode(Ack()),
        "invalid": msgpack.packb({"k": "metrics", "v": SCHEMA_VERSION, "d": {"role": 3}}),
    }
    for payload in bad.values():
        await bus.nc.publish("t.in", payload)
    await bus.publish("t.in", metrics(7))
    assert [m.step for m in await inbox.wait(1)] == [7]
    assert {k: v for k, v in bus.errors.items() if k.startswith("decode:")} == {
        f"decode:{reason}": 1 for reason in bad
    }


async def test_handler_exception_is_counted_and_subscription_lives(bus: Bus) -> None:
    inbox = Inbox()

    async def fragile(msg: Metrics) -> None:
        if msg.step == 0:
            raise ValueError("boom")
        await inbox(msg)

    await bus.subscribe("t.fragile", Metrics, fragile)
    for i in range(3):
        await bus.publish("t.fragile", metrics(i))
    assert [m.step for m in await inbox.wait(2)] == [1, 2]
    assert bus.errors["handler:Metrics"] == 1


async def test_oversized_payload_is_refused_with_a_clear_error(bus: Bus) -> None:
    inbox = Inbox()
    await bus.subscribe("t.big", Metrics, inbox)
    big = Prompt(uid="p", data={"blob": b"x" * (bus.max_payload + 1)})
    with pytest.raises(PayloadTooLarge) as err:
        await bus.publish("t.big", big)
    text = str(err.value)
    assert "t.big" in text and str(bus.max_payload) in text and "max_payload" in text
    assert err.value.size > bus.max_payload
    with pytest.raises(PayloadTooLarge):
        await bus.request("t.big", big, Ack, timeout=1)
    await bus.ensure_stream("BIG", ["t.js.big"])
    with pytest.raises(PayloadTooLarge):
        await bus.js_publish("t.js.big", big, msg_id="big")
    # The connection is unharmed and nothing oversized was half-sent.
    await bus.publish("t.big", metrics(1))
    assert [m.step for m in await inbox.wait(1)] == [1]


async def test_a_stream_beyond_the_servers_storage_is_a_clear_error(bus: Bus) -> None:
    # an exbibyte: more than any disk, so the server refuses to reserve it
    with pytest.raises(StreamStorageError) as err:
        await bus.ensure_stream("HUGE", ["t.js.huge"], max_bytes=1 << 60)
    text = str(err.value)
    assert "'HUGE'" in text and "GiB" in text and "free space" in text
    # the bus goes on: a stream the disk can hold is made and stores
    await bus.ensure_stream("SMALL", ["t.js.small"], max_bytes=1 << 20)
    assert await bus.js_publish("t.js.small", metrics(1), msg_id="one") == 1


# -- request / reply --------------------------------------------------------------------------


def test_closing_after_the_server_was_killed_with_publishes_waiting(tmp_path: Path) -> None:
    """A run's last act, closing its bus, just after its server died (a kill -9 at the end
    of a run): the publishes buffered for a reconnection cannot be sent, and closing says
    so instead of raising. On the loop the actors and ``asyncrl up`` run on (uvloop), where
    flushing them into the dead socket raised."""

    async def kill_then_close() -> bool:
        async with EmbeddedNats(tmp_path / "run") as server:
            bus = await Bus.connect(server.info, name="test")
            assert server.pid is not None
            os.kill(server.pid, signal.SIGKILL)
            await asyncio.sleep(0.05)  # the client has seen the socket go and reconnects
            for _ in range(5):
                with contextlib.suppress(nats.errors.Error):
                    await bus.nc.publish("x.y", b"waits for a server that is gone")
            await bus.close()
            await bus.close()  # idempotent still
            return bus.nc.is_closed

    assert run_async(kill_then_close())


async def test_request_reply_round_trip(bus: Bus) -> None:
    async def grant(req: LeaseRequest) -> Lease:
        prompts = [Prompt(uid=f"q{i}", data={"q": i}) for i in range(req.max_episodes)]
        return Lease(lease_id="L1", actor_id=req.actor_id, version=3, prompts=prompts)

    await bus.serve("t.lease", LeaseRequest, grant, queue="buffer")
    lease = await bus.request(
        "t.lease", LeaseRequest(actor_id="r0", max_episodes=2), Lease, timeout=WAIT
    )
    assert lease.actor_id == "r0" and [p.uid for p in lease.prompts] == ["q0", "q1"]


async def test_a_reply_encoded_by_its_handler_is_sent_as_it_is(bus: Bus) -> None:
    lease = Lease(lease_id="L2", actor_id="r0", version=1, prompts=[Prompt(uid="q", data={})])
    data = encode(lease)

    async def grant(_: LeaseRequest) -> Encoded:
        return Encoded(data)

    await bus.serve("t.encoded", LeaseRequest, grant)
    req = LeaseRequest(actor_id="r0", max_episodes=1)
    assert await bus.request("t.encoded", req, Lease, timeout=WAIT) == lease


async def test_request_timeout_and_no_responders_raise_bus_timeout(bus: Bus) -> None:
    with pytest.raises(BusTimeout, match="no responders"):
        await bus.request("t.nobody", metrics(0), Ack, timeout=WAIT)

    release = asyncio.Event()

    async def stuck(_: Metrics) -> Ack:
        await release.wait()
        return Ack()

    await bus.serve("t.slow", Metrics, stuck)
    with pytest.raises(BusTimeout, match="within"):
        await bus.request("t.slow", metrics(0), Ack, timeout=0.2)
    assert isinstance(BusTimeout("x"), TimeoutError)
    release.set()


async def test_a_concurrent_serve_answers_requests_behind_one_that_waits(
    nats_server: NatsInfo, bus: Bus
) -> None:
    release = asyncio.Event()

    async def held(req: LeaseRequest) -> Lease:
        if req.wait:
            await release.wait()  # a long poll: answered when something frees
        return Lease(lease_id=req.request_id, actor_id=req.actor_id, version=0)

    await bus.serve("t.held", LeaseRequest, held, concurrent=True)

    def ask(actor: str, wait: float) -> Awaitable[Lease]:
        req = LeaseRequest(actor_id=actor, max_episodes=1, request_id=actor, wait=wait)
        return bus.request("t.held", req, Lease, timeout=WAIT)

    first = asyncio.create_task(ask("r0", 1.0))
    assert (await ask("r1", 0.0)).lease_id == "r1"  # not behind r0
    assert not first.done()
    release.set()
    assert (await first).lease_id == "r0"

    # a request still being answered when the responder's bus closes is answered first
    release.clear()
    async with await Bus.connect(nats_server, name="responder") as responder:
        await responder.serve("t.late", LeaseRequest, held, concurrent=True)
        late = asyncio.create_task(
            bus.request(
                "t.late",
                LeaseRequest(actor_id="r2", max_episodes=1, request_id="r2", wait=1.0),
                Lease,
                timeout=WAIT,
            )
        )
        async with asyncio.timeout(WAIT):
            while not responder._answering:  # noqa: ASYNC110 - the request is in
                await asyncio.sleep(0.01)
        closing = asyncio.create_task(responder.close())
        await asyncio.sleep(0.05)
        assert not closing.done()  # waits for the answer being made
        release.set()
        await closing
    assert (await late).lease_id == "r2"


async def test_serve_answers_failures_with_a_remote_error(bus: Bus) -> None:
    async def picky(req: LeaseRequest) -> Lease:
        raise RuntimeError(f"no capacity for {req.actor_id}")

    await bus.serve("t.picky", LeaseRequest, picky)
    with pytest.raises(RemoteError, match="no capacity for r9"):
        await bus.request(
            "t.picky", LeaseRequest(actor_id="r9", max_episodes=1), Lease, timeout=WAIT
        )
    with pytest.raises(RemoteError, match="bad request"):
        await bus.request("t.picky", metrics(0), Lease, timeout=WAIT)
    assert bus.errors["handler:LeaseRequest"] == 1
    assert bus.errors["decode:kind"] == 1

    async def bloated(_: Metrics) -> Prompt:
        return Prompt(uid="p", data={"blob": b"x" * (bus.max_payload + 1)})

    await bus.serve("t.bloated", Metrics, bloated)
    with pytest.raises(RemoteError, match="max_payload"):
        await bus.request("t.bloated", metrics(0), Prompt, timeout=WAIT)
    assert bus.errors["serve:too_large"] == 1


# -- JetStream ---------------------------------------------------------------------------------


async def test_js_same_msg_id_is_stored_once(bus: Bus) -> None:
    await bus.ensure_stream("DEDUP", ["t.dedup"])
    await bus.ensure_stream("DEDUP", ["t.dedup"])  # idempotent
    first = await bus.js_publish("t.dedup", metrics(1), msg_id="sample-1")
    again = await bus.js_publish("t.dedup", metrics(1), msg_id="sample-1")
    other = await bus.js_publish("t.dedup", metrics(2), msg_id="sample-2")
    assert first == again and other == first + 1
    assert (await bus.js.stream_info("DEDUP")).state.messages == 2


async def test_ensure_stream_updates_a_changed_config(bus: Bus) -> None:
    await bus.ensure_stream("UPD", ["t.upd"])
    await bus.ensure_stream("UPD", ["t.upd"], max_bytes=1 << 20)
    assert (await bus.js.stream_info("UPD")).config.max_bytes == 1 << 20


async def test_js_consume_acks_after_handler_and_shares_a_durable(
    nats_server: NatsInfo, bus: Bus
) -> None:
    await bus.ensure_stream("WORK", ["t.work.>"])
    everyone = Inbox()
    shares: list[list[int]] = [[], []]

    def member(share: list[int]) -> Callable[[Metrics], Awaitable[None]]:
        async def handle(msg: Metrics) -> None:
            share.append(msg.step)
            await everyone(msg)

        return handle

    async with (
        await Bus.connect(nats_server, name="w0") as b0,
        await Bus.connect(nats_server, name="w1") as b1,
        asyncio.TaskGroup() as tg,
    ):
        consumers = [
            await b.js_consume("WORK", "t.work.raw", "workers", Metrics, member(share), batch=4)
            for b, share in zip((b0, b1), shares, strict=True)
        ]
        for c in consumers:
            tg.create_task(c.run())
        for i in range(40):
            await bus.js_publish("t.work.raw", metrics(i), msg_id=str(i))
        await everyone.wait(40)
        for c in consumers:
            await c.stop()
    assert sorted(shares[0] + shares[1]) == list(range(40))
    assert sum(c.acked for c in consumers) == 40


async def test_js_redelivery_after_a_consumer_dies_without_acking(
    nats_server: NatsInfo, bus: Bus
) -> None:
    await bus.ensure_stream("TRAJ", ["t.traj"])
    got_it = asyncio.Event()

    async def hang(_: Metrics) -> None:
        got_it.set()
        await asyncio.Event().wait()  # never returns: the process "dies" holding it

    doomed = await Bus.connect(nats_server, name="doomed")
    consumer = await doomed.js_consume("TRAJ", "t.traj", "scorer", Metrics, hang, ack_wait=1.0)
    await bus.js_publish("t.traj", metrics(42), msg_id="m42")
    with pytest.raises(ExceptionGroup) as died:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(consumer.run())
            async with asyncio.timeout(WAIT):
                await got_it.wait()
            # Death: the connection goes away with the message unacked and no nak sent.
            await doomed.nc.close()
    assert died.value.subgroup(nats.errors.ConnectionClosedError) is not None
    assert consumer.acked == 0

    inbox = Inbox()
    heir = await bus.js_consume("TRAJ", "t.traj", "scorer", Metrics, inbox, ack_wait=1.0)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(heir.run())
        assert [m.step for m in await inbox.wait(1)] == [42]  # after ack_wait ran out
        await heir.stop()
    assert heir.acked == 1


async def test_js_cancelled_consumer_hands_its_message_back(bus: Bus) -> None:
    await bus.ensure_stream("HB", ["t.hb"])
    got_it = asyncio.Event()

    async def hang(_: Metrics) -> None:
        got_it.set()
        await asyncio.Event().wait()

    # ack_wait is long: only the nak on cancellation can bring the message back in time.
    first = await bus.js_consume("HB", "t.hb", "d", Metrics, hang, ack_wait=60.0)
    await bus.js_publish("t.hb", metrics(5), msg_id="m5")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(first.run())
        async with asyncio.timeout(WAIT):
            await got_it.wait()
        task.cancel()
    inbox = Inbox()
    second = await bus.js_consume("HB", "t.hb", "d", Metrics, inbox, ack_wait=60.0)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(second.run())
        assert [m.step for m in await inbox.wait(1)] == [5]
        await second.stop()


@pytest.mark.parametrize("end", ["cancel", "stop"])
async def test_a_consumer_that_ends_hands_every_held_message_to_the_next_at_once(
    bus: Bus, end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four handlers hang on four messages and the consumer ends (cancelled, or stopped).
    Its pull request is still open on the server, asking for twelve more: a message nak'ed
    before that request's inbox is withdrawn is redelivered into that request, which the
    ended consumer no longer reads, and waits out ack_wait (60 s here). Every message must
    reach the next consumer at once, whichever order the consumer's own tasks end in: here
    the inbox is withdrawn late, as when the handlers' cancellations run before the pull
    loop's."""
    withdraw = Subscription.unsubscribe

    async def late(sub: Subscription, limit: int = 0) -> None:
        await asyncio.sleep(0.3)
        await withdraw(sub, limit)

    monkeypatch.setattr(Subscription, "unsubscribe", late)
    await bus.ensure_stream("HELD", ["t.held"])
    hung = asyncio.Semaphore(0)

    async def hang(_: Metrics) -> None:
        hung.release()
        await asyncio.Event().wait()

    first = await bus.js_consume(
        "HELD", "t.held", "d", Metrics, hang, ack_wait=60.0, batch=16, concurrency=4
    )
    for step in range(4):
        await bus.js_publish("t.held", metrics(step), msg_id=f"h{step}")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(first.run())
        async with asyncio.timeout(WAIT):
            for _ in range(4):
                await hung.acquire()
        if end == "cancel":
            task.cancel()
        else:
            await first.stop()
    inbox = Inbox()
    second = await bus.js_consume("HELD", "t.held", "d", Metrics, inbox, ack_wait=60.0)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(second.run())
        assert sorted(m.step for m in await inbox.wait(4)) == [0, 1, 2, 3]
        await second.stop()
    assert first.acked == 0 and second.acked == 4


async def test_js_consumer_ends_even_if_a_handler_swallows_its_cancellation(bus: Bus) -> None:
    """A handler that catches the cancellation and returns (as Python 3.11's
    ``asyncio.wait_for`` can, when a result and the cancel arrive together) must not keep
    the consumer's worker looping: the stop then waits on it forever (a reward actor sat out
    the supervisor's whole grace that way)."""
    await bus.ensure_stream("SWALLOW", ["t.swallow"])
    got_it = asyncio.Event()

    async def swallow(_: Metrics) -> None:
        got_it.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()

    consumer = await bus.js_consume("SWALLOW", "t.swallow", "d", Metrics, swallow)
    await bus.js_publish("t.swallow", metrics(1), msg_id="s1")
    task = asyncio.create_task(consumer.run())
    async with asyncio.timeout(WAIT):
        await got_it.wait()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=WAIT)
    assert done == {task}, "the consumer kept running after its cancellation"


async def test_js_failed_handler_naks_and_bad_payload_is_terminated(bus: Bus) -> None:
    await bus.ensure_stream("RETRY", ["t.retry"])
    inbox = Inbox()
    failures = 0

    async def flaky(msg: Metrics) -> None:
        nonlocal failures
        if msg.step == 1 and failures == 0:
            failures += 1
            raise RuntimeError("transient")
        await inbox(msg)

    consumer = await bus.js_consume("RETRY", "t.retry", "d", Metrics, flaky, nak_delay=0.05)
    await bus.js.publish("t.retry", b"\x00\xffgarbage", headers={"Nats-Msg-Id": "g"})
    await bus.js_publish("t.retry", metrics(1), msg_id="m1")
    await bus.js_publish("t.retry", metrics(2), msg_id="m2")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(consumer.run())
        assert sorted(m.step for m in await inbox.wait(2)) == [1, 2]
        await consumer.stop()
    assert bus.errors["handler:Metrics"] == 1
    assert bus.errors["decode:garbage"] == 1
    assert consumer.acked == 2


async def test_js_consumer_outlives_idle_pull_expiries(bus: Bus) -> None:
    await bus.ensure_stream("IDLE", ["t.idle"])
    inbox = Inbox()
    consumer = await bus.js_consume("IDLE", "t.idle", "d", Metrics, inbox)
    consumer.pull_expires = 0.05  # the server ends each idle pull with a 408 status
    async with asyncio.TaskGroup() as tg:
        tg.create_task(consumer.run())
        await bus.js_publish("t.idle", metrics(1), msg_id="1")
        await inbox.wait(1)
        pulls = consumer.pull_requests
        await asyncio.sleep(0.3)  # time passing, not a wait for a state: pulls expire
        assert consumer.pull_requests > pulls  # each expiry was followed by a new pull
        await bus.js_publish("t.idle", metrics(2), msg_id="2")
        assert [m.step for m in await inbox.wait(2)] == [1, 2]
        await consumer.stop()


async def test_js_stop_before_run_and_single_use(bus: Bus) -> None:
    await bus.ensure_stream("ONCE", ["t.once"])
    consumer = await bus.js_consume("ONCE", "t.once", "d", Metrics, Inbox())
    await consumer.stop()  # never ran: nothing to wait for
    await consumer.run()  # returns at once: it was stopped
    with pytest.raises(RuntimeError, match="single use"):
        await consumer.run()


# -- object store ------------------------------------------------------------------------------


async def test_object_store_round_trip_64mb(bus: Bus, tmp_path: Path) -> None:
    blob = np.random.default_rng(0).bytes(64 * 1024 * 1024 + 123)
    src = tmp_path / "weights.bin"
    src.write_bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    assert await bus.put_blob("weights", "v1/model.safetensors", src) == len(blob)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    assert await bus.get_blob("weights", "v1/model.safetensors", out) == len(blob)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest
    assert os.listdir(out.parent) == ["model.safetensors"]  # no leftover partial file


async def test_object_store_bytes_streams_delete_and_missing(bus: Bus) -> None:
    assert await bus.put_blob("b", "k", b"hello") == 5
    assert await bus.put_blob("b", "k", io.BytesIO(b"hello again")) == 11  # replaces
    buf = io.BytesIO()
    assert await bus.get_blob("b", "k", buf) == 11
    assert buf.getvalue() == b"hello again"
    assert await bus.put_blob("b", "empty", b"") == 0
    empty = io.BytesIO()
    assert await bus.get_blob("b", "empty", empty) == 0 and empty.getvalue() == b""
    await bus.delete_blob("b", "k")
    await bus.delete_blob("b", "k")  # idempotent
    await bus.delete_blob("no_such_bucket", "k")
    with pytest.raises(FileNotFoundError):
        await bus.get_blob("b", "k", io.BytesIO())
    with pytest.raises(FileNotFoundError):
        await bus.get_blob("no_such_bucket", "k", io.BytesIO())


async def test_object_store_missing_chunks_fail_loudly(bus: Bus) -> None:
    await bus.put_blob("b", "k", b"x" * 1000)
    store = await bus.js.object_store("b")
    info = await store.get_info("k")
    await bus.js.purge_stream("OBJ_b", subject=f"$O.b.C.{info.nuid}")
    with pytest.raises(RuntimeError, match="missing"):
        await bus.get_blob("b", "k", io.BytesIO())


# -- embedded server ---------------------------------------------------------------------------


async def test_client_without_the_token_is_refused(nats_server: NatsInfo) -> None:
    assert nats_server.token
    for info in (NatsInfo(nats_server.url), NatsInfo(nats_server.url, token="wrong")):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await Bus.connect(info)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.url, allow_reconnect=False, max_reconnect_attempts=1)


async def test_nats_json_is_private_and_names_the_server(embedded_nats: EmbeddedNats) -> None:
    path = embedded_nats.run_dir / "nats.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert nats_info_for_run(embedded_nats.run_dir) == embedded_nats.info
    assert embedded_nats.info.url.startswith("nats://127.0.0.1:")
    token = embedded_nats.info.token
    assert token and token not in repr(embedded_nats.info)
    conf = embedded_nats.store_dir / "nats-server.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # it holds the token too


def test_nats_info_write_never_widens_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "nats.json"
    path.write_text("{}")
    path.chmod(0o644)
    NatsInfo("nats://u:p@example:4222").write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    info = NatsInfo.read(path)
    assert info.token is None and info.redacted_url == "nats://***@example:4222"
    with pytest.raises(FileNotFoundError, match="asyncrl up"):
        nats_info_for_run(tmp_path / "nowhere")


async def test_server_stops_cleanly(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "run")
    info = await server.start()
    b = await Bus.connect(info)
    await b.ensure_stream("S", ["t.s"])
    await b.js_publish("t.s", metrics(1), msg_id="1")
    await b.close()
    await server.stop()
    assert server.returncode == 0
    assert (tmp_path / "run" / "nats" / "jetstream").is_dir()  # the store stays in the run
    with pytest.raises((OSError, nats.errors.Error)):
        await Bus.connect(info)  # nobody listens on that port any more
    await server.stop()  # idempotent


async def test_a_server_that_dies_at_start_fails_start_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="max_payload"):
        EmbeddedNats(tmp_path, max_payload=0)
    monkeypatch.setenv("ASYNCRL_NATS_SERVER", "/bin/false")
    server = EmbeddedNats(tmp_path / "run")
    with pytest.raises(RuntimeError, match="exited with status 1"):
        await server.start()
    assert not (tmp_path / "run" / "nats.json").exists()


async def test_trajectory_crosses_the_bus_intact(bus: Bus) -> None:
    got: list[Trajectory] = []
    done = asyncio.Event()

    async def keep(t: Trajectory) -> None:
        got.append(t)
        done.set()

    await bus.subscribe("t.traj.plain", Trajectory, keep)
    n = 17
    t = Trajectory(
        uid="p/0",
        prompt_uid="p",
        group_index=0,
        group_size=4,
        input_ids=Array.of(np.arange(n, dtype=np.int32)),
        loss_mask=Array.of(np.arange(n) > 5),
        logprobs=Array.of(np.linspace(-3, 0, n, dtype=np.float32)),
        versions=Array.of(np.full(n, 2, dtype=np.int32)),
    )
    await bus.publish("t.traj.plain", t)
    async with asyncio.timeout(WAIT):
        await done.wait()
    assert got == [t]
    np.testing.assert_array_equal(got[0].logprobs.numpy(), t.logprobs.numpy())
