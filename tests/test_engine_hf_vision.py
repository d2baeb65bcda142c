"""The hf engine on the tiny random vision-language models (Qwen2-VL- and Idefics3-shaped):
image requests generate with logprobs a teacher-forced forward with the same pixel inputs
gives back, never sample an image placeholder, resume with their images after a pause,
share decode steps with text requests, and a prompt whose image tokens do not match its
images fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.data.shapes import ShapesSettings, shapes_records
from asyncrl.engines.config import HFEngineConfig, VLLMEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.hf_images import RequestPixels
from asyncrl.engines.vllm import VLLMEngine
from asyncrl.models.resolve import ModelConfig
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.models.tiny_vlm import IDEFICS3_NAME, QWEN2_5_VL_NAME, QWEN2_VL_NAME
from asyncrl.models.vision import (
    QWEN_FAMILY,
    VisionProcessor,
    load_vision_lm,
    mask_placeholders,
    open_image,
    record_messages,
    scoring_inputs,
)

NAMES = [QWEN2_VL_NAME, QWEN2_5_VL_NAME, IDEFICS3_NAME]

LOGPROB_ATOL = 1e-4
"""fp32: the engine's prefill (explicit positions and mask, a KV cache written in place)
and one forward over prompt + completion differ only by summation order."""


def make_engine(path: Path, **kw: Any) -> HFEngine:
    config = HFEngineConfig(max_batch_size=kw.pop("max_batch_size", 8))
    return HFEngine(ModelConfig(path=str(path), dtype="float32"), config, **kw)


def sampling(**kw: Any) -> SamplingParams:
    kw.setdefault("stop_token_ids", ())
    return SamplingParams(**kw)


def image_request(proc: VisionProcessor, rec: dict[str, Any], **kw: Any) -> GenerateRequest:
    ids = proc(record_messages(rec), [open_image(rec["image"])])["input_ids"][0].tolist()
    return GenerateRequest(input_ids=ids, images=[rec["image"]], **kw)


def teacher_forced(
    model: Any, proc: VisionProcessor, resp: GenerateResponse, images: list[str]
) -> torch.Tensor:
    """The logprobs of ``resp``'s output under one forward over prompt + output with the
    pixel inputs of ``images`` (none: the placeholders embedded as text), the placeholders
    masked as the engine masks them, T = 1."""
    ids = torch.tensor([resp.input_ids])
    prompt: dict[str, torch.Tensor] = {"input_ids": ids}
    if images:
        prompt |= proc.pixel_inputs(resp.input_ids, [open_image(p) for p in images])
        if proc.model_type in QWEN_FAMILY:
            prompt["mm_token_type_ids"] = (ids == proc.image_token_id).long()
    completion = torch.tensor([resp.output_ids])
    inputs = scoring_inputs(prompt, completion, proc.image_token_id)
    with torch.no_grad():
        logits = mask_placeholders(model(**inputs).logits.float(), proc.placeholder_ids)
    n = ids.shape[1]
    logp = torch.log_softmax(logits[0, n - 1 : -1], dim=-1)
    return logp.gather(-1, completion[0, :, None])[:, 0]


def gap(resp: GenerateResponse, expected: torch.Tensor) -> float:
    return (torch.tensor(resp.output_logprobs) - expected).abs().max().item()


@pytest.mark.parametrize("name", NAMES)
async def test_image_request_logprobs_equal_a_teacher_forced_forward(vlm_dirs, shapes, name):
    proc = VisionProcessor(vlm_dirs[name])
    model = load_vision_lm(vlm_dirs[name])
    async with make_engine(vlm_dirs[name]) as engine:
        assert engine.vision is not None
        reqs = [
            image_request(proc, rec, sampling=sampling(max_new_tokens=24, seed=i))
            for i, rec in enumerate(shapes[:2])
        ]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    gaps = []
    for req, resp in zip(reqs, resps, strict=True):
        assert resp.finish_reason == "length" and len(resp.output_ids) == 24
        assert not set(resp.output_ids) & set(proc.placeholder_ids)
        gaps.append(gap(resp, teacher_forced(model, proc, resp, req.images)))
    print(f"{name}: max |engine - teacher-forced| = {max(gaps):.1e}")
    assert max(gaps) < LOGPROB_ATOL, gaps
    # the image mattered: the other image's pixels (same size, same ids) score differently
    swapped = teacher_forced(model, proc, resps[0], [shapes[1]["image"]])
    assert gap(resps[0], swapped) > 1e-3


@pytest.mark.parametrize("name", NAMES)
async def test_deterministic_seeded_image_request_repeats(vlm_dirs, shapes, name):
    proc = VisionProcessor(vlm_dirs[name])
    req = image_request(proc, shapes[0], sampling=sampling(max_new_tokens=16, seed=7))
    async with make_engine(vlm_dirs[name], deterministic=True) as engine:
        first = await engine.agenerate(req)
        second = await engine.agenerate(req)
    assert first.output_ids == second.output_ids
    assert first.output_logprobs == second.output_logprobs


async def test_placeholders_are_never_sampled_even_when_favoured(vlm_dirs, shapes):
    path = vlm_dirs[QWEN2_VL_NAME]
    proc = VisionProcessor(path)
    async with make_engine(path) as engine:
        # an lm_head with a bias that makes every placeholder far likelier than any text
        old = engine.model.lm_head
        biased = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        biased.weight = old.weight
        with torch.no_grad():
            biased.bias.zero_()
            biased.bias[proc.placeholder_ids] = 1e4
        engine.model.lm_head = biased
        reqs = [
            image_request(proc, shapes[0], sampling=sampling(max_new_tokens=12, seed=1)),
            image_request(proc, shapes[1], sampling=sampling(max_new_tokens=12, temperature=0)),
            GenerateRequest(
                input_ids=proc.tokenizer.encode("hi", add_special_tokens=False),
                sampling=sampling(max_new_tokens=12, top_k=5, seed=2),
            ),
        ]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        for resp in resps:
            assert len(resp.output_ids) == 12
            assert not set(resp.output_ids) & set(proc.placeholder_ids)
            assert all(lp > -1e3 for lp in resp.output_logprobs)
        # unmasked, greedy decoding would have taken a placeholder
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([reqs[2].input_ids])).logits[0, -1]
        assert int(logits.argmax()) in proc.placeholder_ids
        greedy = resps[1]
        expected = teacher_forced(engine.model, proc, greedy, reqs[1].images)
        assert gap(greedy, expected) < LOGPROB_ATOL


@pytest.mark.parametrize("name", NAMES)
async def test_interrupted_image_request_resumes_with_its_image(vlm_dirs, shapes, name):
    """Paused mid-sequence, updated with the model's own state dict (HF names round-trip),
    resumed: the continuation is prefilled from prompt + partial tokens with the same
    pixel inputs, so every logprob, before and after the switch, is the teacher-forced one
    with this image and not with another image of the same size."""
    path = vlm_dirs[name]
    proc = VisionProcessor(path)
    model = load_vision_lm(path)
    async with make_engine(path) as engine:
        reached = asyncio.Event()
        engine.on_step = lambda _: reached.set() if engine.stats.generated_tokens >= 6 else None
        req = image_request(proc, shapes[0], sampling=sampling(max_new_tokens=40, seed=3))
        async with asyncio.TaskGroup() as tg:
            gen = tg.create_task(engine.agenerate(req))
            await reached.wait()
            await engine.pause()
            assert not gen.done()
            await engine.update_weights(list(model.state_dict().items()), version=1)
            await engine.resume()
        resp = gen.result()
    assert resp.finish_reason == "length" and len(resp.output_ids) == 40
    switch = resp.output_versions.index(1)
    assert 6 <= switch < 40
    expected = teacher_forced(model, proc, resp, req.images)
    other = teacher_forced(model, proc, resp, [shapes[1]["image"]])
    got = torch.tensor(resp.output_logprobs)
    print(f"{name}: max gap after the resume = {(got - expected)[switch:].abs().max():.1e}")
    torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)
    assert (got[switch:] - other[switch:]).abs().max() > 1e-3


async def test_text_and_image_requests_share_decode_steps(vlm_dirs, shapes):
    path = vlm_dirs[QWEN2_VL_NAME]
    proc = VisionProcessor(path)
    model = load_vision_lm(path)
    text = GenerateRequest(
        input_ids=proc.tokenizer.encode("How many?", add_special_tokens=False),
        sampling=sampling(max_new_tokens=20, seed=4),
    )
    image = image_request(proc, shapes[2], sampling=sampling(max_new_tokens=20, seed=5))
    async with make_engine(path) as engine:
        text_resp, image_resp = await asyncio.gather(
            engine.agenerate(text), engine.agenerate(image)
        )
        assert engine.stats.max_decode_batch == 2
    assert gap(text_resp, teacher_forced(model, proc, text_resp, [])) < LOGPROB_ATOL
    assert gap(image_resp, teacher_forced(model, proc, image_resp, image.images)) < LOGPROB_ATOL


async def test_full_update_by_checkpoint_names(vlm_dirs, shapes):
    """A Qwen2-VL checkpoint stores ``model.layers.…`` where the loaded model has
    ``model.language_model.layers.…``: a directory update loads by either."""
    path = vlm_dirs[QWEN2_VL_NAME]
    proc = VisionProcessor(path)
    req = image_request(proc, shapes[0], sampling=sampling(max_new_tokens=8, seed=6))
    async with make_engine(path) as engine:
        before = await engine.agenerate(req)
        await engine.update_weights(path, version=2)
        after = await engine.agenerate(req)
    assert after.output_ids == before.output_ids and set(after.output_versions) == {2}


@pytest.mark.parametrize("name", NAMES)
async def test_mismatched_image_tokens_fail_the_request_not_the_engine(
    vlm_dirs, shapes, tmp_path, name
):
    path = vlm_dirs[name]
    proc = VisionProcessor(path)
    good = image_request(proc, shapes[0], sampling=sampling(max_new_tokens=4), rid="good")
    twice = good.model_copy(update={"images": good.images * 2, "rid": "twice"})
    bare = good.model_copy(update={"images": [], "rid": "bare"})
    bad = [twice, bare]
    if name == QWEN2_VL_NAME:  # a larger image has more patches; Idefics3 resizes all to 64
        larger = shapes_records(1, settings=ShapesSettings(image_size=200), cache_dir=tmp_path)
        bad.append(good.model_copy(update={"images": [larger[0]["image"]], "rid": "larger"}))
    async with make_engine(path) as engine:
        for req in bad:
            with pytest.raises(ValueError, match=f"request '{req.rid}'.*image"):
                await engine.agenerate(req)
        resp = await engine.agenerate(good)
    assert resp.finish_reason == "length" and len(resp.output_ids) == 4


async def test_a_group_shares_one_prefill_only_with_the_same_images(vlm_dirs, shapes):
    """Three requests of one prompt and image joining together are prefilled once; a
    fourth with the same token ids but another image (same size) gets its own prefill, and
    image prompts neither enter nor read the prefix cache."""
    path = vlm_dirs[QWEN2_VL_NAME]
    proc = VisionProcessor(path)
    model = load_vision_lm(path)
    group = [
        image_request(proc, shapes[0], sampling=sampling(max_new_tokens=8, seed=i))
        for i in range(3)
    ]
    other = group[0].model_copy(update={"images": [shapes[1]["image"]]})
    assert other.input_ids == group[0].input_ids
    async with make_engine(path) as engine:
        assert engine._batch is not None and engine._batch.prefix.enabled
        resps = await asyncio.gather(*(engine.agenerate(r) for r in [*group, other]))
        # the group joins together (its images processed once) and is prefilled once; the
        # other image is prefilled on its own, in the same step or another (which one
        # depends on when its processing ends, so the test does not ask)
        assert engine.stats.prefill_tokens == 2 * len(group[0].input_ids)
        again = await engine.agenerate(other)
        assert engine.stats.prefix_cache_hit_tokens == 0
        assert engine.stats.prefix_cache_bytes == 0
    assert again.output_ids == resps[3].output_ids
    for req, resp in zip([*group, other], resps, strict=True):
        assert gap(resp, teacher_forced(model, proc, resp, req.images)) < LOGPROB_ATOL


async def test_images_are_refused_where_no_model_reads_them(tmp_path, shapes):
    """A text model, or a backend that does not feed images, fails an image request with
    a clear error instead of generating as if it had no image."""
    request = GenerateRequest(input_ids=[1, 2, 3], images=[shapes[0]["image"]], rid="r1")
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig()) as text_engine:
        with pytest.raises(ValueError, match=r"request 'r1'.*not a vision model"):
            await text_engine.agenerate(request)
    remote = VLLMEngine(QWEN2_VL_NAME, VLLMEngineConfig())  # never started: the check comes first
    with pytest.raises(ValueError, match="request 'r1' has images, which VLLMEngine"):
        await remote.agenerate(request)


async def test_group_members_wait_for_one_processing_and_outlive_its_cancellation(vlm_dirs, shapes):
    """Requests of one prompt and images share one processing of the images; when the
    request processing them is cancelled, one of the waiting ones takes over."""
    proc = VisionProcessor(vlm_dirs[QWEN2_VL_NAME])
    images = RequestPixels(proc, QWEN2_VL_NAME)
    req = image_request(proc, shapes[0])
    calls = 0
    process = images._process

    def counting(request: GenerateRequest) -> Any:
        nonlocal calls
        calls += 1
        return process(request)

    images._process = counting  # type: ignore[method-assign]
    async with asyncio.TaskGroup() as tg:
        leader = tg.create_task(images.get(req))
        await asyncio.sleep(0)  # one turn: the leader is processing now
        followers = [tg.create_task(images.get(req)) for _ in range(2)]
        await asyncio.sleep(0)  # ... and the followers wait for it
        leader.cancel()
    results = [f.result() for f in followers]
    assert leader.cancelled() and calls == 2
    assert results[0] is results[1] and results[0] is not None
    assert set(results[0]) == {"pixel_values", "image_grid_thw"}
    assert not images._processing
