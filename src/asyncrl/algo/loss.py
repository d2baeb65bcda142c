"""The clipped policy-gradient loss (PPO / GRPO / DAPO / GSPO / decoupled PPO / CISPO), its
corrections for a rollout–trainer mismatch (behaviour-weight cap, IcePop, sequence masking),
and the KL penalty to a reference policy.

Every tensor is ``[B, T]``: ``B`` sequences, right-padded to ``T`` tokens, with
``loss_mask`` True on the tokens that carry a loss (the generated ones). Values at
masked-out positions are ignored, whatever they are (even inf or NaN).
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from asyncrl.algo.config import (
    ImportanceLevel,
    KLPlacement,
    KLType,
    LossAgg,
    LossConfig,
    PolicyObjective,
)

LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
IMPORTANCE_LEVELS: tuple[str, ...] = get_args(ImportanceLevel)
KL_TYPES: tuple[str, ...] = get_args(KLType)
KL_PLACEMENTS: tuple[str, ...] = get_args(KLPlacement)
POLICY_OBJECTIVES: tuple[str, ...] = get_args(PolicyObjective)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: KLType = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π, with ``d = log π_ref − log π``::

    k1 = −d                 (unbiased, high variance, can be negative)
    k2 = d² / 2             (biased, low variance)
    k3 = exp(d) − 1 − d     (unbiased, ≥ 0, low variance)

    Unbiased *values* do not make unbiased *gradients*. With tokens drawn from π, the
    expected gradient of the penalty is, per placement (see :func:`policy_loss`):

    - in the loss (``∇k`` flows): k1 → 0 (E_π[∇log π] = 0: no penalty at all);
      k2 → ∇KL(π ‖ π_ref); k3 → ∇KL(π_ref ‖ π) (the reverse KL, GRPO's choice);
    - in the reward (``k`` detached, times ``∇log π``): k1 → ∇KL(π ‖ π_ref); k2, k3 →
      no KL's gradient (k3's is ∇KL(π ‖ π_ref) − ∇KL(π_ref ‖ π), nearly 0 near π_ref).

    ``asyncrl check`` refuses the placements that give no KL's gradient.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type {kl_type!r}: allowed {list(KL_TYPES)}")
    d = ref_logprobs - logprobs
    if kl_type == "k1":
        return -d
    if kl_type == "k2":
        return 0.5 * d.square()
    return torch.expm1(d) - d


def tokens_per_episode(loss_mask: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: for each sequence, the loss tokens of its whole episode, counted over
    the rows of ``loss_mask [B, T]`` whose ``episode [B]`` id is the same::

        N_b = Σ_{c : episode_c = episode_b} Σ_t m_ct

    An episode of agent code whose calls do not all continue one another gives several
    sequences; :func:`aggregate` weighs it once through these counts.
    """
    if episode.shape != loss_mask.shape[:1]:
        raise ValueError(
            f"episode has shape {tuple(episode.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    n_B = loss_mask.bool().sum(dim=-1)
    _, inverse = torch.unique(episode, return_inverse=True)
    per_episode = torch.zeros(
        int(inverse.max()) + 1 if inverse.numel() else 0, dtype=n_B.dtype, device=n_B.device
    )
    per_episode.index_add_(0, inverse, n_B)
    return per_episode[inverse]


def _episode_units(n_B: torch.Tensor, episode_tokens: torch.Tensor | None) -> torch.Tensor:
    """``[B]`` float64 ``n_b / N_b``: each sequence's share of its episode (1 for a sequence
    that is its own episode, 0 for one without loss tokens)."""
    N_B = n_B if episode_tokens is None else episode_tokens.to(n_B.device)
    if bool((N_B < n_B).any()):
        raise ValueError("episode_tokens must be at least each sequence's own loss tokens")
    return n_B.double() / N_B.double().clamp(min=1)


def agg_count(
    loss_mask: torch.Tensor, loss_agg: LossAgg, episode_tokens: torch.Tensor | None = None
) -> float:
    """How many units ``loss_agg`` averages over: loss tokens for ``token-mean``, episodes
    with at least one loss token otherwise, each sequence counting as its share
    ``n_b / N_b`` of its episode (see :func:`aggregate`; without ``episode_tokens``, every
    sequence is its own episode and counts 1).

    A loss computed on part of a batch, multiplied by ``agg_count(part) / agg_count(batch)``,
    sums over the parts to the loss of the whole batch when every part gets the batch's
    ``episode_tokens`` (and, for ``seq-mean-token-sum-norm``, its ``norm_len``); the train
    engine splits its micro-batches this way, even through an episode.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg {loss_agg!r}: allowed {list(LOSS_AGGS)}")
    n_B = loss_mask.bool().sum(dim=-1)
    if loss_agg == "token-mean":
        return float(n_B.sum())
    return float(_episode_units(n_B, episode_tokens).sum())


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg: LossAgg,
    *,
    norm_len: float | None = None,
    episode_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduces per-token ``values [B, T]`` to a scalar. With ``m`` the mask, ``n_b = Σ_t m_bt``,
    ``N_b`` the loss tokens of sequence ``b``'s episode (``episode_tokens [B]``, see
    :func:`tokens_per_episode`; default ``n_b``: each sequence its own episode) and
    ``E = Σ_b n_b / N_b`` the number of episodes with a loss token::

        token-mean               Σ_bt m·v / Σ_bt m
        seq-mean-token-mean      (1/E) Σ_b (Σ_t m·v / N_b)
        seq-mean-token-sum-norm  (1/E) Σ_b (Σ_t m·v / norm_len)    (Dr.GRPO)

    that is, per episode: the mean over episodes of the token-mean over all the episode's
    loss tokens (across its sequences), or of its token sum over ``norm_len``. An episode
    of three sequences weighs once, as one of one sequence does; without ``episode_tokens``
    the sums run over sequences (``E = |{b : n_b > 0}|``).

    ``norm_len`` defaults to ``max_b n_b``; pass a constant (the generation budget) to make
    the loss independent of the batch. An empty mask gives 0, still attached to the graph so
    that a backward pass runs (distributed ranks must all run one).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg {loss_agg!r}: allowed {list(LOSS_AGGS)}")
    mask = loss_mask.bool()
    # where(), not a product: masked positions may hold inf/NaN, and 0·inf is NaN.
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    n_B = mask.sum(dim=-1)
    if loss_agg == "token-mean":
        return masked.sum() / n_B.sum().clamp(min=1)
    units = _episode_units(n_B, episode_tokens).sum()
    # Not clamp(min=1): part of an episode counts a fraction; only an empty mask has none.
    units = torch.where(units > 0, units, torch.ones_like(units)).to(values.dtype)
    if loss_agg == "seq-mean-token-mean":
        N_B = n_B if episode_tokens is None else episode_tokens.to(n_B.device)
        return (masked.sum(dim=-1) / N_B.clamp(min=1).to(values.dtype)).sum() / units
    if norm_len is None:
        norm_len = float(n_B.max().clamp(min=1))
    if norm_len <= 0:
        raise ValueError(f"norm_len must be positive, got {norm_len}")
    return masked.sum() / norm_len / units


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(mask, values, zero).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    behav_logprobs: torch.Tensor | None = None,
    norm_len: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    episode_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss, to be minimised. Per token, with ``A`` the advantage and
    ``k_t = KL_k(π ‖ π_ref)`` the per-token estimate of :func:`kl_penalty`::

        A_t    = A_t − kl_coef · Σ_{s ≥ t} k_s (detached)   (kl_in = "reward", ref given)
        r      = exp(log π − log π_old)                             (token level)
        r      = exp(mean_{t∈seq} (log π − log π_old))              (sequence level, GSPO)
        ℓ      = max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high))   (PPO; DAPO clip-higher)
        ℓ      = min(ℓ, −c_clip·A)                 where A < 0      (dual clip, c_clip > 1)
        ℓ      = −sg(clip(r, 1 − eps_clip, 1 + eps_clip_high)) · A · log π        (CISPO)
        w      = exp(log π_old − log π_behav)                       (decoupled PPO)
        keep   = w ≤ behav_imp_weight_cap                                   (token cap)
               ∧ 1/icepop_band ≤ w ≤ icepop_band                              (IcePop)
               ∧ 1/seq_mask_band ≤ exp(mean_{s∈seq}(log w_s)) ≤ seq_mask_band
                                                          (sequence-masked IS, per sequence)
        ℓ      = w·ℓ where keep, else 0
        ℓ     += w · kl_coef · k_t,  0 where not keep        (kl_in = "loss", ref given)
        ℓ     −= entropy_coef · H_t,  0 where not keep              (entropy given)
        loss   = aggregate(ℓ, loss_mask, loss_agg)             (per episode, given episode_tokens)

    Which correction: the cap (truncated IS) drops single tokens the behaviour policy made
    far *less* likely than the proximal one, the ones whose weight would blow up; IcePop
    drops a token whose weight is off either way, so a token the trainer finds much less
    likely than the sampler did (w ≪ 1) no longer pushes with a tiny, noisy weight;
    sequence masking drops whole samples whose mismatch is systematic (a sampler bug, a
    weight-sync gap), where per-token weights cannot repair the context the later tokens
    stand on. CISPO is no mask: it bounds the size of each token's weight and keeps its
    gradient, where PPO's clip zeroes the gradient of tokens whose ratio left the clip
    range (MiniMax-M1 keeps rare "reflection" tokens learning that way). Its value is
    ``−A·log π`` scaled, not a ratio, so ``pg_loss`` is not comparable with PPO's; its
    gradient at ``r = 1``, ``−A·∇log π``, is PPO's ``−A·∇r`` there.

    ``kl_in = "reward"`` treats ``−kl_coef · k_t`` as a per-token reward: each token's
    advantage takes the KL still to come in its sequence (the return with γ = 1; the
    tokens before t cannot depend on the choice at t, so leaving them out only removes
    variance). It adds to the task advantage as given (after group normalisation), so
    ``kl_coef`` is in units of normalised advantage. The gradient then is the policy
    gradient of the KL, exact for k1 (see :func:`kl_penalty`). ``kl_in = "loss"`` adds the
    estimate to the loss with its gradient (exact for k2; k3 gives the reverse KL's).
    Either way a token the behaviour-weight cap drops carries no KL term either.

    In the loss, ``k_t`` is the estimate at a token the behaviour policy sampled, so it is
    weighted by ``w`` like the policy term: ``w · k_t`` estimates the proximal policy's
    expected penalty, which is what the exactness claims above are about. The entropy
    ``H_t`` is of the whole next-token distribution, which the sampled token does not
    choose, so it takes no weight; a token the cap drops carries no bonus either, so that
    every term of the loss stands on the same tokens.

    In the decoupled objective (AReaL) ``old_logprobs`` are the *proximal* policy's,
    recomputed by the trainer, and ``behav_logprobs`` those of the policy that sampled the
    tokens; ``w`` corrects for the gap and carries no gradient. Tokens over the cap drop out
    of the numerator but still count in the denominator, so that the denominator never
    depends on the policy. At sequence level every token of a sequence shares one ratio
    (and one clip decision); ``w`` stays per token. Without ``behav_logprobs``, ``w = 1``
    and none of the three masks drops anything.

    The coefficients and choices are the recipe's ``trainer.loss`` section itself
    (``policy_objective``, ``eps_clip``, ``eps_clip_high``, ``c_clip``,
    ``behav_imp_weight_cap``, ``icepop_band``, ``seq_mask_band``,
    ``importance_sampling_level``, ``loss_agg``, ``kl_coef``, ``kl_type``, ``kl_in``,
    ``entropy_coef``); the advantage settings in it play no part here.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs, with gradient.
        old_logprobs: ``[B, T]`` proximal (or, without ``behav_logprobs``, behaviour) logprobs.
        advantages: ``[B, T]`` per token or ``[B]`` per sequence.
        loss_mask: ``[B, T]`` bool, True on tokens that carry a loss.
        config: the loss settings (``eps_clip_high`` None: ``eps_clip``, symmetric PPO).
        behav_logprobs: ``[B, T]`` the behaviour policy's logprobs (decoupled PPO); None:
            ``old_logprobs`` are the behaviour's, no importance weight.
        norm_len: the constant of ``seq-mean-token-sum-norm`` (see :func:`aggregate`);
            None: ``config.norm_len``, else the longest loss span of this batch.
        ref_logprobs: ``[B, T]`` the reference policy's logprobs; the KL penalty needs them
            when ``config.kl_coef`` ≠ 0.
        entropy: ``[B, T]`` entropy of the policy's sampled distribution per token, with
            gradient; the bonus needs it when ``entropy_coef`` ≠ 0.
        episode_tokens: ``[B]`` the loss tokens of each sequence's whole episode, for the
            seq-mean aggregations (see :func:`aggregate`); None: each sequence is its own
            episode.

    Returns:
        ``(loss, stats)``; stats are detached scalars over the masked tokens:
        ``clip_frac_low``/``clip_frac_high``/``clip_frac_dual`` (share of tokens where that
        clip is active; for CISPO, where the weight is clipped below/above, whatever the
        sign of A), ``approx_kl`` (k3 estimate of KL(π_old ‖ π)), ``ratio_mean``,
        ``behav_imp_weight_mean``/``behav_imp_weight_max`` (before any mask),
        ``behav_masked_frac`` (share dropped by the cap), ``icepop_masked_frac`` (share
        outside the IcePop band), ``seq_masked_frac`` (share in sequences outside the
        sequence band) and ``seq_masked_seq_frac`` (share of the sequences with a loss token
        that it drops); a token may count in several of these. ``pg_loss``, ``kl_ref``,
        ``entropy`` (mean over the masked tokens; 0 when none was given).
    """
    eps_clip, eps_clip_high, c_clip = config.eps_clip, config.eps_clip_high, config.c_clip
    behav_imp_weight_cap = config.behav_imp_weight_cap
    icepop_band, seq_mask_band = config.icepop_band, config.seq_mask_band
    objective = config.policy_objective
    importance_sampling_level, loss_agg = config.importance_sampling_level, config.loss_agg
    kl_coef, kl_type, kl_in = config.kl_coef, config.kl_type, config.kl_in
    entropy_coef = config.entropy_coef
    if norm_len is None:
        norm_len = config.norm_len
    if importance_sampling_level not in IMPORTANCE_LEVELS:
        raise ValueError(
            f"importance_sampling_level {importance_sampling_level!r}: "
            f"allowed {list(IMPORTANCE_LEVELS)}"
        )
    if objective not in POLICY_OBJECTIVES:
        raise ValueError(f"policy_objective {objective!r}: allowed {list(POLICY_OBJECTIVES)}")
    if kl_in not in KL_PLACEMENTS:
        raise ValueError(f"kl_in {kl_in!r}: allowed {list(KL_PLACEMENTS)}")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is set but no entropy was given")
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1, got {c_clip}")
    if c_clip is not None and objective == "cispo":
        raise ValueError('c_clip applies to policy_objective "ppo" only')
    for key, band in (("icepop_band", icepop_band), ("seq_mask_band", seq_mask_band)):
        if band is not None and band <= 1.0:
            raise ValueError(f"{key} must be > 1, got {band}")
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    eps_low = eps_clip
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = advantages.to(logprobs.dtype)
    if adv.ndim == 1:
        adv = adv[:, None]
    # Sanitised, not just masked later: a NaN left at a masked position turns into a NaN
    # gradient through the product (0 · NaN), even where the forward value is discarded.
    adv = torch.where(mask, adv.expand_as(logprobs), zero)

    kl_ref = zero
    kl_BT = None
    if ref_logprobs is not None and kl_coef != 0.0:
        kl_BT = kl_penalty(
            torch.where(mask, logprobs, zero),
            torch.where(mask, ref_logprobs.detach(), zero),
            kl_type,
        )
        kl_BT = torch.where(mask, kl_BT, zero)
        kl_ref = _masked_mean(kl_BT.detach(), mask)
        if kl_in == "reward":
            to_go_BT = kl_BT.detach().flip(-1).cumsum(-1).flip(-1)
            adv = torch.where(mask, adv - kl_coef * to_go_BT, zero)

    token_log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), zero)
    if importance_sampling_level == "sequence":
        n_B = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = (token_log_ratio.sum(dim=-1, keepdim=True) / n_B).expand_as(logprobs)
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    if objective == "cispo":
        pg = -adv * clipped_ratio.detach() * torch.where(mask, logprobs, zero)
        with torch.no_grad():
            clip_low = mask & (ratio < 1.0 - eps_low)
            clip_high = mask & (ratio > 1.0 + eps_high)
    else:
        pg = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        with torch.no_grad():
            clip_low = mask & (adv < 0) & (ratio < 1.0 - eps_low)
            clip_high = mask & (adv > 0) & (ratio > 1.0 + eps_high)
    if c_clip is not None:
        dual_bound = -c_clip * adv
        dual = mask & (adv < 0) & (pg > dual_bound)
        pg = torch.where(dual, dual_bound, pg)
    else:
        dual = torch.zeros_like(mask)

    no_token = torch.zeros_like(mask)
    capped, icepop_out, seq_out = no_token, no_token, no_token
    if behav_logprobs is not None:
        behav_log_w = torch.where(mask, old_logprobs - behav_logprobs, zero).detach()
        behav_w = torch.exp(behav_log_w)
        if behav_imp_weight_cap is not None:
            capped = mask & (behav_w > behav_imp_weight_cap)
        if icepop_band is not None:
            icepop_out = mask & ((behav_w < 1.0 / icepop_band) | (behav_w > icepop_band))
        if seq_mask_band is not None:
            n_B = mask.sum(dim=-1, keepdim=True).clamp(min=1)
            seq_log_w = behav_log_w.sum(dim=-1, keepdim=True) / n_B
            seq_out = mask & (seq_log_w.abs() > math.log(seq_mask_band))
        keep = mask & ~capped & ~icepop_out & ~seq_out
        pg = torch.where(keep, pg * behav_w, zero)
    else:
        behav_w = torch.ones_like(logprobs)
        keep = mask

    per_token = pg
    if kl_BT is not None and kl_in == "loss":
        per_token = per_token + kl_coef * torch.where(keep, behav_w * kl_BT, zero)
    entropy_mean = zero
    if entropy is not None:
        entropy_mean = _masked_mean(entropy.detach().to(logprobs.dtype), mask)
        if entropy_coef != 0.0:
            per_token = per_token - entropy_coef * torch.where(keep, entropy, zero)

    loss = aggregate(per_token, mask, loss_agg, norm_len=norm_len, episode_tokens=episode_tokens)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "pg_loss": aggregate(
                pg.detach(), mask, loss_agg, norm_len=norm_len, episode_tokens=episode_tokens
            ),
            "kl_ref": kl_ref,
            "entropy": entropy_mean,
            "clip_frac_low": clip_low.sum() / n,
            "clip_frac_high": clip_high.sum() / n,
            "clip_frac_dual": dual.sum() / n,
            "approx_kl": _masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
            "ratio_mean": _masked_mean(ratio.detach(), mask),
            "behav_imp_weight_mean": _masked_mean(behav_w, mask),
            "behav_imp_weight_max": torch.where(mask, behav_w, zero).max() if mask.any() else zero,
            "behav_masked_frac": capped.sum() / n,
            "icepop_masked_frac": icepop_out.sum() / n,
            "seq_masked_frac": seq_out.sum() / n,
            "seq_masked_seq_frac": seq_out.any(dim=-1).sum() / mask.any(dim=-1).sum().clamp(min=1),
        }
    return loss, {k: v.detach().to(torch.float32) for k, v in stats.items()}
