"""The buffer's bookkeeping, driven directly (no bus needed for leases and admission)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest

from asyncrl.actors.buffer import BufferActor
from asyncrl.actors.buffer.admission import group_head_if_valid
from asyncrl.config.recipe import load_recipe
from asyncrl.observe.audit import read_jsonl
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.messages import (
    ActorExit,
    Array,
    Lease,
    LeaseRequest,
    Trajectory,
    TrajectoryGroup,
)


def make_buffer(tmp_path: Path, *overrides: str) -> BufferActor:
    recipe = load_recipe(
        None,
        [
            "data.size=50",
            "rollout.group_size=2",
            "buffer.batch_size=2",
            "buffer.max_concurrent=10",
            "buffer.max_head_offpolicyness=1",
            *overrides,
        ],
    )
    ctx = ActorContext(
        run_name="t", run_dir=tmp_path, nats=NatsInfo(url="nats://127.0.0.1:1"), recipe=recipe
    )
    return BufferActor(ctx)


def sample(prompt_uid: str, i: int, version: int, reward: float, generated: int = 2) -> Trajectory:
    n = 1 + generated
    return Trajectory(
        uid=f"{prompt_uid}/{i}",
        prompt_uid=prompt_uid,
        group_index=i,
        group_size=2,
        input_ids=Array.of(list(range(1, n + 1)), "int32"),
        loss_mask=Array.of([0] + [1] * generated, "bool"),
        logprobs=Array.of([0] + [-1] * generated, "float32"),
        versions=Array.of([-1] + [version] * generated, "int32"),
        reward=reward,
    )


async def lease(buf: BufferActor, n: int, actor: str = "r0") -> Lease:
    reply = await buf.on_lease(LeaseRequest(actor_id=actor, max_episodes=n))
    assert isinstance(reply, Lease)
    return reply


async def test_lease_respects_capacity_and_groups_are_admitted_whole(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    got = await lease(buf, 100)
    assert len(got.prompts) == 4  # min(10, (1 + 0 + 1)·2)
    assert len((await lease(buf, 5)).prompts) == 0
    uid = got.prompts[0].uid
    await buf.on_scored(sample(uid, 0, 0, 1.0))
    assert not buf.admission.ready and buf.staleness.running == 4
    await buf.on_scored(sample(uid, 0, 0, 1.0))  # a duplicate delivery
    assert buf.counters["duplicates"] == 1
    await buf.on_scored(sample(uid, 1, 0, 0.0))
    assert (
        len(buf.admission.ready) == 1 and buf.staleness.accepted == 1 and buf.staleness.running == 3
    )


async def test_stale_groups_are_rejected_and_give_their_budget_back(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    got = await lease(buf, 4)
    buf.staleness.set_version(2)
    uid = got.prompts[0].uid
    await buf.on_scored(sample(uid, 0, 0, 1.0))
    await buf.on_scored(sample(uid, 1, 1, 1.0))  # oldest token: version 0, 2 − 0 > η
    assert not buf.admission.ready and buf.staleness.rejected == 1 and buf.staleness.accepted == 0


async def test_a_batch_takes_the_groups_that_go_stale_first(tmp_path: Path) -> None:
    """A group leased at version 0 whose episodes ran long is admitted after two groups
    leased at version 1: the batch takes it (head 0, stale at version 2) and the older of
    the two others, in admission order, rather than the first two admitted, which would
    have let it expire at the next version."""
    buf = make_buffer(tmp_path)
    first = [p.uid for p in (await lease(buf, 4)).prompts]  # version 0: (0 + 2)·2 = 4
    for uid in first[1:]:
        await buf.on_scored(sample(uid, 0, 0, 1.0))
        await buf.on_scored(sample(uid, 1, 0, 0.0))
    buf.batcher.ready()
    assert buf.batcher.take(0, {}).step == 0  # three of version 0 ready: two trained
    buf.staleness.set_version(1)
    late = first[0]
    e, f = [p.uid for p in (await lease(buf, 2)).prompts]
    for uid, head in ((e, 1), (f, 1), (late, 0)):
        await buf.on_scored(sample(uid, 0, head, 1.0))
        await buf.on_scored(sample(uid, 1, head, 0.0))
    assert [g.prompt_uid for g in buf.admission.ready] == [first[3], e, f, late]
    assert buf.batcher.ready()
    batch = buf.batcher.take(1, {})
    assert [g.prompt_uid for g in batch.groups] == [first[3], late]
    assert [g.prompt_uid for g in buf.admission.ready] == [e, f]
    buf.staleness.set_version(2)
    assert buf.batcher.ready() and buf.staleness.rejected == 0  # nothing went stale


async def test_dynamic_filter_drops_groups_without_signal(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, "buffer.dynamic_filter=true")
    got = await lease(buf, 4)
    a, b = got.prompts[0].uid, got.prompts[1].uid
    for i in range(2):
        await buf.on_scored(sample(a, i, 0, 1.0))
    await buf.on_scored(sample(b, 0, 0, 1.0))
    await buf.on_scored(sample(b, 1, 0, 0.0))
    assert [g.prompt_uid for g in buf.admission.ready] == [b]
    assert buf.counters["filtered_groups"] == 1 and buf.staleness.accepted == 1


async def test_dynamic_filter_judges_the_shaped_rewards_the_advantages_use(
    tmp_path: Path,
) -> None:
    # budget 10, overlong buffer 4: 3 tokens are free, 9 tokens lose 0.75
    buf = make_buffer(
        tmp_path,
        "buffer.dynamic_filter=true",
        "rollout.sampling.max_new_tokens=10",
        "trainer.shaping.overlong_buffer=4",
    )
    got = await lease(buf, 4)
    a, b = got.prompts[0].uid, got.prompts[1].uid
    # a: equal raw rewards, different lengths: the overlong penalty is a signal, kept
    await buf.on_scored(sample(a, 0, 0, 1.0, generated=3))
    await buf.on_scored(sample(a, 1, 0, 1.0, generated=9))
    # b: equal raw rewards, both within the free zone: equal shaped rewards, dropped
    await buf.on_scored(sample(b, 0, 0, 1.0, generated=2))
    await buf.on_scored(sample(b, 1, 0, 1.0, generated=5))
    assert [g.prompt_uid for g in buf.admission.ready] == [a]
    assert buf.counters["filtered_groups"] == 1


async def test_an_exited_actor_returns_its_prompts_first_in_line(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    held = [p.uid for p in (await lease(buf, 2, actor="dead")).prompts]
    await buf.on_exit(ActorExit(role="rollout", actor_id="dead", ok=False))
    assert buf.staleness.running == 0 and not buf.leases.leased
    again = [p.uid for p in (await lease(buf, 2, actor="alive")).prompts]
    assert sorted(again) == sorted(held)
    buf.journal.close()
    events = read_jsonl(tmp_path / "buffer_events.jsonl")
    assert [e["event"] for e in events].count("return") == 2


async def deliver(buf: BufferActor, samples: list[Trajectory], as_group: bool) -> None:
    """``samples`` of one prompt and attempt, as one group message or one message each."""
    if as_group:
        await buf.on_scored_group(TrajectoryGroup.of(samples))
    else:
        for t in samples:
            await buf.on_scored(t)


def state(buf: BufferActor) -> tuple[object, ...]:
    """What admission decides: budget, counters, the pool, leases, ready groups."""
    sm = buf.staleness
    return (
        sm.running,
        sm.accepted,
        sm.rejected,
        dict(buf.counters),
        [p.uid for p in buf.leases.source.pool],
        sorted(buf.leases.leased),
        [(g.prompt_uid, [t.uid for t in g.samples]) for g in buf.admission.ready],
    )


def attempt(samples: list[Trajectory], lease_id: str) -> list[Trajectory]:
    return [t.model_copy(update={"attempt": lease_id}) for t in samples]


async def test_a_group_message_is_admitted_in_one_go_and_its_redelivery_is_a_duplicate(
    tmp_path: Path,
) -> None:
    buf = make_buffer(tmp_path)
    got = await lease(buf, 4)
    uid = got.prompts[0].uid
    group = attempt([sample(uid, 0, 0, 1.0), sample(uid, 1, 0, 0.0)], got.lease_id)
    await deliver(buf, group, as_group=True)
    [admitted] = buf.admission.ready
    assert admitted.prompt_uid == uid and [t.uid for t in admitted.samples] == [
        f"{uid}/0",
        f"{uid}/1",
    ]
    assert buf.staleness.accepted == 1 and buf.staleness.running == 3
    await deliver(buf, group, as_group=True)  # the stream delivers it again
    assert len(buf.admission.ready) == 1 and buf.staleness.accepted == 1
    assert buf.counters["duplicates"] == 2


BROKEN = {
    "invalid sample": {"reward": float("nan")},
    "trained prompt token": {"loss_mask": Array.of([1, 1, 1], "bool")},
    "future version": {"versions": Array.of([-1, 5, 5], "int32")},
    "positive logprob": {"logprobs": Array.of([0, -1, 0.5], "float32")},
    "negative token id": {"input_ids": Array.of([1, -2, 3], "int32")},
    "no token": {
        name: Array.of([], dtype)
        for name, dtype in (
            ("input_ids", "int32"),
            ("loss_mask", "bool"),
            ("logprobs", "float32"),
            ("versions", "int32"),
        )
    },
    "old epoch": {"epoch": 1},
    "other dtype": {"loss_mask": Array.of([0, 1, 1], "uint8")},  # valid, judged one by one
    "other index": {"group_index": 0},  # two samples of episode 0: a duplicate
}
"""The second sample of the second group, changed: each breaks one rule of
``invalid_reason`` (or, the last two, leaves the group's form the one-go path takes)."""


def test_a_valid_group_is_judged_in_one_go_and_any_broken_one_is_left_to_the_rules() -> None:
    valid = [sample("p", 0, 3, 1.0), sample("p", 1, 2, 0.0, generated=4)]
    judge = functools.partial(group_head_if_valid, group_size=2, version=3, epoch=0)
    assert judge(valid) == 2  # the oldest generated token's version
    assert judge(valid[:1]) is None and judge(valid, version=2) is None
    for case, update in BROKEN.items():
        broken = [valid[0], valid[1].model_copy(update=update)]
        assert judge(broken) is None, case
    # greedy calls only (``per_call`` sampling): no token of a policy, nothing trained
    untrained = [
        t.model_copy(
            update={
                "versions": Array.of([-1] * len(t.input_ids), "int32"),
                "loss_mask": Array.of([0] * len(t.input_ids), "bool"),
            }
        )
        for t in valid
    ]
    assert judge(untrained) == -1


@pytest.mark.parametrize(
    "case", ["admitted", *BROKEN, "lease expired", "stale", "half held", "filtered"]
)
async def test_a_group_message_is_judged_as_its_samples_one_by_one(
    tmp_path: Path, case: str
) -> None:
    """The same story told through group messages and through per-sample messages ends in
    the same state: budget, counters, pool, leases and ready groups (the buffer judges the
    common group message in one go, :func:`group_head_if_valid`, and must end where the
    sample-by-sample rules end)."""
    outcomes = []
    for as_group in (True, False):
        run_dir = tmp_path / ("groups" if as_group else "samples")
        run_dir.mkdir()
        filtered = ["buffer.dynamic_filter=true"] if case == "filtered" else []
        buf = make_buffer(run_dir, "rollout.lease_ttl=10", *filtered)
        got = await lease(buf, 2)
        first, second = (p.uid for p in got.prompts)
        groups = [
            attempt([sample(first, 0, 0, 1.0), sample(first, 1, 0, 0.0)], got.lease_id),
            attempt([sample(second, 0, 0, 0.0), sample(second, 1, 0, 1.0)], got.lease_id),
        ]
        if case in BROKEN:
            groups[1][1] = groups[1][1].model_copy(update=BROKEN[case])
        elif case == "filtered":
            groups[1][1] = groups[1][1].model_copy(update={"reward": 0.0})
        elif case == "half held":  # a sample came alone before its group's message
            await buf.on_scored(groups[1][0])
        elif case == "lease expired":
            # the actor went silent: its prompts are back in the pool when its groups come
            assert buf.leases.expire(time.monotonic() + 11) == ["r0"]
            assert buf.staleness.running == 0 and len(buf.leases.source.pool) == 2
        elif case == "stale":
            buf.version = 2  # weights 2 are out: groups of head 0 are too stale (η = 1)
        for samples in groups:
            await deliver(buf, samples, as_group)
        outcomes.append(state(buf))
    assert outcomes[0] == outcomes[1]
    running, accepted, rejected, counters, pool, leased, ready = outcomes[0]
    if case == "admitted":
        assert len(ready) == 2 and running == 0 and accepted == 2
    elif case == "invalid sample":
        assert len(ready) == 1 and counters["invalid_nonfinite_reward"] == 1 and len(pool) == 1
    elif case in ("other dtype", "half held"):
        assert len(ready) == 2 and accepted == 2
    elif case == "other index":
        assert len(ready) == 1 and counters["duplicates"] == 1
    elif case == "filtered":
        assert len(ready) == 1 and counters["filtered_groups"] == 1
    elif case in BROKEN:
        assert len(ready) == 1 and counters["invalid_samples"] == 1 and len(pool) == 1
    elif case == "lease expired":
        # admitted all the same, taken out of the pool and counted as running work done
        assert len(ready) == 2 and pool == [] and leased == [] and accepted == 2
        assert counters["expired_leases"] == 1
    else:
        assert ready == [] and rejected == 2 and counters["rejected_samples"] == 4


async def test_a_prompt_leased_again_after_its_group_was_admitted_gives_its_budget_back(
    tmp_path: Path,
) -> None:
    """A replacement buffer that never wrote a lease admits that lease's group when it
    arrives, then leases the prompt again (its dataset position rewound): the second run's
    samples are duplicates, and its lease ends with them instead of holding budget for a
    group that can never be admitted twice."""
    buf = make_buffer(tmp_path)
    got = await lease(buf, 1)
    uid = got.prompts[0].uid
    del buf.leases.leased[uid]  # the lease the dead buffer never wrote
    buf.staleness.on_abort(1)
    first = attempt([sample(uid, 0, 0, 1.0), sample(uid, 1, 0, 0.0)], got.lease_id)
    await deliver(buf, first, as_group=True)
    assert len(buf.admission.ready) == 1 and buf.staleness.running == 0
    buf.leases.source.give_back(got.prompts[0])  # as the rewound position hands it out
    again = await lease(buf, 1)
    assert [p.uid for p in again.prompts] == [uid] and buf.staleness.running == 1
    await deliver(buf, attempt(first, again.lease_id), as_group=True)
    assert buf.staleness.running == 0 and uid not in buf.leases.leased
    assert buf.counters["rerun_leases_ended"] == 1 and buf.counters["duplicates"] == 2
    assert len(buf.admission.ready) == 1 and buf.staleness.accepted == 1
