"""Trajectories that make no sense are refused at the buffer, each with its reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_buffer import lease, make_buffer

from asyncrl.actors.buffer.admission import invalid_reason
from asyncrl.observe.audit import read_jsonl
from asyncrl.wire.messages import Array, LeaseRequest, Trajectory


def traj(**changes: Any) -> Trajectory:
    """A sensible sample (prompt of 2 tokens, 3 generated at version 1), then ``changes``."""
    fields: dict[str, Any] = {
        "uid": "p/0",
        "prompt_uid": "p",
        "group_index": 0,
        "group_size": 2,
        "input_ids": Array.of([5, 6, 7, 8, 9], "int32"),
        "loss_mask": Array.of([0, 0, 1, 1, 1], "bool"),
        "logprobs": Array.of([0, 0, -0.5, -1.0, -2.0], "float32"),
        "versions": Array.of([-1, -1, 1, 1, 1], "int32"),
        "reward": 1.0,
    }
    fields.update(changes)
    return Trajectory.model_construct(**fields)  # no validator: the wire may carry anything


def reason(t: Trajectory, version: int = 1) -> str | None:
    return invalid_reason(t, group_size=2, version=version)


def test_a_sensible_sample_passes() -> None:
    assert reason(traj()) is None
    assert reason(traj(reward=0.0, group_index=1)) is None


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"logprobs": Array.of([0, 0, -1.0], "float32")}, "length_mismatch"),
        ({"input_ids": Array.of([[5, 6, 7, 8, 9]], "int32")}, "length_mismatch"),
        ({"group_size": 4}, "group_size_mismatch"),
        ({"group_index": 2}, "group_index_out_of_range"),
        ({"group_index": -1}, "group_index_out_of_range"),
        ({"reward": None}, "missing_reward"),
        ({"reward": float("nan")}, "nonfinite_reward"),
        (
            {
                k: Array.of([], "float32")
                for k in ("input_ids", "loss_mask", "logprobs", "versions")
            },
            "no_token",
        ),
        ({"loss_mask": Array.of([0, 1, 1, 1, 1], "bool")}, "loss_on_prompt_token"),
        ({"loss_mask": Array.of([1, 0, 0, 0, 0], "bool")}, "loss_on_prompt_token"),
        ({"versions": Array.of([-1, -1, 1, 2, 2], "int32")}, "future_version"),
        ({"logprobs": Array.of([0, 0, -0.5, float("nan"), -2.0], "float32")}, "bad_logprobs"),
        ({"logprobs": Array.of([0, 0, -0.5, 0.7, -2.0], "float32")}, "bad_logprobs"),
        ({"input_ids": Array.of([5, 6, -7, 8, 9], "int32")}, "negative_token_id"),
    ],
)
def test_each_reason(changes: dict[str, Any], expected: str) -> None:
    assert reason(traj(**changes)) == expected


def test_a_sample_without_a_generated_token_passes() -> None:
    """An episode of greedy calls only (``rollout.endpoint_sampling = "per_call"``): every
    token is context, version -1, logprob 0. It trains nothing but keeps its place in its
    group's baseline."""
    context = traj(
        loss_mask=Array.of([0, 0, 0, 0, 0], "bool"),
        logprobs=Array.of([0, 0, 0, 0, 0], "float32"),
        versions=Array.of([-1, -1, -1, -1, -1], "int32"),
    )
    assert reason(context) is None
    assert context.head_version == -1


def test_a_version_is_from_the_future_only_beyond_the_buffers() -> None:
    t = traj(versions=Array.of([-1, -1, 1, 2, 2], "int32"))
    assert reason(t, version=1) == "future_version"
    assert reason(t, version=2) is None


def scored(prompt: str, i: int, attempt: str = "", **changes: Any) -> Trajectory:
    return traj(uid=f"{prompt}/{i}", prompt_uid=prompt, group_index=i, attempt=attempt, **changes)


async def test_an_invalid_sample_abandons_its_group_and_returns_the_prompt(
    tmp_path: Path,
) -> None:
    buf = make_buffer(tmp_path)
    buf.version = 1
    got = await lease(buf, 2)
    bad, good = got.prompts[0].uid, got.prompts[1].uid
    await buf.on_scored(scored(bad, 0, got.lease_id, versions=traj().versions))
    await buf.on_scored(scored(bad, 1, got.lease_id, reward=None))
    for i in range(2):
        await buf.on_scored(scored(good, i, got.lease_id))
    assert [g.prompt_uid for g in buf.admission.ready] == [good]
    assert buf.counters["invalid_missing_reward"] == 1 and buf.counters["invalid_samples"] == 1
    # the bad prompt's budget came back and the prompt is first in line again
    assert buf.staleness.running == 0 and bad not in buf.leases.leased
    assert [p.uid for p in buf.leases.source.pool] == [bad]
    # what else that attempt sends is refused with it; the next attempt starts clean
    await buf.on_scored(scored(bad, 1, got.lease_id))
    assert buf.counters["invalid_group_rest"] == 1 and not buf.admission.groups
    again = buf.leases.grant(LeaseRequest(actor_id="r0", max_episodes=1), 0.0)
    assert [p.uid for p in again.prompts] == [bad]
    for i in range(2):
        await buf.on_scored(scored(bad, i, again.lease_id))
    assert [g.prompt_uid for g in buf.admission.ready] == [good, bad]
    buf.journal.close()
    events = read_jsonl(tmp_path / "buffer_events.jsonl")
    assert any(e["event"] == "invalid" and e["reason"] == "missing_reward" for e in events)
