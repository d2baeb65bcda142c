"""Reward shaping against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algo import overlong_penalty, shape_rewards


def test_bias_then_scale_then_clip() -> None:
    r = torch.tensor([0.0, 1.0, 3.0])
    torch.testing.assert_close(
        shape_rewards(r, bias=-0.5, scale=2.0), torch.tensor([-1.0, 1.0, 5.0])
    )
    torch.testing.assert_close(
        shape_rewards(r, bias=-0.5, scale=2.0, clip=2.0), torch.tensor([-1.0, 1.0, 2.0])
    )
    with pytest.raises(ValueError, match="clip"):
        shape_rewards(r, clip=0.0)


def test_overlong_penalty_ramps_inside_the_buffer() -> None:
    lengths = torch.tensor([3, 6, 7, 8, 10, 11])
    # max 10, buffer 4: free up to 6, then (6 − L)/4 · 2, and −2 past 10
    expected = torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    torch.testing.assert_close(
        overlong_penalty(lengths, max_len=10, buffer_len=4, penalty=2.0), expected
    )
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=11)
