"""10,000 bad messages over every subject of a live ``asyncrl up`` run: no actor exits, the
run goes on, and the drop counters the actors report account for every message.

The fuzz comes from this test's own connection only, so what each actor must have dropped
follows from its subscriptions (:data:`SUBSCRIPTIONS`) and what was sent where. Every
payload is checked not to be a valid message of any kind before it is sent (a random
draw can be one: an empty body is a whole ``Ack``): a fuzzed ``control`` payload must
never be a real ``stop``.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from pathlib import Path

import msgpack
import nats.errors
import pytest
from e2e_kit import running_up
from test_e2e import connect, read_jsonl

from asyncrl.runtime.bus import Bus, PayloadTooLarge
from asyncrl.wire.codec import DecodeError, decode_any, encode
from asyncrl.wire.messages import (
    SCHEMA_VERSION,
    Ack,
    ActorExit,
    ActorInfo,
    BatchRequest,
    Control,
    EpisodeAborted,
    LeaseRequest,
    Message,
    Metrics,
    Prompt,
    WeightsQuery,
    WeightsUpdated,
)
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow

N_MESSAGES = 10_000
SEED = 1234

# What each actor of recipes/ci.toml subscribes to, relative to the run's prefix (the
# keys of its drop counters): the actors' setup() calls, and the control subject of all.
SUBSCRIPTIONS: dict[str, list[str]] = {
    "buffer-0": [
        "control",
        "buffer.lease",
        "buffer.batch",
        "buffer.weights",
        "buffer.aborted",
        "weights",
        "actor.heartbeat.rollout",
        "actor.exit",
        "traj.scored",
        "traj.scored_groups",
    ],
    "reward-0": ["control", "traj.raw", "traj.raw_groups"],
    "rollout-0": ["control", "weights"],
    "eval-0": ["control", "weights"],
    "trainer-0": ["control", "actor.heartbeat.*", "metrics.rollout"],
}
# This test's own subscriptions: its bus counts the fuzz it receives like any other.
OWN_SUBSCRIPTIONS = ["actor.heartbeat.*", "actor.exit", "metrics.trainer"]
REQUEST_SUBJECTS = {"buffer.lease", "buffer.batch", "buffer.weights", "buffer.aborted"}
JETSTREAM_SUBJECTS = {"traj.raw", "traj.raw_groups", "traj.scored", "traj.scored_groups"}
# Every subject of a run (asyncrl.wire.subjects), the request subjects included; the
# heartbeat and metrics subjects once per role and once for a role nobody has.
FUZZED_SUBJECTS = sorted(
    {
        "control",
        "actor.started",
        "actor.exit",
        *(f"actor.heartbeat.{r}" for r in ("buffer", "reward", "rollout", "trainer", "eval", "x")),
        *(f"metrics.{r}" for r in ("buffer", "reward", "rollout", "trainer", "eval", "x")),
        "weights",
        "rollout.memory",
        "rollout.memory.released",
        *REQUEST_SUBJECTS,
        *JETSTREAM_SUBJECTS,
    }
)
DECODE_REASONS = {"garbage", "schema_version", "kind", "invalid"}

# Valid messages, to truncate and to re-stamp with a wrong schema version.
SEEDS: list[Message] = [
    Control(command="stop"),
    Control(command="stop", target="trainer-0", reason="fuzz"),
    ActorExit(role="trainer", actor_id="trainer-0", ok=False, reason="fuzz"),
    ActorInfo(role="rollout", actor_id="rollout-0", pid=1, host="h", holding=["p1"]),
    Metrics(role="rollout", actor_id="rollout-0", step=3, values={"tokens": 1.0}),
    LeaseRequest(actor_id="rollout-0", max_episodes=4),
    EpisodeAborted(actor_id="rollout-0", prompt_uid="p", lease_id="L"),
    BatchRequest(step=1, version=0),
    WeightsQuery(actor_id="rollout-0"),
    WeightsUpdated(version=99, kind="dir", location="/nonexistent"),
    Ack(ok=True),
]
KINDS = [m.KIND for m in SEEDS]


def _junk(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack-able value."""
    pick = rng.randrange(7 if depth < 3 else 4)
    if pick == 0:
        return rng.randint(-(2**40), 2**40)
    if pick == 1:
        return rng.random()
    if pick == 2:
        return "".join(rng.choice("abc/.*> \x00é") for _ in range(rng.randrange(12)))
    if pick == 3:
        return rng.choice([None, True, False, b"\xff\x00"])
    if pick == 4:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if pick == 5:
        return {str(_junk(rng, 3)): _junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    return {"k": rng.choice(KINDS), "v": SCHEMA_VERSION, "d": _junk(rng, depth + 1)}


def fuzz_payload(rng: random.Random, category: str) -> bytes:
    """A payload of ``category`` that is no valid message of any kind: a draw that happens
    to be one (``{"k": "ack", "v": 1, "d": {}}`` is a whole Ack) is drawn again."""
    while True:
        payload = _draw(rng, category)
        try:
            decode_any(payload)
        except DecodeError:
            return payload


def _draw(rng: random.Random, category: str) -> bytes:
    if category == "random bytes":
        return rng.randbytes(rng.randrange(1, 300))
    if category == "empty":
        return b""
    if category == "wrong shape":
        if rng.random() < 0.5:
            return msgpack.packb(_junk(rng))
        # a real kind and schema version, with fields that are not its fields
        body = {f"fuzz_{rng.randrange(100)}": _junk(rng)}
        return msgpack.packb({"k": rng.choice(KINDS), "v": SCHEMA_VERSION, "d": body})
    seed = rng.choice(SEEDS)
    if category == "truncated":
        data = encode(seed)
        return data[: rng.randrange(len(data))]
    assert category == "schema version"
    version = rng.choice([0, SCHEMA_VERSION + 1, -1, 2**31, "1"])
    return msgpack.packb({"k": seed.KIND, "v": version, "d": seed.model_dump()})


CATEGORIES = ["random bytes", "empty", "wrong shape", "truncated", "schema version"]


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def by_pattern(drops: dict[str, int]) -> Counter[str]:
    """``{"<pattern>/<reason>": n}`` summed over the reasons."""
    out: Counter[str] = Counter()
    for key, n in drops.items():
        pattern, reason = key.rsplit("/", 1)
        assert reason in DECODE_REASONS | {"no_reply"}, key
        out[pattern] += n
    return out


class Watch:
    """The run as this test sees it: latest heartbeat per actor, exits, trainer step."""

    def __init__(self) -> None:
        self.heartbeats: dict[str, ActorInfo] = {}
        self.exits: list[ActorExit] = []
        self.replies: list[Ack] = []
        self.step = 0
        self.changed = asyncio.Condition()

    async def on_heartbeat(self, info: ActorInfo) -> None:
        async with self.changed:
            self.heartbeats[info.actor_id] = info
            self.changed.notify_all()

    async def on_exit(self, msg: ActorExit) -> None:
        self.exits.append(msg)

    async def on_reply(self, ack: Ack) -> None:
        async with self.changed:
            self.replies.append(ack)
            self.changed.notify_all()

    async def on_metrics(self, m: Metrics) -> None:
        async with self.changed:
            self.step = max(self.step, m.step)
            self.changed.notify_all()

    async def wait(self, what: object, timeout: float) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout), self.changed:
            await self.changed.wait_for(what)  # type: ignore[arg-type]


async def fuzz(bus: Bus, s: Subjects, reply_inbox: str) -> tuple[Counter[str], int, int]:
    """Sends the fuzz; returns what arrived on the server by subject (relative) and
    reason-free, how many requests carried a reply subject, and how many oversized
    messages were refused before they were sent."""
    rng = random.Random(SEED)
    sent: Counter[str] = Counter()
    with_reply = refused = 0
    big = b"x" * (bus.max_payload + 1)
    for i in range(N_MESSAGES):
        rel = FUZZED_SUBJECTS[i % len(FUZZED_SUBJECTS)]
        subject = f"{s.prefix}.{rel}"
        if i % 100 == 99:  # oversized: refused by the sending side, never on the wire
            with pytest.raises((PayloadTooLarge, nats.errors.MaxPayloadError)):
                if rel in JETSTREAM_SUBJECTS:
                    await bus.js_publish(subject, Prompt(uid="p", data={"b": big}), msg_id=str(i))
                elif i % 200 == 99:
                    await bus.publish(subject, Prompt(uid="p", data={"b": big}))
                else:
                    await bus.nc.publish(subject, big)
            refused += 1
            continue
        payload = fuzz_payload(rng, CATEGORIES[rng.randrange(len(CATEGORIES))])
        if rel in JETSTREAM_SUBJECTS:
            await bus.js.publish(subject, payload)
        elif rel in REQUEST_SUBJECTS and rng.random() < 0.5:
            await bus.nc.publish(subject, payload, reply=reply_inbox)
            with_reply += 1
        else:
            await bus.nc.publish(subject, payload)
        sent[rel] += 1
    await bus.nc.flush()
    return sent, with_reply, refused


async def test_ten_thousand_bad_messages_kill_nothing_and_are_all_counted(
    tmp_path: Path,
) -> None:
    s = Subjects("fuzz")
    async with running_up(
        tmp_path,
        "fuzz",
        "trainer.max_steps=100000",
        # an eval actor too, for its subscriptions: it scores version 0 once, cheaply
        "eval.every=100000",
        "eval.k=0",
        "eval.max_prompts=4",
    ) as up:
        run_dir = up.run_dir
        bus = await connect(run_dir)
        try:
            watch = Watch()
            await bus.subscribe(s.heartbeat("*"), ActorInfo, watch.on_heartbeat)
            await bus.subscribe(s.exited, ActorExit, watch.on_exit)
            await bus.subscribe(s.metrics("trainer"), Metrics, watch.on_metrics)
            inbox = bus.nc.new_inbox()
            await bus.subscribe(inbox, Ack, watch.on_reply)
            # the whole run is up and training: every actor heartbeats, a step is done
            await watch.wait(
                lambda: watch.step >= 1 and set(SUBSCRIPTIONS) <= set(watch.heartbeats), 300
            )

            sent, with_reply, refused = await fuzz(bus, s, inbox)
            assert sum(sent.values()) + refused == N_MESSAGES and refused == N_MESSAGES // 100

            expected = {
                actor: Counter(
                    {p: sum(n for rel, n in sent.items() if matches(p, rel)) for p in subs}
                )
                for actor, subs in SUBSCRIPTIONS.items()
            }

            def all_counted() -> bool:
                return all(
                    by_pattern(watch.heartbeats[a].dropped) == +expected[a] for a in SUBSCRIPTIONS
                )

            await watch.wait(all_counted, 60)
            step_after_fuzz = watch.step
            # the requests that named a reply subject were each answered with an error
            await watch.wait(lambda: len(watch.replies) >= with_reply, 30)
            assert len(watch.replies) == with_reply
            assert all(not a.ok and "bad request" in a.error for a in watch.replies)
            # this test's own subscriptions count the fuzz they got too
            prefix = s.prefix + "."
            own = by_pattern({k.removeprefix(prefix): n for k, n in bus.drops.items()})
            assert own == +Counter(
                {p: sum(n for rel, n in sent.items() if matches(p, rel)) for p in OWN_SUBSCRIPTIONS}
            )
            # the run goes on: two more steps, the same five actors, none exited
            await watch.wait(lambda: watch.step >= step_after_fuzz + 2, 300)
            assert set(watch.heartbeats) == set(SUBSCRIPTIONS), "an actor was restarted"
            assert all(h.status == "running" for h in watch.heartbeats.values())
            assert watch.exits == []
            total = sum(sum(c.values()) for c in expected.values())
            print(
                f"fuzz: {N_MESSAGES} messages, {refused} refused as oversized, "
                f"{total} deliveries to actors, all counted; steps {step_after_fuzz} -> {watch.step}"
            )
        finally:
            await bus.close()
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.proc.wait(), 120) == 0
        # the trainer's metrics carry the run's drops, summed over the actors
        last = read_jsonl(run_dir / "metrics.jsonl")[-1]
        assert last["step"] >= step_after_fuzz + 2
        reported = {k: v for k, v in last.items() if k.startswith("dropped/")}
        assert sum(reported.values()) == total
        assert reported["dropped/control/garbage"] > 0
