"""Group advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo.advantages import group_advantages

# Two groups of 4 (a row each): means 0.5 and 0.75; unbiased stds sqrt(1/3) and 0.5.
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])


def close(actual_NG: torch.Tensor, expected: list[float]) -> None:
    """``expected`` lists the groups' advantages end to end."""
    torch.testing.assert_close(actual_NG.reshape(-1), torch.tensor(expected), rtol=0, atol=1e-5)


def test_grpo_normalises_by_group_mean_and_std() -> None:
    a = 0.5 / math.sqrt(1 / 3)
    close(group_advantages(REWARDS), [a, -a, -a, a, 0.5, 0.5, 0.5, -1.5])


def test_population_std_on_request() -> None:
    close(group_advantages(REWARDS, unbiased_std=False)[0], [1.0, -1.0, -1.0, 1.0])


def test_dr_grpo_has_no_std() -> None:
    close(
        group_advantages(REWARDS, std_level=None),
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75],
    )


def test_rloo_baseline_leaves_the_sample_out() -> None:
    # group 1: baseline_i = (2 − r_i)/3 → A = ±2/3; group 2: (3 − r_i)/3 → 1/3, 1/3, 1/3, −1
    third = 1 / 3
    close(
        group_advantages(REWARDS, std_level=None, leave_one_out=True),
        [2 * third, -2 * third, -2 * third, 2 * third, third, third, third, -1.0],
    )


def test_batch_mean_and_batch_std() -> None:
    # batch mean 5/8; unbiased batch std sqrt(1.875/7)
    std = math.sqrt(1.875 / 7)
    hi, lo = 0.375 / std, -0.625 / std
    close(
        group_advantages(REWARDS, mean_level="batch", std_level="batch"),
        [hi, lo, lo, hi, hi, hi, hi, lo],
    )


def test_group_mean_with_batch_std() -> None:
    std = math.sqrt(1.875 / 7)
    expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    close(group_advantages(REWARDS, std_level="batch"), [x / std for x in expected])


def test_batch_leave_one_out() -> None:
    # baseline_i = (5 − r_i)/7
    expected = [r - (5 - r) / 7 for r in REWARDS.reshape(-1).tolist()]
    close(
        group_advantages(REWARDS, mean_level="batch", std_level=None, leave_one_out=True),
        expected,
    )


def test_no_baseline() -> None:
    close(group_advantages(REWARDS, mean_level=None, std_level=None), REWARDS.reshape(-1).tolist())


def test_uniform_group_gives_zero_not_nan() -> None:
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    close(adv[0], [0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize(
    ("rewards", "kwargs", "match"),
    [
        (REWARDS.reshape(-1), {}, r"\[N, G\]"),  # flat rewards: which are a group's?
        (REWARDS, {"std_level": "token"}, "allowed"),
        (REWARDS.reshape(-1, 1), {"std_level": None, "leave_one_out": True}, "at least 2"),
        (REWARDS.reshape(-1, 1), {}, "unbiased std"),
    ],
)
def test_bad_arguments_are_refused(rewards: torch.Tensor, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)
