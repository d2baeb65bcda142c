"""The train engine on vision-language models (the tiny random Qwen2-VL and Idefics3), on
shapes images: its logprobs equal a plain transformers forward of each sequence alone with
its image inputs (image placeholder ids excluded from the distribution, as the engines
sample), packed or padded; a packed micro-batch's gradient is the sum of its samples'
alone (float64); the vision part stays frozen unless asked; LoRA adapts the language model
only; exported weights load back into the same class."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers.invariance import relative_error
from train_helpers.tiny import Float64Engine, one_torch_thread, step_gradients
from transformers import AutoModelForImageTextToText

from asyncrl.algo.config import LossConfig
from asyncrl.models.resolve import ModelConfig
from asyncrl.models.tiny_vlm import IDEFICS3_NAME, QWEN2_5_VL_NAME, QWEN2_VL_NAME
from asyncrl.models.vision import VisionProcessor, open_image, scoring_inputs
from asyncrl.train import OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.config import LoraConfig
from asyncrl.train.engine import TrainEngine
from asyncrl.train.vision import vision_module_names

NAMES = [QWEN2_VL_NAME, QWEN2_5_VL_NAME, IDEFICS3_NAME]

GAP = 1e-5
"""fp32 logprob gap allowed between the engine and a plain forward of one sequence."""

_gaps: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def config(**overrides: Any) -> TrainerConfig:
    fields: dict[str, Any] = dict(
        optim=OptimConfig(lr=1e-2, grad_clip=None),
        max_tokens_per_microbatch=4096,
        loss=LossConfig(behav_imp_weight_cap=None),
    )
    fields.update(overrides)
    return TrainerConfig(**fields)


def engine_of(path: Path, trainer: TrainerConfig, cls: type[TrainEngine] = TrainEngine) -> Any:
    return cls(trainer, ModelConfig(path=str(path), dtype="float32"))


def chat(n_images: int, text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"}] * n_images
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


Case = tuple[list[dict[str, Any]], list[str], int]
"""A sample's chat, its images and its completion length."""


def cases(shapes: list[dict[str, Any]]) -> list[Case]:
    """Four sequences of different lengths: one image each (different images), two images
    in one prompt, and a text-only prompt."""
    paths = [str(r["image"]) for r in shapes]
    return [
        (chat(1, shapes[0]["prompt"]), [paths[0]], 7),
        (chat(2, "Which has more shapes?"), [paths[1], paths[2]], 12),
        (chat(1, shapes[3]["prompt"]), [paths[3]], 3),
        (chat(0, "Count to five."), [], 9),
    ]


def prompt_inputs(
    proc: VisionProcessor, messages: list[dict[str, Any]], paths: list[str]
) -> dict[str, torch.Tensor]:
    """The processor's inputs of a prompt; a text-only one through its tokenizer (the
    image processors refuse an empty image list)."""
    if paths:
        return proc(messages, [open_image(p) for p in paths])
    return dict(proc.tokenizer([proc.chat_text(messages)], return_tensors="pt"))


def build_samples(proc: VisionProcessor, cases: list[Case], seed: int = 0) -> list[Sample]:
    """Prompts as the processor expands them, each with a random completion of ordinary
    tokens (no placeholder id), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor(
        [i for i in range(len(proc.tokenizer)) if i not in set(proc.placeholder_ids)]
    )
    samples = []
    for k, (messages, paths, n) in enumerate(cases):
        prompt = prompt_inputs(proc, messages, paths)["input_ids"][0]
        completion = allowed[torch.randint(0, allowed.numel(), (n,), generator=g)]
        ids = torch.cat([prompt, completion])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt.numel() :] = True
        adv = 1.0 if k % 2 == 0 else -0.5
        samples.append(Sample(ids, mask, torch.zeros(ids.numel()), adv, images=tuple(paths)))
    return samples


def reference_logprobs(
    model: torch.nn.Module, proc: VisionProcessor, case: Case, ids: torch.Tensor
) -> Any:
    """Every position's logprob (0 at position 0) from a plain transformers forward of
    the one sequence with its image inputs, placeholder ids' logits at −inf."""
    messages, paths, n = case
    prompt = prompt_inputs(proc, messages, paths)
    inputs = scoring_inputs(prompt, ids[None, -n:], proc.image_token_id)
    assert torch.equal(inputs["input_ids"][0], ids)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    logits[:, proc.placeholder_ids] = float("-inf")
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


LAYOUTS = {
    "packed": dict(max_tokens_per_microbatch=4096),
    "one_per_microbatch": dict(max_tokens_per_microbatch=1),
    "padded": dict(packing=False, max_tokens_per_microbatch=4096),
    "packed_sdpa": dict(max_tokens_per_microbatch=4096, attn_implementation="sdpa"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_logprobs_equal_each_sequence_alone(vlm_dirs, shapes, name, layout):
    path = vlm_dirs[name]
    engine = engine_of(path, config(**LAYOUTS[layout]))
    proc = engine.vision_processor
    assert proc is not None
    batch_cases = cases(shapes)
    batch = build_samples(proc, batch_cases)
    micro = engine._plan(batch)
    assert len(micro) == (4 if layout == "one_per_microbatch" else 1)
    got = engine.compute_logprobs(batch, all_positions=True)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    gap = 0.0
    for case, sample, lp in zip(batch_cases, batch, got, strict=True):
        want = reference_logprobs(model, proc, case, sample.input_ids)
        # a placeholder target (inside the prompt) is never sampled: −inf on both sides
        never = torch.isin(sample.input_ids, torch.tensor(proc.placeholder_ids))
        never[0] = False
        assert torch.equal(torch.isinf(lp), never) and torch.equal(torch.isinf(want), never)
        assert not never[sample.loss_mask].any()
        gap = max(gap, float((lp[~never] - want[~never]).abs().max()))
    _gaps[f"{name}/{layout}"] = gap
    print(f"{name} {layout}: max |engine - transformers| = {gap:.2e}")
    assert gap < GAP, gap
    # the pixels count: the same tokens with another image score otherwise
    swapped = [batch[0].__class__(**{**vars(batch[0]), "images": batch[2].images})]
    (other,) = engine.compute_logprobs(swapped, all_positions=True)
    assert (other[batch[0].loss_mask] - got[0][batch[0].loss_mask]).abs().max() > 1e-4


def with_behaviour(engine: TrainEngine, batch: list[Sample]) -> list[Sample]:
    """``batch`` with behaviour logprobs equal to the engine's (ratio 1: nothing clipped)."""
    logprobs = engine.compute_logprobs(batch)
    return [
        Sample(s.input_ids, s.loss_mask, lp.float(), s.advantages, images=s.images)
        for s, lp in zip(batch, logprobs, strict=True)
    ]


def snapshot(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.lm.named_parameters()}


@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_train_step_moves_the_vision_part_only_when_not_frozen(vlm_dirs, shapes, name, freeze):
    engine = engine_of(vlm_dirs[name], config(freeze_vision=freeze))
    assert engine.vision_processor is not None
    batch = with_behaviour(engine, build_samples(engine.vision_processor, cases(shapes)))
    vision = tuple(f"{n}." for n in vision_module_names(engine.lm))
    assert vision
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    for n, p in engine.lm.named_parameters():
        assert (id(p) in optimized) == (p.requires_grad) == (not freeze or not n.startswith(vision))
    before = snapshot(engine)
    stats = engine.train_step(batch)
    assert stats["optimizer_steps"] == 1.0
    after = snapshot(engine)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    language = {n for n in before if not n.startswith(vision)}
    assert language <= moved, sorted(language - moved)
    vision_moved = {n for n in moved if n.startswith(vision)}
    if freeze:
        assert not vision_moved
    else:
        assert vision_moved == set(before) - language


@pytest.mark.parametrize("name", NAMES)
def test_packed_gradient_is_the_sum_of_each_sample_alone(vlm_dirs, shapes, name):
    """float64: one packed micro-batch of all samples, a micro-batch per sample and
    right-padded micro-batches give one gradient (to 1e-10 relative)."""
    grads = {}
    for layout in ("packed", "one_per_microbatch", "padded"):
        engine = engine_of(
            vlm_dirs[name], config(freeze_vision=False, **LAYOUTS[layout]), Float64Engine
        )
        batch = with_behaviour(engine, build_samples(engine.vision_processor, cases(shapes)))
        _, (grads[layout],) = step_gradients(
            engine, lambda engine=engine, batch=batch: engine.train_step(batch)
        )
    for layout in ("one_per_microbatch", "padded"):
        error = relative_error(grads[layout], grads["packed"])
        print(f"{name} {layout}: relative gradient gap {error:.1e}")
        assert error < 1e-10, (layout, error)


@pytest.mark.parametrize("name", NAMES)
def test_lora_adapts_the_language_model_only(vlm_dirs, shapes, name):
    engine = engine_of(vlm_dirs[name], config(lora=LoraConfig(rank=4)))
    vision = tuple(f"{n}." for n in vision_module_names(engine.lm))
    adapted = {n.split(".lora_")[0] for n, _ in engine.lm.named_parameters() if ".lora_" in n}
    assert adapted
    assert not [n for n in adapted if n.startswith(vision)]
    language = engine.lm.get_decoder()
    linears = {
        n
        for n, m in engine.lm.named_modules()
        if n.rsplit(".", 1)[-1] in LoraConfig().target_modules and ".layers." in n
    }
    assert adapted == {n for n in linears if not n.startswith(vision)}
    assert any(m is language for m in engine.lm.modules())
    batch = with_behaviour(engine, build_samples(engine.vision_processor, cases(shapes)))
    stats = engine.train_step(batch)
    assert stats["optimizer_steps"] == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_exported_weights_load_into_the_same_class(vlm_dirs, shapes, name, tmp_path):
    engine = engine_of(vlm_dirs[name], config(freeze_vision=False))
    proc = engine.vision_processor
    batch_cases = cases(shapes)
    batch = with_behaviour(engine, build_samples(proc, batch_cases))
    engine.train_step(batch)  # weights away from the directory's
    engine.export_weights(tmp_path / "out")
    fresh = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(fresh) is type(engine.lm)
    exported = dict(pair for bucket in engine.iter_weights() for pair in bucket)
    assert set(exported) <= set(fresh.state_dict())
    again = VisionProcessor(tmp_path / "out")  # the directory is a vision model's
    messages, paths, n = batch_cases[0]
    prompt = again(messages, [open_image(p) for p in paths])
    inputs = scoring_inputs(prompt, batch[0].input_ids[None, -n:], again.image_token_id)
    engine.lm.eval()
    with torch.no_grad():
        want = engine.lm(**inputs).logits
        got = fresh.eval()(**inputs).logits
    assert torch.equal(got, want)


def test_prefix_sharing_is_refused_for_a_vision_model(vlm_dirs):
    with pytest.raises(ValueError, match=r"trainer\.share_prefix = true"):
        engine_of(vlm_dirs[QWEN2_VL_NAME], config(share_prefix=True))
    engine = engine_of(vlm_dirs[QWEN2_VL_NAME], config())
    assert engine.config.shares_prefix and not engine.shares_prefix


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_an_idle_ranks_dummy_micro_batch_runs(vlm_dirs, name, packing):
    engine = engine_of(vlm_dirs[name], config(packing=packing))
    lp_BT, _ = engine._forward_BT(engine._shard_micro_batch([], []))
    assert lp_BT.shape == (1, 2) and not lp_BT.any()
