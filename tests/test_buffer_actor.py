"""The buffer actor on a real nats-server, fed through JetStream and asked by the real
trainer's batch fetch: published versions, refused trajectories, batch blobs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import nats.js.errors
import pytest
from actor_helpers.buffer_kit import context, recipe, running_buffer

import asyncrl.actors.buffer.actor as buffer_actor
from asyncrl.actors.trainer import TrainerActor
from asyncrl.config.recipe import Recipe
from asyncrl.observe.audit import read_jsonl
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo
from asyncrl.wire.messages import (
    SCHEMA_VERSION,
    Array,
    BatchRequest,
    Lease,
    LeaseRequest,
    TrainBatchRef,
    Trajectory,
    TrajectoryGroup,
)
from asyncrl.wire.subjects import Subjects

S = Subjects("t")


def sample(
    lease: Lease, prompt: int, i: int, version: int = 0, tokens: int = 3, prompt_loss: bool = False
) -> Trajectory:
    uid = lease.prompts[prompt].uid
    mask = [prompt_loss] + [True] * (tokens - 1)
    return Trajectory(
        uid=f"{uid}/{i}",
        prompt_uid=uid,
        group_index=i,
        group_size=2,
        actor_id="r0",
        attempt=lease.lease_id,
        input_ids=Array.of([7] * tokens, "int32"),
        loss_mask=Array.of(mask, "bool"),
        logprobs=Array.of([0.0] + [-1.0] * (tokens - 1), "float32"),
        versions=Array.of([-1] + [version] * (tokens - 1), "int32"),
        reward=float(i),
    )


async def take_lease(bus: Bus, n: int) -> Lease:
    req = LeaseRequest(actor_id="r0", max_episodes=n, request_id=f"q{n}")
    return await bus.request(S.lease, req, Lease, timeout=10)


async def score(bus: Bus, *samples: Trajectory) -> None:
    for t in samples:
        await bus.js_publish(S.scored, t, msg_id=t.msg_id("scored"))


class EngineFree(TrainerActor):
    step = 0  # no engine to own the progress: the test sets it
    version = 0


def trainer(run_dir: Path, nats: NatsInfo, bus: Bus, r: Recipe) -> TrainerActor:
    """The real trainer actor's batch fetch, without its engine."""
    t = EngineFree(context(run_dir, nats, r, "trainer-0"))
    t._bus = bus
    return t


async def test_update_every_beyond_eta_plus_one_still_gets_batches(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """k = 3 > η + 1: three steps train on data of the published version 0; judged
    against the trainer's own version the third step's groups (head 0, v = 2) would all
    be stale and the trainer would ask forever."""
    r = recipe("trainer.update_every=3")
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        got = await take_lease(bus, 10)
        assert len(got.prompts) == 6  # (v + k·(⌊η/k⌋ + 1))·B = (0 + 3)·2
        await score(bus, *(sample(got, p, i) for p in range(6) for i in range(2)))
        t = trainer(tmp_path, nats_server, bus, r)
        async with asyncio.timeout(30):
            for step in range(3):
                t.version = step  # trained, not yet published
                batch = await t._fetch_batch(step)
                assert [len(g.samples) for g in batch.groups] == [2, 2] and batch.version == 0
        assert buf.staleness.rejected == 0 and buf.version == 0


async def test_the_not_ready_answer_says_what_the_trainer_waits_for(
    tmp_path: Path,
    nats_server: NatsInfo,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(buffer_actor, "BATCH_WAIT", 0.2)
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        got = await take_lease(bus, 4)
        buf.version = 2  # weights 2 are out: a group of head 0 is too stale (2 − 0 > η)
        await score(bus, sample(got, 0, 0, 0), sample(got, 0, 1, 0))
        await score(bus, sample(got, 1, 0, 1), sample(got, 1, 1, 2))
        req = BatchRequest(step=0, version=2, published_version=2)
        async with asyncio.timeout(30):
            # each answer comes after the buffer's short wait: ask until both groups are in
            reply = await bus.request(S.batch, req, TrainBatchRef, timeout=10)
            while reply.waiting is None or reply.waiting.running != 2:
                reply = await bus.request(S.batch, req, TrainBatchRef, timeout=10)
        assert reply.waiting is not None and not reply.groups
        w = reply.waiting
        assert (w.ready_groups, w.batch_size, w.rejected_stale, w.running) == (1, 2, 1, 2)
        assert "1/2 groups ready" in w.describe() and "1 rejected as stale" in w.describe()
        t = trainer(tmp_path, nats_server, bus, r)
        t.version = t.published_version = 2
        capsys.readouterr()
        with pytest.raises(TimeoutError):  # no batch will come: it keeps asking
            async with asyncio.timeout(2):
                await t._fetch_batch(0)
        logged = capsys.readouterr().out
        assert logged.count("waiting for a batch") == 1  # rate-limited: once per 30 s
        assert "1/2 groups ready, 2 running, 1 rejected as stale" in logged


async def test_invalid_trajectories_are_counted_and_the_batch_forms_from_good_ones(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        got = await take_lease(bus, 3)
        await score(bus, sample(got, 0, 0), sample(got, 0, 1))
        bad = sample(got, 1, 1, prompt_loss=True)  # a loss on the first (prompt) token
        await score(bus, sample(got, 1, 0), bad)
        await score(bus, sample(got, 2, 0), sample(got, 2, 1))
        t = trainer(tmp_path, nats_server, bus, r)
        async with asyncio.timeout(30):
            batch = await t._fetch_batch(0)
        prompts = {x.prompt_uid for g in batch.groups for x in g.samples}
        assert prompts == {got.prompts[0].uid, got.prompts[2].uid}
        assert {g.prompt_uid for g in batch.groups} == prompts
        assert batch.counters["invalid_loss_on_prompt_token"] == 1
        assert buf.counters["invalid_samples"] == 1
        # the bad prompt went back to the pool with its budget
        assert buf.staleness.running == 0 and got.prompts[1].uid in {
            p.uid for p in buf.leases.source.pool
        }
    events = read_jsonl(tmp_path / "buffer_events.jsonl")
    assert any(e.get("reason") == "loss_on_prompt_token" for e in events)


@pytest.fixture
async def small_nats(tmp_path: Path) -> AsyncIterator[NatsInfo]:
    """A server whose max_payload (64 KiB) a batch of four 3,000-token samples exceeds."""
    async with EmbeddedNats(tmp_path / "nats-small", max_payload=64 * 1024) as server:
        yield server.info


async def test_batch_blobs_have_their_own_bucket_and_are_deleted_once_fetched(
    tmp_path: Path, small_nats: NatsInfo
) -> None:
    r = recipe()
    async with await Bus.connect(small_nats, name="test") as bus:
        async with running_buffer(tmp_path, small_nats, bus, r):
            got = await take_lease(bus, 2)
            await score(bus, *(sample(got, p, i, tokens=3000) for p in range(2) for i in range(2)))
            t = trainer(tmp_path, small_nats, bus, r)
            async with asyncio.timeout(30):
                batch = await t._fetch_batch(0)
            assert [len(g.samples) for g in batch.groups] == [2, 2] and not batch.blob_key
            assert batch.groups[0].samples[0].input_ids.shape == (3000,)
            store = await bus.js.object_store(S.batch_bucket)
            try:
                left = [o.name for o in await store.list(ignore_deletes=True)]
            except nats.js.errors.NotFoundError:
                left = []
            assert left == []
            with pytest.raises(nats.js.errors.BucketNotFoundError):
                await bus.js.object_store(S.weights_bucket)
            # a repeated request (a trainer that lost the reply) gets the same batch back
            again = await bus.request(
                S.batch, BatchRequest(step=0, version=0), TrainBatchRef, timeout=10
            )
            assert again.blob_key
            await bus.delete_blob(S.batch_bucket, again.blob_key)


async def test_group_messages_are_admitted_and_malformed_ones_counted_and_dropped(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """One message per group on the scored groups subject: a good group is admitted once
    (its repeat under the same id is not stored again), and what does not decode as a
    group (garbage; samples of another prompt or attempt; no sample at all) is dropped
    and counted under the subject, never held against the stream."""
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        got = await take_lease(bus, 3)
        good = TrajectoryGroup.of([sample(got, 0, 0), sample(got, 0, 1)])
        mixed = {  # what TrajectoryGroup refuses, sent as the fields it would have
            "prompt_uid": got.prompts[1].uid,
            "attempt": got.lease_id,
            "samples": [
                sample(got, 1, 0).__pydantic_serializer__.to_python(sample(got, 1, 0)),
                sample(got, 2, 1).__pydantic_serializer__.to_python(sample(got, 2, 1)),
            ],
        }
        empty = {"prompt_uid": got.prompts[2].uid, "attempt": got.lease_id, "samples": []}
        junk = [b"\xc1 not msgpack"] + [
            msgpack.packb({"k": TrajectoryGroup.KIND, "v": SCHEMA_VERSION, "d": d})
            for d in (mixed, empty)
        ]
        for i, payload in enumerate(junk):
            await bus.js.publish(S.scored_groups, payload, headers={"Nats-Msg-Id": f"junk{i}"})
        for _ in range(2):
            await bus.js_publish(S.scored_groups, good, msg_id=good.msg_id("scored"))
        async with asyncio.timeout(30):
            while sum(buf.bus.drops.values()) < len(junk) or not buf.admission.ready:  # noqa: ASYNC110 - a consumer's counts, no event
                await asyncio.sleep(0.05)
        pattern = S.scored_groups
        assert buf.bus.drops == {f"{pattern}/garbage": 1, f"{pattern}/invalid": 2}
        [group] = buf.admission.ready
        assert group.prompt_uid == got.prompts[0].uid and len(group.samples) == 2
        assert buf.staleness.accepted == 1 and buf.staleness.running == 2
        assert buf.counters["duplicates"] == 0  # the stream stored the repeat once
        # every message leaves the stream: the junk terminated, the good group acked once
        # its state write is done
        async with asyncio.timeout(30):
            while (info := await bus.js.consumer_info(S.stream, "buffer_groups")).num_ack_pending:  # noqa: ASYNC110 - a server state, no event
                await asyncio.sleep(0.05)
        assert info.num_pending == 0 and info.num_redelivered == 0, info
        info = await bus.js.stream_info(S.stream, subjects_filter=S.scored_groups)
        assert not info.state.subjects, info.state
