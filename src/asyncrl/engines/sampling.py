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
    cdf_RV = probs_RV.double().cumsum(dim=-1)
    u_R = u_R.to(cdf_RV.device) * cdf_RV[:, -1]
    tokens_R = torch.searchsorted(cdf_RV, u_R[:, None], right=True).squeeze(-1)
    tokens_R = tokens_R.clamp(max=logits_RV.shape[-1] - 1)
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
