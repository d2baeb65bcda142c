"""The hf engine's weight staging and colocation: updates read while generation goes on,
memory released for a trainer step and taken back with the next weights."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from test_engine_hf import perturbed, prompt_ids, sampling

from asyncrl.api.inference import GenerateRequest
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.models.tiny import tiny_model_dir


@pytest.fixture
async def engine() -> AsyncIterator[HFEngine]:
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig(max_batch_size=8)) as eng:
        yield eng


def save_dir(pairs: list[tuple[str, torch.Tensor]], path: Path) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in pairs}, str(path / "model.safetensors"))
    return path


async def generate_across(engine: HFEngine, during: object, max_new: int = 30) -> list[int]:
    """Runs one generation and awaits ``during`` (a coroutine) once 5 tokens exist;
    returns the response's per-token versions."""
    reached = asyncio.Event()
    engine.on_step = lambda r: reached.set() if engine.stats.generated_tokens >= 5 else None
    req = GenerateRequest(
        input_ids=prompt_ids(engine, "Count with me:"), sampling=sampling(max_new_tokens=max_new)
    )
    async with asyncio.TaskGroup() as tg:
        gen = tg.create_task(engine.agenerate(req))
        await reached.wait()
        await during  # type: ignore[misc]
    resp = gen.result()
    assert resp.finish_reason == "length" and len(resp.output_ids) == max_new
    return resp.output_versions


async def test_staging_reads_a_directory_without_pausing_and_loads_the_same_weights(
    engine: HFEngine, tmp_path: Path
):
    pairs = perturbed(engine.model, seed=4)
    staged = await engine.stage_weights(save_dir(pairs, tmp_path / "v1"))
    assert not engine.paused and engine.version == 0  # staging changes nothing yet
    assert isinstance(staged, list) and {n for n, _ in staged} == {n for n, _ in pairs}

    async def pause_load_resume() -> None:
        await engine.pause()
        await engine.update_weights(staged, version=1)
        await engine.resume()

    versions = await generate_across(engine, pause_load_resume())
    switch = versions.index(1)
    assert versions == [0] * switch + [1] * (len(versions) - switch) and switch >= 5
    params = dict(engine.model.named_parameters())
    for name, expected in pairs:
        torch.testing.assert_close(params[name].detach(), expected)


async def test_released_engine_waits_and_takes_its_memory_back_with_new_weights(
    engine: HFEngine,
):
    new = perturbed(engine.model, seed=5)

    async def trainer_step() -> None:
        freed = await engine.release_memory()
        assert freed == 0  # on the CPU only the KV cache goes, and nothing is shared
        assert engine.released and engine.paused
        steps = engine.stats.steps
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.stats.steps == steps  # nothing runs while released
        await engine.update_weights(new, version=1)
        assert not engine.released and engine.paused
        await engine.resume()

    versions = await generate_across(engine, trainer_step())
    assert versions[:5] == [0] * 5 and versions[-1] == 1


async def test_resume_memory_without_new_weights_keeps_the_old_ones(engine: HFEngine):
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def release_then_resume() -> None:
        await engine.release_memory()
        await engine.resume_memory()
        assert not engine.released
        await engine.resume()

    versions = await generate_across(engine, release_then_resume())
    assert set(versions) == {0}
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_release_on_cuda_frees_the_weights_memory():
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig(device="cuda")) as eng:
        weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        freed = await eng.release_memory()
        assert freed >= weights
        await eng.resume_memory()
        await eng.resume()
        resp = await eng.agenerate(
            GenerateRequest(input_ids=prompt_ids(eng, "ok"), sampling=sampling(max_new_tokens=3))
        )
        assert resp.output_versions == [0, 0, 0]
