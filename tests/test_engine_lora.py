"""Server engines with LoRA adapter updates, against the in-test vLLM server speaking
vLLM's documented LoRA endpoints: each adapter is loaded under a name carrying its
version, the one before is unloaded, and requests name the loaded adapter."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fake_servers import FakeModel, RunningServer, vllm_app

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.engines.config import VLLMEngineConfig
from asyncrl.engines.server import ServerError
from asyncrl.engines.vllm import VLLMEngine, max_lora_rank
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

MODEL = "tiny-random-llama"


def adapter_dir(path: Path) -> Path:
    path.mkdir()
    (path / ADAPTER_CONFIG).write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (path / ADAPTER_WEIGHTS).write_bytes(b"")  # the imitation server reads only the config
    return path


def request(rid: str) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=3, stop_token_ids=())
    return GenerateRequest(input_ids=[5, 6, 7], sampling=sp, rid=rid)


async def test_vllm_loads_each_adapter_by_version_and_requests_name_it(tmp_path: Path) -> None:
    model = FakeModel(step_s=0.0)
    config = VLLMEngineConfig(retry_backoff=0.01)
    async with RunningServer(vllm_app(model), model) as server:
        engine = VLLMEngine(MODEL, config.model_copy(update={"urls": [server.url]}), lora_rank=8)
        async with engine:
            await engine.agenerate(request("a/0"))
            await engine.update_weights(adapter_dir(tmp_path / "v1"), version=1)
            first = await engine.agenerate(request("b/0"))
            await engine.update_weights(adapter_dir(tmp_path / "v2"), version=2)
            second = await engine.agenerate(request("c/0"))
            # a restarted trainer publishes version 2 again: reloaded under the same name
            await engine.update_weights(adapter_dir(tmp_path / "v2-again"), version=2)
            await engine.agenerate(request("d/0"))
    assert model.models == ["policy", "policy-v1", "policy-v2", "policy-v2"]
    assert first.output_versions == [1] * 3 and second.output_versions == [2] * 3
    assert first.output_logprobs == [-2.0] * 3  # generated under the adapter
    lora_calls = [c for c in model.calls if "lora" in c[0] or c[0] == "update_weight_version"]
    assert lora_calls == [
        ("load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(tmp_path / "v1")}),
        ("update_weight_version", "1"),
        ("load_lora_adapter", {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2")}),
        ("unload_lora_adapter", {"lora_name": "policy-v1"}),
        ("update_weight_version", "2"),
        ("unload_lora_adapter", {"lora_name": "policy-v2"}),
        ("load_lora_adapter", {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2-again")}),
        ("update_weight_version", "2"),
    ]
    assert not any(c[0] == "collective_rpc" for c in model.calls)  # the base stays
    assert model.adapters == {"policy-v2": str(tmp_path / "v2-again")}


async def test_vllm_without_lora_refuses_an_adapter_naming_the_fix(tmp_path: Path) -> None:
    model = FakeModel(step_s=0.0)
    async with RunningServer(vllm_app(model), model) as server:
        engine = VLLMEngine(MODEL, VLLMEngineConfig(urls=[server.url], retry_backoff=0.01))
        async with engine:
            with pytest.raises(ServerError, match=re.escape('trainer.lora.publish = "merged"')):
                await engine.update_weights(adapter_dir(tmp_path / "v1"), version=1)
            assert engine.version == 0


def test_vllm_servers_start_with_lora_for_the_adapters_rank() -> None:
    config = VLLMEngineConfig(command=["vllm"])
    engine = VLLMEngine(MODEL, config, lora_rank=12)
    engine.model_path = "/m"
    argv = engine.server_argv(8000)
    assert argv[argv.index("--max-lora-rank") + 1] == "16"  # vLLM's next allowed rank
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "1"
    assert engine.server_env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in VLLMEngine(MODEL, config).server_argv(8000)
    assert [max_lora_rank(r) for r in (1, 8, 9, 320, 321)] == [1, 8, 16, 320, 512]


async def test_sglang_loads_each_adapter_by_version_and_requests_name_it(tmp_path: Path) -> None:
    from fake_servers import sglang_app

    from asyncrl.engines.config import SGLangEngineConfig
    from asyncrl.engines.sglang import SGLangEngine

    model = FakeModel(step_s=0.0)
    async with RunningServer(sglang_app(model), model) as server:
        config = SGLangEngineConfig(urls=[server.url], retry_backoff=0.01)
        async with SGLangEngine(MODEL, config, lora_rank=8) as engine:
            await engine.update_weights(adapter_dir(tmp_path / "v1"), version=1)
            await engine.agenerate(request("a/0"))
            await engine.update_weights(adapter_dir(tmp_path / "v2"), version=2)
            out = await engine.agenerate(request("b/0"))
    assert model.models == ["policy-v1", "policy-v2"]
    assert out.output_versions == [2] * 3
    assert [c for c in model.calls if "lora" in c[0]] == [
        ("load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(tmp_path / "v1")}),
        ("load_lora_adapter", {"lora_name": "policy-v2", "lora_path": str(tmp_path / "v2")}),
        ("unload_lora_adapter", {"lora_name": "policy-v1"}),
    ]
    assert not any(c[0] == "update_weights_from_disk" for c in model.calls)
    assert not (tmp_path / "v1" / "config.json").exists()  # an adapter is no model folder
    argv = SGLangEngine(MODEL, SGLangEngineConfig(command=["sglang"]), lora_rank=8).server_argv(1)
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
