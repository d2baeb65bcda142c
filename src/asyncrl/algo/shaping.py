"""Reward shaping applied before advantages: DAPO's soft overlong penalty, then an affine
map with a clip.

Plain Python on floats, no torch: the buffer shapes a group's rewards once, as it admits
the group (:class:`~asyncrl.wire.messages.Group` carries them to the trainer's
advantages), and its dynamic filter judges the group on those very numbers, so a group
whose raw rewards are equal but whose shaped rewards differ (different lengths under the
overlong penalty) still carries a signal and is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from asyncrl.wire.messages import Array

if TYPE_CHECKING:
    from asyncrl.algo.config import ShapingConfig


def shape_reward(
    reward: float, *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> float:
    """``r' = clamp((r + bias) · scale, −clip, clip)``; no clamp when ``clip`` is None.

    The bias is added before scaling so that ``bias=-0.5, scale=2`` maps {0, 1} to {−1, 1}.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be positive, got {clip}")
    shaped = (float(reward) + bias) * scale
    if clip is not None:
        shaped = min(max(shaped, -clip), clip)
    return shaped


def overlong_penalty(length: int, *, max_len: int, buffer_len: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment, to be added to the reward.

    With ``L`` the generated length, ``M = max_len`` and ``B = buffer_len``::

        0                          if L ≤ M − B
        ((M − B) − L) / B · penalty if M − B < L ≤ M      (linear ramp from 0 to −penalty)
        −penalty                   if L > M

    ``length`` counts generated tokens (the loss-mask sum), not prompt + answer.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len ({buffer_len}) <= max_len ({max_len})")
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    if length > max_len:
        return -penalty
    return (start - length) / buffer_len * penalty


def shaped_rewards(
    rewards: Sequence[float],
    lengths: Sequence[int],
    *,
    max_len: int | Sequence[int],
    overlong_buffer: int = 0,
    overlong_penalty_at_max: float = 1.0,
    scale: float = 1.0,
    bias: float = 0.0,
    clip: float | None = None,
) -> list[float]:
    """The rewards advantages are computed from, one per sample::

        r' = clamp((r + overlong(L) + bias) · scale, −clip, clip)

    where ``overlong`` is :func:`overlong_penalty` over the last ``overlong_buffer`` tokens
    of the generation budget ``max_len`` (0 when the buffer is 0): one for every sample,
    or one per sample.
    """
    budgets = [max_len] * len(lengths) if isinstance(max_len, int) else list(max_len)
    if not len(rewards) == len(lengths) == len(budgets):
        raise ValueError(f"{len(rewards)} rewards, {len(lengths)} lengths, {len(budgets)} budgets")
    out = []
    for r, n, m in zip(rewards, lengths, budgets, strict=True):
        if overlong_buffer > 0:
            r = float(r) + overlong_penalty(
                n, max_len=m, buffer_len=overlong_buffer, penalty=overlong_penalty_at_max
            )
        out.append(shape_reward(r, scale=scale, bias=bias, clip=clip))
    return out


class ScoredSample(Protocol):
    """What shaping reads of a sample (a scored trajectory or a train sample)."""

    @property
    def reward(self) -> float | None: ...

    @property
    def loss_mask(self) -> Array: ...


def replies(loss_mask: Sequence[bool] | Array | np.ndarray) -> int:
    """The replies a sample holds: the runs of generated tokens in its loss mask (calls
    that continue one another, and the turns of a multi-turn sample, are separated by
    context tokens). A reply of no token counts for none; it used none of its budget."""
    mask = np.asarray(loss_mask.numpy() if isinstance(loss_mask, Array) else loss_mask, dtype=bool)
    if mask.size == 0:
        return 0
    return int(mask[0]) + int((mask[1:] & ~mask[:-1]).sum())


def shaped_sample_rewards(
    samples: Sequence[ScoredSample], s: ShapingConfig, budget: Callable[[int], int]
) -> list[float]:
    """The rewards the trainer's advantages use: ``trainer.shaping`` (``s``) applied to each
    sample's reward and generated length, with ``budget(n)`` the generation budget of a
    sample of ``n`` :func:`replies` (:func:`asyncrl.config.recipe.sample_budget`): agent
    code whose consecutive calls continue one another makes one sample of several calls,
    and one call's budget would penalise it as overlong. The buffer computes them as it
    admits a group; its dynamic filter judges the group on the same numbers."""
    if s.overlong_buffer > 0:
        lengths = [int(t.loss_mask.numpy().sum()) for t in samples]
        budgets: int | list[int] = [budget(max(1, replies(t.loss_mask))) for t in samples]
    else:  # without the overlong penalty neither is read: not counted for every sample
        lengths, budgets = [0] * len(samples), 0
    return shaped_rewards(
        [float(t.reward or 0.0) for t in samples],
        lengths,
        max_len=budgets,
        overlong_buffer=s.overlong_buffer,
        overlong_penalty_at_max=s.overlong_penalty,
        scale=s.scale,
        bias=s.bias,
        clip=s.clip,
    )
