"""TrainEngine in one process: split invariance, non-finite steps, schedule, export and
the weight stream."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers.tiny import (
    VOCAB,
    full_weights,
    one_torch_thread,
    random_batch,
    tiny_config,
    tiny_engine,
    train_config,
)

from asyncrl.algo.loss import policy_loss, tokens_per_episode
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.packing import build_micro_batch, split_minibatches
from asyncrl.train.schedule import lr_at
from asyncrl.train.shard import plan_shards


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _step_and_weights(config: TrainerConfig, batch: list[Sample]) -> tuple[dict, dict]:
    engine = tiny_engine(config)
    stats = engine.train_step(batch)
    return stats, full_weights(engine)


@pytest.mark.parametrize(
    "variant",
    [
        {"max_tokens_per_microbatch": 10_000},
        {"packing": False, "max_tokens_per_microbatch": 40},
        {"gradient_checkpointing": True},
        {"lm_head_chunk_tokens": 3},
    ],
    ids=["one-micro-batch", "padded", "grad-checkpointing", "small-logit-chunks"],
)
@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_layout_choices_do_not_change_the_step(variant: dict, loss_agg: str) -> None:
    """Splitting into micro-batches, padding, recomputation and logit chunking are
    layout choices: loss and updated weights stay the same."""
    batch = random_batch(3, per_token_adv=True)
    loss = LossConfig(loss_agg=loss_agg, behav_imp_weight_cap=None)  # type: ignore[arg-type]
    base_stats, base_w = _step_and_weights(train_config(loss=loss), batch)
    assert base_stats["micro_batches"] > 1
    stats, weights = _step_and_weights(train_config(loss=loss, **variant), batch)
    assert stats["loss"] == pytest.approx(base_stats["loss"], rel=1e-5, abs=1e-7)
    assert stats["grad_norm"] == pytest.approx(base_stats["grad_norm"], rel=1e-5)
    for name, tensor in base_w.items():
        # See test_train_distributed: Adam turns ~0 gradients' float noise into up to lr.
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_an_episode_split_over_micro_batches_weighs_once(loss_agg: str) -> None:
    """Samples 0 and 2 are one episode, 1 and 4 another (3 and 5 alone): 4 episodes, not 6
    samples. The step's loss is the per-episode aggregation of the whole batch computed
    by hand (plain PPO against the behaviour logprobs, of the initial weights'
    logprobs), although the 24-token micro-batches cut both episodes; one micro-batch
    gives the same loss and weights; each sample its own episode gives another loss."""
    ids = [0, 1, 0, 2, 1, 3]
    batch = [
        dataclasses.replace(s, episode=e)
        for s, e in zip(random_batch(3, per_token_adv=True), ids, strict=True)
    ]
    loss_cfg = LossConfig(loss_agg=loss_agg, proximal="behaviour", behav_imp_weight_cap=None)  # type: ignore[arg-type]
    config = train_config(loss=loss_cfg)
    (shard,) = plan_shards(batch, config, 1)
    where = {i: k for k, mb in enumerate(shard.minibatches[0]) for i in mb}
    assert where[0] != where[2] and where[1] != where[4]  # both episodes are cut
    assert shard.units_total == [4]

    logprobs = tiny_engine(config).compute_logprobs(batch)
    mb = build_micro_batch(batch, list(range(6)))
    lp_BT = torch.zeros(mb.loss_mask_BT.shape)
    for b, lp in enumerate(logprobs):
        lp_BT[b, : len(lp)] = lp
    n_e = tokens_per_episode(mb.loss_mask_BT, torch.tensor(ids))
    assert n_e.tolist() == [7, 11, 7, 8, 11, 2]  # loss spans 4, 6, 3, 8, 5, 2
    by_hand = {}
    for name, counts in (("episodes", n_e), ("samples", None)):
        loss, _ = policy_loss(
            lp_BT,
            mb.behav_logprobs_BT,
            mb.advantages_BT,
            mb.loss_mask_BT,
            loss_cfg,
            norm_len=8.0,  # the longest loss span of the batch
            episode_tokens=counts,
        )
        by_hand[name] = loss.item()

    stats, weights = _step_and_weights(config, batch)
    assert stats["micro_batches"] > 1
    assert stats["loss"] == pytest.approx(by_hand["episodes"], rel=1e-5)
    assert by_hand["samples"] != pytest.approx(by_hand["episodes"], rel=1e-3)
    one_stats, one_weights = _step_and_weights(
        train_config(loss=loss_cfg, max_tokens_per_microbatch=10_000), batch
    )
    assert one_stats["micro_batches"] == 1
    assert one_stats["loss"] == pytest.approx(stats["loss"], rel=1e-5)
    assert one_stats["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-5)
    for name, tensor in one_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_engine_takes_the_same_step() -> None:
    """``trainer.compile``: every decoder layer under ``torch.compile`` (dynamic shapes),
    two steps on batches of different lengths (one graph for both), the same losses and
    weights as eager up to the fused kernels' float rounding."""
    batches = [random_batch(3, per_token_adv=True), random_batch(2, (5, 11, 8), per_token_adv=True)]
    eager, compiled = tiny_engine(train_config()), tiny_engine(train_config(compile=True))
    for batch in batches:
        want, got = eager.train_step(batch), compiled.train_step(batch)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    base_w = full_weights(eager)
    for name, tensor in full_weights(compiled).items():
        torch.testing.assert_close(tensor, base_w[name], rtol=0, atol=1e-4, msg=name)


def test_stats_of_a_step() -> None:
    engine = tiny_engine(train_config())
    batch = random_batch(4)
    stats = engine.train_step(batch)
    assert stats["tokens"] == sum(len(s) for s in batch)
    assert stats["loss_tokens"] == sum(s.num_loss_tokens for s in batch)
    assert stats["input_tokens"] == stats["tokens"]  # packing computes no padding
    assert (stats["step"], stats["version"], engine.version) == (1, 1, 1)
    assert (stats["minibatches"], stats["optimizer_steps"]) == (1, 1)
    # One minibatch: the proximal logprobs are the training forward's own, no extra forward.
    assert "time/proximal_s" not in stats
    # The behaviour logprobs (≈ −4.8) are near the model's (uniform over 128 ≈ −4.85).
    assert 0.5 < stats["behav_imp_weight_mean"] < 2.0
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert stats["lr"] == pytest.approx(1e-3 / 2)  # first of 2 warmup steps
    padded = tiny_engine(train_config(packing=False)).train_step(batch)
    assert padded["input_tokens"] > padded["tokens"]


def test_mismatch_corrections_reach_the_step_stats() -> None:
    """IcePop and the sequence mask run in the trainer's own decoupled step (the proximal
    logprobs of its forward) and report their shares: with bands of 1.000001 nearly every
    token's and sequence's weight (≈ exp(−4.85 + 4.8), see test_stats_of_a_step) lies
    outside; CISPO takes a finite step."""
    batch = random_batch(4)
    loss = LossConfig(icepop_band=1.000001, seq_mask_band=1.000001)
    stats = tiny_engine(train_config(loss=loss)).train_step(batch)
    assert 0.5 < stats["icepop_masked_frac"] <= 1.0
    assert 0.5 < stats["seq_masked_frac"] <= 1.0
    plain = tiny_engine(train_config()).train_step(batch)
    assert plain["icepop_masked_frac"] == 0.0 and plain["seq_masked_frac"] == 0.0
    cispo = tiny_engine(train_config(loss=LossConfig(policy_objective="cispo"))).train_step(batch)
    assert math.isfinite(cispo["loss"]) and cispo["grad_norm"] > 0


def _constant_lr(**overrides: Any) -> TrainerConfig:
    optim = OptimConfig(lr=3e-2, weight_decay=0.01, warmup_steps=0, schedule="constant")
    return train_config(optim=optim, **overrides)


EIGHT = (7, 12, 5, 16, 9, 3, 10, 14)


def test_ppo_minibatches_step_against_one_proximal_policy() -> None:
    """Four optimizer steps per batch, version + 1 once; from the second minibatch on the
    policy has moved away from the proximal one, so the ratio leaves 1 and the clip acts."""
    engine = tiny_engine(_constant_lr(ppo_minibatches=4))
    batch = random_batch(4, EIGHT)
    stats = engine.train_step(batch)
    assert (stats["minibatches"], stats["optimizer_steps"]) == (4, 4)
    assert (stats["step"], stats["version"], engine.version) == (1, 1, 1)
    assert "time/proximal_s" in stats  # recomputed once, before the first minibatch
    assert stats["clip_frac"] > 0
    assert stats["clip_frac"] == pytest.approx(
        stats["clip_frac_low"] + stats["clip_frac_high"] + stats["clip_frac_dual"]
    )
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="ppo_minibatches=9"):
        tiny_engine(_constant_lr(ppo_minibatches=9)).train_step(batch)


def test_ppo_minibatches_equal_steps_on_each_minibatch_by_hand() -> None:
    """The minibatch loop is n ordinary steps, each decoupled against the logprobs of the
    weights *before the first* of them."""
    batch = random_batch(4, EIGHT)
    engine = tiny_engine(_constant_lr(ppo_minibatches=4))
    stats = engine.train_step(batch)

    by_hand = tiny_engine(_constant_lr())
    proximal = by_hand.compute_logprobs(batch)
    losses = []
    for idx in split_minibatches([len(s) for s in batch], 4):
        part = [dataclasses.replace(batch[i], old_logprobs=proximal[i]) for i in idx]
        losses.append(by_hand.train_step(part)["loss"])
    assert stats["loss"] == pytest.approx(sum(losses) / 4, rel=1e-5)
    expected = full_weights(by_hand)
    for name, tensor in full_weights(engine).items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_free_proximal_equals_a_separate_proximal_forward(loss_agg: str) -> None:
    """With one minibatch the training forward's detached logprobs replace the no-grad
    recompute: same loss, gradient and updated weights, one forward fewer."""
    batch = random_batch(11)
    runs = []
    for separate in (False, True):
        loss = LossConfig(
            loss_agg=loss_agg,  # type: ignore[arg-type]
            separate_proximal_forward=separate,
            behav_imp_weight_cap=None,
        )
        runs.append(_step_and_weights(train_config(loss=loss), batch))
    (free, free_w), (recomputed, recomputed_w) = runs
    assert "time/proximal_s" in recomputed and "time/proximal_s" not in free
    for key in ("loss", "pg_loss", "grad_norm", "ratio_mean", "behav_imp_weight_mean"):
        assert free[key] == pytest.approx(recomputed[key], rel=1e-6, abs=1e-9), key
    for name, tensor in recomputed_w.items():
        torch.testing.assert_close(free_w[name], tensor, rtol=0, atol=1e-7, msg=name)


def test_plain_ppo_without_proximal_recompute() -> None:
    engine = tiny_engine(
        train_config(loss=LossConfig(proximal="behaviour", behav_imp_weight_cap=None))
    )
    stats = engine.train_step(random_batch(4))
    # Against the behaviour logprobs, no importance weights are involved.
    assert stats["behav_imp_weight_mean"] == 1.0
    assert stats["ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert "time/proximal_s" not in stats


def test_reference_model_is_the_frozen_initial_policy() -> None:
    engine = tiny_engine(
        train_config(loss=LossConfig(kl_coef=0.5, kl_type="k3", behav_imp_weight_cap=None))
    )
    assert engine.ref_module is not None
    assert not any(p.requires_grad for p in engine.ref_module.parameters())
    batch = random_batch(5)
    initial = engine.compute_logprobs(batch)
    stats = engine.train_step(batch)  # no ref_logprobs given: the engine scores them
    assert "time/ref_s" in stats
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # still the reference weights
    current = engine.compute_logprobs(batch)
    stats = engine.train_step(batch)
    # k3 by hand over the loss tokens: exp(d) − 1 − d with d = log π_ref − log π.
    d = torch.cat([(r - c)[s.loss_mask] for r, c, s in zip(initial, current, batch, strict=True)])
    assert stats["kl_ref"] == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-4)
    assert stats["kl_ref"] > 0
    for ref, first in zip(engine.compute_ref_logprobs(batch), initial, strict=True):
        torch.testing.assert_close(ref, first, rtol=0, atol=0)
    assert tiny_engine(train_config()).ref_module is None  # kl_coef 0: no second model


def test_kl_to_reference_logprobs() -> None:
    engine = tiny_engine(train_config(loss=LossConfig(kl_coef=0.5, behav_imp_weight_cap=None)))
    batch = random_batch(5)
    ref = engine.compute_logprobs(batch)
    for s, lp in zip(batch, ref, strict=True):
        s.ref_logprobs = lp
    stats = engine.train_step(batch)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # same weights as the reference
    stats = engine.train_step(batch)
    assert stats["kl_ref"] > 0


def test_non_finite_step_is_skipped_and_counted() -> None:
    engine = tiny_engine(train_config())
    before = full_weights(engine)
    bad = random_batch(6)
    bad[2].advantages = torch.tensor(math.nan)
    stats = engine.train_step(bad)
    assert not math.isfinite(stats["grad_norm"])
    assert (stats["step_skipped"], stats["skipped_nonfinite"], engine.version) == (1.0, 1.0, 1)
    for name, tensor in full_weights(engine).items():
        assert torch.equal(tensor, before[name]), name
    stats = engine.train_step(random_batch(6))
    assert (stats["step_skipped"], stats["skipped_nonfinite"]) == (0.0, 1.0)
    assert any(not torch.equal(t, before[n]) for n, t in full_weights(engine).items())


@pytest.mark.parametrize("max_norm", [1e-5, 1e3], ids=["clipped", "under-the-cap"])
def test_the_clip_folded_into_adamw_steps_as_clip_grad_norm_then_adamw(max_norm: float) -> None:
    """On one CPU process in float32 the engine gives the clip's factor to the fused AdamW
    (its grad_scale) rather than scaling every gradient first: the weights after the step
    are those of torch's clip_grad_norm_ then AdamW, clipped or not."""
    engine = tiny_engine(train_config(optim=OptimConfig(lr=1e-2, grad_clip=max_norm)))
    ref = {n: p.detach().clone().requires_grad_() for n, p in engine.module.named_parameters()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(5)
    for name, param in engine.module.named_parameters():
        grad = torch.randn(param.shape, generator=gen)
        param.grad, ref[name].grad = grad.clone(), grad.clone()
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    norm = engine._clip_and_step()
    want = torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm)
    ref_opt.step()
    assert norm == pytest.approx(float(want), rel=1e-6)
    assert (norm > max_norm) == (max_norm == 1e-5)
    assert getattr(engine.optimizer, "grad_scale", None) is None
    for name, param in engine.module.named_parameters():
        torch.testing.assert_close(param.detach(), ref[name].detach(), rtol=1e-6, atol=1e-7)


def test_lr_schedule() -> None:
    kw = {"lr": 1.0, "warmup_steps": 2, "total_steps": 6, "min_lr_ratio": 0.1}
    assert [lr_at(s, **kw) for s in range(2)] == [0.5, 1.0]
    assert lr_at(2, schedule="constant", **kw) == 1.0
    cosine = [lr_at(s, schedule="cosine", **kw) for s in range(2, 8)]
    assert cosine[0] == pytest.approx(1.0)
    assert cosine[2] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway
    assert cosine[4] == cosine[5] == pytest.approx(0.1)  # floor after total_steps
    engine = tiny_engine(
        train_config(
            optim=OptimConfig(lr=1.0, weight_decay=0.01, schedule="cosine", min_lr_ratio=0.0),
            max_steps=4,
        )
    )
    lrs = [engine.train_step(random_batch(s))["lr"] for s in range(3)]
    assert lrs == pytest.approx([1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5])


def test_export_hf_loads_back_and_gives_the_same_logprobs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = tiny_engine(architecture=tiny_config("qwen2"))
    engine.train_step(random_batch(7))
    engine.export_hf(tmp_path / "fp32", dtype="float32")
    assert (tmp_path / "fp32" / "model.safetensors").is_file()
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32)
    ids = random_batch(8)[3].input_ids[None]
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=ids).logits, engine.lm(input_ids=ids).logits)

    engine.export_hf(tmp_path / "bf16", dtype="bfloat16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    lm16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert next(lm16.parameters()).dtype == torch.bfloat16


def test_export_shards_with_an_index(tmp_path: Path) -> None:
    from asyncrl.train.dcp import export_hf

    engine = tiny_engine(train_config())
    export_hf(tmp_path, engine.lm, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(full_weights(engine))


def test_iter_weights_buckets() -> None:
    engine = tiny_engine(train_config())
    buckets = list(engine.iter_weights(10_000, dtype="bfloat16"))
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(n for n, _ in engine.lm.named_parameters())
    assert len(names) == len(set(names))
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert len(bucket) == 1 or sum(sizes) <= 10_000
        assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for _, t in bucket)


def test_bf16_compute_on_cpu_keeps_fp32_master_weights() -> None:
    engine = tiny_engine(dtype="bfloat16")
    stats = engine.train_step(random_batch(9))
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in engine.lm.parameters())


def test_sample_validation() -> None:
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        Sample(ids, torch.ones(4, dtype=torch.bool), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="behav_logprobs has shape"):
        Sample(ids, torch.zeros(4, dtype=torch.bool), torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        Sample(ids, torch.zeros(4, dtype=torch.bool), torch.zeros(4), torch.zeros(2))
    import numpy as np

    s = Sample(np.arange(4), np.array([0, 0, 1, 1], dtype=bool), np.zeros(4, "float32"), 0.5)
    assert s.input_ids.dtype == torch.int64 and s.num_loss_tokens == 2
    assert s.advantages_per_token().tolist() == [0.5] * 4


def test_config_is_strict() -> None:
    with pytest.raises(ValueError, match="extra"):
        TrainerConfig(learning_rate=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="greater than 1"):
        LossConfig(c_clip=0.5)


def test_bf16_compute_still_takes_logits_in_fp32() -> None:
    """With bf16 compute the LM head runs in float32: logprobs equal an fp32 head on the
    decoder's own (bf16) hidden states, not logits rounded to bf16 first (~1e-2 off)."""
    engine = tiny_engine(train_config(max_tokens_per_microbatch=4096), dtype="bfloat16")
    with torch.no_grad():
        engine.lm.lm_head.weight.mul_(30.0)  # logits of a few units, where bf16 rounds by ~1e-2
    captured: list[torch.Tensor] = []
    hook = engine.lm.get_decoder().register_forward_hook(
        lambda _m, _i, out: captured.append(out.last_hidden_state.detach())
    )
    batch = random_batch(5, lengths=(9, 14))
    got = engine.compute_logprobs(batch)
    hook.remove()
    assert len(captured) == 1  # one packed row
    hidden = captured[0][0].float()
    logp = torch.log_softmax(hidden @ engine.lm.lm_head.weight.float().T, dim=-1)
    start = 0
    for s, lp in zip(batch, got, strict=True):
        ids = s.input_ids
        positions = torch.nonzero(s.loss_mask).squeeze(-1)
        want = logp[start + positions - 1, ids[positions]]
        torch.testing.assert_close(lp[positions], want, atol=2e-5, rtol=0)
        start += len(ids)


def test_the_training_forward_runs_the_lm_head_once_per_chunk() -> None:
    """Entropy (statistic and bonus) comes from the training forward's logits: the forward
    runs the LM head once per chunk, not a second time for the entropy."""
    from torch.overrides import TorchFunctionMode

    class CountHead(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.nn.functional.linear and args[1].shape[0] == VOCAB:
                CountHead.calls += 1
            return func(*args, **(kwargs or {}))

    engine = tiny_engine(train_config(max_tokens_per_microbatch=4096))
    with CountHead():
        stats = engine.train_step(random_batch(6, lengths=(9, 14)))
    assert stats["micro_batches"] == 1 and stats["entropy"] > 0
    assert CountHead.calls == 1
