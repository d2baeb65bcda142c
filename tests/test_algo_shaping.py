"""Reward shaping against hand-computed values."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrl.algo.shaping import (
    overlong_penalty,
    replies,
    shape_reward,
    shaped_rewards,
    shaped_sample_rewards,
)
from asyncrl.config.recipe import load_recipe, sample_budget
from asyncrl.wire.messages import Array


@dataclass
class Scored:
    reward: float
    loss_mask: Array


def calls_sample(*lengths: int) -> Scored:
    """Reward 1; a prompt of 4 tokens, then one call of each length, two context tokens
    (the chat template's turn end and the next turn's head) between continued calls."""
    mask = [False] * 4
    for i, n in enumerate(lengths):
        mask += ([False] * 2 if i else []) + [True] * n
    return Scored(1.0, Array.of(mask, "bool"))


def test_a_sample_of_continued_calls_has_a_budget_per_call(tmp_path: Path) -> None:
    """Agent code, one call's budget 512 (``max_new_tokens``), overlong buffer 128 at
    penalty 1: three continued calls of 300 tokens (900 generated, 3 replies) have the
    budget 3 · 512 = 1536, free up to 1408, so no penalty: reward 1. One call of 512 tokens
    sits at its budget M: (M − B − L)/B = (384 − 512)/128 = −1, the full penalty: 0. One
    of 448: (384 − 448)/128 = −0.5: 0.5."""
    code = tmp_path / "agent.py"
    code.write_text("async def agent(client, data):\n    return 1.0\n")
    recipe = load_recipe(
        None,
        [
            f"rollout.workflow={code}:agent",
            "rollout.sampling.max_new_tokens=512",
            "trainer.shaping.overlong_buffer=128",
            "trainer.shaping.overlong_penalty=1.0",
        ],
    )
    samples = [calls_sample(300, 300, 300), calls_sample(512), calls_sample(448)]
    assert [replies(t.loss_mask) for t in samples] == [3, 1, 1]
    assert sample_budget(recipe, 3) == 1536 and sample_budget(recipe, 1) == 512
    got = shaped_sample_rewards(samples, recipe.trainer.shaping, lambda n: sample_budget(recipe, n))
    assert got == pytest.approx([1.0, 0.0, 0.5])


def test_bias_then_scale_then_clip() -> None:
    assert [shape_reward(r, bias=-0.5, scale=2.0) for r in (0.0, 1.0, 3.0)] == [-1.0, 1.0, 5.0]
    assert [shape_reward(r, bias=-0.5, scale=2.0, clip=2.0) for r in (0.0, 1.0, 3.0)] == [
        -1.0,
        1.0,
        2.0,
    ]
    with pytest.raises(ValueError, match="clip"):
        shape_reward(1.0, clip=0.0)


def test_overlong_penalty_ramps_inside_the_buffer() -> None:
    # max 10, buffer 4: free up to 6, then (6 − L)/4 · 2, and −2 past 10
    got = [overlong_penalty(n, max_len=10, buffer_len=4, penalty=2.0) for n in (3, 6, 7, 8, 10, 11)]
    assert got == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(3, max_len=10, buffer_len=11)


def test_shaped_rewards_add_the_overlong_penalty_before_the_affine_map() -> None:
    # (r + overlong + bias)·scale with budget 10, buffer 4: (1 − 0.75 − 0.5)·2 = −0.5
    got = shaped_rewards([1.0, 1.0], [3, 9], max_len=10, overlong_buffer=4, bias=-0.5, scale=2.0)
    assert got == pytest.approx([1.0, -0.5])
    assert shaped_rewards([1.0, 0.0], [3, 9], max_len=10) == [1.0, 0.0]


def test_shaping_imports_no_torch() -> None:
    # the buffer filters on shaped rewards and must not pay for torch
    code = "import sys, asyncrl.algo.shaping; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
