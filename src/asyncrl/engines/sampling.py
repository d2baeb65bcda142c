"""Next-token sampling for a batch of rows, each with its own parameters.

For row r with temperature T, logits l and vocabulary V:

    scaled:     log p(v)  = log_softmax(l / T)(v)
    kept set:   K = top-k(p) ∩ smallest prefix of p sorted descending whose mass ≥ top_p
    sampled:    q(v) = p(v) / Σ_{u∈K} p(u) for v ∈ K, else 0;   token ~ q

``LogprobMode`` says which logprob of the sampled token is reported:

- ``"scaled"`` (the default): ``log p(token)``, the temperature-scaled distribution before
  the top-k/top-p cut. It is what a trainer recomputes with one forward pass as
  ``log_softmax(logits / T)`` at the same temperature, so behaviour and proximal logprobs
  are comparable. Without a cut (top_k = 0, top_p = 1) it *is* the sampled distribution.
- ``"processed"``: ``log q(token)``, the distribution actually sampled from, cut and
  renormalised. It exceeds ``log p`` by ``-log Σ_{u∈K} p(u)``.

Greedy rows (T = 0) take the argmax; their logprob is ``log_softmax(l)(token)`` in
``"scaled"`` mode (T = 1) and 0 in ``"processed"`` mode (a point mass).
"""

from __future__ import annotations

from typing import Literal

import torch

LogprobMode = Literal["scaled", "processed"]


def sample_next(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    generators: list[torch.Generator | None],
    mode: LogprobMode = "scaled",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row; returns ``(tokens_R int64, logprobs_R float32)``.

    ``generators[r]`` (a CPU generator) seeds row r; rows with ``None`` use torch's global
    generator.
    """
    logits_RV = logits_RV.float()
    greedy_R = temperature_R <= 0
    temp_R = torch.where(greedy_R, torch.ones_like(temperature_R), temperature_R).float()
    logp_RV = torch.log_softmax(logits_RV / temp_R[:, None], dim=-1)

    cut = bool((top_k_R > 0).any()) or bool((top_p_R < 1).any())
    q_logp_RV = _cut(logp_RV, top_k_R, top_p_R) if cut else logp_RV
    probs_RV = q_logp_RV.exp()

    # Inverse-CDF sampling: one uniform per row instead of one random number per vocabulary
    # entry (torch.multinomial), which dominated the sampling cost on CPU.
    u_R = torch.empty(logits_RV.shape[0], dtype=torch.float64)
    for r, g in enumerate(generators):
        if g is not None:
            u_R[r] = torch.rand((), generator=g, dtype=torch.float64)
    free = [r for r, g in enumerate(generators) if g is None]
    if free:
        u_R[free] = torch.rand(len(free), dtype=torch.float64)
    cdf_RV = probs_RV.double().cumsum(dim=-1)
    u_R = u_R.to(cdf_RV.device) * cdf_RV[:, -1]
    tokens_R = torch.searchsorted(cdf_RV, u_R[:, None], right=True).squeeze(-1)
    tokens_R = tokens_R.clamp(max=logits_RV.shape[-1] - 1)
    tokens_R = torch.where(greedy_R, logits_RV.argmax(dim=-1), tokens_R)

    chosen = tokens_R[:, None]
    if mode == "scaled":
        logprobs_R = logp_RV.gather(-1, chosen).squeeze(-1)
    else:
        logprobs_R = q_logp_RV.gather(-1, chosen).squeeze(-1)
        logprobs_R = torch.where(greedy_R, torch.zeros_like(logprobs_R), logprobs_R)
    return tokens_R, logprobs_R


def _cut(logp_RV: torch.Tensor, top_k_R: torch.Tensor, top_p_R: torch.Tensor) -> torch.Tensor:
    """log q: ``logp_RV`` restricted to each row's kept set and renormalised."""
    vocab = logp_RV.shape[-1]
    sorted_RV, order_RV = logp_RV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=logp_RV.device)
    k_R = torch.where(top_k_R > 0, top_k_R, torch.full_like(top_k_R, vocab))
    keep_RV = rank_V[None, :] < k_R[:, None]
    probs_RV = sorted_RV.exp()
    # A token stays while the mass strictly before it is below top_p: the first token
    # always stays, and the prefix reaching top_p is kept whole.
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV
    keep_RV &= mass_before_RV < top_p_R[:, None].to(probs_RV.dtype)
    keep_in_vocab_RV = torch.zeros_like(keep_RV).scatter(-1, order_RV, keep_RV)
    return torch.log_softmax(logp_RV.masked_fill(~keep_in_vocab_RV, float("-inf")), dim=-1)
