"""The top-k / top-p cut of a next-token distribution: which tokens a sampler keeps.

Rollout engines sample from, and report logprobs of, the cut distribution; the trainer
scores the same cut distribution. Both decide the kept set with this one function, so that
on equal logits they keep equal sets.
"""

from __future__ import annotations

import torch


def kept_mask(logp_RV: torch.Tensor, top_k_R: torch.Tensor, top_p_R: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` bool: the tokens a top-k / top-p sampler keeps, per row.

    With ``p = exp(logp)`` sorted descending, a token is kept when its rank is below
    ``top_k`` (0: no top-k cut) and the mass strictly before it is below ``top_p``: the
    most likely token is always kept, and the prefix that reaches ``top_p`` is kept whole.
    The two cuts apply to the same scaled distribution (top-k does not renormalise before
    top-p), the order vLLM and SGLang use. Carries no gradient.
    """
    logp_RV = logp_RV.detach()
    vocab = logp_RV.shape[-1]
    sorted_RV, order_RV = logp_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logp_RV.device)
    top_k_R = top_k_R.to(logp_RV.device)
    k_R = torch.where(top_k_R > 0, top_k_R, torch.full_like(top_k_R, vocab))
    keep_RV = rank_V[None, :] < k_R[:, None]
    probs_RV = sorted_RV.exp()
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    keep_RV &= mass_before_RV < top_p_R.to(device=probs_RV.device, dtype=probs_RV.dtype)[:, None]
    return torch.zeros_like(keep_RV).scatter(-1, order_RV, keep_RV)


def cut_logprobs(logits_RV: torch.Tensor, keep_RV: torch.Tensor) -> torch.Tensor:
    """``log q``: ``log_softmax`` of ``logits_RV`` restricted to ``keep_RV`` (renormalised
    over the kept tokens), −inf elsewhere. Differentiable in the logits of kept tokens."""
    return torch.log_softmax(logits_RV.masked_fill(~keep_RV, float("-inf")), dim=-1)
