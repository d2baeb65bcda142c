"""Group-relative advantages: GRPO, Dr.GRPO and RLOO from one function.

Rewards arrive as ``[N, G]``: one row per group (prompt), one column per episode of it,
stacked from the batch's groups (:class:`~asyncrl.wire.messages.Group`) by the caller.
The functions are pure: rewards are data, so nothing here tracks gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    rewards_NG: torch.Tensor,
    *,
    mean_level: MeanLevel = "group",
    std_level: StdLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """One advantage per episode from the rewards of whole groups.

    With ``r`` the rewards of the ``n`` episodes in the reference set of episode ``i`` (its
    group's ``G``, a row, for level ``"group"``; the whole batch's ``N·G`` for
    ``"batch"``)::

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
        rewards_NG: ``[N, G]`` float rewards, a row per group; ``G`` ≥ 2 for
            leave-one-out and for an unbiased std at level ``"group"``.

    Returns:
        ``[N, G]`` float32 advantages, in the places of ``rewards_NG``.
    """
    if mean_level not in _LEVELS or std_level not in _LEVELS:
        raise ValueError(
            f"mean_level {mean_level!r} / std_level {std_level!r}: allowed {list(_LEVELS)}"
        )
    if rewards_NG.ndim != 2:
        raise ValueError(f"rewards must be [N, G], a row per group; got {tuple(rewards_NG.shape)}")
    rewards_NG = rewards_NG.to(torch.float32)
    group_size = rewards_NG.shape[1]

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
    return adv_NG


def episode_advantages(
    episode_rewards_NG: torch.Tensor,
    sample_episodes: Sequence[torch.Tensor],
    sample_turns_to_go: Sequence[torch.Tensor],
    *,
    turn_discount: float = 1.0,
    std_level: StdLevel = "group",
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> list[torch.Tensor]:
    """Advantages of samples that come several to an episode (agent code whose calls do not
    all continue one another), from the advantages of the episodes.

    ``episode_rewards_NG`` are the episodes' undiscounted rewards, a row per group as in
    :func:`group_advantages`, which gives each episode ``i`` its advantage ``A_i``. Group
    ``n``'s samples belong to episodes ``sample_episodes[n]`` (``[S_n]`` column indices
    into row ``n``) and ended ``sample_turns_to_go[n]`` (``[S_n]``, ``k_j`` ≥ 0) calls
    before their episode's last. Sample ``j`` of episode ``i`` has advantage

        A_j = γ^k_j · A_i          (γ = ``turn_discount``)

    so the baseline and the scale are the group's episodes', whatever number of samples
    each gave; the sample holding an episode's final call (``k = 0``), and an episode of
    one sample, get exactly the episode's advantage. The discount acts on the advantage,
    never on the reward: adding a constant to every reward changes no ``A_i``, hence no
    ``A_j`` (discounting rewards before the baseline would, e.g. push down the earlier
    calls of episodes that all succeeded under Dr.GRPO).

    Returns:
        a ``[S_n]`` float32 tensor per group, in the order of ``sample_episodes``.
    """
    if not len(sample_episodes) == len(sample_turns_to_go) == episode_rewards_NG.shape[0]:
        raise ValueError(
            f"{episode_rewards_NG.shape[0]} groups of episode rewards, {len(sample_episodes)} "
            f"of sample episodes and {len(sample_turns_to_go)} of turns to go"
        )
    if not 0 < turn_discount <= 1:
        raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
    adv_NG = group_advantages(
        episode_rewards_NG, std_level=std_level, leave_one_out=leave_one_out, eps=eps
    )
    out = []
    for n, (episodes_S, to_go_S) in enumerate(
        zip(sample_episodes, sample_turns_to_go, strict=True)
    ):
        if bool((to_go_S < 0).any()):
            raise ValueError(f"group {n}: turns to go must be >= 0, got {to_go_S.tolist()}")
        discount_S = turn_discount ** to_go_S.to(torch.float32)
        out.append(discount_S * adv_NG[n, episodes_S.to(torch.long)])
    return out
