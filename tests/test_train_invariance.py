"""Gradient invariance, in float64 on the tiny model: one minibatch's gradient (and its
loss) must not depend on how the trainer cuts the minibatch, to 1e-10 relative.

Compared with the whole minibatch in one packed micro-batch in one process:

- micro-batch token limits: a sequence per micro-batch, and micro-batches of several
  sequences, the gradient accumulated over them before the one optimizer step (an
  episode's samples in different micro-batches);
- packing off (right-padded micro-batches);
- two gloo ranks under FSDP2, through the ranks' command protocol (an episode's samples
  on both ranks, or one rank idle);
- an episode cut into consecutive samples (a continued answer split where the weights
  or the sampling changed), the segments one episode.

Every ``loss_agg``, without and with the KL (in the loss, and in the reward) and entropy
terms, with and without LoRA. Where an invariance does not hold by design, the test
asserts the design's own numbers instead: ``seq-mean-token-sum-norm`` with no
``loss.norm_len`` divides by the batch's longest loss span, which cutting a sample
shortens; segments that are not tied into one episode weigh as episodes of their own
(each sample's gradient then enters with the weight the aggregation's formula gives it);
and a KL in the reward sums the KL still to come within a sample only.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_helpers.invariance import (
    AGGS,
    BATCHES,
    CUTS,
    EPISODE,
    LAYOUTS,
    REFERENCE,
    Case,
    OffsetEngine,
    Result,
    relative_error,
    run_batch,
    run_case,
    world2_cases,
)
from train_helpers.once import made_once
from train_helpers.tiny import one_torch_thread

from asyncrl.train.batch import Sample
from asyncrl.train.shard import plan_shards
from asyncrl.train.torchrun import torchrun_argv

TOLERANCE = 1e-10
"""Relative, over all parameters (float64 summation-order noise is ~1e-16)."""

WORKER = Path(__file__).parent / "train_helpers" / "worker.py"

SUM_NORM = "seq-mean-token-sum-norm"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _train_step(engine: OffsetEngine, batch: list[Sample]) -> dict[str, float]:
    return engine.train_step(batch)


_results: dict[Case, Result] = {}


def result(case: Case) -> Result:
    """``case``'s loss and gradient in this process (once per case and test process)."""
    if case not in _results:
        _results[case] = run_case(case, _train_step)
    return _results[case]


def longest_loss_span(batch: list[Sample]) -> int:
    return max(s.num_loss_tokens for s in batch)


def expected(case: Case) -> Result:
    """What ``case`` must give: its reference's loss and gradient, scaled by the one
    difference the design makes among these cases: ``seq-mean-token-sum-norm`` without
    ``norm_len`` divides by the batch's longest loss span, which the segmented batch's
    cut shortens."""
    loss, grads = result(case.reference())
    if case.agg == SUM_NORM and case.norm_len is None:
        scale = longest_loss_span(BATCHES["episodes"]()) / longest_loss_span(case.samples())
        loss, grads = loss * scale, {k: g * scale for k, g in grads.items()}
    return loss, grads


def mismatch(got: Result, want: Result, what: str) -> list[str]:
    """``what``, if its loss or gradient is off by more than :data:`TOLERANCE`."""
    grad_err = relative_error(got[1], want[1])
    loss_err = abs(got[0] - want[0]) / abs(want[0])
    if grad_err <= TOLERANCE and loss_err <= TOLERANCE:
        return []
    return [f"{what}: gradient {grad_err:.2e}, loss {loss_err:.2e} relative"]


def test_the_layouts_cut_the_batch_where_the_cases_say() -> None:
    """The cases test what they claim: an episode's samples in different micro-batches,
    on both ranks, and an idle rank."""

    def episodes_per_micro_batch(case: Case) -> list[list[list[int | None]]]:
        batch = case.samples()
        shards = plan_shards(batch, case.config(), case.world)
        return [
            [[shard.samples[i].episode for i in mb] for mb in shard.minibatches[0]]
            for shard in shards
        ]

    (one,) = episodes_per_micro_batch(Case("token-mean", layout="accumulated"))
    assert sum(1 in mb for mb in one) == 2, one
    (one,) = episodes_per_micro_batch(Case("token-mean", layout="accumulated", batch="segments"))
    assert sum(EPISODE in mb for mb in one) == len(CUTS) + 1, one
    ranks = episodes_per_micro_batch(
        Case("token-mean", layout="per-sequence", world=2, batch="segments")
    )
    for episode in (1, EPISODE):
        assert all(any(episode in mb for mb in rank) for rank in ranks), ranks
    ranks = episodes_per_micro_batch(Case("token-mean", layout="padded", world=2))
    assert [mb for rank in ranks for mb in rank].count([]) == 1, ranks
    # the cut shortens the longest loss span (seq-mean-token-sum-norm's default norm_len)
    assert longest_loss_span(BATCHES["segments"]()) < longest_loss_span(BATCHES["episodes"]())


LOSSES = [
    pytest.param(agg, terms, lora, id=f"{agg}-{terms}-{'lora' if lora else 'full'}")
    for agg in AGGS
    for terms, lora in [
        ("pg", False),
        ("kl+entropy", False),
        ("kl-in-reward", False),
        ("pg", True),
        ("kl+entropy", True),
    ]
]
"""Every aggregation with each set of terms; LoRA (which changes what trains, not the
loss) without the KL in the reward."""


@pytest.mark.parametrize(("agg", "terms", "lora"), LOSSES)
def test_micro_batches_accumulation_and_padding_leave_the_gradient(
    agg: str, terms: str, lora: bool
) -> None:
    want = result(Case(agg, terms, lora))
    failures = []
    for layout in LAYOUTS:
        if layout != REFERENCE:
            failures += mismatch(result(Case(agg, terms, lora, layout)), want, layout)
    assert not failures, failures


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("terms", ["pg", "kl+entropy"])
@pytest.mark.parametrize("agg", AGGS)
def test_an_episode_cut_into_samples_keeps_its_gradient(agg: str, terms: str, lora: bool) -> None:
    """The segments of one episode give the unsplit sample's gradient, in one micro-batch
    or spread over several; for ``seq-mean-token-sum-norm`` without ``norm_len`` that
    gradient scaled by the ratio of the two batches' longest loss spans (with a constant
    ``norm_len``, the same)."""
    failures = []
    for layout in ("whole", "accumulated"):
        case = Case(agg, terms, lora, layout, batch="segments")
        failures += mismatch(result(case), expected(case), layout)
    if agg == SUM_NORM:
        fixed = Case(agg, terms, lora, batch="segments", norm_len=32.0)
        failures += mismatch(result(fixed), result(fixed.reference()), "norm_len = 32")
    assert not failures, failures


def per_sample_design(agg: str, batch: list[Sample], singles: list[Result]) -> Result:
    """The loss and gradient that ``agg``'s formula gives ``batch`` from each sample's own
    (``singles``: a batch of that sample alone), with ``n_b`` a sample's loss tokens,
    ``N_b`` its episode's and ``E = Σ_b n_b / N_b`` the episodes::

        token-mean               Σ_b n_b · g_b / Σ_b n_b
        seq-mean-token-mean      (1/E) Σ_b (n_b / N_b) · g_b
        seq-mean-token-sum-norm  (1/E) Σ_b g_b              (a constant norm_len)
    """
    n = [s.num_loss_tokens for s in batch]
    keys = [(0, i) if s.episode is None else (1, s.episode) for i, s in enumerate(batch)]
    per_episode: dict[tuple[int, int], int] = {}
    for key, count in zip(keys, n, strict=True):
        per_episode[key] = per_episode.get(key, 0) + count
    share = [count / per_episode[key] for key, count in zip(keys, n, strict=True)]
    episodes = sum(share)
    if agg == "token-mean":
        weights = [count / sum(n) for count in n]
    elif agg == "seq-mean-token-mean":
        weights = [s / episodes for s in share]
    else:
        weights = [1 / episodes] * len(batch)
    loss = sum(w * single[0] for w, single in zip(weights, singles, strict=True))
    grads = {
        name: sum(w * single[1][name] for w, single in zip(weights, singles, strict=True))
        for name in singles[0][1]
    }
    return loss, grads  # type: ignore[return-value]


@pytest.mark.parametrize("terms", ["kl+entropy", "kl-in-reward"])
@pytest.mark.parametrize("agg", AGGS)
def test_segments_weigh_as_the_aggregation_formula_says(agg: str, terms: str) -> None:
    """The batch's gradient is its aggregation's weighted sum of each sample's own, with
    the segments one episode (which weighs once, like the unsplit sample) and with each
    segment an episode of its own (each then weighs as a whole episode: the seq-mean
    gradients differ from the unsplit sample's, by design; episode ids are what ties
    samples together; ``token-mean`` reads none).

    With the KL in the reward, each token's advantage takes the KL still to come *in its
    sample*: a segment's tokens lose the later segments' KL, so cutting an episode changes
    the gradient by design, whatever the aggregation (spreading it over micro-batches does
    not: the layout test), and each segment's gradient is its own alone."""
    segments = Case(agg, terms, batch="segments", norm_len=32.0)
    config = segments.config()
    singles = [run_batch(config, [s], _train_step) for s in segments.samples()]
    failures = []
    for kind in ("segments", "separate"):
        case = Case(agg, terms, batch=kind, norm_len=32.0)
        failures += mismatch(result(case), per_sample_design(agg, case.samples(), singles), kind)
    unsplit = result(segments.reference())
    for kind in ("segments", "separate"):
        got = result(Case(agg, terms, batch=kind, norm_len=32.0))
        same = (kind == "segments" or agg == "token-mean") and terms != "kl-in-reward"
        if same:
            failures += mismatch(got, unsplit, f"{kind} against the unsplit sample")
        elif relative_error(got[1], unsplit[1]) < 1e-4:
            failures.append(f"{kind}: the unsplit sample's gradient, where the design differs")
    assert not failures, failures


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Every two-rank case's loss and gradient, from one torchrun of the worker (once per
    session, whichever worker's tests ask: :func:`made_once`)."""

    def make(folder: Path) -> None:
        argv = torchrun_argv([str(WORKER), "invariance", "--out", str(folder / "out.pt")], nproc=2)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(argv, check=True, timeout=240, env=env)

    folder = made_once(tmp_path_factory, "invariance", make)
    results: dict[str, Result] = torch.load(folder / "out.pt", weights_only=True)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", world2_cases(), ids=lambda case: case.id)
def test_two_ranks_give_the_gradient_of_one_process(case: Case, world2: dict[str, Result]) -> None:
    failures = mismatch(world2[case.id], expected(case), case.id)
    assert not failures, failures
