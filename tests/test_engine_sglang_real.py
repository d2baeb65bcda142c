"""The sglang engine against a real SGLang server on the CPU (``.venv-sglang``).

Slow (a server start takes minutes on two cores) and opt-in: ``make test-sglang``, or
``ASYNCRL_SGLANG_TESTS=1 pytest -m sglang``. Skipped without ``.venv-sglang`` (``make
sglang``). The server runs SGLang's CPU engine (``rollout.engine.cpu``) with a test-only
stand-in for its compiled kernel package (tests/sglang/sgl_kernel_stub).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from weights_kit import gloo_publisher, tensor_weights

from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.engines.config import SGLangEngineConfig
from asyncrl.engines.sglang import SGLangEngine

REPO = Path(__file__).resolve().parent.parent
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .venv-sglang: run `make sglang`"),
    pytest.mark.skipif(
        os.environ.get("ASYNCRL_SGLANG_TESTS") != "1",
        reason="real-SGLang tests are opt-in: `make test-sglang` (ASYNCRL_SGLANG_TESTS=1)",
    ),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(1200),
]

MODEL = "smollm2-135m-instruct"
KV_TOKENS = 4096  # enough for these tests; SGLang's default takes GBs of host memory


def config(**kw: object) -> SGLangEngineConfig:
    return SGLangEngineConfig(
        python=str(SGLANG_PYTHON),
        cpu=True,
        max_total_tokens=KV_TOKENS,
        startup_timeout=1200,
        **kw,  # type: ignore[arg-type]
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SGLangEngine]:
    # ASYNCRL_SGLANG_URL: a CPU server of SmolLM2 already running (fp32, as the engine
    # starts it), to iterate on these tests without waiting for a start each time
    url = os.environ.get("ASYNCRL_SGLANG_URL")
    cfg = config(urls=[url]) if url else config()
    sglang = SGLangEngine(MODEL, cfg, log_dir=tmp_path_factory.mktemp("sglang-logs"))
    async with sglang:
        yield sglang


def sampling(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)  # type: ignore[arg-type]


PROMPT = [5, 17, 33, 8, 91, 12]


def trainer_logprobs(model_path: str, outs: list[GenerateResponse], temperature: float) -> list:
    """The trainer's logprobs (fp32, ``temperature``) of each response's generated tokens."""
    import torch

    from asyncrl.models.resolve import ModelConfig
    from asyncrl.train import TrainerConfig
    from asyncrl.train.batch import Sample
    from asyncrl.train.engine import TrainEngine

    trainer = TrainEngine(
        TrainerConfig(max_tokens_per_microbatch=4096, temperature=temperature),
        ModelConfig(path=model_path),
    )
    samples = []
    for o in outs:
        ids = torch.tensor(o.input_ids + o.output_ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(o.input_ids) :] = True
        samples.append(Sample(ids, mask, torch.zeros(len(ids)), 0.0))
    scored = trainer.compute_logprobs(samples)
    return [r[s.loss_mask].tolist() for s, r in zip(samples, scored, strict=True)]


async def test_generate_returns_input_ids_tokens_with_the_trainers_logprobs(
    engine: SGLangEngine,
) -> None:
    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(8, temperature=0.0, stop_token_ids=())
    )
    a, b = await asyncio.gather(engine.agenerate(greedy), engine.agenerate(greedy))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8  # greedy is deterministic
    assert a.finish_reason == "length" and a.output_versions == [0] * 8
    sampled = [
        GenerateRequest(input_ids=PROMPT, sampling=sampling(12, temperature=0.7, seed=s))
        for s in range(3)
    ]
    outs = list(await asyncio.gather(*(engine.agenerate(r) for r in sampled)))
    for out in outs:
        assert 1 <= len(out.output_ids) == len(out.output_logprobs) <= 12
        assert all(math.isfinite(x) and x <= 0 for x in out.output_logprobs)
        if out.finish_reason == "stop":
            assert out.output_ids[-1] == engine.tokenizer.eos_token_id  # the stop token is kept
    # SGLang's logprobs are the trainer's (same weights, fp32, same temperature)
    expected = await asyncio.to_thread(trainer_logprobs, engine.model_path, outs, 0.7)
    gaps = [
        abs(x - y)
        for o, e in zip(outs, expected, strict=True)
        for x, y in zip(o.output_logprobs, e, strict=True)
    ]
    assert max(gaps) < 1e-3, gaps


async def test_pause_aborts_with_partial_tokens_and_continue_finishes_them(
    engine: SGLangEngine, tmp_path: Path
) -> None:
    """Two requests are paused mid-way by a weight update and finish under the new version.
    How far they got before the pause depends on this machine's speed, so the wait before
    the pause adapts: halved when the requests finished first, doubled when none had
    started decoding, for a few tries."""
    weights = tmp_path / "same"
    weights.mkdir()
    shutil.copy(Path(engine.model_path) / "model.safetensors", weights / "model.safetensors")
    n = 64
    req = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(n, temperature=1.0, stop_token_ids=()), rid="p/0"
    )
    wait, split = 4.0, 0
    for _ in range(5):
        staged = await engine.stage_weights(weights)
        old = engine.version
        tasks = [asyncio.ensure_future(engine.agenerate(req)) for _ in range(2)]
        await asyncio.sleep(wait)
        await engine.pause()
        await engine.update_weights(staged, version=old + 1)
        await engine.resume()
        outs = await asyncio.gather(*tasks)
        assert engine.version == old + 1
        new_counts = []
        for out in outs:
            assert len(out.output_ids) == n == len(out.output_logprobs)
            assert out.finish_reason == "length"
            versions = out.output_versions
            assert versions == sorted(versions) and set(versions) <= {old, old + 1}
            new_counts.append(versions.count(old + 1))
        split = sum(0 < c < n for c in new_counts)
        if split:
            break
        wait = wait / 2 if max(new_counts) == 0 else wait * 2
    assert split, "no request was interrupted by the update: all ran on one version"


async def test_weights_from_disk_change_generation_and_the_old_ones_restore_it(
    engine: SGLangEngine, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(8, temperature=0.0, stop_token_ids=())
    )
    before = await engine.agenerate(greedy)
    tensors = load_file(str(Path(engine.model_path) / "model.safetensors"))
    changed = {k: (v.flip(0) if v.ndim == 2 and "embed" in k else v) for k, v in tensors.items()}
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    new_dir.mkdir()
    old_dir.mkdir()
    save_file(changed, str(new_dir / "model.safetensors"))
    save_file(tensors, str(old_dir / "model.safetensors"))
    await engine.update_weights(await engine.stage_weights(new_dir), version=engine.version + 1)
    after = await engine.agenerate(greedy)
    assert after.output_ids != before.output_ids
    assert set(after.output_versions) == {engine.version}
    await engine.update_weights(await engine.stage_weights(old_dir), version=engine.version + 1)
    again = await engine.agenerate(greedy)
    assert again.output_ids == before.output_ids  # flush_cache left no stale prefix KV
    info = await engine._call(engine.servers[0], "/model_info", method="GET")
    assert info["weight_version"] == str(engine.version)


async def test_release_and_resume_memory_are_accepted_no_ops_on_the_cpu(
    engine: SGLangEngine,
) -> None:
    """On the CPU there is no device memory to hand over, and SGLang's release synchronizes
    CUDA, which kills a CPU server: the engine keeps both calls to itself, and the server
    generates as before."""
    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(4, temperature=0.0, stop_token_ids=())
    )
    before = await engine.agenerate(greedy)
    assert await engine.release_memory() == 0
    assert engine.released and engine.paused
    await engine.resume_memory()
    await engine.resume()
    after = await engine.agenerate(greedy)
    assert after.output_ids == before.output_ids


async def test_the_broadcast_reaches_the_server_through_sglangs_own_endpoints(
    engine: SGLangEngine, tmp_path: Path
) -> None:
    """A trainer's publisher in this process, the server joined to it with
    ``/init_weights_update_group``: the first version (changed embeddings) arrives with
    the join and changes greedy generation, the second (the original weights) arrives by
    broadcast and restores it. Between receiving and the update, new tokens already carry
    the version received (SGLang loads while it receives)."""
    from safetensors.torch import load_file

    from asyncrl.api.inference import BroadcastStaged
    from asyncrl.runtime.bus import Bus
    from asyncrl.runtime.nats_server import EmbeddedNats
    from asyncrl.weights.receiver import EngineWeights
    from asyncrl.wire.subjects import Subjects

    original = load_file(str(Path(engine.model_path) / "model.safetensors"))
    changed = {k: (v.flip(0) if v.ndim == 2 and "embed" in k else v) for k, v in original.items()}

    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(8, temperature=0.0, stop_token_ids=())
    )
    before = await engine.agenerate(greedy)
    v1, v2 = engine.version + 1, engine.version + 2
    async with EmbeddedNats(tmp_path / "run") as nats:
        bus = await Bus.connect(nats.info, name="test")
        subjects = Subjects("sglang-broadcast")
        pub = gloo_publisher(bus, subjects, dtype=engine.dtype, timeout_s=120)
        receiver = EngineWeights(engine, bus, subjects, "rollout-0", device="cpu")
        try:
            await pub.start()

            await receiver.listen()

            async def take(version: int) -> None:
                async with asyncio.timeout(600), receiver.receive() as got:
                    assert (got.version, got.via) == (version, "collective")
                    assert got.source == BroadcastStaged(version, 0)
                    await engine.pause()
                    await engine.update_weights(got.source, got.version)
                    await engine.resume()

            await pub.publish(
                tensor_weights(v1, changed, tmp_path)
            )  # the engine joins; the join brings it
            async with asyncio.timeout(600), receiver.receive() as got:
                assert (got.version, got.via) == (v1, "collective")
                early = await engine.agenerate(greedy)  # received, not yet taken
                assert engine.version == v1 - 1 and set(early.output_versions) == {v1}
                await engine.pause()
                await engine.update_weights(got.source, got.version)
                await engine.resume()
            after = await engine.agenerate(greedy)
            assert after.output_ids == early.output_ids != before.output_ids
            assert set(after.output_versions) == {v1} and engine.version == v1

            msg = await pub.publish(
                tensor_weights(v2, original, tmp_path)
            )  # by broadcast, to the member
            assert msg.members == ["rollout-0"]
            await take(v2)
            assert pub.delivery()["sent_to"] == ["rollout-0"]
            again = await engine.agenerate(greedy)
            assert again.output_ids == before.output_ids and set(again.output_versions) == {v2}
            info = await engine._call(engine.servers[0], "/model_info", method="GET")
            assert info["weight_version"] == str(v2)
            assert receiver.counters["fallbacks"] == 0 and pub.stats.dropped == 0
        finally:
            await receiver.close()
            await pub.close()
            await bus.close()
