"""The sglang engine against an in-test server speaking SGLang's native API as a real SGLang
0.5.23 server answers it (tests/test_engine_sglang_real.py drives the real one on the CPU,
opt-in: ``make test-sglang``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_servers import FakeModel, RunningServer, sglang_app

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.engines.config import SGLangEngineConfig
from asyncrl.engines.server import ServerError, resolve_interpreter
from asyncrl.engines.sglang import CPU_ARGS, SGLangEngine, generate_payload, parse_generate

MODEL = "tiny-random-llama"


def engine_for(url: str, *, memory_saver: bool = False) -> SGLangEngine:
    config = SGLangEngineConfig(urls=[url], retry_backoff=0.01)
    return SGLangEngine(MODEL, config, memory_saver=memory_saver)


def request(rid: str, n: int = 8, **sampling: object) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, stop_token_ids=(), **sampling)  # type: ignore[arg-type]
    return GenerateRequest(input_ids=[5, 6, 7], sampling=sp, rid=rid)


def test_generate_payload_follows_sglangs_native_api() -> None:
    req = GenerateRequest(
        input_ids=[1, 2],
        sampling=SamplingParams(temperature=0.5, top_p=0.8, top_k=0, max_new_tokens=7, seed=3),
        rid="u/1",
    )
    body = generate_payload(req, "u/1-abc")
    assert body["input_ids"] == [1, 2] and body["rid"] == "u/1-abc"
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["top_logprobs_num"] == 0 and body["stream"] is False
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 7 and sp["temperature"] == 0.5 and sp["top_p"] == 0.8
    assert sp["top_k"] == -1  # SGLang's "no cut"
    assert sp["sampling_seed"] == 3
    assert "stop_token_ids" not in sp and "ignore_eos" not in sp
    assert json.loads(json.dumps(body)) == body  # plain JSON


def test_parse_generate_reads_meta_info() -> None:
    req = request("u/0")
    body = {
        "text": "ab",
        "output_ids": [11, 12],
        "meta_info": {
            "id": "u/0-abc",
            "finish_reason": {"type": "stop", "matched": 12},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "output_token_logprobs": [[-0.25, 11, None], [-1.5, 12, None]],
        },
    }
    out = parse_generate(req, body)
    assert (out.output_ids, out.output_logprobs, out.finish_reason) == (
        [11, 12],
        [-0.25, -1.5],
        "stop",
    )
    body["meta_info"]["output_token_logprobs"][1][1] = 13
    with pytest.raises(ServerError, match="disagree"):
        parse_generate(req, body)
    with pytest.raises(ServerError, match="malformed"):
        parse_generate(req, {"text": "no meta"})


async def test_generation_interrupted_by_an_update_resumes_with_two_versions(
    tmp_path: Path,
) -> None:
    model = FakeModel(step_s=0.01)
    weights = tmp_path / "v1"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    async with RunningServer(sglang_app(model), model) as server:
        async with engine_for(server.url) as engine:
            tasks = [
                asyncio.ensure_future(engine.agenerate(request(f"g/{i}", n=20))) for i in range(2)
            ]
            await model.after_tokens(2 * 4).wait()
            staged = await engine.stage_weights(weights)  # adds the model's config files
            assert (weights / "config.json").is_file()
            await engine.pause()
            await engine.update_weights(staged, version=1)
            await engine.resume()
            outs = await asyncio.gather(*tasks)
    for out in outs:
        assert out.output_ids == [(8 + k) % 50 for k in range(20)]
        k = out.output_versions.index(1)
        assert 0 < k < 20 and out.output_versions == [0] * k + [1] * (20 - k)
        assert out.output_logprobs == [-1.0] * k + [-2.0] * (20 - k)
    calls = model.calls[: [c[0] for c in model.calls].index("continue_generation") + 1]
    assert [c[0] for c in calls] == [
        "pause_generation",
        "update_weights_from_disk",
        "flush_cache",
        "continue_generation",
    ]
    assert calls[0][1] == "abort"
    assert calls[1][1] == {"model_path": str(weights), "weight_version": "1"}


async def test_a_failed_load_surfaces_sglangs_message(tmp_path: Path) -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(sglang_app(model), model) as server:
        async with engine_for(server.url) as engine:
            with pytest.raises(ServerError, match=r"HTTP 400: .*config.json not found"):
                await engine.update_weights(tmp_path, version=1)  # not staged: no config.json
            assert engine.version == 0


async def test_release_and_resume_memory_for_colocation(tmp_path: Path) -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(sglang_app(model), model) as server:
        async with engine_for(server.url, memory_saver=True) as engine:
            assert "--enable-memory-saver" in engine.server_argv(1234)
            await engine.agenerate(request("a/0", n=2))
            await engine.release_memory()
            assert engine.released and engine.paused
            await engine.resume_memory()
            await engine.resume()
            out = await engine.agenerate(request("b/0", n=2))
    assert out.output_ids == [8, 9]
    names = [c[0] for c in model.calls]
    assert names.index("pause_generation") < names.index("release_memory_occupation")
    assert names.index("release_memory_occupation") < names.index("resume_memory_occupation")


def test_a_cpu_engine_starts_sglangs_cpu_path_from_its_own_virtualenv() -> None:
    config = SGLangEngineConfig(python="/opt/sg/bin/python", cpu=True, max_total_tokens=4096)
    engine = SGLangEngine(MODEL, config)
    argv = engine.server_argv(31001)
    assert argv[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"]
    i = argv.index("--max-total-tokens")
    assert argv[i + 1] == "4096"
    assert argv[-len(CPU_ARGS) :] == CPU_ARGS and "torch_native" in CPU_ARGS
    assert engine.server_env() == {"SGLANG_USE_CPU_ENGINE": "1"}
    gpu = SGLangEngine(MODEL, SGLangEngineConfig())
    assert "--device" not in gpu.server_argv(31001) and gpu.server_env() == {}
    assert "--max-total-tokens" not in gpu.server_argv(31001)


def test_a_relative_interpreter_is_found_in_the_checkout_or_named_with_its_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not the checkout: the path resolves against the checkout
    assert resolve_interpreter("src/asyncrl/__init__.py", "SGLang", "sglang") == str(
        Path(__file__).resolve().parents[1] / "src" / "asyncrl" / "__init__.py"
    )
    assert resolve_interpreter("python3", "SGLang", "sglang") == "python3"
    with pytest.raises(ServerError, match=r"run `make sglang`"):
        resolve_interpreter(".venv-none/bin/python", "SGLang", "sglang")


async def test_a_cpu_engine_keeps_release_and_resume_memory_to_itself() -> None:
    """A real CPU server dies of /release_memory_occupation (it synchronizes CUDA), and has
    no device memory to free: the engine only pauses."""
    model = FakeModel(step_s=0.001)
    async with RunningServer(sglang_app(model), model) as server:
        config = SGLangEngineConfig(urls=[server.url], retry_backoff=0.01, cpu=True)
        async with SGLangEngine(MODEL, config) as engine:
            assert await engine.release_memory() == 0
            assert engine.released and engine.paused
            await engine.resume_memory()
            await engine.resume()
            out = await engine.agenerate(request("c/0", n=2))
    assert out.output_ids == [8, 9]
    names = [c[0] for c in model.calls]
    assert "release_memory_occupation" not in names and "resume_memory_occupation" not in names
    assert names.index("pause_generation") < names.index("continue_generation")
