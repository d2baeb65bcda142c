"""The reward actor against a real nats-server and real reward worker processes.

Raw trajectories are stored on the run's stream before the actor starts; the test reads
what the actor republishes on the scored subject (as the buffer would), then asks the
server how the actor's durable consumer acknowledged the raw ones."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.actors.reward import RewardActor
from asyncrl.config.recipe import load_recipe
from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.wire.messages import Array, Trajectory, TrajectoryGroup
from asyncrl.wire.subjects import Subjects

GATE_REWARD = Path(__file__).parent / "actor_helpers" / "gate_reward.py"

# How long a gated reward call waits for the others before it gives up (and scores 0):
# only a consumer that scores one at a time ever waits this long.
GATE_WAIT_S = 10.0

# The bound on a whole test: worker start-up (a fresh interpreter each) and scoring.
TEST_LIMIT_S = 120.0


class Gate:
    """A Unix-socket rendezvous: holds every caller until ``n`` wait at the same time,
    then lets those ``n`` go. Records who waited together."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.waiting: list[str] = []
        self.rounds: list[list[str]] = []
        self._open = asyncio.Event()

    async def on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        name = (await reader.readline()).decode().strip()
        opened = self._open
        self.waiting.append(name)
        if len(self.waiting) == self.n:
            self.rounds.append(self.waiting)
            self.waiting = []
            self._open = asyncio.Event()
            opened.set()
        await opened.wait()
        writer.write(b"1")
        await writer.drain()
        writer.close()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short folder: a Unix socket path must stay under ~100 bytes."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-gate-") as d:
        yield Path(d)


@pytest.fixture
async def stream(bus: Bus) -> AsyncIterator[Subjects]:
    """The run's trajectory stream, configured as ``asyncrl up`` configures it."""
    subjects = Subjects("t")
    await ensure_trajectory_stream(bus, subjects)
    yield subjects


def raw(i: int, data: dict[str, Any]) -> Trajectory:
    return Trajectory(
        uid=f"p{i}/0",
        prompt_uid=f"p{i}",
        group_index=0,
        group_size=1,
        attempt="lease-1",
        input_ids=Array.of([1, 2, 3], "int32"),
        loss_mask=Array.of([0, 1, 1], "bool"),
        logprobs=Array.of([0.0, -1.0, -1.0], "float32"),
        versions=Array.of([-1, 0, 0], "int32"),
        completion=f"answer {i}",
        data=data,
    )


def reward_actor(embedded_nats: EmbeddedNats, workers: int, timeout: float) -> RewardActor:
    recipe = load_recipe(
        None,
        [
            "run.name=t",
            f"reward.fn={GATE_REWARD}:gate_reward",
            f"reward.workers={workers}",
            f"reward.timeout={timeout}",
        ],
    )
    ctx = ActorContext(
        run_name="t", run_dir=embedded_nats.run_dir, nats=embedded_nats.info, recipe=recipe
    )
    return RewardActor(ctx)


async def score_all(
    bus: Bus,
    subjects: Subjects,
    actor: RewardActor,
    sent: list[Trajectory],
    *,
    until_failure: bool = False,
) -> dict[str, Trajectory]:
    """Runs ``actor`` until every trajectory of ``sent`` came back scored (or, with
    ``until_failure``, until one came back as a failed reward); returns them by uid."""
    scored: dict[str, Trajectory] = {}
    twice: list[str] = []
    done = asyncio.Event()

    async def on_scored(t: Trajectory) -> None:
        if t.uid in scored:
            twice.append(t.uid)
        scored[t.uid] = t
        if len(scored) == len(sent) or (until_failure and not t.reward_info["ok"]):
            done.set()

    for t in sent:
        await bus.js_publish(subjects.trajectories, t, msg_id=t.msg_id("raw"))
    reader = await bus.js_consume(subjects.stream, subjects.scored, "buffer", Trajectory, on_scored)
    async with asyncio.timeout(TEST_LIMIT_S), asyncio.TaskGroup() as tg:
        main = tg.create_task(actor.main())
        reading = tg.create_task(reader.run())
        await done.wait()
        actor.stop("test done")
        await reader.stop()
    assert main.result() == 0 and reading.done()
    assert not twice, f"scored twice: {twice}"
    return scored


async def assert_each_acked_once(bus: Bus, subjects: Subjects, n: int) -> None:
    info = await bus.js.consumer_info(subjects.stream, "reward")
    assert info.delivered.consumer_seq == n, info  # every raw trajectory delivered once...
    assert info.num_redelivered == 0, info
    assert info.ack_floor.consumer_seq == n and info.num_ack_pending == 0, info  # ...and acked
    # a work queue: an acknowledged raw trajectory has left the stream
    info = await bus.js.stream_info(subjects.stream, subjects_filter=subjects.trajectories)
    assert not info.state.subjects, info.state


async def test_scores_as_many_trajectories_at_once_as_it_has_workers(
    embedded_nats: EmbeddedNats, bus: Bus, stream: Subjects, socket_dir: Path
) -> None:
    workers, rounds = 3, 2
    gate = Gate(workers)
    path = str(socket_dir / "gate.sock")
    server = await asyncio.start_unix_server(gate.on_connection, path)
    data = {"gate": path, "wait_s": GATE_WAIT_S}
    sent = [raw(i, data) for i in range(workers * rounds)]
    async with server:
        actor = reward_actor(embedded_nats, workers, timeout=3 * GATE_WAIT_S)
        scored = await score_all(bus, stream, actor, sent, until_failure=True)
    failed = {u: t.reward_info for u, t in scored.items() if not t.reward_info["ok"]}
    assert not failed, f"rewards did not meet at the gate {workers} at a time: {failed}"
    assert len(gate.rounds) == rounds and not gate.waiting
    assert sorted(c for r in gate.rounds for c in r) == sorted(t.completion for t in sent)
    assert all(t.reward == 1.0 for t in scored.values())
    # past scoring a sample carries neither its prompt record nor its completion text
    assert all(t.data == {} and t.completion == "" for t in scored.values())
    assert actor.counters["scored"] == len(sent)
    await assert_each_acked_once(bus, stream, len(sent))


async def test_failed_rewards_score_a_recorded_zero_while_others_go_on(
    embedded_nats: EmbeddedNats, bus: Bus, stream: Subjects, socket_dir: Path
) -> None:
    """A reward that raises, returns NaN or hangs past the timeout scores 0 with its
    reason; the two good calls in the same round still meet at the gate."""
    path = str(socket_dir / "gate.sock")
    server = await asyncio.start_unix_server(Gate(2).on_connection, path)
    good = {"gate": path, "wait_s": 2.5}
    behaviours = ["raise", "nan", "hang"]
    sent = [raw(0, good), raw(1, good)] + [
        raw(2 + i, {"behaviour": b}) for i, b in enumerate(behaviours)
    ]
    async with server:
        # five handlers at once: the hang holds one worker past the timeout while the
        # others are scored beside it
        actor = reward_actor(embedded_nats, workers=5, timeout=3.0)
        scored = await score_all(bus, stream, actor, sent)
    assert [scored[f"p{i}/0"].reward for i in range(5)] == [1.0, 1.0, 0.0, 0.0, 0.0]
    reasons = [scored[f"p{i}/0"].reward_info["reason"].split(":")[0] for i in range(2, 5)]
    assert reasons == ["raised", "bad_value", "timeout"]
    assert [scored[f"p{i}/0"].reward_info["ok"] for i in range(5)] == [True] * 2 + [False] * 3
    assert {k: v for k, v in actor.counters.items() if k.startswith("failed:")} == {
        "failed:raised": 1,
        "failed:bad_value": 1,
        "failed:timeout": 1,
    }
    await assert_each_acked_once(bus, stream, len(sent))


async def test_a_group_message_is_scored_at_once_and_goes_on_as_one_scored_group(
    embedded_nats: EmbeddedNats, bus: Bus, stream: Subjects, socket_dir: Path
) -> None:
    """The prompt record travels once, in the group; every sample is scored against it,
    all at once (they meet at the gate together), and the scored group is one message."""
    size = 3
    gate = Gate(size)
    path = str(socket_dir / "gate.sock")
    server = await asyncio.start_unix_server(gate.on_connection, path)
    samples = [
        raw(0, {}).model_copy(update={"uid": f"p0/{i}", "group_index": i, "group_size": size})
        for i in range(size)
    ]
    group = TrajectoryGroup(
        prompt_uid="p0",
        attempt="lease-1",
        data={"gate": path, "wait_s": GATE_WAIT_S},
        samples=[t.model_copy(update={"completion": f"answer {t.uid}"}) for t in samples],
    )
    await bus.js_publish(stream.trajectory_groups, group, msg_id=group.msg_id("raw"))
    got: list[TrajectoryGroup] = []
    done = asyncio.Event()

    async def on_scored(g: TrajectoryGroup) -> None:
        got.append(g)
        done.set()

    reader = await bus.js_consume(
        stream.stream, stream.scored_groups, "buffer_groups", TrajectoryGroup, on_scored
    )
    async with server:
        actor = reward_actor(embedded_nats, workers=size, timeout=3 * GATE_WAIT_S)
        async with asyncio.timeout(TEST_LIMIT_S), asyncio.TaskGroup() as tg:
            main = tg.create_task(actor.main())
            reading = tg.create_task(reader.run())
            await done.wait()
            actor.stop("test done")
            await reader.stop()
    assert main.result() == 0 and reading.done()
    [scored] = got
    assert [sorted(r) for r in gate.rounds] == [[f"answer p0/{i}" for i in range(size)]]
    assert [t.uid for t in scored.samples] == ["p0/0", "p0/1", "p0/2"]
    assert [t.reward for t in scored.samples] == [1.0] * size
    assert all(t.reward_info["ok"] for t in scored.samples)
    assert scored.data == {} and all(t.data == {} and not t.completion for t in scored.samples)
    assert actor.counters["scored"] == size
    info = await bus.js.consumer_info(stream.stream, "reward_groups")
    assert info.delivered.consumer_seq == 1 and info.num_redelivered == 0, info
    assert info.ack_floor.consumer_seq == 1 and info.num_ack_pending == 0, info
