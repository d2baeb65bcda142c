"""The ``collective`` weight transport into a real vLLM server (vLLM's CPU build in
``.venv-vllm``): the server joins the trainer's gloo group through asyncrl's worker
extension and receives each version itself.

Slow and opt-in like tests/test_engine_vllm.py: ``make test-vllm``, or
``ASYNCRL_VLLM_TESTS=1 pytest -m vllm``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from e2e_kit import running_up, up_args
from safetensors.torch import load_file, save_file
from test_e2e import read_jsonl
from weights_kit import gloo_publisher, tensor_weights

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.engines.config import VLLMEngineConfig
from asyncrl.engines.vllm import VLLMEngine
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.weights.receiver import EngineWeights
from asyncrl.wire.subjects import Subjects

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make vllm`"),
    pytest.mark.skipif(
        os.environ.get("ASYNCRL_VLLM_TESTS") != "1",
        reason="real-vLLM tests are opt-in: `make test-vllm` (ASYNCRL_VLLM_TESTS=1)",
    ),
    pytest.mark.timeout(900),
]

MODEL = "smollm2-135m-instruct"
PROMPT = [5, 17, 33, 8, 91, 12]
GREEDY = GenerateRequest(
    input_ids=PROMPT,
    sampling=SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=()),
)


async def test_a_vllm_server_takes_the_broadcast_itself(tmp_path: Path) -> None:
    config = VLLMEngineConfig(
        python=str(VLLM_PYTHON), cpu_kvcache_gib=1, max_model_len=512, startup_timeout=600
    )
    subjects = Subjects("vbcast")
    async with (
        EmbeddedNats(tmp_path / "run") as nats,
        VLLMEngine(MODEL, config, log_dir=tmp_path / "logs") as engine,
    ):
        bus = await Bus.connect(nats.info, name="test")
        pub = gloo_publisher(bus, subjects, dtype=engine.dtype, timeout_s=60)
        await pub.start()
        receiver = EngineWeights(engine, bus, subjects, "rollout-0", device="cpu")

        await receiver.listen()

        async def load_next() -> tuple[int, str]:
            async with asyncio.timeout(300):
                async with receiver.receive() as got:
                    await engine.update_weights(got.source, got.version)
                    return got.version, got.via

        try:
            before = await engine.agenerate(GREEDY)
            original = load_file(str(Path(engine.model_path) / "model.safetensors"))
            changed = dict(original)
            name = "model.embed_tokens.weight"
            changed[name] = original[name].flip(0)

            # the first version comes with the join the announcement starts
            await pub.publish(tensor_weights(1, changed, tmp_path))
            assert await load_next() == (1, "collective")
            after = await engine.agenerate(GREEDY)
            assert after.output_ids != before.output_ids
            assert set(after.output_versions) == {1}
            # the same weights from a directory (the path the object store takes) give
            # the same tokens and logprobs: the broadcast loaded exactly those weights
            folder = tmp_path / "v1"
            folder.mkdir()
            save_file(changed, str(folder / "model.safetensors"))
            await engine.update_weights(folder, version=1)
            from_files = await engine.agenerate(GREEDY)
            assert from_files.output_ids == after.output_ids
            assert from_files.output_logprobs == after.output_logprobs

            # the next one is broadcast to the member the server now is
            msg = await pub.publish(tensor_weights(2, original, tmp_path))
            assert msg.members == ["rollout-0"]
            assert await load_next() == (2, "collective")
            assert pub.delivery()["sent_to"] == ["rollout-0"]
            again = await engine.agenerate(GREEDY)
            # the old weights give the old tokens: the prefix cache held no stale KV
            assert again.output_ids == before.output_ids
            assert set(again.output_versions) == {2}
            info = await engine._call(engine.servers[0], "/weight_info", method="GET")
            assert info["weight_version"] == "2"
            assert receiver.counters["fallbacks"] == 0 and pub.stats.fallbacks == 0
        finally:
            await pub.close()
            await receiver.close()
            await bus.close()


@pytest.mark.timeout(1500)
async def test_a_run_on_vllm_takes_every_version_by_the_broadcast(tmp_path: Path) -> None:
    """``asyncrl up`` with the vllm engine and ``weights.transport = "collective"``: the
    rollout actor's server joins on the first version and every later one is broadcast
    to it; none comes from the object store."""
    sets = [
        f"model.path={MODEL}",
        "rollout.engine.type=vllm",
        f"rollout.engine.python={VLLM_PYTHON}",
        "rollout.engine.cpu_kvcache_gib=1",
        "rollout.engine.max_model_len=1024",
        "weights.transport=collective",
        "trainer.max_steps=3",
        "trainer.checkpoint_every=100",
    ]
    async with running_up(tmp_path, "vbcast", argv=up_args(tmp_path, "vbcast", *sets)) as run:
        code = await asyncio.wait_for(run.proc.wait(), 1400)
    logs = run.run_dir / "logs"
    assert code == 0, (logs / "up.log").read_text()[-3000:]
    published = read_jsonl(run.run_dir / "weights.jsonl")
    assert len(published) >= 3 and all(p["transport"] == "collective" for p in published)
    assert all(p["sent_to"] == ["rollout-0"] and not p["dropped"] for p in published[1:])
    rollout = "".join(p.read_text() for p in logs.glob("rollout-0*.log"))
    assert "joined the weight broadcast" in rollout
    loads = [line for line in rollout.splitlines() if "weights updated" in line]
    assert loads and all("via=collective" in line for line in loads), loads
    assert "object store instead" not in rollout
