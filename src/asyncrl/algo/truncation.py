"""The top-k / top-p cut of a next-token distribution: which tokens a sampler keeps.

Rollout engines sample from, and report logprobs of, the cut distribution; the trainer
scores the same cut distribution. Both decide the kept set with this one function, so that
on equal logits they keep equal sets.
"""

from __future__ import annotations

import torch


def kept_mask(logp_RV: torch.Tensor, top_k_R: torch.Tensor, top_p_R: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` bool: the tokens a top-k / top-p sampler keeps, per row.

    With ``p = exp(logp)`` sorted descending (rank 0 the most likely)::

        K_k   = {v : rank(v) < top_k}          (top_k = 0: the whole vocabulary)
        p'(v) = p(v) / Σ_{u∈K_k} p(u)          on K_k: renormalised after top-k
        K     = {v ∈ K_k : Σ_{rank(u) < rank(v)} p'(u) < top_p}   (top_p = 1: K = K_k)

    so top-p keeps the smallest prefix of ``p'`` whose mass reaches ``top_p``, the token
    that crosses it included, and the most likely token always. This is vLLM's rule
    (top-k first, then top-p on the distribution renormalised over the top-k survivors);
    the trap is the renormalisation: on ``p = (0.5, 0.3, 0.2)``, ``top_k = 2``,
    ``top_p = 0.6`` it keeps token 0 only (``p' = (0.625, 0.375)``), where a top-p on the
    unrenormalised ``p`` would keep tokens 0 and 1.

    Ties at the top-k boundary go to the lower token id (a stable sort), so exactly
    ``top_k`` tokens are kept, as vLLM's GPU kernel does (its unsorted-CPU fallback keeps
    every tied token). Carries no gradient.
    """
    logp_RV = logp_RV.detach()
    vocab = logp_RV.shape[-1]
    sorted_RV, order_RV = logp_RV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(vocab, device=logp_RV.device)
    top_k_R = top_k_R.to(logp_RV.device)
    k_R = torch.where(top_k_R > 0, top_k_R, torch.full_like(top_k_R, vocab))
    keep_RV = rank_V[None, :] < k_R[:, None]
    # rows without a top-k cut keep exp(logp) as it is, bit for bit: renormalising an
    # already normalised row would only move the top-p boundary by rounding
    renormed_RV = torch.where(
        (k_R < vocab)[:, None],
        torch.log_softmax(sorted_RV.masked_fill(~keep_RV, float("-inf")), dim=-1).exp(),
        sorted_RV.exp(),
    )
    # exclusive prefix sum: the mass strictly before each rank, without the rounding of
    # cumsum − p at the boundary token
    mass_before_RV = torch.cat(
        [torch.zeros_like(renormed_RV[:, :1]), renormed_RV.cumsum(dim=-1)[:, :-1]], dim=-1
    )
    top_p_R = top_p_R.to(device=logp_RV.device, dtype=renormed_RV.dtype)
    # top_p = 1 cuts nothing, even where float rounding brings the prefix mass to 1.0
    # before the tail
    keep_RV &= (mass_before_RV < top_p_R[:, None]) | (top_p_R[:, None] >= 1)
    return torch.zeros_like(keep_RV).scatter(-1, order_RV, keep_RV)


def cut_logprobs(logits_RV: torch.Tensor, keep_RV: torch.Tensor) -> torch.Tensor:
    """``log q``: ``log_softmax`` of ``logits_RV`` restricted to ``keep_RV`` (renormalised
    over the kept tokens), −inf elsewhere. Differentiable in the logits of kept tokens."""
    return torch.log_softmax(logits_RV.masked_fill(~keep_RV, float("-inf")), dim=-1)
