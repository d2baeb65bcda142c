"""The buffer's durable state and the trainer-restart roll-back.

- a buffer started again in the same run goes on where the last one stood (real
  nats-server, state in the run's object store);
- :meth:`Admission.roll_back` by hand-computed cases: which groups are kept, which
  prompts run again, and the recounted budget;
- the trainer's records after its checkpoint are dropped; restart back-off doubles.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from actor_helpers.buffer_kit import recipe, running_buffer
from test_buffer_actor import S, sample, score, take_lease, trainer

from asyncrl.actors.buffer import actor as buffer_actor
from asyncrl.actors.buffer.admission import Admission, admitted_group, raw_rewards
from asyncrl.actors.buffer.batching import Batcher
from asyncrl.actors.buffer.durable import (
    OldSnapshotError,
    keep_for_resume,
    named_parts,
    part_key,
    restore,
)
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook, PromptSource
from asyncrl.observe.records import drop_records_after
from asyncrl.runtime.actor import awaiting
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.runtime.supervisor import RESTART_ENV, ActorSpec
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import (
    SCHEMA_VERSION,
    Array,
    BatchRequest,
    BufferPart,
    BufferSnapshot,
    Group,
    Lease,
    LeaseRequest,
    TrainBatchRef,
    Trajectory,
)


def traj(prompt: str, i: int, version: int, *, attempt: str = "L1", epoch: int = 0) -> Trajectory:
    return Trajectory(
        uid=f"{prompt}/{i}",
        prompt_uid=prompt,
        group_index=i,
        group_size=2,
        attempt=attempt,
        input_ids=Array.of([5, 6, 7], "int32"),
        loss_mask=Array.of([False, True, True], "bool"),
        logprobs=Array.of([0.0, -1.0, -1.0], "float32"),
        versions=Array.of([-1, version, version], "int32"),
        reward=float(i),
        data={"question": prompt},
        epoch=epoch,
    )


async def test_a_restarted_buffer_goes_on_where_the_last_one_stood(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as first:
        got = await take_lease(bus, 4)  # (v + η + 1)·B = 4 prompts
        g = [[traj(p.uid, i, 0, attempt=got.lease_id) for i in range(2)] for p in got.prompts]
        await score(bus, *g[0], *g[1], *g[2], g[3][0])  # three groups and half of one
        req = BatchRequest(step=0, version=0)
        batch = await bus.request(S.batch, req, TrainBatchRef, timeout=30)
        assert batch.waiting is None
        stood = (
            first.version,
            sorted(first.leases.leased),
            dict(first.counters),
            first.leases.source.state(),  # the dataset position
        )
    async with running_buffer(tmp_path, nats_server, bus, r) as second:
        assert (
            second.version,
            sorted(second.leases.leased),
            dict(second.counters),
            second.leases.source.state(),
        ) == stood
        assert [len(g) for g in second.admission.groups.values()] == [1]  # the half group
        assert len(second.admission.ready) == 1  # three groups, two of them served
        again = await bus.request(S.batch, req, TrainBatchRef, timeout=30)
        assert again.groups == batch.groups  # samples and shaped rewards alike
        await score(bus, g[3][1])  # the rest of the half group completes it
        async with asyncio.timeout(30):
            while len(second.admission.ready) < 2:
                second.ready_changed.clear()
                await second.ready_changed.wait()
        assert second.durable is not None
        await second.durable.persisted()
        assert second.durable.writes > 0


async def test_resume_keeps_the_dataset_position_of_the_checkpoints_step(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """The buffer records the dataset position of each served step; ``up --resume`` from
    the checkpoint of step 1 keeps the position of step 0's batch (not the newest one)
    and the accounting of version 1, and forgets the rest."""
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as first:
        got = await take_lease(bus, 4)  # (v + η + 1)·B = 4 prompts at version 0
        await score(bus, *(sample(got, p, i) for p in range(4) for i in range(2)))
        req = BatchRequest(step=0, version=0)
        assert (await bus.request(S.batch, req, TrainBatchRef, timeout=30)).waiting is None
        at_step_0 = first.leases.source.state()
        req = BatchRequest(step=1, version=1)
        assert (await bus.request(S.batch, req, TrainBatchRef, timeout=30)).waiting is None
        more = await take_lease(bus, 2)  # version 1: two more prompts, the position moves
        assert len(more.prompts) == 2 and first.leases.source.state() != at_step_0
        assert first.batcher.positions[0] == at_step_0
        assert first.durable is not None
        first._changed()
        await first.durable.persisted()
    kept = await keep_for_resume(bus, S.buffer_bucket, step=1, version=1, batch_size=2)
    assert kept == at_step_0
    async with running_buffer(tmp_path, nats_server, bus, r) as second:
        assert second.leases.source.state() == at_step_0
        assert (second.version, second.staleness.accepted, second.staleness.running) == (1, 2, 0)
        assert not second.leases.leased and not second.admission.ready
        assert not second.batcher.served
        # the dataset goes on from there: the next lease is the one after step 0's
        assert [p.uid for p in (await take_lease(bus, 2)).prompts] == [p.uid for p in more.prompts]
    # nothing recorded for a step (a buffer without durable state): the dataset restarts
    assert await keep_for_resume(bus, S.buffer_bucket, step=9, version=9, batch_size=2) is None


async def test_a_stopping_buffer_ends_its_batch_wait_and_writes_its_last_changes(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop while a batch request waits for groups answers that request "not ready" at
    once, not after the wait (here longer than the test's limit), and the stopping
    buffer writes what changed since its writer's last write (a lease here), so its
    replacement holds it. Before, the connection's drain waited for such a handler, and
    one that waited on the cancelled writer held the actor until the supervisor's
    SIGKILL."""
    monkeypatch.setattr(buffer_actor, "BATCH_WAIT", 3600.0)
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        assert buf.durable is not None
        buf.durable.min_interval = 3600.0  # after its next write, the writer waits
        first = await take_lease(bus, 2)
        await buf.durable.persisted()
        writes = buf.durable.writes
        second = await take_lease(bus, 1)  # a change the writer will not write
        req = BatchRequest(step=0, version=0)
        waiting = asyncio.create_task(bus.request(S.batch, req, TrainBatchRef, timeout=3600))
        async with asyncio.timeout(30):  # until the request waits inside the buffer
            while not any("on_batch_request" in awaiting(t) for t in asyncio.all_tasks()):  # noqa: ASYNC110 - no event marks it
                await asyncio.sleep(0.02)
        assert buf.durable.writes == writes
        buf.stop("test")
        async with asyncio.timeout(60):
            answer = await waiting
        assert answer.waiting is not None and not answer.groups
    assert buf.durable.writes == writes + 1
    async with running_buffer(tmp_path, nats_server, bus, r) as again:
        assert sorted(again.leases.leased) == sorted(
            p.uid for p in (*first.prompts, *second.prompts)
        )


async def test_a_served_batch_is_written_without_waiting_out_the_pause_between_writes(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """Writes are at most one per ``min_interval`` (many changes, one write), but a batch
    is not: the trainer waits for its write. With a pause of an hour after each write,
    scored samples stay unwritten (and unacked) while the batch is written and served at
    once."""
    r = recipe()
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        assert buf.durable is not None
        got = await take_lease(bus, 2)
        await buf.durable.persisted()
        buf.durable.min_interval = 3600.0  # after its next write, the writer waits
        await take_lease(bus, 1)  # a change: written now, then the pause begins
        await buf.durable.persisted()
        writes = buf.durable.writes
        await score(bus, *(sample(got, p, i) for p in range(2) for i in range(2)))
        async with asyncio.timeout(30):  # taken, but not written: the pause holds them
            while len(buf.admission.ready) < 2:  # noqa: ASYNC110 - no event marks it
                await asyncio.sleep(0.02)
        assert buf.durable.writes == writes
        t = trainer(tmp_path, nats_server, bus, r)
        async with asyncio.timeout(30):
            batch = await t._fetch_batch(0)
        assert {g.prompt_uid for g in batch.groups} == {p.uid for p in got.prompts}
        assert buf.durable.writes == writes + 1


async def test_each_group_is_written_once_and_its_part_deleted_once_no_snapshot_names_it(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admitted groups go into parts written once each, however many snapshots name
    them while they are ready and then served; the snapshot names them by place. Once
    the snapshot in the bucket no longer names a part (its batch is past the two kept),
    the part is deleted."""
    r = recipe()
    written: list[bytes] = []
    async with running_buffer(tmp_path, nats_server, bus, r) as buf:
        assert buf.durable is not None
        put = buf.bus.put_blob

        async def recording_put(bucket: str, key: str, source: Any) -> int:
            if key.startswith("part-"):
                written.append(bytes(source))
            return await put(bucket, key, source)

        monkeypatch.setattr(buf.bus, "put_blob", recording_put)
        t = trainer(tmp_path, nats_server, bus, r)
        got = await take_lease(bus, 4)  # (v + η + 1)·B = 4 prompts
        async with asyncio.timeout(30):
            for step in range(2):  # a batch's groups scored apart from the other's
                await score(
                    bus, *(sample(got, p, i) for p in (2 * step, 2 * step + 1) for i in (0, 1))
                )
                t.version = step
                await t._fetch_batch(step)
            buf.version = 1  # room for two more prompts
            req = LeaseRequest(actor_id="r0", max_episodes=2, request_id="m")
            more = await bus.request(S.lease, req, Lease, timeout=10)
            assert len(more.prompts) == 2
            await score(bus, *(sample(more, p, i, 1) for p in range(2) for i in range(2)))
            t.version = t.published_version = 2
            await t._fetch_batch(2)
            # the batch went out with its groups' fields as they were encoded for their part
            served = buf.batcher.served[2]
            assert {id(g) for g in served.groups} <= buf._encoded.fields.keys()
            assert encode(served, buf._encoded.fields) == encode(served)
        await buf.durable.persisted()
        snap = await buf.durable.load()
        assert snap is not None
        store = await bus.js.object_store(S.buffer_bucket)
        keys = {info.name for info in await store.list(ignore_deletes=True)}
    uids = [
        decode(g, Group).prompt_uid for part in written for g in decode(part, BufferPart).groups
    ]
    assert sorted(uids) == sorted(p.uid for p in (*got.prompts, *more.prompts))  # once each
    assert [r.step for r in snap.served] == [1, 2]
    assert keys == {"state"} | {part_key(n) for n in named_parts(snap)}
    assert len(written) > len(named_parts(snap))  # the parts of step 0 alone were deleted


def admission(tmp_path: Path, version: int) -> Admission:
    sm = StalenessManager(batch_size=2, max_concurrent=16, max_head_offpolicyness=1)
    sm.version = version
    journal = Journal(tmp_path / "events.jsonl")
    records = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    leases = LeaseBook(PromptSource(records, 1), sm, journal, ttl=30, incarnation="x")
    return Admission(sm, leases, journal, group_size=2, dynamic_filter=False)


def group(prompt: str, version: int) -> Group:
    """An admitted group of two, as the buffer keeps it."""
    return admitted_group([traj(prompt, i, version) for i in range(2)], raw_rewards)


def test_roll_back_keeps_the_groups_of_the_versions_that_remain(tmp_path: Path) -> None:
    a = admission(tmp_path, version=3)
    a.ready.extend([group("e0-1", 2), group("e0-3", 3)])
    for uid in ("e0-1", "e0-3", "e0-5", "e0-7"):
        a.completed.add(uid)
    served = [group("e0-5", 1), group("e0-7", 3)]
    # a group in the making, of a lease still out
    a.leases.leased["e0-8"] = a.leases.leased.get("e0-8") or _lease(a, "e0-8", "L9")
    a.hold(traj("e0-8", 0, 3, attempt="L9"))
    a.staleness.running = 1

    dropped = a.roll_back(2, epoch=1, served=served)

    # restarted from version 2: versions ≤ 2 stay (served first, then ready), 3 is gone
    assert [g.prompt_uid for g in a.ready] == ["e0-5", "e0-1"]
    assert dropped == 2 and a.journal.counters["rolled_back_groups"] == 2
    assert a.journal.counters["rolled_back_samples"] == 4
    # they run again, with their records from the dataset (samples carry none)
    pool = {p.uid: p.data for p in a.leases.source.pool}
    assert pool["e0-7"] == {"question": "q7", "answer": "7"}
    assert pool["e0-3"] == {"question": "q3", "answer": "3"}
    assert "e0-7" not in a.completed and "e0-3" not in a.completed
    assert "e0-1" in a.completed and "e0-5" in a.completed
    # the group in the making is abandoned and its prompt returned through its lease
    assert not a.groups and "e0-8" not in a.leases.leased and "L9" in a.refused["e0-8"]
    assert a.staleness.running == 0
    # accepted = v·B + groups kept = 2·2 + 2; the version went back
    assert (a.staleness.version, a.staleness.accepted) == (2, 6)
    # a late sample of the old epoch is refused; one of the new epoch is taken
    assert a.on_scored(traj("e0-9", 0, 2, attempt="L2", epoch=0)) == "invalid"
    assert a.journal.counters["invalid_old_epoch"] == 1
    assert a.on_scored(traj("e0-7", 0, 2, attempt="L3", epoch=1)) == "pending"


def test_a_snapshot_of_groups_kept_as_bare_samples_is_refused_naming_the_run(
    tmp_path: Path,
) -> None:
    """An older asyncrl kept an admitted group as a bare list of samples (no shaped
    rewards): restoring it fails before changing anything, with the run folder named."""
    a = admission(tmp_path, version=3)
    batcher = Batcher(a, a.staleness, a.journal, batch_size=2)
    samples = group("e0-1", 2).samples
    old = msgpack.packb(
        {
            "k": "buffer_group",
            "v": SCHEMA_VERSION,
            "d": {"samples": [t.__pydantic_serializer__.to_python(t) for t in samples]},
        }
    )
    snap = BufferSnapshot(version=9, ready=[(0, 0)])
    with pytest.raises(OldSnapshotError, match=str(tmp_path)):
        restore(
            snap, a.leases, a, batcher, 0.0, run_dir=tmp_path, parts={0: BufferPart(groups=[old])}
        )
    with pytest.raises(OldSnapshotError, match="part 0, which its bucket does not hold"):
        restore(snap, a.leases, a, batcher, 0.0, run_dir=tmp_path)  # the part is missing
    assert a.staleness.version == 3 and not a.ready


def _lease(a: Admission, uid: str, lease_id: str) -> object:
    from asyncrl.actors.buffer.leases import Leased
    from asyncrl.wire.messages import Prompt

    a.leases.attempts[uid] += 1
    return Leased(Prompt(uid=uid, data={"question": uid}), "r0", lease_id)


def test_records_after_the_checkpoint_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "trained_samples.jsonl"
    lines = [json.dumps({"step": s, "uid": f"u{s}"}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "ui')  # torn by a kill
    assert drop_records_after(path, 3) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert drop_records_after(tmp_path / "absent.jsonl", 3) == 0


def test_restart_back_off_doubles_and_the_replacement_knows_its_number() -> None:
    spec = ActorSpec("trainer", "trainer-0", ["x", "trainer-0"], restarts=8, backoff=1.0)
    assert spec.delay() == 0.0
    delays, s = [], spec
    for n in range(1, 8):
        s = s.restarted(n)
        delays.append(s.delay())
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert s.actor_id == "trainer-0-r7" and s.argv == ["x", "trainer-0-r7"]
    assert s.env[RESTART_ENV] == "7" and s.restarts == 1
