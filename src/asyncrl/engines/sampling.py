"""Next-token sampling for a batch of rows, each with its own parameters.

For row r with temperature T, logits l and vocabulary V:

    scaled:     log p(v)  = log_softmax(l / T)(v)
    kept set:   K = smallest prefix, sorted descending, of p renormalised over top-k(p),
                    whose mass ≥ top_p (top-k first, then top-p on the survivors, as vLLM)
    sampled:    q(v) = p(v) / Σ_{u∈K} p(u) for v ∈ K, else 0;   token ~ q

(``K`` is :func:`asyncrl.algo.truncation.kept_mask`, the trainer's cut too.)
``LogprobMode`` says which logprob of the sampled token is reported:

- ``"processed"`` (the default): ``log q(token)``, the distribution actually sampled from,
  cut and renormalised. It is the run's one definition of a behaviour logprob: vLLM reports
  it (``--logprobs-mode processed_logprobs``) and the trainer scores it (the same cut,
  decided from its own logits), so importance weights compare like with like. Without a
  cut (top_k = 0, top_p = 1) it is ``log p``.
- ``"scaled"``: ``log p(token)``, the temperature-scaled distribution before the cut. It
  falls short of ``log q`` by ``log Σ_{u∈K} p(u)``; for diagnostics only.

Greedy rows (T = 0) take the argmax and report ``log_softmax(l)(token)`` (T = 1, no cut)
in both modes, as vLLM does.
"""

from __future__ import annotations

from typing import Literal

import torch

from asyncrl.algo.truncation import cut_logprobs, kept_mask

LogprobMode = Literal["scaled", "processed"]

CDF_BLOCK = 256
"""Vocabulary entries per block of :func:`inverse_cdf`'s first level."""


def sample_next(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    generators: list[torch.Generator | None],
    mode: LogprobMode = "processed",
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
    q_logp_RV = cut_logprobs(logp_RV, kept_mask(logp_RV, top_k_R, top_p_R)) if cut else logp_RV
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
    tokens_R = inverse_cdf(probs_RV, u_R.to(probs_RV.device))
    if bool(greedy_R.any()):
        tokens_R = torch.where(greedy_R, logits_RV.argmax(dim=-1), tokens_R)

    chosen = tokens_R[:, None]
    if mode == "scaled":
        logprobs_R = logp_RV.gather(-1, chosen).squeeze(-1)
    else:
        logprobs_R = torch.where(
            greedy_R,
            logp_RV.gather(-1, chosen).squeeze(-1),
            q_logp_RV.gather(-1, chosen).squeeze(-1),
        )
    return tokens_R, logprobs_R


def inverse_cdf(probs_RV: torch.Tensor, u_R: torch.Tensor) -> torch.Tensor:
    """Per row r, the first token ``v`` whose cumulative mass ``Σ_{w ≤ v} p(w)`` exceeds
    ``u_R[r] · Σ_w p(w)`` (``u`` uniform in [0, 1), float64): a draw from ``p``, which need
    not be normalised. Never a token of zero mass.

    In two levels, so that no float64 copy or running sum of the whole ``[R, V]`` is made
    (on a CPU decode of SmolLM2's 49,152 entries at 32 rows, those two took ~10 ms of a
    ~190 ms step): the sums of blocks of :data:`CDF_BLOCK` entries locate the block, then
    the float64 running sum of that block alone the token. A block's sum is taken in the
    probabilities' own dtype (float32: pairwise, ~1e-7 of the block's mass, the precision
    of the probabilities themselves), so a draw differs from one float64 running sum's
    only where ``u`` falls that close to a boundary between two tokens.
    """
    rows, vocab = probs_RV.shape
    full = vocab - vocab % CDF_BLOCK
    sums = [probs_RV[:, :full].view(rows, -1, CDF_BLOCK).sum(dim=-1)]
    if full < vocab:
        sums.append(probs_RV[:, full:].sum(dim=-1, keepdim=True))
    sums_RB = torch.cat(sums, dim=1).double()
    block_cdf_RB = sums_RB.cumsum(dim=1)
    target_R1 = (u_R * block_cdf_RB[:, -1])[:, None]
    block_R = torch.searchsorted(block_cdf_RB, target_R1, right=True).squeeze(-1)
    # u · total rounded up to the total, past the last block with mass: that block
    ids_B = torch.arange(sums_RB.shape[1], device=sums_RB.device)
    block_R = torch.minimum(block_R, torch.where(sums_RB > 0, ids_B, 0).amax(dim=1))
    below_R = block_cdf_RB.gather(1, (block_R - 1).clamp(min=0)[:, None]).squeeze(-1)
    below_R = torch.where(block_R > 0, below_R, 0.0)
    ids_K = torch.arange(CDF_BLOCK, device=probs_RV.device)
    cols_RK = block_R[:, None] * CDF_BLOCK + ids_K
    p_RK = probs_RV.gather(1, cols_RK.clamp(max=vocab - 1)).double()
    p_RK = torch.where(cols_RK < vocab, p_RK, 0.0)
    cdf_RK = below_R[:, None] + p_RK.cumsum(dim=1)
    offset_R = torch.searchsorted(cdf_RK, target_R1, right=True).squeeze(-1)
    # rounding can put the target past the block's own sum: its last token with mass
    last_R = torch.where(p_RK > 0, ids_K, 0).amax(dim=1)
    return block_R * CDF_BLOCK + torch.minimum(offset_R, last_R)
