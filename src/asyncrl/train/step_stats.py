"""The statistics of one train step: what its micro-batches add up on each rank, reduced
over ranks once at the end of the step, so that no micro-batch waits for a device sync."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from asyncrl.algo.mismatch import MISMATCH_KL, MISMATCH_MAX_ABS, MISMATCH_RATIO_OUT

MEAN_STATS = (
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac_dual",
    "approx_kl",
    "ratio_mean",
    "behav_imp_weight_mean",
    "behav_masked_frac",
    "icepop_masked_frac",
    "seq_masked_frac",
    "kl_ref",
    MISMATCH_KL,
    MISMATCH_RATIO_OUT,
)
"""Per-token statistics of :func:`~asyncrl.algo.policy_loss` and
:func:`~asyncrl.algo.mismatch.mismatch_stats`, averaged over the loss tokens of the whole
batch (all minibatches)."""

MAX_STATS = ("behav_imp_weight_max", MISMATCH_MAX_ABS)
"""Statistics whose step value is their maximum over the micro-batches and ranks."""


@dataclasses.dataclass
class StepTotals:
    """Running sums of one train step on this rank."""

    device: torch.device
    sums: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    stat_max: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(len(MAX_STATS)))
    """:data:`MAX_STATS`, in that order (all are ≥ 0, so 0 is the identity)."""
    micro_batches: int = 0
    input_tokens: int = 0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        self.stat_max = self.stat_max.to(self.device)

    def add_micro_batch(
        self,
        loss: torch.Tensor,
        stats: dict[str, torch.Tensor],
        *,
        share: float,
        loss_tokens: torch.Tensor,
        input_tokens: int,
    ) -> None:
        """One micro-batch: its loss, weighted by ``share`` (its part of the minibatch's
        loss), and its per-token statistics, weighted by its ``loss_tokens``."""
        self._add("loss", loss.detach() * share)
        self._add("pg_loss", stats["pg_loss"] * share)
        for key in MEAN_STATS:
            self._add(key, stats[key] * loss_tokens)
        maxes = torch.stack([stats[k].to(self.stat_max.device) for k in MAX_STATS])
        self.stat_max = torch.maximum(self.stat_max, maxes)
        self.micro_batches += 1
        self.input_tokens += input_tokens

    def add_entropy(self, entropy_sum: torch.Tensor) -> None:
        """The policy's token entropy summed over a minibatch's loss tokens (the training
        forwards'); reported as ``entropy``, the mean over the batch's loss tokens."""
        self._add("entropy", entropy_sum)

    def _add(self, key: str, value: torch.Tensor) -> None:
        self.sums[key] = self.sums[key] + value if key in self.sums else value

    def reduce(self, *, loss_tokens: int, minibatches: int) -> dict[str, float]:
        """The step's statistics over all ranks (collective when distributed): ``loss`` and
        ``pg_loss`` as means over ``minibatches``, :data:`MEAN_STATS` over ``loss_tokens``,
        :data:`MAX_STATS` as maxima, their sum of clip fractions as ``clip_frac``, and the
        micro-batch counts."""
        keys = sorted(self.sums)
        packed = torch.stack([self.sums[k].to(self.device).double() for k in keys])
        counts = torch.tensor(
            [float(self.micro_batches), float(self.input_tokens)], device=self.device
        )
        stat_max = self.stat_max
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
            dist.all_reduce(counts)
            dist.all_reduce(stat_max, op=dist.ReduceOp.MAX)
        out = dict(zip(keys, packed.tolist(), strict=True))
        for key in (*MEAN_STATS, "entropy"):
            if key in out:
                out[key] /= max(1, loss_tokens)
        for key in ("loss", "pg_loss"):
            out[key] /= max(1, minibatches)
        # low (A < 0), high (A > 0) and dual (A < 0, ratio above c_clip) are disjoint
        out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"] + out["clip_frac_dual"]
        out.update(zip(MAX_STATS, stat_max.tolist(), strict=True))
        out["micro_batches"] = float(counts[0])
        out["input_tokens"] = float(counts[1])
        out["time/forward_backward_s"] = self.forward_backward_s
        out["time/optimizer_s"] = self.optimizer_s
        return out
