"""Episodes of several samples (agent code whose calls do not all continue one another):
every sample is trained, with the baseline and scale of its group's episodes. The
advantages against hand-computed numbers, the buffer's whole groups, the trainer's batch,
and the endpoint workflow that makes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scripted_engine import ScriptedEngine
from test_buffer import lease, make_buffer

from asyncrl.actors.buffer.admission import (
    admitted_group,
    group_complete,
    invalid_reason,
    raw_rewards,
)
from asyncrl.algo.advantages import episode_advantages, group_advantages
from asyncrl.config.recipe import load_recipe
from asyncrl.endpoint import OpenAIAgentWorkflow, OpenAIEndpoint
from asyncrl.models.tiny import build_tokenizer
from asyncrl.observe.records import agent_metrics, batch_stats
from asyncrl.train.batch import build_samples
from asyncrl.wire.messages import Array, Trajectory


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
        reward_info={"turns": 2 if n > 1 else 1, "tool_calls": 0, "tool_errors": {}},
    )


def test_episode_advantages_by_hand() -> None:
    """One group of 3 episodes, rewards R = (1, 0, 0.5): mean 0.5, unbiased std 0.5.
    Episode 0 gave two samples (0.9 = 1·γ with γ = 0.9, then 1); the others one each."""
    sample_r = [torch.tensor([0.9, 1.0, 0.0, 0.5])]
    episode_of = [torch.tensor([0, 0, 1, 2])]
    episode_r = torch.tensor([[1.0, 0.0, 0.5]])
    eps = 1e-6
    (adv,) = episode_advantages(episode_r, sample_r, episode_of, eps=eps)
    s = 0.5 + eps
    expected = [(0.9 - 0.5) / s, (1.0 - 0.5) / s, (0.0 - 0.5) / s, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    # one sample per episode: exactly GRPO
    (single,) = episode_advantages(episode_r, [episode_r[0]], [torch.arange(3)])
    assert single.tolist() == pytest.approx(group_advantages(episode_r)[0].tolist())
    # RLOO, no std: episode 0's baseline is the others' mean 0.25
    (loo,) = episode_advantages(episode_r, sample_r, episode_of, std_level=None, leave_one_out=True)
    assert loo.tolist() == pytest.approx([0.9 - 0.25, 1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5])
    # equal episode rewards carry no signal: a discounted sample is not blown up by std 0
    (flat,) = episode_advantages(
        torch.tensor([[1.0, 1.0]]), [torch.tensor([0.9, 1.0, 1.0])], [torch.tensor([0, 0, 1])]
    )
    assert flat.tolist() == [0.0, 0.0, 0.0]


def test_the_trainer_batch_of_episodes_of_several_samples() -> None:
    """Two groups of 2 episodes: p0 = [e0: 0.9, 1.0 | e1: 0.0], p1 = [e0: 1.0 | e1: 1.0]."""
    # p0's samples arrive out of order: the group puts them in episode order
    p0 = admitted_group(
        [traj("p0", 1, 0.0), traj("p0", 0, 1.0, 1, 2), traj("p0", 0, 0.9, 0, 2)], raw_rewards
    )
    p1 = admitted_group([traj("p1", 0, 1.0), traj("p1", 1, 1.0)], raw_rewards)
    assert [t.uid for t in p0.samples] == ["p0/0/0", "p0/0/1", "p0/1"]
    assert p0.final_positions == [1, 2] and p1.final_positions == [0, 1]
    samples, _ = build_samples([p0, p1], load_recipe(None, ["rollout.group_size=2"]).trainer.loss)
    s = 2**-0.5 + 1e-6  # the unbiased std of (1, 0)
    expected = [(0.9 - 0.5) / s, (1.0 - 0.5) / s, (0.0 - 0.5) / s, 0.0, 0.0]
    assert [x.advantages for x in samples] == pytest.approx(expected, abs=1e-5)
    stats = batch_stats([p0, p1], 256)
    assert stats["reward_groups/all_one"] == 0.5  # p1 only: p0 is told by prompt, not by 2s
    batch = [*p0.samples, *p1.samples]
    assert agent_metrics(batch)["agent/turns"] == pytest.approx((2 + 1 + 1 + 1) / 4)


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
            wf = OpenAIAgentWorkflow(ep, f"{path}:agent", group_size=2, turn_discount=0.5)
            out = await wf.arun_episode(engine, {"uid": "p", "question": "q"})
    assert out is not None
    assert [t.uid for t in out] == ["p/0/0", "p/0/1", "p/1/0", "p/1/1"]
    assert [t.reward for t in out] == [0.5, 1.0, 0.5, 1.0]  # the first ended a call earlier
    assert [(t.episode_sample, t.episode_samples) for t in out] == [(0, 2), (1, 2)] * 2
    first, second = out[0], out[1]
    assert "first" in tok.decode(first.input_ids.numpy().tolist())
    assert "second" in tok.decode(second.input_ids.numpy().tolist())
    assert "first" not in tok.decode(second.input_ids.numpy().tolist())
    assert all(invalid_reason(t, group_size=2, version=0) is None for t in out)
    assert group_complete(out, 2)


async def test_the_dynamic_filter_judges_the_episodes_rewards(tmp_path: Path) -> None:
    """Both episodes scored 1: the discounted first sample (0.9) is no signal."""
    buf = make_buffer(tmp_path, "buffer.dynamic_filter=true")
    uid = (await lease(buf, 1)).prompts[0].uid
    for t in (traj(uid, 0, 1.0), traj(uid, 1, 0.9, 0, 2), traj(uid, 1, 1.0, 1, 2)):
        await buf.on_scored(t)
    assert not buf.admission.ready and buf.counters["filtered_groups"] == 1
