"""Bad input on every receive path of the bus: nothing dies, and every message that is not
handled is counted under the subscription it came in by and a reason (``Bus.drops``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgpack
import nats.errors
import pytest

from asyncrl.actors.buffer.journal import Journal
from asyncrl.runtime import bus as bus_module
from asyncrl.runtime.bus import Bus, PayloadTooLarge, RemoteError
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import SCHEMA_VERSION, Ack, LeaseRequest, Metrics, Prompt

WAIT = 10.0


def metrics(step: int) -> Metrics:
    return Metrics(role="trainer", actor_id="t0", step=step, values={"loss": 0.5})


# One payload per decode reason, plus the shapes a fuzzer tends to produce.
BAD: dict[str, tuple[str, bytes]] = {
    "random bytes": ("garbage", b"\xc1\x93\xffnot msgpack"),
    "empty": ("garbage", b""),
    "truncated": ("garbage", encode(metrics(1))[:-3]),
    "msgpack list": ("garbage", msgpack.packb([1, "two", None])),
    "msgpack map, no envelope": ("garbage", msgpack.packb({"k": "metrics"})),
    "future schema": (
        "schema_version",
        msgpack.packb({"k": "metrics", "v": SCHEMA_VERSION + 1, "d": {}}),
    ),
    "wrong kind": ("kind", encode(Ack())),
    "wrong fields": ("invalid", msgpack.packb({"k": "metrics", "v": SCHEMA_VERSION, "d": {}})),
}


def expected_drops(pattern: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason, _ in BAD.values():
        out[f"{pattern}/{reason}"] = out.get(f"{pattern}/{reason}", 0) + 1
    return out


async def test_subscribe_counts_drops_by_subscribed_pattern_and_reason(bus: Bus) -> None:
    got: list[int] = []
    last = asyncio.Event()

    async def handler(m: Metrics) -> None:
        if m.step == 0:
            raise ValueError("a handler that fails")
        got.append(m.step)
        last.set()

    await bus.subscribe("t.metrics.*", Metrics, handler)
    # concrete subjects vary; the key is the pattern, so senders cannot grow the keys
    for i, (_, payload) in enumerate(BAD.values()):
        await bus.nc.publish(f"t.metrics.made-up-{i}", payload)
    await bus.publish("t.metrics.x", metrics(0))
    await bus.publish("t.metrics.y", metrics(7))
    async with asyncio.timeout(WAIT):
        await last.wait()
    assert got == [7]
    assert dict(bus.drops) == {**expected_drops("t.metrics.*"), "t.metrics.*/handler": 1}


async def test_serve_counts_bad_requests_and_still_answers(bus: Bus) -> None:
    async def grant(req: LeaseRequest) -> Metrics:
        if req.actor_id == "fail":
            raise ValueError("nothing to lease")
        if req.actor_id == "bloat":
            return Metrics(role="r", actor_id="a", values={"x" * bus.max_payload: 1.0})
        return metrics(1)

    await bus.serve("t.lease", LeaseRequest, grant)
    for _, payload in BAD.values():
        reply = await bus.nc.request("t.lease", payload, timeout=WAIT)
        with pytest.raises(RemoteError, match="bad request"):
            await bus.request("t.lease", Ack(), LeaseRequest, timeout=WAIT)  # kind mismatch
        assert b"bad request" in reply.data
    await bus.nc.publish("t.lease", encode(LeaseRequest(actor_id="r", max_episodes=1)))  # no reply
    with pytest.raises(RemoteError, match="nothing to lease"):
        await bus.request(
            "t.lease", LeaseRequest(actor_id="fail", max_episodes=1), Metrics, timeout=WAIT
        )
    with pytest.raises(RemoteError, match="max_payload"):
        await bus.request(
            "t.lease", LeaseRequest(actor_id="bloat", max_episodes=1), Metrics, timeout=WAIT
        )
    ok = await bus.request(
        "t.lease", LeaseRequest(actor_id="r", max_episodes=1), Metrics, timeout=WAIT
    )
    assert ok.step == 1
    want = expected_drops("t.lease")
    del want["t.lease/invalid"]  # "wrong fields" is a metrics envelope: here a wrong kind
    want["t.lease/kind"] += 1 + len(BAD)  # and the typed requests of the wrong kind
    want |= {"t.lease/no_reply": 1, "t.lease/handler": 1, "t.lease/reply_too_large": 1}
    assert dict(bus.drops) == want


async def test_jetstream_consumer_terminates_and_counts_what_does_not_decode(bus: Bus) -> None:
    await bus.ensure_stream("FUZZ", ["t.js.>"], retention="workqueue")
    got: list[int] = []
    last = asyncio.Event()

    async def handler(m: Metrics) -> None:
        got.append(m.step)
        last.set()

    consumer = await bus.js_consume("FUZZ", "t.js.in", "c", Metrics, handler, ack_wait=2.0)
    for _, payload in BAD.values():
        await bus.js.publish("t.js.in", payload)
    await bus.js_publish("t.js.in", metrics(3), msg_id="good")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(consumer.run())
        async with asyncio.timeout(WAIT):
            await last.wait()
        await consumer.stop()
    assert got == [3]
    assert dict(bus.drops) == expected_drops("t.js.in")
    # terminated, not left to come back after ack_wait, and gone from the work queue (the
    # server applies acks apart from its API requests: ask until it has)
    async with asyncio.timeout(WAIT):
        while (info := await bus.js.consumer_info("FUZZ", "c")).num_ack_pending:  # noqa: ASYNC110 - a server state, no event
            await asyncio.sleep(0.05)
    assert info.num_pending == 0 and info.num_redelivered == 0
    assert (await bus.js.stream_info("FUZZ")).state.messages == 0


async def test_a_slow_consumer_loss_is_counted(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """NATS drops what a stuck handler's subscription cannot buffer; each loss is counted
    under the subscription, and handled + dropped accounts for everything sent."""
    monkeypatch.setattr(bus_module, "SUB_PENDING_MSGS", 4)
    release, all_in = asyncio.Event(), asyncio.Event()
    handled: list[int] = []
    lost = bus.drops.__getitem__

    async def stuck(m: Metrics) -> None:
        await release.wait()
        handled.append(m.step)
        if len(handled) + lost("t.slow/slow_consumer") == 50:
            all_in.set()

    await bus.subscribe("t.slow", Metrics, stuck)
    for i in range(50):
        await bus.publish("t.slow", metrics(i))
    # the server sends our messages before the flush's answer: once it is back, each one
    # is either queued for the handler or dropped (and counted)
    await bus.nc.flush()
    # nats-py reports each loss through the error callback from a task of its own, so the
    # count may trail the flush by a few loop turns
    async with asyncio.timeout(WAIT):
        while lost("t.slow/slow_consumer") < 50 - 5:  # noqa: ASYNC110 - 4 pending + 1 in the handler
            await asyncio.sleep(0.01)
    release.set()
    async with asyncio.timeout(WAIT):
        await all_in.wait()
    assert handled == sorted(handled) and len(handled) <= 5


async def test_an_oversized_publish_raises_and_nothing_arrives(bus: Bus) -> None:
    got: list[int] = []
    last = asyncio.Event()

    async def handler(m: Metrics) -> None:
        got.append(m.step)
        last.set()

    await bus.subscribe("t.big", Metrics, handler)
    big = Metrics(role="r", actor_id="a", values={"x": 1.0}, step=-1)
    big_payload = encode(big) + b"\x00" * bus.max_payload
    with pytest.raises(PayloadTooLarge):
        await bus.publish("t.big", Prompt(uid="p", data={"b": b"x" * bus.max_payload}))
    with pytest.raises(nats.errors.MaxPayloadError):
        await bus.nc.publish("t.big", big_payload)  # the raw client refuses it too
    await bus.publish("t.big", metrics(5))
    async with asyncio.timeout(WAIT):
        await last.wait()
    assert got == [5] and not bus.drops


def test_the_buffer_journal_counts_what_arrives_after_it_closed(tmp_path: Path) -> None:
    """The buffer closes its journal in teardown, while its bus may still deliver: such an
    event is counted, not an I/O error on a closed file."""
    journal = Journal(tmp_path / "events.jsonl")
    journal.event("lease", prompt="p0")
    journal.close()
    journal.event("return", prompt="p0")
    journal.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["lease"]
    assert journal.counters["events_after_close"] == 1
