"""The trainer's build_samples: reward shaping (DAPO overlong penalty, affine, clip), done
once as the buffer admits a group, before group advantages, against hand-computed
values."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from asyncrl.actors.buffer.admission import admitted_group
from asyncrl.algo.shaping import shaped_sample_rewards
from asyncrl.config.recipe import Recipe, load_recipe, sample_budget
from asyncrl.train.batch import build_samples
from asyncrl.wire.messages import Array, Group, Trajectory

PROMPT = 2


def traj(uid: str, index: int, reward: float, generated: int) -> Trajectory:
    n = PROMPT + generated
    mask = np.arange(n) >= PROMPT
    return Trajectory(
        uid=f"{uid}/{index}",
        prompt_uid=uid,
        group_index=index,
        group_size=2,
        input_ids=Array.of(np.arange(n, dtype=np.int64)),
        loss_mask=Array.of(mask),
        logprobs=Array.of(np.where(mask, -1.0, 0.0).astype(np.float32)),
        versions=Array.of(np.where(mask, 0, -1).astype(np.int32)),
        reward=reward,
    )


BATCH = [traj("a", 0, 1.0, 3), traj("a", 1, 1.0, 9), traj("b", 0, 0.0, 10), traj("b", 1, 0.0, 5)]
SHAPING = [
    "rollout.group_size=2",
    "rollout.sampling.max_new_tokens=10",
    "trainer.loss.adv_std_level=none",
    "trainer.shaping.overlong_buffer=4",
    "trainer.shaping.overlong_penalty=1.0",
    "trainer.shaping.bias=-0.5",
    "trainer.shaping.scale=2.0",
]


def advantages(samples: list) -> list[float]:
    return [float(s.advantages) for s in samples]


def admitted(batch: Sequence[Trajectory], recipe: Recipe) -> list[Group]:
    """The batch's groups of two as the buffer admits them: shaped by the recipe."""
    return [
        admitted_group(
            batch[i : i + 2],
            lambda s: shaped_sample_rewards(
                s, recipe.trainer.shaping, lambda replies: sample_budget(recipe, replies)
            ),
        )
        for i in range(0, len(batch), 2)
    ]


def train(batch: Sequence[Trajectory], overrides: list[str]) -> tuple[list, dict[str, float]]:
    recipe = load_recipe(None, overrides)
    return build_samples(admitted(batch, recipe), recipe.trainer.loss)


def test_overlong_penalty_and_affine_shaping_before_advantages() -> None:
    # Budget 10, buffer 4: free up to 6 tokens, then (6 − L)/4.
    # r' = (r + overlong + bias)·scale: a: (1+0−.5)·2 = 1, (1−.75−.5)·2 = −.5
    #                                  b: (0−1−.5)·2 = −3, (0+0−.5)·2 = −1
    groups = admitted(BATCH, load_recipe(None, SHAPING))
    assert [g.shaped_rewards for g in groups] == [[1.0, -0.5], [-3.0, -1.0]]
    samples, stats = build_samples(groups, load_recipe(None, SHAPING).trainer.loss)
    assert advantages(samples) == pytest.approx([0.75, -0.75, -1.0, 1.0])
    assert stats["reward_mean"] == pytest.approx(0.5)  # the raw reward, for the metrics
    assert stats["reward_shaped_mean"] == pytest.approx(-0.875)
    # clip 2: b's −3 becomes −2, its group mean −1.5
    samples, _ = train(BATCH, [*SHAPING, "trainer.shaping.clip=2"])
    assert advantages(samples) == pytest.approx([0.75, -0.75, -0.5, 0.5])


def test_no_shaping_by_default() -> None:
    samples, stats = train(BATCH, SHAPING[:3])
    assert advantages(samples) == pytest.approx([0.0, 0.0, 0.0, 0.0])
    assert stats["reward_shaped_mean"] == stats["reward_mean"] == pytest.approx(0.5)


def test_mask_truncated_clears_the_loss_of_samples_cut_by_the_budget() -> None:
    batch = [t.model_copy(update={"finish_reason": "stop"}) for t in BATCH]
    batch[1] = batch[1].model_copy(update={"finish_reason": "length"})
    masked, stats = train(batch, [*SHAPING, "trainer.loss.mask_truncated=true"])
    kept, _ = train(batch, SHAPING)
    assert [int(s.loss_mask.sum()) for s in kept] == [3, 9, 10, 5]
    assert [int(s.loss_mask.sum()) for s in masked] == [3, 0, 10, 5]
    assert stats["truncated_masked"] == 1.0
    # the truncated sample still counts in its group's baseline: advantages are unchanged
    assert advantages(masked) == advantages(kept)
