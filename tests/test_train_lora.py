"""LoRA in the train engine: only the adapters train and hold optimizer state, the adapted
model starts as the base model exactly, the KL reference is the base model (no copy),
checkpoints hold the adapters alone, and the adapter export merges, in the hf engine and
in the trainer's merged export, to the same weights."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_helpers.tiny import one_torch_thread, random_batch, tiny_engine, train_config

from asyncrl.models.resolve import TINY_NAME, ModelConfig
from asyncrl.train import LossConfig
from asyncrl.train.config import LoraConfig
from asyncrl.train.engine import TrainEngine
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merged, read_adapter

LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def lora_engine(**overrides: object) -> TrainEngine:
    """A tiny engine with rank-4 adapters and a KL penalty (so a reference is scored)."""
    loss = LossConfig(kl_coef=0.1, behav_imp_weight_cap=None)
    return tiny_engine(train_config(lora=LORA, loss=loss, **overrides))


def small_vocab_batch(seed: int) -> list:
    """:func:`random_batch` within the 102 tokens of ``tiny-random-llama``."""
    return [dataclasses.replace(s, input_ids=s.input_ids % 100) for s in random_batch(seed)]


def params(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.lm.named_parameters()}


def test_only_adapters_train_and_hold_optimizer_state() -> None:
    engine = lora_engine()
    assert engine.ref_module is None, "LoRA's reference is the base model, not a copy"
    trainable = {n for n, p in engine.lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # q/k/v/o/gate/up/down in each of the 2 layers, A and B each
    assert len(trainable) == 2 * 7 * 2
    by_id = {id(p): n for n, p in engine.lm.named_parameters()}
    in_optimizer = {by_id[id(p)] for g in engine.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == trainable

    before = params(engine)
    stats = engine.train_step(random_batch(0))
    assert stats["kl_ref"] == 0.0  # the adapters start at B = 0: policy = reference
    engine.train_step(random_batch(1))
    after = params(engine)
    for name, tensor in before.items():
        if name in trainable:
            if ".lora_B." in name:  # (A's gradient is 0 while B is 0: it moves from step 2)
                assert not torch.equal(after[name], tensor), f"{name} did not train"
        else:
            assert torch.equal(after[name], tensor), f"frozen {name} changed"
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # Adam moments for the adapters only


def test_lora_starts_as_the_base_model_and_its_reference_stays_there() -> None:
    """With B = 0 the adapted model's logprobs are the base model's, bit for bit; after
    training, the reference (adapters disabled) still gives exactly those."""
    base = tiny_engine(train_config())
    engine = lora_engine()
    batch = random_batch(7)
    expected = base.compute_logprobs(batch)
    for got, want in zip(engine.compute_logprobs(batch), expected, strict=True):
        assert torch.equal(got, want)
    engine.train_step(random_batch(0))
    engine.train_step(random_batch(1))
    moved = engine.compute_logprobs(batch)
    assert any(not torch.equal(a, b) for a, b in zip(moved, expected, strict=True))
    for got, want in zip(engine.compute_ref_logprobs(batch), expected, strict=True):
        assert torch.equal(got, want)


def test_checkpoint_holds_the_adapters_and_resumes_them(tmp_path: Path) -> None:
    """Tied embeddings: the LM head is a state-dict key of its own, frozen all the same."""
    from train_helpers.tiny import tiny_config

    loss = LossConfig(kl_coef=0.1, behav_imp_weight_cap=None)
    config = train_config(lora=LORA, loss=loss)

    def lora_engine() -> TrainEngine:
        return tiny_engine(config, architecture=tiny_config(tie_word_embeddings=True))

    engine = lora_engine()
    engine.train_step(random_batch(0))
    engine.train_step(random_batch(1))
    engine.save_checkpoint(tmp_path / "ckpt")
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)

    resumed = lora_engine()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 2
    for (name, a), b in zip(engine.lm.named_parameters(), resumed.lm.parameters(), strict=True):
        assert torch.equal(a, b), name
    # same adapters and Adam moments: the next step is the same step
    assert resumed.train_step(random_batch(2))["loss"] == engine.train_step(random_batch(2))["loss"]


def test_adapter_export_merges_like_the_merged_export_in_the_hf_engine(tmp_path: Path) -> None:
    """The published adapter, applied by the hf engine to its base weights, gives the
    weights of the trainer's merged export; a second adapter replaces the first."""
    from asyncrl.engines.hf import HFEngine

    engine = TrainEngine(
        train_config(lora=LORA), ModelConfig(path=TINY_NAME, dtype="float32"), seed=0
    )
    engine.train_step(small_vocab_batch(0))
    engine.train_step(small_vocab_batch(1))
    engine.export_weights(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
    ]
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["r"] == 4
    engine.export_hf(tmp_path / "merged", dtype="float32")
    from safetensors.torch import load_file

    want = load_file(str(tmp_path / "merged" / "model.safetensors"))
    adapter = read_adapter(tmp_path / "adapter")
    assert adapter.scale == 2.0 and len(adapter.factors) == 2 * 7
    engine.train_step(small_vocab_batch(2))
    engine.export_weights(tmp_path / "adapter2")
    engine.export_hf(tmp_path / "merged2", dtype="float32")
    want2 = load_file(str(tmp_path / "merged2" / "model.safetensors"))

    async def served() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
        async with HFEngine(ModelConfig(path=TINY_NAME, dtype="float32")) as hf:
            base = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
            await hf.update_weights(tmp_path / "adapter", 1)
            first = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
            await hf.update_weights(tmp_path / "adapter2", 2)
            second = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
            assert set(base) == set(want)
            return first, second, hf.version

    first, second, version = asyncio.run(served())
    assert version == 2
    for name, tensor in want.items():
        torch.testing.assert_close(first[name], tensor, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(second[name], want2[name], rtol=0, atol=1e-6, msg=name)


def test_merge_formula() -> None:
    """W + (alpha / r)·B·A, by hand: r = 1, alpha = 2."""
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    a = torch.tensor([[1.0, 2.0]])  # [r, in]
    b = torch.tensor([[3.0], [-1.0]])  # [out, r]
    out = merged(w, a, b, 2.0)
    assert torch.equal(out, torch.tensor([[7.0, 12.0], [-2.0, -3.0]]))
    assert torch.equal(w, torch.eye(2))  # not changed in place


@pytest.mark.slow
def test_lora_under_fsdp_on_two_ranks_matches_one_process(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two gloo ranks, FSDP2 over the adapted model: the same steps, logprobs, reference
    logprobs and merged weights as one process; the checkpoint (adapters only) loads in
    one process, and the adapter export is the one process's. (The two ranks are the
    world-2 torchrun of test_train_distributed.py, whose worker runs these steps too.)"""
    from test_train_distributed import launch
    from train_helpers.tiny import full_weights, lora_fsdp_engine

    folder = launch("world2", tmp_path_factory)["dir"] / "lora"
    sharded = torch.load(folder / "out.pt", weights_only=True)

    engine = lora_fsdp_engine()
    stats = [engine.train_step(random_batch(step)) for step in range(2)]
    for got, want in zip(sharded["stats"], stats, strict=True):
        for key in ("loss", "pg_loss", "grad_norm", "kl_ref"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert stats[1]["kl_ref"] > 0  # the reference (adapters off) is not the policy
    batch = random_batch(7)
    for a, b in zip(sharded["logprobs"], engine.compute_logprobs(batch), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(sharded["ref"], engine.compute_ref_logprobs(batch), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    plain = full_weights(engine)
    assert sharded["weights"].keys() == plain.keys()
    assert not any("lora" in name or "base_layer" in name for name in plain)
    for name, tensor in plain.items():
        torch.testing.assert_close(sharded["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)

    resumed = lora_fsdp_engine()
    resumed.load_checkpoint(folder / "ckpt")
    for name, tensor in full_weights(resumed).items():
        torch.testing.assert_close(tensor, sharded["weights"][name], rtol=0, atol=0, msg=name)
    engine.export_weights(tmp_path / "plain")
    got, want = read_adapter(folder / "adapter"), read_adapter(tmp_path / "plain")
    assert got.factors.keys() == want.factors.keys() and got.scale == want.scale
    for name, (a, b) in want.factors.items():
        torch.testing.assert_close(got.factors[name][0], a, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(got.factors[name][1], b, rtol=0, atol=1e-5, msg=name)


def test_the_recipe_refuses_adapters_outside_the_decoder_layers() -> None:
    from asyncrl.config.recipe import RecipeError, load_recipe

    for name in ("lm_head", "embed_tokens"):
        with pytest.raises(RecipeError, match=rf"trainer\.lora\.target_modules.*{name}"):
            load_recipe(
                None, ["trainer.lora.rank=4", f'trainer.lora.target_modules=["q_proj", "{name}"]']
            )


def test_a_target_that_matches_no_decoder_linear_layer_stops_the_trainer_naming_it() -> None:
    from asyncrl.models.resolve import load_causal_lm
    from asyncrl.train.lora import apply_lora

    lm = load_causal_lm(TINY_NAME)
    config = LoraConfig(rank=4, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match=r"target_modules: \['qkv_proj'\].*'q_proj'"):
        apply_lora(lm, config)
    # what matches is adapted, every decoder layer's
    adapted = apply_lora(load_causal_lm(TINY_NAME), LoraConfig(rank=4, target_modules=["v_proj"]))
    names = [n for n, _ in adapted.named_parameters() if ".lora_A." in n]
    assert names and all(".v_proj." in n for n in names)
