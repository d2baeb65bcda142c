"""The rollout–trainer mismatch corrections of policy_loss (IcePop, sequence-masked IS,
CISPO) against hand-computed values, and their reduction to the plain loss when the
behaviour, proximal and current policies agree.

Convention: ``w = exp(old − behav)`` is set through ``behav = −log w`` with ``old = 0``;
with ``logprobs = old`` the ratio ``r`` is 1, so a kept token's PPO loss is ``−A·w`` and its
gradient with respect to ``log π`` is ``−A·w·r = −A·w`` (over the token-mean's count).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from asyncrl.algo.config import LossConfig
from asyncrl.algo.loss import policy_loss

F64 = torch.float64


def loss_config(**settings: Any) -> LossConfig:
    """The loss section with ``settings``; no behaviour-weight cap unless one is given."""
    return LossConfig(**{"behav_imp_weight_cap": None, **settings})


def t64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def behav_for(weights: list[list[float]]) -> torch.Tensor:
    """Behaviour logprobs giving ``w = exp(0 − behav)`` equal to ``weights`` (NaN stays)."""
    return -torch.log(t64(weights))


def test_icepop_masks_tokens_outside_the_band_both_ways() -> None:
    """w = [1.5, 0.25, 3.0, 1.0], A = [1, 1, −1, 2], r = 1, icepop_band = 2: the band is
    [0.5, 2], so token 1 (0.25 < 0.5) and token 2 (3.0 > 2) carry no loss.
    loss = (−1·1.5 + 0 + 0 − 2·1) / 4 = −3.5 / 4 = −0.875 (the dropped tokens still count in
    the token-mean's denominator); ∂loss/∂log π = −A·w / 4 = [−0.375, 0, 0, −0.5];
    icepop_masked_frac = 2/4. A cap of 2.5 drops token 2 as well: behav_masked_frac = 1/4,
    each rule counted on its own, and the loss is the same."""
    logp = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    old = torch.zeros(1, 4, dtype=F64)
    behav = behav_for([[1.5, 0.25, 3.0, 1.0]])
    adv = t64([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)

    loss, stats = policy_loss(
        logp, old, adv, mask, loss_config(icepop_band=2.0), behav_logprobs=behav
    )
    assert loss.item() == pytest.approx(-0.875)
    assert stats["icepop_masked_frac"].item() == pytest.approx(0.5)
    assert stats["behav_masked_frac"].item() == 0.0
    assert stats["seq_masked_frac"].item() == 0.0
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t64([[-0.375, 0.0, 0.0, -0.5]]))

    capped, cstats = policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_config(icepop_band=2.0, behav_imp_weight_cap=2.5),
        behav_logprobs=behav,
    )
    assert capped.item() == pytest.approx(-0.875)
    assert cstats["behav_masked_frac"].item() == pytest.approx(0.25)
    assert cstats["icepop_masked_frac"].item() == pytest.approx(0.5)

    # Without the band, the same tokens all count: (−1.5 − 0.25 + 3.0 − 2.0) / 4 = −0.1875.
    plain, _ = policy_loss(logp, old, adv, mask, loss_config(), behav_logprobs=behav)
    assert plain.item() == pytest.approx(-0.1875)


def test_sequence_mask_drops_whole_sequences_by_their_geometric_mean_weight() -> None:
    """Two sequences, the second one token shorter (its pad holds NaN, which must not leak).
    Row 0: w = [2, 2, 1], geometric mean (2·2·1)^(1/3) = 4^(1/3) ≈ 1.587 > 1.5: dropped
    whole, its w = 1 token too. Row 1: w = [1.2, 1.4], √1.68 ≈ 1.296 ∈ [1/1.5, 1.5]: kept.
    A = [1, −1] per sequence, r = 1: row 1's tokens give −(−1)·w = 1.2 and 1.4;
    loss = (1.2 + 1.4) / 5 = 0.52 (token-mean over the 5 loss tokens);
    ∂loss/∂log π = [[0, 0, 0], [1.2/5, 1.4/5, 0]]; seq_masked_frac = 3/5 (tokens),
    seq_masked_seq_frac = 1/2 (sequences).

    IcePop with the same band on the same data drops only row 0's two w = 2 tokens:
    loss = (−1·1 + 1.2 + 1.4) / 5 = 1.6 / 5 = 0.32, icepop_masked_frac = 2/5."""
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    behav = behav_for([[2.0, 2.0, 1.0], [1.2, 1.4, math.nan]])
    adv = t64([[1.0], [-1.0]]).squeeze(-1)
    mask = torch.tensor([[True, True, True], [True, True, False]])

    loss, stats = policy_loss(
        logp, old, adv, mask, loss_config(seq_mask_band=1.5), behav_logprobs=behav
    )
    assert loss.item() == pytest.approx(0.52)
    assert stats["seq_masked_frac"].item() == pytest.approx(0.6)
    assert stats["seq_masked_seq_frac"].item() == pytest.approx(0.5)
    assert stats["icepop_masked_frac"].item() == 0.0
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t64([[0.0, 0.0, 0.0], [0.24, 0.28, 0.0]]))

    token_loss, tstats = policy_loss(
        logp, old, adv, mask, loss_config(icepop_band=1.5), behav_logprobs=behav
    )
    assert token_loss.item() == pytest.approx(0.32)
    assert tstats["icepop_masked_frac"].item() == pytest.approx(0.4)
    assert tstats["seq_masked_frac"].item() == 0.0


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient() -> None:
    """π_old = [0.5, 0.5, 0.8, 0.4], r = π/π_old = [1.5, 0.5, 1.0, 0.5], so
    π = [0.75, 0.25, 0.8, 0.2]; A = [1, 1, −1, −2]; eps 0.2: clip(r) = [1.2, 0.8, 1, 0.8].
    ℓ = −clip(r)·A·log π = [−1.2·log 0.75, −0.8·log 0.25, log 0.8, 1.6·log 0.2]
      ≈ [0.345219, 1.109035, −0.223144, −2.575101]; loss = Σ/4 ≈ −0.335998.
    ∂loss/∂log π = −clip(r)·A / 4 = [−0.3, −0.2, 0.25, 0.4]: tokens 0 and 3, whose ratio
    left the range on the side PPO clips, keep their gradient (PPO's is 0 there).
    clip_frac_high = 1/4 (token 0), clip_frac_low = 2/4 (tokens 1 and 3, any sign of A).

    Decoupled, with w = [2, 1, 1, 0.5]: ℓ·w ≈ [0.690438, 1.109035, −0.223144, −1.287551],
    loss ≈ 0.288778 / 4 ≈ 0.0721945, ∂loss/∂log π = −w·clip(r)·A / 4 = [−0.6, −0.2, 0.25, 0.2].
    """
    pi_old = t64([[0.5, 0.5, 0.8, 0.4]])
    pi = t64([[0.75, 0.25, 0.8, 0.2]])
    old = torch.log(pi_old)
    adv = t64([[1.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cispo = loss_config(policy_objective="cispo", eps_clip=0.2)

    logp = torch.log(pi).requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, cispo)
    terms = [
        -1.2 * math.log(0.75),
        -0.8 * math.log(0.25),
        math.log(0.8),
        1.6 * math.log(0.2),
    ]
    assert loss.item() == pytest.approx(sum(terms) / 4)
    assert loss.item() == pytest.approx(-0.335998, abs=1e-6)
    assert stats["clip_frac_high"].item() == pytest.approx(0.25)
    assert stats["clip_frac_low"].item() == pytest.approx(0.5)
    assert stats["clip_frac_dual"].item() == 0.0
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t64([[-0.3, -0.2, 0.25, 0.4]]))

    ppo_logp = torch.log(pi).requires_grad_(True)
    ppo, _ = policy_loss(ppo_logp, old, adv, mask, loss_config(eps_clip=0.2))
    ppo.backward()
    assert ppo_logp.grad is not None
    assert ppo_logp.grad[0, 0].item() == 0.0
    assert ppo_logp.grad[0, 3].item() == 0.0

    w = [2.0, 1.0, 1.0, 0.5]
    dlogp = torch.log(pi).requires_grad_(True)
    dloss, _ = policy_loss(dlogp, old, adv, mask, cispo, behav_logprobs=old - torch.log(t64([w])))
    assert dloss.item() == pytest.approx(sum(wi * ti for wi, ti in zip(w, terms, strict=True)) / 4)
    assert dloss.item() == pytest.approx(0.0721945, abs=1e-6)
    dloss.backward()
    assert dlogp.grad is not None
    torch.testing.assert_close(dlogp.grad, t64([[-0.6, -0.2, 0.25, 0.2]]))


def _equal_policies(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs ``[3, 5]`` (the same for all three policies), per-sequence advantages and a
    ragged mask."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    adv = torch.randn(3, generator=g, dtype=F64)
    mask = torch.tensor(
        [[True, True, True, True, True], [True, True, True, False, False], [True] * 4 + [False]]
    )
    return logp, adv, mask


def _loss_and_grad(
    logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, logp, adv, mask, config, behav_logprobs=logp)
    loss.backward()
    assert x.grad is not None
    return loss.detach(), x.grad, stats


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masks_change_nothing_when_the_policies_agree(loss_agg: str, level: str) -> None:
    """With π = π_old = π_behav every w is 1, inside any band > 1: IcePop and the sequence
    mask drop nothing, and loss and gradient are the plain decoupled PPO's, bit for bit."""
    logp, adv, mask = _equal_policies(0)
    base = {"loss_agg": loss_agg, "importance_sampling_level": level}
    plain, plain_grad, _ = _loss_and_grad(logp, adv, mask, loss_config(**base))
    for settings in ({"icepop_band": 1.01}, {"seq_mask_band": 1.01}):
        loss, grad, stats = _loss_and_grad(logp, adv, mask, loss_config(**base, **settings))
        assert torch.equal(loss, plain)
        assert torch.equal(grad, plain_grad)
        assert stats["icepop_masked_frac"].item() == 0.0
        assert stats["seq_masked_frac"].item() == 0.0
        assert stats["seq_masked_seq_frac"].item() == 0.0


@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_cispo_gradient_is_ppos_when_the_policies_agree(loss_agg: str) -> None:
    """At r = 1 the weight is 1 (unclipped): CISPO's gradient −A·∇log π equals PPO's −A·∇r
    (∇r = r·∇log π). The values differ: PPO's token loss is −A, CISPO's −A·log π."""
    logp, adv, mask = _equal_policies(1)
    ppo, ppo_grad, _ = _loss_and_grad(logp, adv, mask, loss_config(loss_agg=loss_agg))
    cispo, cispo_grad, stats = _loss_and_grad(
        logp, adv, mask, loss_config(loss_agg=loss_agg, policy_objective="cispo")
    )
    torch.testing.assert_close(cispo_grad, ppo_grad, rtol=1e-12, atol=1e-15)
    assert stats["clip_frac_low"].item() == 0.0
    assert stats["clip_frac_high"].item() == 0.0
    # token-mean: PPO's value is −Σ A / N, CISPO's −Σ A·log π / N.
    if loss_agg == "token-mean":
        n = mask.sum()
        adv_BT = adv[:, None].expand_as(logp)
        assert ppo.item() == pytest.approx(-(adv_BT[mask].sum() / n).item())
        assert cispo.item() == pytest.approx(-((adv_BT * logp)[mask].sum() / n).item())


def test_default_config_keeps_todays_loss() -> None:
    """The defaults name no correction: PPO objective, both bands off."""
    config = LossConfig()
    assert config.policy_objective == "ppo"
    assert config.icepop_band is None
    assert config.seq_mask_band is None


@pytest.mark.parametrize("key", ["icepop_band", "seq_mask_band"])
@pytest.mark.parametrize("band", [1.0, 0.5])
def test_a_band_must_exceed_one(key: str, band: float) -> None:
    with pytest.raises(ValidationError, match=key):
        LossConfig(**{key: band})
    logp = torch.zeros(1, 2, dtype=F64)
    # A section built without validation is still refused where the loss runs.
    unchecked = LossConfig.model_construct(**{key: band})
    with pytest.raises(ValueError, match=f"{key} must be > 1"):
        policy_loss(logp, logp, t64([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), unchecked)


@pytest.mark.parametrize("key", ["icepop_band", "seq_mask_band"])
def test_a_band_needs_recomputed_proximal_logprobs(key: str) -> None:
    with pytest.raises(
        ValidationError,
        match=re.escape(f'trainer.loss.{key} with trainer.loss.proximal = "behaviour"'),
    ):
        LossConfig(**{key: 2.0, "proximal": "behaviour"})


def test_cispo_refuses_the_dual_clip() -> None:
    with pytest.raises(
        ValidationError,
        match=re.escape('trainer.loss.c_clip = 3 with trainer.loss.policy_objective = "cispo"'),
    ):
        LossConfig(policy_objective="cispo", c_clip=3.0)
    with pytest.raises(ValidationError, match="policy_objective"):
        LossConfig(policy_objective="grpo")
