"""The top-k / top-p cut (:mod:`asyncrl.algo.truncation`): vLLM's rule, top-k first and
then top-p on the distribution renormalised over the top-k survivors, in the trainer's
function, the trainer's logprob head and the hf engine's sampler alike."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algo.truncation import cut_logprobs, kept_mask
from asyncrl.engines import sampling
from asyncrl.engines.sampling import inverse_cdf, sample_next
from asyncrl.train.models import chunk_logprobs

NEG_INF = float("-inf")

# (p, top_k, top_p, kept token ids, log q of the kept ones)
HAND_CASES = [
    # top-k = 2 leaves (0.5, 0.3), renormalised p' = (0.625, 0.375): the mass before token 1
    # is 0.625 ≥ 0.6, so token 0 alone is kept and log q = (log 1) = (0). On the
    # unrenormalised p the mass before token 1 would be 0.5 < 0.6: tokens 0 and 1 kept.
    ([0.5, 0.3, 0.2], 2, 0.6, [0], [0.0]),
    # top-k = 3 leaves (0.4, 0.3, 0.2), p' = (4/9, 3/9, 2/9): the mass before token 2 is
    # 7/9 ≈ 0.778 ≥ 0.75, so tokens 0 and 1 are kept, q = (0.4, 0.3) / 0.7 = (4/7, 3/7),
    # log q = (−0.5596, −0.8473). On the unrenormalised p the mass before token 2 would be
    # 0.7 < 0.75: tokens 0, 1, 2 kept.
    ([0.4, 0.3, 0.2, 0.1], 3, 0.75, [0, 1], [math.log(4 / 7), math.log(3 / 7)]),
]


def expected_row(vocab: int, kept: list[int], logq: list[float]) -> torch.Tensor:
    row = torch.full((vocab,), NEG_INF)
    row[kept] = torch.tensor(logq)
    return row


@pytest.mark.parametrize(("p", "top_k", "top_p", "kept", "logq"), HAND_CASES)
def test_top_p_applies_to_the_distribution_renormalised_after_top_k(
    p: list[float], top_k: int, top_p: float, kept: list[int], logq: list[float]
) -> None:
    """``kept_mask`` and ``cut_logprobs`` on the hand-computed cases of ``HAND_CASES``."""
    logp = torch.tensor([p]).log()
    keep = kept_mask(logp, torch.tensor([top_k]), torch.tensor([top_p]))
    assert keep[0].nonzero().flatten().tolist() == kept
    torch.testing.assert_close(
        cut_logprobs(logp, keep)[0], expected_row(len(p), kept, logq), atol=1e-6, rtol=0
    )


def test_trainer_head_scores_the_renormalised_cut() -> None:
    """The trainer's logprob head on logits ``z = log p`` (H = 1, h = 1, W = log p, T = 1),
    ``p = (0.5, 0.3, 0.2)``, top_k = 2, top_p = 0.6: K = {0} (see ``HAND_CASES``), so the
    target 0 gets ``log q = log 1 = 0`` and the entropy of the one-token ``q`` is 0. (A cut
    on the unrenormalised p keeps {0, 1}: log q = log 0.625 = −0.47, H = 0.66.)"""
    w = torch.tensor([[0.5], [0.3], [0.2]]).log()
    lp, ent = chunk_logprobs(torch.ones(1, 1), w, None, torch.tensor([0]), 1.0, 2, 0.6)
    assert lp.item() == pytest.approx(0.0, abs=1e-6)
    assert ent.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("p", "top_k", "top_p", "kept", "logq"), HAND_CASES)
def test_hf_sampler_draws_from_the_renormalised_cut(
    p: list[float], top_k: int, top_p: float, kept: list[int], logq: list[float]
) -> None:
    """The hf engine's ``sample_next`` at T = 1 on logits ``log p``, 200 rows each seeded:
    every token drawn is in the hand-computed K, its reported (processed) logprob is its
    hand-computed ``log q``, and with two kept tokens both are drawn."""
    rows = 200
    logits = torch.tensor([p]).log().expand(rows, -1)
    tokens, logprobs = sample_next(
        logits,
        torch.ones(rows),
        torch.full((rows,), top_k),
        torch.full((rows,), top_p),
        [torch.Generator().manual_seed(s) for s in range(rows)],
    )
    assert set(tokens.tolist()) == set(kept)
    by_token = dict(zip(kept, logq, strict=True))
    want = torch.tensor([by_token[t] for t in tokens.tolist()])
    torch.testing.assert_close(logprobs, want, atol=1e-6, rtol=0)


def reference_kept(p: list[float], top_k: int, top_p: float) -> set[int]:
    """vLLM's documented rule, written out directly: sort descending (ties to the lower
    id), keep the first ``top_k`` (0: all), renormalise them, keep the smallest prefix
    whose cumulative probability reaches ``top_p``."""
    order = sorted(range(len(p)), key=lambda v: (-p[v], v))
    if top_k > 0:
        order = order[:top_k]
    total = sum(p[v] for v in order)
    kept, mass = [], 0.0
    for v in order:
        kept.append(v)
        mass += p[v] / total
        if mass >= top_p:
            break
    return set(kept)


def test_kept_set_matches_the_rule_on_random_distributions() -> None:
    """On 300 random distributions (Dirichlet-like and peaked, V from 2 to 40) with random
    top_k (0 included) and top_p (1 included), the kept set is ``reference_kept``'s.
    Exactly-tied cases are left out: a float64 cumulative within 1e-9 of top_p."""
    rng = random.Random(0)
    checked = 0
    while checked < 300:
        vocab = rng.randint(2, 40)
        sharpness = rng.choice([0.3, 1.0, 3.0])
        w = [
            rng.random() ** (1 / sharpness) * math.exp(rng.gauss(0, sharpness))
            for _ in range(vocab)
        ]
        p = [x / sum(w) for x in w]
        top_k = rng.choice([0, 1, rng.randint(1, vocab), vocab, vocab + 3])
        top_p = rng.choice([1.0, rng.uniform(0.05, 1.0)])
        order = sorted(range(vocab), key=lambda v: (-p[v], v))[: top_k or vocab]
        total = sum(p[v] for v in order)
        cums = [sum(p[u] for u in order[: i + 1]) / total for i in range(len(order))]
        if any(abs(c - top_p) < 1e-9 for c in cums) and top_p < 1:
            continue
        logp = torch.tensor([p], dtype=torch.float64).log()
        keep = kept_mask(logp, torch.tensor([top_k]), torch.tensor([top_p]))
        got = set(keep[0].nonzero().flatten().tolist())
        assert got == reference_kept(p, top_k, top_p), (p, top_k, top_p)
        checked += 1


def test_top_k_ties_go_to_the_lower_token_id() -> None:
    """p = (0.1, 0.3, 0.3, 0.3), top_k = 2: three tokens tie at 0.3; exactly two are kept,
    the lower ids 1 and 2."""
    logp = torch.tensor([[0.1, 0.3, 0.3, 0.3]]).log()
    keep = kept_mask(logp, torch.tensor([2]), torch.tensor([1.0]))
    assert keep[0].tolist() == [False, True, True, False]


def one_level_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The search over one running sum of the whole row, written out directly: the first
    token whose cumulative mass exceeds ``u`` times the row's mass."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)


def test_two_level_draw_finds_the_same_token_as_one_running_sum() -> None:
    """``inverse_cdf`` on 2,000 rows of a 1,000-entry vocabulary (three blocks of 256 and a
    tail of 232), softmax rows of several sharpnesses, some with a top-k cut (blocks with
    no mass at all): the same token as the one-level search on every row whose uniform
    is not within 1e-6 of a boundary (there a block sum's float32 rounding may decide)."""
    g = torch.Generator().manual_seed(0)
    rows, vocab = 2000, 1000
    logits = (
        torch.randn(rows, vocab, generator=g)
        * torch.tensor([0.5, 2.0, 8.0]).repeat(700)[:rows, None]
    )
    probs = torch.softmax(logits, dim=-1)
    cut = torch.arange(rows) % 4 == 0  # top-k 5 on every fourth row
    top = probs[cut].topk(5, dim=-1).indices
    probs[cut] = torch.zeros_like(probs[cut]).scatter(1, top, probs[cut].gather(1, top))
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1) / probs.double().sum(dim=-1, keepdim=True)
    near = ((cdf - u[:, None]).abs() < 1e-6).any(dim=-1)
    got, want = inverse_cdf(probs, u), one_level_draw(probs, u)
    assert int(near.sum()) < 100  # nearly every row is compared
    assert torch.equal(got[~near], want[~near])
    assert bool((probs.gather(1, got[:, None]) > 0).all())


@pytest.mark.parametrize(
    ("p", "u", "token"),
    [
        # blocks of 2: (0, 0) (0.25, 0) (0.25, 0.5); mass 1
        ([0.0, 0.0, 0.25, 0.0, 0.25, 0.5], 0.0, 2),  # leading tokens of no mass skipped
        ([0.0, 0.0, 0.25, 0.0, 0.25, 0.5], 0.3, 4),  # 0.25 < 0.3 ≤ 0.5: third block's first
        ([0.0, 0.0, 0.25, 0.0, 0.25, 0.5], 0.5, 5),  # cumulative 0.5 is not past 0.5
        ([0.0, 0.0, 0.25, 0.0, 0.25, 0.5], 1 - 2**-53, 5),
        # a tail block of one entry holding no mass, unnormalised rows
        ([1.0, 3.0, 0.0, 4.0, 0.0], 0.5, 3),  # target 4: cumulative 1, 4, 4, 8
        ([1.0, 3.0, 0.0, 4.0, 0.0], 1.0, 3),  # u = 1 (past any uniform): the last with mass
        ([2.0, 0.0, 0.0, 0.0, 0.0], 0.999, 0),
    ],
)
def test_two_level_draw_by_hand(
    monkeypatch: pytest.MonkeyPatch, p: list[float], u: float, token: int
) -> None:
    """``inverse_cdf`` with blocks of 2 on hand-made rows: the first token whose cumulative
    mass exceeds ``u`` times the row's, never one of zero mass, even where ``u · total``
    reaches the total."""
    monkeypatch.setattr(sampling, "CDF_BLOCK", 2)
    got = inverse_cdf(torch.tensor([p]), torch.tensor([u], dtype=torch.float64))
    assert got.tolist() == [token]
