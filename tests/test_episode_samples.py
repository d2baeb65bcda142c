"""Episodes of several samples (agent code whose calls do not all continue one another):
every sample is trained, with the baseline and scale of its group's episodes. The
advantages against hand-computed numbers, the buffer's whole groups, the trainer's batch,
and the endpoint workflow that makes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripted_engine import ScriptedEngine
from test_buffer import lease, make_buffer
from train_helpers.tiny import tiny_engine, train_config

from asyncrl.actors.buffer import BufferActor
from asyncrl.actors.buffer.admission import (
    admitted_group,
    group_complete,
    invalid_reason,
    raw_rewards,
)
from asyncrl.actors.buffer.durable import capture, restore
from asyncrl.algo.advantages import episode_advantages, group_advantages
from asyncrl.config.recipe import load_recipe
from asyncrl.endpoint import OpenAIAgentWorkflow, OpenAIEndpoint
from asyncrl.endpoint.recording import Call, episode_samples
from asyncrl.models.tiny import build_tokenizer
from asyncrl.observe.records import SAMPLES_FILE, StepRecords, agent_metrics, batch_stats
from asyncrl.train import LossConfig
from asyncrl.train.batch import build_samples
from asyncrl.wire.messages import ActorExit, Array, Trajectory


def traj(
    prompt: str, episode: int, reward: float, k: int = 0, n: int = 1, group_size: int = 2
) -> Trajectory:
    return Trajectory(
        uid=f"{prompt}/{episode}" + (f"/{k}" if n > 1 else ""),
        prompt_uid=prompt,
        group_index=episode,
        group_size=group_size,
        episode_sample=k,
        episode_samples=n,
        input_ids=Array.of([1, 2, 3], "int32"),
        loss_mask=Array.of([0, 1, 1], "bool"),
        logprobs=Array.of([0.0, -1.0, -1.0], "float32"),
        versions=Array.of([-1, 0, 0], "int32"),
        reward=reward,
        finish_reason="stop",
        reward_info={
            "turns": 2 if n > 1 else 1,
            "tool_calls": 0,
            "tool_errors": {},
            "turns_to_go": n - 1 - k,
        },
    )


def test_episode_advantages_by_hand() -> None:
    """One group of 3 episodes, rewards R = (1, 0, 0.5): mean 0.5, unbiased std 0.5, so
    GRPO gives A = (1, −1, 0) (÷ (0.5 + eps) · 0.5). Episode 0 gave two samples, the first
    ending k = 2 calls before the last: with γ = 0.5 it gets γ² · A_0 = 0.25, the second
    A_0 = 1. Dr.GRPO (no std): A = (0.5, −0.5, 0), so (0.125, 0.5, −0.5, 0). RLOO, no std:
    episode 0's baseline is the others' mean 0.25, A_0 = 0.75: (0.1875, 0.75, −0.75, 0)."""
    episode_of = [torch.tensor([0, 0, 1, 2])]
    to_go = [torch.tensor([2, 0, 0, 0])]
    episode_r = torch.tensor([[1.0, 0.0, 0.5]])
    eps = 1e-6
    (adv,) = episode_advantages(episode_r, episode_of, to_go, turn_discount=0.5, eps=eps)
    expected = [0.25, 1.0, -1.0, 0.0]
    assert adv.tolist() == pytest.approx([x * 0.5 / (0.5 + eps) for x in expected], abs=1e-6)
    # one sample per episode: exactly GRPO
    (single,) = episode_advantages(
        episode_r, [torch.arange(3)], [torch.zeros(3, dtype=torch.long)], turn_discount=0.5
    )
    assert single.tolist() == pytest.approx(group_advantages(episode_r)[0].tolist())
    (dr,) = episode_advantages(episode_r, episode_of, to_go, turn_discount=0.5, std_level=None)
    assert dr.tolist() == pytest.approx([0.125, 0.5, -0.5, 0.0])
    (loo,) = episode_advantages(
        episode_r, episode_of, to_go, turn_discount=0.5, std_level=None, leave_one_out=True
    )
    assert loo.tolist() == pytest.approx([0.1875, 0.75, -0.75, 0.0])
    # equal episode rewards carry no signal: no sample of theirs is pushed either way
    (flat,) = episode_advantages(
        torch.tensor([[1.0, 1.0]]),
        [torch.tensor([0, 0, 1])],
        [torch.tensor([1, 0, 0])],
        turn_discount=0.5,
    )
    assert flat.tolist() == [0.0, 0.0, 0.0]


def test_the_trainer_batch_of_episodes_of_several_samples() -> None:
    """Two groups of 2 episodes: p0 = [e0: 1.0 (k = 1), 1.0 | e1: 0.0], p1 = [e0: 1.0 |
    e1: 1.0]. p0's episode rewards (1, 0): mean 0.5, unbiased std 2^−½, A = ±0.5/s; the
    first sample of e0 ended one call early: γ · A with γ = 0.9. p1 is flat: 0."""
    # p0's samples arrive out of order: the group puts them in episode order
    p0 = admitted_group(
        [traj("p0", 1, 0.0), traj("p0", 0, 1.0, 1, 2), traj("p0", 0, 1.0, 0, 2)], raw_rewards
    )
    p1 = admitted_group([traj("p1", 0, 1.0), traj("p1", 1, 1.0)], raw_rewards)
    assert [t.uid for t in p0.samples] == ["p0/0/0", "p0/0/1", "p0/1"]
    assert p0.final_positions == [1, 2] and p1.final_positions == [0, 1]
    loss = load_recipe(None, ["rollout.group_size=2"]).trainer.loss
    samples, _ = build_samples([p0, p1], loss, turn_discount=0.9)
    s = 2**-0.5 + 1e-6  # the unbiased std of (1, 0)
    expected = [0.9 * 0.5 / s, 0.5 / s, -0.5 / s, 0.0, 0.0]
    assert [x.advantages for x in samples] == pytest.approx(expected, abs=1e-5)
    # One id per (group, episode): p0's e0 (two samples), p0's e1, p1's e0, p1's e1.
    assert [x.episode for x in samples] == [0, 0, 1, 2, 3]
    # and one per group, whose prompt the trainer may forward once (trainer.share_prefix)
    assert [x.group for x in samples] == [0, 0, 0, 1, 1]
    stats = batch_stats([p0, p1], 256)
    assert stats["reward_groups/all_one"] == 0.5  # p1 only: p0 is told by prompt, not by 2s
    batch = [*p0.samples, *p1.samples]
    assert agent_metrics(batch)["agent/turns"] == pytest.approx((2 + 1 + 1 + 1) / 4)


def shift_groups(c: float) -> list:
    """Two groups of 3 episodes of 1 to 3 samples each, every reward shifted by ``c``; the
    samples' rewards and calls to go are what :func:`episode_samples` makes of them."""
    calls_per_sample = {  # episode: the calls of each of its samples (none continue)
        0: [[0], [1], [2]],
        1: [[0], [1]],
        2: [[0]],
    }
    groups = []
    for prompt, rewards in (("a", (1.0, 0.0, 0.5)), ("b", (1.0, 1.0, 0.25))):
        trajectories = []
        for episode, reward in enumerate(rewards):
            calls = [
                Call([1, 2 + i], [3 + i, 4], [-0.5, -0.5], [0, 0], "stop")
                for i in range(len(calls_per_sample[episode]))
            ]
            made = episode_samples(calls, reward + c)
            assert [m.calls for m in made] == calls_per_sample[episode]
            for k, m in enumerate(made):
                trajectories.append(
                    m.trace.to_trajectory(
                        prompt,
                        episode,
                        3,
                        {},
                        "",
                        "stop",
                        reward=m.reward,
                        reward_info={"turns_to_go": m.calls_to_go},
                    ).model_copy(update={"episode_sample": k, "episode_samples": len(made)})
                )
        groups.append(admitted_group(trajectories, raw_rewards))
    return groups


@pytest.mark.parametrize("std", ["group", "none"])
def test_a_reward_shift_changes_no_advantage(std: str) -> None:
    """GRPO and Dr.GRPO with γ = 0.5 and episodes of several samples: adding c = 3 to every
    reward moves every baseline by c and no advantage. Discounting the rewards instead
    (r · γ^k) would not: group b's episodes 0 and 1 both score 1, yet a first sample of
    episode 0 (k = 2) would get 0.25·(1 + c) against a baseline near 1 + c."""
    loss = load_recipe(
        None, ["rollout.group_size=3", f"trainer.loss.adv_std_level={std!r}"]
    ).trainer.loss
    base, _ = build_samples(shift_groups(0.0), loss, turn_discount=0.5)
    shifted, _ = build_samples(shift_groups(3.0), loss, turn_discount=0.5)
    assert len(base) == 2 * (3 + 2 + 1)
    assert [float(x.advantages) for x in shifted] == pytest.approx(
        [float(x.advantages) for x in base], abs=1e-5
    )
    # the sample of an episode's last call has the episode's advantage; earlier ones γ^k of it
    a = [float(x.advantages) for x in base[:6]]
    assert a[0:3] == pytest.approx([0.25 * a[2], 0.5 * a[2], a[2]])


def test_a_group_is_whole_with_every_sample_of_every_episode() -> None:
    one, two_a, two_b = traj("p", 0, 1.0), traj("p", 1, 0.9, 0, 2), traj("p", 1, 1.0, 1, 2)
    assert not group_complete([one, two_a], 2)
    assert group_complete([one, two_a, two_b], 2)
    assert not group_complete([two_a, two_b], 2)
    bad = traj("p", 1, 1.0, 2, 2)
    assert invalid_reason(bad, group_size=2, version=0) == "episode_sample_out_of_range"


async def test_the_buffer_admits_the_group_once_every_sample_is_in(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    uid = (await lease(buf, 1)).prompts[0].uid
    for t in (traj(uid, 0, 1.0), traj(uid, 1, 0.9, 0, 2)):
        await buf.on_scored(t)
        assert not buf.admission.ready
    await buf.on_scored(traj(uid, 1, 1.0, 1, 2))
    (group,) = buf.admission.ready
    assert [(t.group_index, t.episode_sample) for t in group.samples] == [(0, 0), (1, 0), (1, 1)]
    assert group.prompt_uid == uid and group.final_positions == [0, 2]
    assert group.shaped_rewards == [1.0, 0.9, 1.0]  # shaped once, here (no shaping set)


FRESH_AGENT = """
async def agent(client, data):
    for question in ("first", "second"):  # two chats: the second does not continue the first
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}]
        )
    return 1.0
"""


async def test_an_episode_of_two_chats_trains_both_samples(tmp_path: Path) -> None:
    path = tmp_path / "agent.py"
    path.write_text(FRESH_AGENT)
    tok = build_tokenizer()
    async with ScriptedEngine(tok, lambda prompt: "ok") as engine:
        async with OpenAIEndpoint(engine, model_name="m", token="t") as ep:
            wf = OpenAIAgentWorkflow(ep, f"{path}:agent", group_size=2)
            out = await wf.arun_episode(engine, {"uid": "p", "question": "q"})
    assert out is not None
    assert [t.uid for t in out] == ["p/0/0", "p/0/1", "p/1/0", "p/1/1"]
    assert [t.reward for t in out] == [1.0] * 4  # undiscounted: the trainer discounts
    assert [t.reward_info["turns_to_go"] for t in out] == [1, 0, 1, 0]
    assert [(t.episode_sample, t.episode_samples) for t in out] == [(0, 2), (1, 2)] * 2
    first, second = out[0], out[1]
    assert "first" in tok.decode(first.input_ids.numpy().tolist())
    assert "second" in tok.decode(second.input_ids.numpy().tolist())
    assert "first" not in tok.decode(second.input_ids.numpy().tolist())
    assert all(invalid_reason(t, group_size=2, version=0) is None for t in out)
    assert group_complete(out, 2)


async def test_the_dynamic_filter_judges_the_episodes_rewards(tmp_path: Path) -> None:
    """Both episodes scored 1: no signal, whatever number of samples each gave."""
    buf = make_buffer(tmp_path, "buffer.dynamic_filter=true")
    uid = (await lease(buf, 1)).prompts[0].uid
    for t in (traj(uid, 0, 1.0), traj(uid, 1, 1.0, 0, 2), traj(uid, 1, 1.0, 1, 2)):
        await buf.on_scored(t)
    assert not buf.admission.ready and buf.counters["filtered_groups"] == 1


def by_attempt(prompt: str, episode: int, k: int, n: int, attempt: str, token: int) -> Trajectory:
    """Sample ``k`` of ``n`` of an episode as the lease ``attempt`` ran it: its generated
    tokens are ``token`` twice, which tells the attempts' continuations apart."""
    return traj(prompt, episode, float(k), k, n).model_copy(
        update={"attempt": attempt, "input_ids": Array.of([1, token, token], "int32")}
    )


async def expired_and_leased_again(buf: BufferActor) -> tuple[str, str, str]:
    """A prompt leased to r0 (attempt A), whose actor exits, leased again to r1 (attempt
    B): (prompt uid, A, B)."""
    first = await lease(buf, 1, actor="r0")
    await buf.on_exit(ActorExit(role="rollout", actor_id="r0", ok=False))
    second = await lease(buf, 1, actor="r1")
    uid = first.prompts[0].uid
    assert second.prompts[0].uid == uid and second.lease_id != first.lease_id
    return uid, first.lease_id, second.lease_id


def episode_tokens(buf: BufferActor) -> list[tuple[int, int, int]]:
    """(group index, episode sample, generated token) of the one admitted group."""
    (group,) = buf.admission.ready
    return [(t.group_index, t.episode_sample, int(t.input_ids.numpy()[1])) for t in group.samples]


async def test_an_episode_is_never_pieced_together_from_two_attempts(tmp_path: Path) -> None:
    """Attempt A delivers episode 0 whole (token 10) and sample 0 of episode 1's two
    (token 11); its lease expires. Attempt B delivers episode 1 whole: samples 0 and 1
    (tokens 20, 21). Episode 1 is B's two samples (not A's 11 with B's 21); episode 0
    stays A's, a whole episode of the same prompt. A's sample 0 of episode 1 is superseded
    (1 sample), and A's late sample 1 of it is a duplicate (1)."""
    buf = make_buffer(tmp_path)
    uid, a, b = await expired_and_leased_again(buf)
    for t in (by_attempt(uid, 0, 0, 1, a, 10), by_attempt(uid, 1, 0, 2, a, 11)):
        assert buf.admission.on_scored(t) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 1, 0, 2, b, 20)) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 1, 1, 2, b, 21)) == "admitted"
    assert episode_tokens(buf) == [(0, 0, 10), (1, 0, 20), (1, 1, 21)]
    assert buf.counters["superseded_partial_samples"] == 1 and buf.counters["duplicates"] == 0
    assert buf.admission.on_scored(by_attempt(uid, 1, 1, 2, a, 12)) == "duplicate"
    assert buf.counters["duplicates"] == 1


async def test_attempts_that_disagree_on_episode_samples_are_not_mixed(tmp_path: Path) -> None:
    """A's episode 1 had three samples and delivered only sample 0 (token 11); B's gave
    two (tokens 20, 21). The episode is B's two samples, each saying 2 of them; a group of
    A's sample 0 (of 3) and B's sample 1 (of 2) would train a sample of another run as the
    first of B's episode. Then an episode of one sample from B (token 30) after A's sample
    0 of 2 (token 31) on episode 0: the episode is B's one sample, not two."""
    buf = make_buffer(tmp_path)
    uid, a, b = await expired_and_leased_again(buf)
    for t in (by_attempt(uid, 1, 0, 3, a, 11), by_attempt(uid, 0, 0, 2, a, 31)):
        assert buf.admission.on_scored(t) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 1, 0, 2, b, 20)) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 1, 1, 2, b, 21)) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 0, 0, 1, b, 30)) == "admitted"
    assert episode_tokens(buf) == [(0, 0, 30), (1, 0, 20), (1, 1, 21)]
    (group,) = buf.admission.ready
    assert [t.episode_samples for t in group.samples] == [1, 2, 2]
    assert group.final_positions == [0, 2]
    assert buf.counters["superseded_partial_samples"] == 2  # A's 11 and A's 31


async def test_an_attempt_whose_samples_disagree_on_episode_samples_is_refused(
    tmp_path: Path,
) -> None:
    """One attempt says its episode 1 has 2 samples, then 3: no count makes it whole, so
    the attempt is refused and the prompt returns to the pool, as for any invalid sample."""
    buf = make_buffer(tmp_path)
    uid = (got := await lease(buf, 1)).prompts[0].uid
    assert buf.admission.on_scored(by_attempt(uid, 1, 0, 2, got.lease_id, 11)) == "pending"
    assert buf.admission.on_scored(by_attempt(uid, 1, 1, 3, got.lease_id, 12)) == "invalid"
    assert buf.counters["invalid_episode_samples_mismatch"] == 1
    assert not buf.admission.groups and uid not in buf.leases.leased


async def test_a_restored_buffer_keeps_each_attempts_samples_apart(tmp_path: Path) -> None:
    """The snapshot holds A's and B's sample 0 of episode 1 (same sample id, tokens 11
    and 20): a buffer restored from it still tells them apart, and B's sample 1 (21) then
    completes episode 1 with B's 20, not A's 11."""
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    buf = make_buffer(tmp_path / "first")
    uid, a, b = await expired_and_leased_again(buf)
    for t in (
        by_attempt(uid, 0, 0, 1, a, 10),
        by_attempt(uid, 1, 0, 2, a, 11),
        by_attempt(uid, 1, 0, 2, b, 20),
    ):
        buf.admission.on_scored(t)
    snap = capture(buf.leases, buf.admission, buf.batcher, epoch=0, weights=None)
    again = make_buffer(tmp_path / "second")
    restore(snap, again.leases, again.admission, again.batcher, 0.0, run_dir=tmp_path)
    assert sum(len(g) for g in again.admission.groups.values()) == 3
    assert again.admission.on_scored(by_attempt(uid, 1, 1, 2, b, 21)) == "admitted"
    assert episode_tokens(again) == [(0, 0, 10), (1, 0, 20), (1, 1, 21)]


async def test_an_episode_of_greedy_calls_stays_in_its_groups_baseline(tmp_path: Path) -> None:
    """Episode 0's calls were all greedy (per_call sampling): no generated token, every
    version −1. The buffer at version 1 with η = 1 admits the group on episode 1's version
    0 (its −1 is no version: 1 − (−1) would be stale); the trainer gives episode 0 its
    place in the baseline, rewards (0, 1) → A = (−s, s), and no loss: the step is the step
    of episode 1 alone. Its records count no staleness for it."""
    buf = make_buffer(tmp_path)
    uid = (await lease(buf, 1)).prompts[0].uid
    buf.admission.staleness.version = 1
    greedy = [
        Call([1, 2], [3, 4], [-0.5, -0.5], [0, 0], "stop", temperature=0.0),
        Call([1, 2, 3, 4, 5], [6], [-0.5], [0], "stop", temperature=0.0),
    ]
    (untrained,) = episode_samples(greedy, 0.0)
    assert untrained.trace.loss_mask == [0] * 6 and untrained.sampled_with is None
    zero = untrained.trace.to_trajectory(uid, 0, 2, {}, "", "stop", reward=0.0)
    assert invalid_reason(zero, group_size=2, version=1) is None
    await buf.on_scored(zero)
    await buf.on_scored(traj(uid, 1, 1.0))
    (group,) = buf.admission.ready
    assert group.head_version == 0
    assert buf.admission.staleness.admissible(-1)  # a group of no generated token at all
    loss = load_recipe(None, ["rollout.group_size=2"]).trainer.loss
    samples, _ = build_samples([group], loss)
    assert [int(x.loss_mask.sum()) for x in samples] == [0, 2]
    s = 2**-0.5 + 1e-6  # the unbiased std of (0, 1)
    assert [float(x.advantages) for x in samples] == pytest.approx([-0.5 / s, 0.5 / s])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        config = train_config(loss=LossConfig(loss_agg=agg, behav_imp_weight_cap=None))
        both = tiny_engine(config).train_step(samples)
        alone = tiny_engine(config).train_step(samples[1:])
        assert both["loss"] == pytest.approx(alone["loss"], rel=1e-5), agg
        assert both["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5), agg
    records = StepRecords(load_recipe(None, ["rollout.group_size=2"]), tmp_path)
    records.open(0)
    record = records.step(2, 3, [group], {}, {}, {}, {}, {})  # trained at 2: episode 1 is 2 old
    records.close()
    assert (record["staleness_mean"], record["staleness_max"], record["staleness/2"]) == (2, 2, 1)
    lines = [json.loads(x) for x in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [x["staleness"] for x in lines] == [None, 2]
    assert [x["tokens"] for x in lines] == [len(x.input_ids) for x in samples]
