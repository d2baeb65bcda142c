"""The learning-rate schedule, as a pure function of the step."""

from __future__ import annotations

import math


def lr_at(
    step: int,
    *,
    lr: float,
    warmup_steps: int = 0,
    schedule: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate of the update with 0-based index ``step``::

        warmup (step < W):  lr · (step + 1) / W
        constant:           lr
        cosine:             lr · (m + (1 − m) · ½ (1 + cos(π · p))),
                            p = min(1, (step − W) / max(1, total_steps − W)),  m = min_lr_ratio

    Being a function of the step alone, the schedule needs no state beyond the step count
    to resume exactly.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"schedule {schedule!r}: allowed ['constant', 'cosine']")
    if total_steps is None:
        raise ValueError("the cosine schedule needs total_steps")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
