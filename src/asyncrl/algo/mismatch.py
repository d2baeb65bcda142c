"""How far the trainer's view of a policy is from the engine's that sampled with it, and
the gate that stops a run whose first batch shows the two disagree.

At version 0 the trainer's proximal logprobs and the behaviour logprobs come from the same
weights; anything but rounding between them is a setup error (a sampler temperature or cut
the trainer does not apply, another chat template, an engine in another dtype or on other
weights), and a run trained through it learns from importance weights that are noise."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

MISMATCH_KL = "mismatch/kl"
MISMATCH_MAX_ABS = "mismatch/max_abs_logprob_diff"
MISMATCH_RATIO_OUT = "mismatch/ratio_out_frac"

RATIO_BAND = (0.5, 2.0)
"""A token whose ratio π_trainer / π_behav leaves this band counts in ``ratio_out_frac``."""

LIKELY_CAUSES = (
    "the engine's dtype vs the trainer's (model.dtype, the engine's own dtype)",
    "the chat template (the engine's prompt tokens vs the trainer's)",
    "the sampling cut (rollout.sampling.top_k / top_p) applied by one side only",
    "the temperature (rollout.sampling.temperature vs what the engine applied)",
    "the engine's weights version (an engine not on the initial weights)",
)


class MismatchError(RuntimeError):
    """The trainer's and the engine's logprobs of the same version-0 tokens disagree by
    more than ``trainer.mismatch_limit``."""


def mismatch_stats(
    trainer_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Agreement of the trainer's and the behaviour policy's logprobs over the loss tokens.
    Per loss token, with ``d = log π_trainer − log π_behav``::

        kl_t  = exp(d) − 1 − d        (k3 estimate of KL(π_behav ‖ π_trainer), ≥ 0)
        out_t = exp(d) ∉ [0.5, 2]

    Returns detached float32 scalars: ``mismatch/kl`` (mean of ``kl_t``),
    ``mismatch/max_abs_logprob_diff`` (max of ``|d|``) and ``mismatch/ratio_out_frac``
    (mean of ``out_t``); all 0 without a loss token. Inputs ``[B, T]`` (or any one shape)."""
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=trainer_logprobs.device)
    d = torch.where(mask, trainer_logprobs.detach().float() - behav_logprobs.float(), zero)
    n = mask.sum().clamp(min=1)
    kl = torch.where(mask, torch.expm1(d) - d, zero)
    low, high = RATIO_BAND
    out = mask & ((d < math.log(low)) | (d > math.log(high)))
    return {
        MISMATCH_KL: kl.sum() / n,
        MISMATCH_MAX_ABS: d.abs().max() if mask.any() else zero,
        MISMATCH_RATIO_OUT: out.sum() / n,
    }


def gate_applies(trainer_version: int, newest_versions: Iterable[int]) -> bool:
    """Whether a batch is one the version-0 gate judges: the trainer has not updated yet
    (``trainer_version`` 0), and every group's newest token version is 0, so that every
    generated token was sampled with the weights the trainer scores it with. A group
    without a generated token (-1: its calls were all greedy, so it trains nothing)
    neither blocks the gate nor is judged; a batch of only such groups is not judged."""
    versions = [v for v in newest_versions if v >= 0]
    return trainer_version == 0 and bool(versions) and all(v == 0 for v in versions)


def check_mismatch(stats: dict[str, float], limit: float | None) -> None:
    """The version-0 gate: raises :class:`MismatchError` when ``stats[MISMATCH_KL]`` (a
    step's :func:`mismatch_stats`, on a batch sampled at version 0 and scored by the
    trainer before any update) exceeds ``limit``; None: no gate."""
    if limit is None:
        return
    kl = stats[MISMATCH_KL]
    if not kl <= limit:  # NaN trips it too
        causes = "; ".join(LIKELY_CAUSES)
        raise MismatchError(
            f"{MISMATCH_KL} = {kl:.6g} on the first batch sampled at version 0 exceeds "
            f"trainer.mismatch_limit = {limit:g}: the trainer's logprobs of the engine's "
            f"own tokens disagree with the engine's (max |Δ logprob| = "
            f"{stats.get(MISMATCH_MAX_ABS, float('nan')):.4g}, share of ratios outside "
            f"[0.5, 2] = {stats.get(MISMATCH_RATIO_OUT, float('nan')):.4g}). Likely causes: "
            f"{causes}. Fix the setup, or raise trainer.mismatch_limit (--set trainer.mismatch_limit=null turns the "
            f"gate off)."
        )
