"""Reward shaping applied before advantages: affine scaling with a clip, and DAPO's
soft overlong penalty."""

from __future__ import annotations

import torch


def shape_rewards(
    rewards: torch.Tensor,
    *,
    scale: float = 1.0,
    bias: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """``r' = clamp((r + bias) · scale, −clip, clip)``; no clamp when ``clip`` is None.

    The bias is added before scaling so that ``bias=-0.5, scale=2`` maps {0, 1} to {−1, 1}.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be positive, got {clip}")
    shaped = (rewards.to(torch.float32) + bias) * scale
    if clip is not None:
        shaped = shaped.clamp(-clip, clip)
    return shaped


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, to be added to the rewards.

    With ``L`` the generated length, ``M = max_len`` and ``B = buffer_len``::

        0                          if L ≤ M − B
        ((M − B) − L) / B · penalty if M − B < L ≤ M      (linear ramp from 0 to −penalty)
        −penalty                   if L > M

    Args:
        lengths: ``[N]`` generated-token counts (the loss-mask sums, not prompt + answer).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len ({buffer_len}) <= max_len ({max_len})")
    lengths_f = lengths.to(torch.float32)
    start = max_len - buffer_len
    ramp = (start - lengths_f) / buffer_len * penalty
    out = torch.where(lengths_f <= start, torch.zeros_like(lengths_f), ramp)
    return torch.where(lengths_f > max_len, torch.full_like(lengths_f, -penalty), out)
