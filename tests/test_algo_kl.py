"""The KL penalty's expected gradient, placement by placement, on a small categorical
distribution: exact sums over the actions, compared with autograd of the exact KL."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncrl.algo.config import LossConfig
from asyncrl.algo.loss import policy_loss

F64 = torch.float64  # exact sums: compared to numerical precision
THETA = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=F64)
REF = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, 1.0, -0.3], dtype=F64), dim=0)


def loss_config(**settings: Any) -> LossConfig:
    """The loss section with ``settings``; no behaviour-weight cap unless one is given."""
    return LossConfig(**{"behav_imp_weight_cap": None, **settings})


def forward_kl(theta: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(theta, dim=0)
    return (logp.exp() * (logp - REF)).sum()


def reverse_kl(theta: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(theta, dim=0)
    return (REF.exp() * (REF - logp)).sum()


def exact_gradient(kl_type: str, kl_in: str) -> torch.Tensor:
    """Σ_a π(a) · ∇ℓ(a): the expected gradient of the per-sample surrogate, a one-token
    sequence per action, advantage 0 so that only the penalty acts."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    expected = torch.zeros((), dtype=F64)
    for a in range(len(THETA)):
        lp = logp[a].reshape(1, 1)
        loss, _ = policy_loss(
            lp,
            lp.detach(),
            torch.zeros(1, dtype=F64),
            torch.ones(1, 1, dtype=torch.bool),
            loss_config(kl_coef=1.0, kl_type=kl_type, kl_in=kl_in),
            ref_logprobs=REF[a].reshape(1, 1),
        )
        expected = expected + logp[a].exp().detach() * loss
    (grad,) = torch.autograd.grad(expected, theta)
    return grad


def gradient_of(kl: object) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl(theta), theta)  # type: ignore[operator]
    return grad


@pytest.mark.parametrize(("kl_type", "kl_in"), [("k1", "reward"), ("k2", "loss")])
def test_supported_placements_give_the_gradient_of_kl_pi_ref(kl_type: str, kl_in: str) -> None:
    torch.testing.assert_close(
        exact_gradient(kl_type, kl_in), gradient_of(forward_kl), rtol=1e-12, atol=1e-12
    )


def test_k3_in_the_loss_gives_the_gradient_of_the_reverse_kl() -> None:
    want = gradient_of(reverse_kl)
    torch.testing.assert_close(exact_gradient("k3", "loss"), want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(want, gradient_of(forward_kl), atol=1e-3)


def test_refused_placements_give_no_kl_gradient() -> None:
    # k1 in the loss: E_π[∇ log π] = 0, the penalty does nothing
    torch.testing.assert_close(
        exact_gradient("k1", "loss"), torch.zeros(5, dtype=F64), atol=1e-12, rtol=0
    )
    # k3 as a reward: ∇KL(π‖π_ref) − ∇KL(π_ref‖π), neither KL's gradient
    torch.testing.assert_close(
        exact_gradient("k3", "reward"), gradient_of(forward_kl) - gradient_of(reverse_kl)
    )


def test_a_kl_reward_is_the_kl_still_to_come_in_the_sequence() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5, 1.0]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.5]]))
    mask = torch.tensor([[True, True, True, False]])  # the last token carries no loss
    k1 = (logp - ref).detach()[0]  # log 2, −log 2, 0, (log 2: masked out)
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([1.0]),
        mask,
        loss_config(kl_coef=0.5, kl_type="k1", kl_in="reward"),
        ref_logprobs=ref,
    )
    to_go = torch.stack([k1[0] + k1[1] + k1[2], k1[1] + k1[2], k1[2], torch.zeros(())])
    adv = torch.where(mask[0], 1.0 - 0.5 * to_go, torch.zeros(()))
    loss.backward()
    # ratio 1: ℓ_t = −A_t·r_t, so ∂/∂ log π_t = −A_t / 3 (token-mean over 3 tokens)
    torch.testing.assert_close(logp.grad[0], -adv / 3)
    assert loss.item() == pytest.approx(float(-adv.sum() / 3))
    assert stats["kl_ref"].item() == pytest.approx(float(k1[:3].mean()))


@pytest.mark.parametrize("kl_in", ["loss", "reward"])
def test_a_token_the_behaviour_cap_drops_carries_no_kl_term(kl_in: str) -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    # behaviour 0.05 on the second token: w = 0.5 / 0.05 = 10 > cap 5
    behav = torch.log(torch.tensor([[0.5, 0.05]]))
    loss, stats = policy_loss(
        logp,
        logp.detach(),
        torch.zeros(1),
        torch.ones(1, 2, dtype=torch.bool),
        loss_config(
            behav_imp_weight_cap=5.0,
            kl_coef=1.0,
            kl_type="k2" if kl_in == "loss" else "k1",
            kl_in=kl_in,
        ),
        behav_logprobs=behav,
        ref_logprobs=ref,
    )
    assert stats["behav_masked_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 0].item() != 0.0
