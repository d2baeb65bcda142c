"""Group-relative advantages: GRPO, Dr.GRPO and RLOO from one function.

Rewards arrive as one flat tensor of whole groups laid end to end: the ``G`` samples of
prompt 0, then the ``G`` samples of prompt 1, and so on (the order the buffer assembles
them in). The function is pure: rewards are data, so nothing here tracks gradients.
"""

from __future__ import annotations

from typing import Literal

import torch

MeanLevel = Literal["group", "batch"] | None
StdLevel = Literal["group", "batch"] | None

_LEVELS = ("group", "batch", None)


def _level_sum(rewards_NG: torch.Tensor, level: str) -> torch.Tensor:
    """Sum of the rewards at ``level``, broadcast back to ``[N, G]``."""
    if level == "group":
        return rewards_NG.sum(dim=1, keepdim=True).expand_as(rewards_NG)
    return rewards_NG.sum().expand_as(rewards_NG)


def _level_std(rewards_NG: torch.Tensor, level: str, *, unbiased: bool) -> torch.Tensor:
    """Std of the rewards at ``level``, broadcast back to ``[N, G]``."""
    if level == "group":
        return rewards_NG.std(dim=1, keepdim=True, unbiased=unbiased).expand_as(rewards_NG)
    return rewards_NG.std(unbiased=unbiased).expand_as(rewards_NG)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    mean_level: MeanLevel = "group",
    std_level: StdLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """One advantage per sample from rewards of whole groups.

    With ``r`` the rewards of the ``n`` samples in the reference set of sample ``i`` (its
    group of ``G`` for level ``"group"``, the whole batch of ``N·G`` for ``"batch"``)::

        baseline_i = mean(r)                                  (leave_one_out=False)
        baseline_i = (sum(r) − r_i) / (n − 1)                 (leave_one_out=True, RLOO)
        A_i        = (r_i − baseline_i) / (std(r) + eps)      (std_level set)
        A_i        =  r_i − baseline_i                        (std_level=None, Dr.GRPO)

    ``mean_level=None`` uses no baseline (``A_i = r_i``, then scaled by std if asked).
    ``std`` is taken over the rewards at ``std_level`` (Bessel-corrected unless
    ``unbiased_std=False``), not over the centred values; a group whose rewards are all
    equal therefore gets advantage 0, not a division by zero.

    Variants: GRPO = defaults; Dr.GRPO = ``std_level=None``; RLOO =
    ``leave_one_out=True, std_level=None``.

    Args:
        rewards: ``[N·G]`` float rewards, groups contiguous.
        group_size: ``G``; must divide ``len(rewards)`` and be ≥ 2 for leave-one-out.

    Returns:
        ``[N·G]`` float32 advantages, in the order of ``rewards``.
    """
    if mean_level not in _LEVELS or std_level not in _LEVELS:
        raise ValueError(
            f"mean_level {mean_level!r} / std_level {std_level!r}: allowed {list(_LEVELS)}"
        )
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    rewards_NG = rewards.to(torch.float32).reshape(-1, group_size)

    if mean_level is None:
        baseline_NG = torch.zeros_like(rewards_NG)
    else:
        n = group_size if mean_level == "group" else rewards_NG.numel()
        total_NG = _level_sum(rewards_NG, mean_level)
        if leave_one_out:
            if n < 2:
                raise ValueError("leave_one_out needs at least 2 samples per reference set")
            baseline_NG = (total_NG - rewards_NG) / (n - 1)
        else:
            baseline_NG = total_NG / n
    adv_NG = rewards_NG - baseline_NG

    if std_level is not None:
        if (group_size if std_level == "group" else rewards_NG.numel()) < 2 and unbiased_std:
            raise ValueError("an unbiased std needs at least 2 samples; pass unbiased_std=False")
        adv_NG = adv_NG / (_level_std(rewards_NG, std_level, unbiased=unbiased_std) + eps)
    return adv_NG.reshape(-1)


def episode_advantages(
    sample_rewards: torch.Tensor,
    episode_of_sample: torch.Tensor,
    episode_rewards: torch.Tensor,
    group_size: int,
    *,
    std_level: StdLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages of samples that come several to an episode (agent code whose calls do not
    all continue one another), with the baseline of the episodes.

    ``episode_rewards`` are the ``N·G`` episodes' rewards, groups contiguous as in
    :func:`group_advantages`, which gives each episode ``i`` its advantage
    ``A_i = (R_i − b_i) / s`` (``s = std + eps`` at ``std_level``, 1 without). Sample ``j``
    of episode ``i = episode_of_sample[j]`` has reward ``r_j`` (the episode's, discounted
    when it ended calls before the last) and advantage

        A_j = (r_j − b_i) / s = A_i + (r_j − R_i) / s

    so the baseline and the scale are the group's episodes', whatever number of samples
    each gave, and an episode of one sample gets exactly its GRPO advantage. With
    ``std_level`` set, a group whose episode rewards are all equal carries no signal, as in
    GRPO: every sample of it gets 0 (dividing a discount by a zero std would not be one).
    """
    adv_episode = group_advantages(
        episode_rewards, group_size, std_level=std_level, leave_one_out=leave_one_out, eps=eps
    )
    rewards_NG = episode_rewards.to(torch.float32).reshape(-1, group_size)
    if std_level is None:
        scale = torch.ones_like(episode_rewards, dtype=torch.float32)
        signal = torch.ones_like(scale, dtype=torch.bool)
    else:
        std_NG = _level_std(rewards_NG, std_level, unbiased=True)
        scale = (std_NG + eps).reshape(-1)
        signal = (std_NG > 0).reshape(-1)
    idx = episode_of_sample.to(torch.long)
    offset = (sample_rewards.to(torch.float32) - episode_rewards.to(torch.float32)[idx]) / scale[
        idx
    ]
    return torch.where(signal[idx], adv_episode[idx] + offset, torch.zeros_like(offset))
