"""The SFT loss: token cross-entropy on the answer tokens, a mean over the global batch.

    loss = − Σ_{b,t} mask[b,t] · log p(x[b,t] | x[b,<t]) / N,   N = Σ mask over the batch

``log p`` comes from the train engine's fused LM head (the logprob of each target token),
so the cross-entropy is its negative at the masked (answer) positions. ``N`` counts the
answer tokens of the whole global batch, not of one micro-batch or rank: each
micro-batch's term is its own sum divided by the global ``N``, so the terms add up to the
same loss (and gradient) however the batch is split into ranks and micro-batches, and
every answer token weighs the same. (A mean per sequence would weigh a token of a short
answer more than one of a long answer; a mean per micro-batch would make the loss depend
on packing.)
"""

from __future__ import annotations

import torch


def masked_ce(
    logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``− Σ mask · logprobs / num_tokens`` (float32 scalar): this part's share of the
    batch's token-mean cross-entropy. ``num_tokens`` is the batch's answer-token count
    (at least 1)."""
    if num_tokens < 1:
        raise ValueError("the batch has no answer tokens")
    masked = torch.where(
        loss_mask_BT, logprobs_BT.float(), torch.zeros_like(logprobs_BT, dtype=torch.float32)
    )
    return -masked.sum() / num_tokens


__all__ = ["masked_ce"]
