"""Reward shaping against hand-computed values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.algo.shaping import overlong_penalty, shape_reward, shaped_rewards


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
