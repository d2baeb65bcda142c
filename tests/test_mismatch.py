"""The rollout–trainer mismatch: its per-step statistics and the version-0 gate."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from train_helpers.tiny import one_torch_thread, train_config

from asyncrl.algo.mismatch import (
    MISMATCH_KL,
    MISMATCH_MAX_ABS,
    MISMATCH_RATIO_OUT,
    MismatchError,
    check_mismatch,
    gate_applies,
    mismatch_stats,
)
from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.config.checks import recipe_problems
from asyncrl.config.recipe import load_recipe
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.models.resolve import ModelConfig
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.train.batch import Sample
from asyncrl.train.config import MISMATCH_LIMIT_DEFAULT
from asyncrl.train.engine import TrainEngine
from asyncrl.train.step_stats import StepTotals
from asyncrl.wire.messages import SampledWith

ROOT = Path(__file__).resolve().parents[1]


def test_mismatch_stats_on_hand_computed_tensors() -> None:
    """Loss tokens with d = log π_trainer − log π_behav = 0, ln 2, −ln 4, 0.1 (the last
    row's second token is masked out, with d = 5 that must not count)::

        k3(d) = e^d − 1 − d:  0;  2 − 1 − ln 2 = 0.306853;  1/4 − 1 + ln 4 = 0.636294;
                              e^0.1 − 1.1 = 0.005171
        kl   = (0 + 0.306853 + 0.636294 + 0.005171) / 4 = 0.237079
        max |d| = ln 4 = 1.386294
        ratios 1, 2, 1/4, 1.105: only 1/4 leaves [0.5, 2] (2 is on its edge) → 1/4
    """
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    d = torch.tensor([[0.0, math.log(2), -math.log(4)], [0.1, 5.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    stats = mismatch_stats(behav + d, behav, mask)
    assert stats[MISMATCH_KL].item() == pytest.approx(0.237079, abs=1e-6)
    assert stats[MISMATCH_MAX_ABS].item() == pytest.approx(1.386294, abs=1e-6)
    assert stats[MISMATCH_RATIO_OUT].item() == pytest.approx(0.25)
    empty = mismatch_stats(behav + d, behav, torch.zeros_like(mask))
    assert [v.item() for v in empty.values()] == [0.0, 0.0, 0.0]


def test_step_totals_weight_means_by_tokens_and_take_the_max() -> None:
    """Two micro-batches of 3 and 1 loss tokens with kl 0.2 and 0.6, ratio_out_frac 1/3 and
    1, max |d| 0.5 and 0.25: kl = (0.2·3 + 0.6·1) / 4 = 0.3, ratio_out_frac = (1 + 1) / 4
    = 0.5, max |d| = 0.5."""
    totals = StepTotals(device=torch.device("cpu"))
    zero = torch.tensor(0.0)
    for tokens, kl, out, top in ((3, 0.2, 1 / 3, 0.5), (1, 0.6, 1.0, 0.25)):
        stats = {k: zero for k in ("pg_loss", "clip_frac_low", "clip_frac_high")}
        stats |= {k: zero for k in ("clip_frac_dual", "approx_kl", "ratio_mean")}
        stats |= {k: zero for k in ("behav_imp_weight_mean", "behav_imp_weight_max")}
        stats |= {k: zero for k in ("behav_masked_frac", "icepop_masked_frac")}
        stats |= {k: zero for k in ("seq_masked_frac", "kl_ref")}
        stats |= {
            MISMATCH_KL: torch.tensor(kl),
            MISMATCH_RATIO_OUT: torch.tensor(out),
            MISMATCH_MAX_ABS: torch.tensor(top),
        }
        totals.add_micro_batch(
            zero, stats, share=0.5, loss_tokens=torch.tensor(tokens), input_tokens=tokens
        )
    out = totals.reduce(loss_tokens=4, minibatches=1)
    assert out[MISMATCH_KL] == pytest.approx(0.3)
    assert out[MISMATCH_RATIO_OUT] == pytest.approx(0.5)
    assert out[MISMATCH_MAX_ABS] == pytest.approx(0.5)


async def _generate(
    temperature: float, cuts: Sequence[SampledWith | None] = ()
) -> list[GenerateResponse]:
    """Four completions of the tiny model on the hf engine (fp32), one batch: at
    ``temperature``, or each at its own temperature and cut (``cuts``, None: at
    ``temperature``)."""
    texts = ["What is 12+7?", "Name a colour.", "What is 3*4?", "Say hello."]
    cuts = list(cuts) or [None] * len(texts)
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig(max_batch_size=8)) as eng:
        reqs = [
            GenerateRequest(
                input_ids=list(eng.tokenizer.encode(t, add_special_tokens=False)),
                sampling=SamplingParams(
                    temperature=temperature if cut is None else cut.temperature,
                    top_k=0 if cut is None else cut.top_k,
                    top_p=1.0 if cut is None else cut.top_p,
                    max_new_tokens=16,
                    stop_token_ids=(),
                    seed=i,
                ),
            )
            for i, (t, cut) in enumerate(zip(texts, cuts, strict=True))
        ]
        return list(await asyncio.gather(*(eng.agenerate(r) for r in reqs)))


def _samples(responses: list[GenerateResponse]) -> list[Sample]:
    out = []
    for i, r in enumerate(responses):
        n, m = len(r.input_ids), len(r.output_ids)
        mask = torch.zeros(n + m, dtype=torch.bool)
        mask[n:] = True
        behav = torch.zeros(n + m)
        behav[n:] = torch.tensor(r.output_logprobs)
        out.append(Sample(torch.tensor(r.input_ids + r.output_ids), mask, behav, i % 2 - 0.5))
    return out


@pytest.mark.parametrize(("engine_t", "trainer_t", "trips"), [(0.5, 0.5, False), (0.5, 1.0, True)])
def test_gate_trips_on_a_wrong_temperature_and_passes_the_right_one(
    engine_t: float, trainer_t: float, trips: bool
) -> None:
    """The hf engine (fp32) samples at ``engine_t``; a trainer on the same fp32 weights
    scores the tokens at ``trainer_t``. Agreeing, the two differ by rounding (k3 ≈ 1e-14
    measured); at 0.5 vs 1.0 the tiny model's mismatch/kl is ≈ 0.047, over the default
    limit, and the step's own statistics carry it."""
    responses = asyncio.run(_generate(engine_t))
    with one_torch_thread():
        engine = TrainEngine(
            train_config(temperature=trainer_t),
            ModelConfig(path=str(tiny_model_dir()), dtype="float32"),
        )
        stats = engine.train_step(_samples(responses))
    assert {MISMATCH_KL, MISMATCH_MAX_ABS, MISMATCH_RATIO_OUT} <= stats.keys()
    if not trips:
        assert stats[MISMATCH_KL] < 1e-9
        assert stats[MISMATCH_MAX_ABS] < 1e-4
        check_mismatch(stats, MISMATCH_LIMIT_DEFAULT)
        return
    assert stats[MISMATCH_KL] > 2 * MISMATCH_LIMIT_DEFAULT
    with pytest.raises(MismatchError) as info:
        check_mismatch(stats, MISMATCH_LIMIT_DEFAULT)
    message = str(info.value)
    assert f"{stats[MISMATCH_KL]:.6g}" in message
    assert f"trainer.mismatch_limit = {MISMATCH_LIMIT_DEFAULT:g}" in message
    for cause in ("dtype", "chat template", "top_k", "temperature", "version"):
        assert cause in message
    check_mismatch(stats, None)  # no gate


def test_each_sample_is_scored_with_the_sampling_its_calls_chose() -> None:
    """``rollout.endpoint_sampling = "per_call"``: one batch of the hf engine holds
    completions drawn at T = 0.5 with top_k = 5, at T = 1.3 with top_p = 0.8, at T = 0.9
    with both, and one at the recipe's T = 0.7. A trainer at 0.7 that scores each sample
    with its ``sampled_with`` agrees with the engine to rounding; one that scores every
    sample at 0.7 (what it did before the mode) trips the gate."""
    cuts = [
        SampledWith(temperature=0.5, top_k=5),
        SampledWith(temperature=1.3, top_p=0.8),
        SampledWith(temperature=0.9, top_k=20, top_p=0.9),
        None,
    ]
    responses = asyncio.run(_generate(0.7, cuts))
    stats = {}
    for label, carried in (("own", cuts), ("recipe", [None] * len(cuts))):
        samples = _samples(responses)
        for sample, cut in zip(samples, carried, strict=True):
            sample.sampled_with = cut
        with one_torch_thread():
            engine = TrainEngine(
                train_config(temperature=0.7),
                ModelConfig(path=str(tiny_model_dir()), dtype="float32"),
            )
            stats[label] = engine.train_step(samples)
    assert stats["own"][MISMATCH_KL] < 1e-9
    assert stats["own"][MISMATCH_MAX_ABS] < 1e-4
    check_mismatch(stats["own"], MISMATCH_LIMIT_DEFAULT)
    with pytest.raises(MismatchError):
        check_mismatch(stats["recipe"], MISMATCH_LIMIT_DEFAULT)


def test_gate_judges_only_a_batch_sampled_wholly_at_version_0_before_any_update() -> None:
    assert gate_applies(0, [0, 0, 0])
    assert not gate_applies(0, [0, 1])  # a group that has tokens of version 1
    assert not gate_applies(0, [-1])  # no generated token
    assert gate_applies(0, [0, -1])  # a group without one neither blocks nor is judged
    assert not gate_applies(1, [0, 0])  # the trainer has moved on: its weights differ


def test_gate_trips_on_nan() -> None:
    with pytest.raises(MismatchError, match="nan"):
        check_mismatch({MISMATCH_KL: float("nan")}, 1.0)


@pytest.mark.parametrize("recipe", ["quickstart.toml", "tools.toml", "ci.toml"])
def test_shipped_recipes_check_with_the_default_limit(recipe: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", str(ROOT / "recipes" / recipe)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"mismatch_limit = {MISMATCH_LIMIT_DEFAULT}" in out.stdout


def test_check_warns_that_the_instant_engine_trips_the_gate() -> None:
    _, warnings = recipe_problems(load_recipe(None, ["rollout.engine.type=instant"]))
    assert any("trainer.mismatch_limit" in w for w in warnings), warnings
    off = ["rollout.engine.type=instant", "trainer.mismatch_limit=null"]
    _, warnings = recipe_problems(load_recipe(None, off))
    assert not any("trainer.mismatch_limit" in w for w in warnings), warnings
