"""policy_loss, aggregate and kl_penalty against hand-computed values.

Convention in these tests: old logprobs are 0, so ``logprobs = log r`` puts the ratio
``r`` in directly.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from asyncrl.algo.config import LossConfig
from asyncrl.algo.loss import agg_count, aggregate, kl_penalty, policy_loss, tokens_per_episode


def loss_config(**settings: Any) -> LossConfig:
    """The loss section with ``settings``; no behaviour-weight cap unless one is given."""
    return LossConfig(**{"behav_imp_weight_cap": None, **settings})


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def log_ratios(*ratios: float) -> torch.Tensor:
    return torch.log(row(*ratios)).requires_grad_(True)


def ones_mask(n: int) -> torch.Tensor:
    return torch.ones(1, n, dtype=torch.bool)


def test_symmetric_ppo_clip_values_gradients_and_fractions() -> None:
    logp = log_ratios(1.5, 0.5, 1.1, 0.7)
    adv = row(1.0, 1.0, -1.0, -1.0)
    loss, stats = policy_loss(
        logp, torch.zeros_like(logp), adv, ones_mask(4), loss_config(eps_clip=0.2)
    )
    # per token: max(−1.5, −1.2)=−1.2 (clipped high), max(−0.5, −0.8)=−0.5,
    #            max(1.1, 1.1)=1.1, max(0.7, 0.8)=0.8 (clipped low)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    assert stats["clip_frac_high"].item() == pytest.approx(0.25)
    assert stats["clip_frac_low"].item() == pytest.approx(0.25)
    assert stats["clip_frac_dual"].item() == 0.0
    loss.backward()
    # d(−A·r)/d log r = −A·r on unclipped tokens, 0 on clipped ones; token-mean over 4
    torch.testing.assert_close(logp.grad, row(0.0, -0.5 / 4, 1.1 / 4, 0.0))


def test_clip_higher_widens_only_the_upper_bound() -> None:
    logp = log_ratios(1.5, 0.5, 1.1, 0.7)
    adv = row(1.0, 1.0, -1.0, -1.0)
    loss, stats = policy_loss(
        logp,
        torch.zeros_like(logp),
        adv,
        ones_mask(4),
        loss_config(eps_clip=0.2, eps_clip_high=0.6),
    )
    # r = 1.5 < 1.6 is no longer clipped; the lower clip at 0.8 still holds
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 1.1 + 0.8) / 4)
    assert stats["clip_frac_high"].item() == 0.0
    assert stats["clip_frac_low"].item() == pytest.approx(0.25)


def test_dual_clip_bounds_negative_advantages() -> None:
    logp = log_ratios(4.0, 2.0, 4.0)
    adv = row(-1.0, -1.0, 1.0)
    loss, stats = policy_loss(
        logp, torch.zeros_like(logp), adv, ones_mask(3), loss_config(c_clip=3.0)
    )
    # A<0, r=4: max(4, 1.2)=4 → min(4, 3)=3 (dual); A<0, r=2: 2 < 3 stays;
    # A>0, r=4: max(−4, −1.2)=−1.2 (clipped high, dual never applies)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert stats["clip_frac_dual"].item() == pytest.approx(1 / 3)
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, row(0.0, 2.0 / 3, 0.0))
    with pytest.raises(ValueError, match="c_clip"):
        policy_loss(logp, torch.zeros_like(logp), adv, ones_mask(3), loss_config(c_clip=1.0))


def test_decoupled_weights_and_cap() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)  # π = π_prox: r = 1
    prox = torch.zeros(1, 3)
    behav = -torch.log(row(0.5, 2.0, 8.0))  # w = exp(prox − behav) = 0.5, 2, 8
    adv = row(1.0, 1.0, 1.0)
    loss, stats = policy_loss(logp, prox, adv, ones_mask(3), loss_config(), behav_logprobs=behav)
    assert loss.item() == pytest.approx(-(0.5 + 2.0 + 8.0) / 3)
    capped, cstats = policy_loss(
        logp, prox, adv, ones_mask(3), loss_config(behav_imp_weight_cap=5.0), behav_logprobs=behav
    )
    # the w = 8 token drops out of the sum but stays in the denominator
    assert capped.item() == pytest.approx(-(0.5 + 2.0) / 3)
    assert cstats["behav_imp_weight_mean"].item() == pytest.approx(3.5)
    assert cstats["behav_imp_weight_max"].item() == pytest.approx(8.0)
    assert cstats["behav_masked_frac"].item() == pytest.approx(1 / 3)
    assert stats["behav_masked_frac"].item() == 0.0
    capped.backward()
    # d(−A·w·r)/d log π = −w per kept token, the weight itself carries no gradient
    torch.testing.assert_close(logp.grad, row(-0.5 / 3, -2.0 / 3, 0.0))


def test_decoupled_ratio_is_against_the_proximal_policy() -> None:
    logp = torch.log(row(3.0)).requires_grad_(True)
    prox = torch.log(row(2.0))  # r = 3/2 = 1.5 → clipped to 1.2 for A > 0
    behav = torch.log(row(1.0))  # w = 2
    loss, stats = policy_loss(
        logp, prox, row(1.0), ones_mask(1), loss_config(), behav_logprobs=behav
    )
    assert loss.item() == pytest.approx(-2.0 * 1.2)
    assert stats["clip_frac_high"].item() == 1.0


def test_sequence_level_ratio_is_shared_by_the_sequence() -> None:
    # seq 0: log r = [log 2, log 0.5] → mean 0 → r = 1 for both tokens
    # seq 1: log r = [log 1.5, log 1.5] → r = 1.5, clipped to 1.2 for A > 0
    logp = torch.log(torch.tensor([[2.0, 0.5], [1.5, 1.5]])).requires_grad_(True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])  # one advantage per sequence
    seq_loss, stats = policy_loss(
        logp, torch.zeros(2, 2), adv, mask, loss_config(importance_sampling_level="sequence")
    )
    assert seq_loss.item() == pytest.approx((-1.0 - 1.0 - 1.2 - 1.2) / 4)
    assert stats["clip_frac_high"].item() == pytest.approx(0.5)
    seq_loss.backward()
    # pg_t = −exp(mean_j log r_j): each token of seq 0 gets −(1/2)·2 tokens / 4 = −0.25
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))
    token_loss, _ = policy_loss(logp, torch.zeros(2, 2), adv, mask, loss_config())
    assert token_loss.item() == pytest.approx((-1.2 - 0.5 - 1.2 - 1.2) / 4)


# values row 0: [1, 2, NaN (masked)], row 1: [3, 4, 5], row 2: fully masked
VALUES = torch.tensor([[1.0, 2.0, math.nan], [3.0, 4.0, 5.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])


@pytest.mark.parametrize(
    ("loss_agg", "norm_len", "expected"),
    [
        ("token-mean", None, 15 / 5),
        ("seq-mean-token-mean", None, (1.5 + 4.0) / 2),
        ("seq-mean-token-sum-norm", None, (3 / 3 + 12 / 3) / 2),
        ("seq-mean-token-sum-norm", 4.0, (3 / 4 + 12 / 4) / 2),
    ],
)
def test_each_aggregation(loss_agg: str, norm_len: float | None, expected: float) -> None:
    assert aggregate(VALUES, MASK, loss_agg, norm_len=norm_len).item() == pytest.approx(expected)  # type: ignore[arg-type]
    # Through policy_loss: r = 1 and A = −v make the per-token loss exactly v.
    logp = torch.zeros(3, 3, requires_grad=True)
    loss, _ = policy_loss(
        logp,
        torch.zeros(3, 3),
        -VALUES,
        MASK,
        loss_config(loss_agg=loss_agg),
        norm_len=norm_len,  # type: ignore[arg-type]
    )
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert torch.isfinite(logp.grad).all()  # type: ignore[arg-type]
    assert (logp.grad[~MASK] == 0).all()  # type: ignore[index]


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_parts_weighted_by_agg_count_sum_to_the_whole(loss_agg: str) -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.rand(6, 5, generator=g) + 0.5
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[4] = False
    whole = aggregate(values, mask, loss_agg, norm_len=5.0)  # type: ignore[arg-type]
    total = agg_count(mask, loss_agg)  # type: ignore[arg-type]
    parts = sum(
        aggregate(values[s], mask[s], loss_agg, norm_len=5.0) * agg_count(mask[s], loss_agg) / total  # type: ignore[arg-type]
        for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    assert float(parts) == pytest.approx(whole.item(), rel=1e-6)


# Rows 0–2 are one episode of three samples (loss tokens 1 2 | 3 4 5 | 6), row 3 another (8).
EP_VALUES = torch.tensor(
    [[1.0, 2.0, math.nan], [3.0, 4.0, 5.0], [6.0, math.inf, 0.0], [8.0, 0.0, 0.0]]
)
EP_MASK = torch.tensor(
    [[True, True, False], [True, True, True], [True, False, False], [True, False, False]]
)
EP_IDS = torch.tensor([7, 7, 7, 2])


@pytest.mark.parametrize(
    ("loss_agg", "norm_len", "expected"),
    [
        ("token-mean", None, 29 / 7),
        ("seq-mean-token-mean", None, (21 / 6 + 8 / 1) / 2),
        ("seq-mean-token-sum-norm", 4.0, (21 / 4 + 8 / 4) / 2),
        ("seq-mean-token-sum-norm", None, (21 / 3 + 8 / 3) / 2),
    ],
)
def test_an_episode_of_several_samples_weighs_once(
    loss_agg: str, norm_len: float | None, expected: float
) -> None:
    """Episode 7 has loss tokens 1..6 over three samples (sum 21, 6 tokens), episode 2 the
    single token 8 (the default norm_len is the longest sample's span, 3)::

        token-mean               (21 + 8) / 7                  = 29/7
        seq-mean-token-mean      (21/6 + 8/1) / 2              = 5.75
        sum-norm, norm_len 4     (21/4 + 8/4) / 2              = 3.625
        sum-norm, norm_len 3     (21/3 + 8/3) / 2              = 29/6

    Counted per sample instead, seq-mean-token-mean was (1.5 + 4 + 6 + 8)/4 = 4.875 and
    sum-norm (4) (3 + 12 + 6 + 8)/4/4 = 1.8125: the three-sample episode weighed 3×.
    """
    n_e = tokens_per_episode(EP_MASK, EP_IDS)
    assert n_e.tolist() == [6, 6, 6, 1]
    got = aggregate(EP_VALUES, EP_MASK, loss_agg, norm_len=norm_len, episode_tokens=n_e)  # type: ignore[arg-type]
    assert got.item() == pytest.approx(expected)
    assert agg_count(EP_MASK, loss_agg, n_e) == pytest.approx(  # type: ignore[arg-type]
        7 if loss_agg == "token-mean" else 2
    )
    # Through policy_loss: r = 1 and A = −v make the per-token loss exactly v.
    logp = torch.zeros(4, 3, requires_grad=True)
    loss, stats = policy_loss(
        logp,
        torch.zeros(4, 3),
        -EP_VALUES,
        EP_MASK,
        loss_config(loss_agg=loss_agg),
        norm_len=norm_len,
        episode_tokens=n_e,
    )
    assert loss.item() == pytest.approx(expected)
    assert stats["pg_loss"].item() == pytest.approx(expected)


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_one_sample_per_episode_is_the_per_sample_aggregation(loss_agg: str) -> None:
    """Distinct ids: ``N_b = n_b`` and ``E`` the samples with a loss token (the fully
    masked row 2 of VALUES counts in neither), so the result is the per-sample one."""
    n_e = tokens_per_episode(MASK, torch.tensor([0, 1, 2]))
    assert n_e.tolist() == [2, 3, 0]
    for norm_len in (None, 4.0):
        with_ids = aggregate(VALUES, MASK, loss_agg, norm_len=norm_len, episode_tokens=n_e)  # type: ignore[arg-type]
        without = aggregate(VALUES, MASK, loss_agg, norm_len=norm_len)  # type: ignore[arg-type]
        assert with_ids.item() == pytest.approx(without.item())


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_parts_that_split_an_episode_sum_to_the_whole(loss_agg: str) -> None:
    """Parts {0}, {1, 3}, {2} cut episode 7 in three; each part's loss times
    ``agg_count(part) / agg_count(whole)``, with the whole batch's episode counts, sums
    to the whole. For seq-mean-token-mean the shares of E = 2 are 2/6, 3/6 + 1 and 1/6,
    and the weighted parts add to 5.75 (a share below 1 is no empty part)."""
    n_e = tokens_per_episode(EP_MASK, EP_IDS)
    whole = aggregate(EP_VALUES, EP_MASK, loss_agg, norm_len=4.0, episode_tokens=n_e)  # type: ignore[arg-type]
    total = agg_count(EP_MASK, loss_agg, n_e)  # type: ignore[arg-type]
    assert total == pytest.approx(2.0)
    parts = 0.0
    for rows in ([0], [1, 3], [2]):
        r = torch.tensor(rows)
        part = aggregate(EP_VALUES[r], EP_MASK[r], loss_agg, norm_len=4.0, episode_tokens=n_e[r])  # type: ignore[arg-type]
        parts += float(part) * agg_count(EP_MASK[r], loss_agg, n_e[r]) / total  # type: ignore[arg-type]
    assert parts == pytest.approx(whole.item())
    assert whole.item() == pytest.approx(5.75 if loss_agg == "seq-mean-token-mean" else 3.625)


def test_masked_garbage_never_reaches_loss_or_gradient() -> None:
    logp = torch.tensor([[0.1, math.inf, -0.2]], requires_grad=True)
    old = torch.tensor([[0.0, -math.inf, 0.1]])
    adv = torch.tensor([[1.0, math.nan, 2.0]])
    mask = torch.tensor([[True, False, True]])
    loss, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_config(kl_coef=0.1),
        behav_logprobs=torch.tensor([[0.0, math.nan, 0.0]]),
        ref_logprobs=torch.tensor([[0.0, math.nan, 0.0]]),
    )
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in stats.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()  # type: ignore[arg-type]
    assert logp.grad[0, 1] == 0  # type: ignore[index]


def test_empty_mask_gives_zero_with_a_graph() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(
        logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool), loss_config()
    )
    assert loss.item() == 0.0
    loss.backward()  # must not raise: idle distributed ranks run this
    assert stats["behav_imp_weight_max"].item() == 0.0


def test_kl_estimators() -> None:
    logp, ref = torch.log(row(0.5)), torch.log(row(0.25))
    d = math.log(0.5)  # log π_ref − log π
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(d) - 1 - d)
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_penalty_is_added_per_token() -> None:
    logp = torch.log(row(0.5, 0.5)).requires_grad_(True)
    ref = torch.log(row(0.25, 0.5))
    k3 = 0.5 - 1 - math.log(0.5)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        row(1.0, 1.0),
        ones_mask(2),
        loss_config(kl_coef=0.1, kl_type="k3"),
        ref_logprobs=ref,
    )
    assert loss.item() == pytest.approx(-1.0 + 0.1 * k3 / 2)
    assert stats["kl_ref"].item() == pytest.approx(k3 / 2)
    assert stats["pg_loss"].item() == pytest.approx(-1.0)


def test_stats_approx_kl_and_ratio_mean() -> None:
    logp = log_ratios(2.0, 1.0)
    _, stats = policy_loss(logp, torch.zeros_like(logp), row(0.0, 0.0), ones_mask(2), loss_config())
    # k3 of KL(π_old ‖ π) with r = π/π_old: (r − 1) − log r
    assert stats["approx_kl"].item() == pytest.approx((1 - math.log(2)) / 2)
    assert stats["ratio_mean"].item() == pytest.approx(1.5)


def test_bad_options_are_refused() -> None:
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(
            logp, logp, row(1.0, 1.0), ones_mask(2), loss_config(importance_sampling_level="group")
        )
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(logp, logp, row(1.0, 1.0), ones_mask(2), loss_config(loss_agg="sum"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(logp[0], logp[0], row(1.0, 1.0)[0], ones_mask(2)[0], loss_config())


def test_entropy_bonus_goes_through_the_loss_aggregation() -> None:
    logp = torch.zeros(2, 3, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.zeros(2)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        loss_config(entropy_coef=0.1, loss_agg="seq-mean-token-mean"),
        entropy=entropy,
    )
    # seq-mean-token-mean of H: ((1 + 2)/2 + 4/1)/2 = 2.75; the loss loses 0.1 of it
    assert loss.item() == pytest.approx(-0.275)
    assert stats["entropy"].item() == pytest.approx(7 / 3)  # token mean, a statistic
    loss.backward()
    torch.testing.assert_close(
        entropy.grad, torch.tensor([[-0.025, -0.025, 0.0], [-0.05, 0.0, 0.0]])
    )
    # without a coefficient the entropy is only reported
    loss, stats = policy_loss(
        logp, logp.detach(), adv, mask, loss_config(), entropy=entropy.detach()
    )
    assert loss.item() == 0.0 and stats["entropy"].item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, logp.detach(), adv, mask, loss_config(entropy_coef=0.1))


def test_entropy_bonus_gradient_step_raises_the_entropy() -> None:
    from asyncrl.train.models import chunk_logprobs

    hidden = torch.tensor([[1.0, 0.5]])
    weight = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], requires_grad=True)
    for top_k in (0, 2):  # the bonus acts on the sampled (cut) distribution too
        _, h = chunk_logprobs(hidden, weight, None, torch.tensor([0]), 1.0, top_k=top_k)
        loss, _ = policy_loss(
            torch.zeros(1, 1, requires_grad=True),
            torch.zeros(1, 1),
            torch.zeros(1),
            torch.ones(1, 1, dtype=torch.bool),
            loss_config(entropy_coef=1.0),
            entropy=h[None],
        )
        (grad,) = torch.autograd.grad(loss, weight)
        with torch.no_grad():
            _, h_after = chunk_logprobs(
                hidden, weight - 0.1 * grad, None, torch.tensor([0]), 1.0, top_k=top_k
            )
        assert h_after.item() > h.item()


def test_the_kl_and_entropy_terms_stand_on_the_tokens_the_behaviour_cap_keeps() -> None:
    """Decoupled PPO with cap 5: token 1 has w = e^0.5 (kept), token 2 w = e^2 ≈ 7.39
    (dropped). Advantage 0 and π = π_old, so only the penalty and the bonus act. k2 at
    token 1 with d = log π_ref − log π = 0.4 is 0.08; token-mean over the 2 masked tokens:

        KL term:      0.2 · e^0.5 · 0.08 / 2          (weighted by w like the policy term)
        entropy term: −0.1 · 1.0 / 2                   (token 2's 2.0 is dropped with it)
    """
    mask = torch.tensor([[False, True, True]])
    logp = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64)
    behav = logp - torch.tensor([[0.0, 0.5, 2.0]], dtype=torch.float64)
    ref = logp + torch.tensor([[0.0, 0.4, 0.3]], dtype=torch.float64)
    entropy = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    adv = torch.zeros(1, dtype=torch.float64)
    kl_only, _ = policy_loss(
        logp,
        logp,
        adv,
        mask,
        loss_config(behav_imp_weight_cap=5.0, kl_coef=0.2, kl_type="k2", kl_in="loss"),
        behav_logprobs=behav,
        ref_logprobs=ref,
    )
    assert kl_only.item() == pytest.approx(0.2 * math.exp(0.5) * 0.08 / 2, rel=1e-12)
    entropy_only, _ = policy_loss(
        logp,
        logp,
        adv,
        mask,
        loss_config(behav_imp_weight_cap=5.0, entropy_coef=0.1),
        behav_logprobs=behav,
        entropy=entropy,
    )
    assert entropy_only.item() == pytest.approx(-0.1 * 1.0 / 2, rel=1e-12)
