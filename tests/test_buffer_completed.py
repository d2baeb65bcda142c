"""The buffer's set of complete prompts: a set of ids, in a size that does not grow with
the run (one bit a record per data epoch, a number per whole epoch)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_buffer_durable import traj

from asyncrl.actors.buffer.admission import Admission
from asyncrl.actors.buffer.batching import Batcher
from asyncrl.actors.buffer.completed import CompletedPrompts
from asyncrl.actors.buffer.durable import capture, restore
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook, PromptSource
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import BufferSnapshot, LeaseRequest, Prompt

SIZE = 5

# ids of the dataset's form (epochs 0-1 of 5 records, so whole epochs happen), and others:
# an index past the dataset, a leading zero, foreign ids
uids = st.one_of(
    st.builds(lambda e, i: f"e{e}-{i}", st.integers(0, 1), st.integers(0, SIZE - 1)),
    st.sampled_from(["e0-5", "e0-17", "e01-2", "e-1-2", "e0-", "e0", "p7", "", "e1-02", "x0-1"]),
)
ops = st.lists(st.tuples(st.sampled_from(["add", "discard"]), uids), max_size=80)


def snapshot_of(done: CompletedPrompts) -> BufferSnapshot:
    full, partial = done.epochs()
    return BufferSnapshot(completed=done.others(), completed_epochs=full, completed_bits=partial)


def restored(snap: BufferSnapshot) -> CompletedPrompts:
    return CompletedPrompts.restored(
        SIZE, snap.completed_epochs, snap.completed_bits, snap.completed
    )


FILL = [("add", f"e0-{i}") for i in range(SIZE - 1)]


@settings(max_examples=300, deadline=None)
@given(ops)
@example(FILL)  # all but one: not whole
@example([*FILL, ("add", f"e0-{SIZE - 1}"), ("discard", "e0-2"), ("add", "e0-2")])
@example([*FILL, ("add", f"e0-{SIZE - 1}"), ("discard", "e0-0"), ("discard", "e0-0")])
@example([("add", "e1-02"), ("add", "e1-2"), ("discard", "e1-02")])
def test_the_complete_prompts_hold_what_a_set_of_their_ids_holds(steps) -> None:
    done, model = CompletedPrompts(SIZE), set()
    for op, uid in steps:
        getattr(done, op)(uid)
        getattr(model, op)(uid)
        assert len(done) == len(model)
    probes = {f"e{e}-{i}" for e in range(4) for i in range(SIZE + 1)} | {u for _, u in steps}
    assert {u for u in probes if u in done} == model & probes
    # through a snapshot, encoded and decoded, the same set
    back = restored(decode(encode(snapshot_of(done)), BufferSnapshot))
    assert len(back) == len(model)
    assert {u for u in probes if u in back} == model & probes


def test_a_whole_data_epoch_is_kept_as_its_number_and_parts_again_when_one_leaves() -> None:
    done = CompletedPrompts(SIZE)
    for i in range(SIZE):
        done.add(f"e3-{i}")
    done.add("e4-2")
    assert done.epochs()[0] == [3]
    assert [(p.epoch, p.bits) for p in done.epochs()[1]] == [(4, bytes([0b100]))]
    done.discard("e3-1")  # a rolled-back group: its prompt runs again
    assert "e3-1" not in done and "e3-0" in done and "e3-4" in done and len(done) == 5
    assert done.epochs()[0] == []
    assert [(p.epoch, p.bits) for p in done.epochs()[1]] == [(3, bytes([0b11101])), (4, bytes([4]))]


def test_the_snapshot_of_a_long_run_does_not_grow_with_its_groups() -> None:
    size = 7473  # GSM8K's train split
    done = CompletedPrompts(size)
    sizes = []
    for epoch in range(20):
        for i in range(size):
            done.add(f"e{epoch}-{i}")
        done.add(f"e{epoch + 1}-{epoch}")
        sizes.append(len(encode(snapshot_of(done))))
    assert len(done) == 20 * size + 1
    # one whole epoch more is a few bytes more; the bits of the epoch under way ~size/8
    assert sizes[-1] - sizes[0] < 100 and sizes[-1] < size // 8 + 400


def test_an_older_snapshot_that_kept_every_id_restores_to_the_same_set() -> None:
    ids = [f"e0-{i}" for i in range(SIZE)] + ["e1-3", "p9"]
    done = restored(BufferSnapshot(completed=ids))
    assert len(done) == len(ids) and all(u in done for u in ids)
    assert done.epochs()[0] == [0] and done.others() == ["p9"]


def test_admitting_groups_keeps_no_per_prompt_record_that_grows_with_the_run(
    tmp_path: Path,
) -> None:
    """Leases granted and their groups admitted through the buffer's own lease book and
    admission, three data epochs of a 10-record dataset: the snapshot neither lists the
    complete prompts nor counts their single attempts; a prompt that failed once keeps
    its count (its next lease after a roll-back is its second attempt, as before), and an
    attempt refused for an invalid sample is kept only until its prompt completes."""
    sm, journal, leases, a = buffer_parts(tmp_path)
    batcher = Batcher(a, sm, journal, batch_size=2)
    failed = None
    for n in range(30):
        lease = leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
        (p,) = lease.prompts
        if n == 3:  # its episode fails once: back to the pool, leased again next
            assert leases.return_prompt(p.uid, "aborted", lease_id=lease.lease_id)
            failed = p.uid
            continue
        if n == 5:  # an invalid sample: the attempt is refused, the prompt runs again
            bad = traj(p.uid, 0, 0, attempt=lease.lease_id).model_copy(
                update={"reward": float("nan")}
            )
            assert a.on_scored_group([bad]) == ["invalid"]
            assert lease.lease_id in a.refused[p.uid]
            refused = (p.uid, lease.lease_id)
            continue
        outcomes = a.on_scored_group([traj(p.uid, i, 0, attempt=lease.lease_id) for i in range(2)])
        assert outcomes[-1] == "admitted", outcomes
    snap = capture(leases, a, batcher, epoch=0, weights=None)
    assert len(a.completed) == 28 and failed in a.completed
    assert snap.completed == [] and snap.completed_epochs == [0, 1]
    assert [e.epoch for e in snap.completed_bits] == [2]
    assert snap.attempts == {failed: 2, refused[0]: 2}
    # the refused attempt is forgotten once its prompt completed: a late sample of it is
    # a duplicate of the complete group, as it was while the attempt was still kept
    assert snap.refused == [] and not a.refused
    late = traj(refused[0], 1, 0, attempt=refused[1])
    assert a.on_scored(late) == "duplicate"


def test_a_prompt_dropped_after_its_last_attempt_counts_as_complete(tmp_path: Path) -> None:
    """Three failed attempts drop a prompt for good: it counts as complete, what is held
    of it goes (counted), and a late sample of it (an actor thought dead) is a duplicate,
    not a group in the making kept in every snapshot for the rest of the run."""
    sm, journal, leases, a = buffer_parts(tmp_path)
    first = leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
    uid = first.prompts[0].uid
    lease = first
    for attempt in (1, 2, 3):
        assert lease.prompts[0].uid == uid and lease.prompts[0].attempt == attempt
        if attempt == 3:  # half of a group arrives before the last lease is given up
            assert a.on_scored(traj(uid, 0, 0, attempt=lease.lease_id)) == "pending"
        assert leases.return_prompt(uid, "aborted", lease_id=lease.lease_id)
        if attempt < 3:
            lease = leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
    assert journal.counters["dropped_prompts"] == 1 and uid not in leases.leased
    assert uid in a.completed and uid not in a.groups
    assert journal.counters["dropped_prompt_samples"] == 1
    assert a.on_scored(traj(uid, 1, 0, attempt=lease.lease_id)) == "duplicate"
    snap = capture(leases, a, Batcher(a, sm, journal, batch_size=2), epoch=0, weights=None)
    assert snap.partial == [] and uid not in [p.uid for p in snap.pool]


def test_a_roll_back_that_drops_a_prompt_in_the_making_abandons_it_once(tmp_path: Path) -> None:
    """A trainer restart abandons the groups in the making and returns their leases; a
    prompt on its last attempt is dropped by that return, with its group already gone."""
    _, journal, leases, a = buffer_parts(tmp_path)
    lease = leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
    uid = lease.prompts[0].uid
    for _ in range(2):  # two failed attempts
        assert leases.return_prompt(uid, "aborted", lease_id=lease.lease_id)
        lease = leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), now=0.0)
    assert a.on_scored(traj(uid, 0, 0, attempt=lease.lease_id)) == "pending"
    assert a.roll_back(0, epoch=1, served=[]) == 0
    assert journal.counters["dropped_prompts"] == 1 and uid in a.completed
    assert not a.groups and "dropped_prompt_samples" not in journal.counters


def test_a_snapshot_holds_leased_prompts_by_id_and_restores_them_with_their_records(
    tmp_path: Path,
) -> None:
    """The prompts out on lease, the answered leases (which hold them again) and the
    returned ones in the pool are written without their records: a snapshot does not grow
    with the records' length. A restored buffer gets each record back from its dataset
    (the record itself, not a copy), and a prompt that names no record of it (or an older
    snapshot's prompt with its record) comes back as it was written."""
    # records of 5 KB: written with every prompt (11 leased, 12 in the answers, 1 in the
    # pool), the snapshot was 122 KB
    big = "x" * 5_000
    sm, journal, leases, a = buffer_parts(tmp_path, text=big)
    batcher = Batcher(a, sm, journal, batch_size=2)
    for actor in range(4):
        lease = leases.grant(
            LeaseRequest(actor_id=f"r{actor}", max_episodes=3, request_id=f"q{actor}"), now=0.0
        )
        assert len(lease.prompts) == 3
    returned = leases.leased[next(iter(leases.leased))]
    assert leases.return_prompt(returned.prompt.uid, "aborted", lease_id=returned.lease_id)
    leases.source.pool.append(Prompt(uid="elsewhere-x", data={}))  # names no record
    data = encode(capture(leases, a, batcher, epoch=0, weights=None))
    assert len(data) < 3_000, len(data)
    snap = decode(data, BufferSnapshot)
    assert all(not r.prompt.data for r in snap.leased) and len(snap.leased) == 11
    assert all(not p.data for ans in snap.answers for p in ans.lease.prompts)

    _, _, again, b = buffer_parts(tmp_path / "again", text=big)
    restore(snap, again, b, Batcher(b, sm, journal, batch_size=2), 0.0, run_dir=tmp_path)
    records = again.source.records
    for uid, entry in again.leased.items():
        assert entry.prompt.data is records[int(uid.split("-")[1])]  # held once, not copied
        assert entry.prompt == leases.leased[uid].prompt
    assert [p.uid for p in again.source.pool] == [returned.prompt.uid, "elsewhere-x"]
    assert again.source.pool[0] == leases.source.pool[0]
    assert again.source.pool[1].data == {}
    assert again.answers == leases.answers
    # the same request again gets the same lease, its prompts with their records
    repeat = again.grant(LeaseRequest(actor_id="r1", max_episodes=3, request_id="q1"), 1.0)
    assert repeat == leases.answers["r1"][1] and all(p.data["prompt"] for p in repeat.prompts)
    # an older snapshot, its prompts with their records, restores the same
    old = snap.model_copy(
        update={
            "leased": [
                r.model_copy(update={"prompt": e.prompt})
                for r, e in zip(snap.leased, leases.leased.values(), strict=True)
            ]
        }
    )
    _, _, third, c = buffer_parts(tmp_path / "third", text=big)
    restore(old, third, c, Batcher(c, sm, journal, batch_size=2), 0.0, run_dir=tmp_path)
    assert {u: e.prompt for u, e in third.leased.items()} == {
        u: e.prompt for u, e in leases.leased.items()
    }


def buffer_parts(
    tmp_path: Path, text: str = ""
) -> tuple[StalenessManager, Journal, LeaseBook, Admission]:
    """The buffer's staleness, journal, lease book (10 prompts, ``text`` in each) and
    admission (groups of 2), as the buffer wires them."""
    sm = StalenessManager(batch_size=2, max_concurrent=64, max_head_offpolicyness=100)
    tmp_path.mkdir(parents=True, exist_ok=True)
    journal = Journal(tmp_path / "events.jsonl")
    records = [{"prompt": f"q{i}{text}", "answer": str(i)} for i in range(10)]
    leases = LeaseBook(PromptSource(records, 1), sm, journal, ttl=30, incarnation="x")
    return sm, journal, leases, Admission(sm, leases, journal, group_size=2, dynamic_filter=False)
