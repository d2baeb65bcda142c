"""The vllm engine against a real vLLM server (vLLM's CPU build in ``.venv-vllm``).

Slow (a server start is about a minute on two cores) and opt-in: ``make test-vllm``, or
``ASYNCRL_VLLM_TESTS=1 pytest -m vllm``. Skipped without ``.venv-vllm`` (``make vllm``).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.api.reward import RewardResult
from asyncrl.engines.config import VLLMEngineConfig
from asyncrl.engines.vllm import VLLMEngine
from asyncrl.tools.builtin import calculator_tool
from asyncrl.tools.calls import ParsedReply, ToolCall, tools_system_text
from asyncrl.workflows.agent import AgentWorkflow
from asyncrl.workflows.tool_env import Step, ToolEnv

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
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

MODEL = "smollm2-135m-instruct"  # the tiny random model's head_dim (16) has no CPU kernel


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VLLMEngine]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    config = VLLMEngineConfig(
        python=str(VLLM_PYTHON), cpu_kvcache_gib=1, max_model_len=512, startup_timeout=600
    )
    vllm = VLLMEngine(MODEL, config, log_dir=logs)
    async with vllm:
        yield vllm


def sampling(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **kw)  # type: ignore[arg-type]


PROMPT = [5, 17, 33, 8, 91, 12]


async def test_generation_returns_tokens_with_logprobs(engine: VLLMEngine) -> None:
    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(12, temperature=0.0, stop_token_ids=())
    )
    a, b = await asyncio.gather(engine.agenerate(greedy), engine.agenerate(greedy))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 12  # greedy is deterministic
    assert a.finish_reason == "length" and a.output_versions == [0] * 12
    assert all(math.isfinite(x) and x <= 0 for x in a.output_logprobs)
    sampled = GenerateRequest(input_ids=PROMPT, sampling=sampling(16, temperature=0.7, seed=1))
    out = await engine.agenerate(sampled)
    assert 1 <= len(out.output_ids) == len(out.output_logprobs) <= 16
    if out.finish_reason == "stop":
        assert out.output_ids[-1] == engine.tokenizer.eos_token_id  # the stop token is kept


async def test_pause_aborts_with_partial_tokens_and_resume_continues(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    weights = tmp_path / "same"
    weights.mkdir()
    shutil.copy(Path(engine.model_path) / "model.safetensors", weights / "model.safetensors")
    req = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(300, temperature=1.0, stop_token_ids=()), rid="p/0"
    )
    tasks = [asyncio.ensure_future(engine.agenerate(req)) for _ in range(4)]
    await asyncio.sleep(1.0)  # let them generate under version 0 (timing only shifts the split)
    await engine.pause()
    await engine.update_weights(weights, version=1)
    await engine.resume()
    outs = await asyncio.gather(*tasks)
    split = 0
    for out in outs:
        assert len(out.output_ids) == 300 and out.finish_reason == "length"
        assert len(out.output_logprobs) == 300
        versions = out.output_versions
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        split += 0 < versions.count(1) < 300
    assert split, "no request was interrupted by the update: all ran on one version"
    assert engine.version == 1


async def test_reloaded_weights_change_generation_and_reloading_the_old_ones_restores_it(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    greedy = GenerateRequest(
        input_ids=PROMPT, sampling=sampling(10, temperature=0.0, stop_token_ids=())
    )
    before = await engine.agenerate(greedy)
    tensors = load_file(str(Path(engine.model_path) / "model.safetensors"))
    changed = {k: (v.flip(0) if v.ndim == 2 and "embed" in k else v) for k, v in tensors.items()}
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    new_dir.mkdir()
    old_dir.mkdir()
    save_file(changed, str(new_dir / "model.safetensors"))
    save_file(tensors, str(old_dir / "model.safetensors"))
    await engine.update_weights(new_dir, version=engine.version + 1)
    after = await engine.agenerate(greedy)
    assert after.output_ids != before.output_ids
    assert set(after.output_versions) == {engine.version}
    await engine.update_weights(old_dir, version=engine.version + 1)
    again = await engine.agenerate(greedy)
    # same tokens as before the change: the prefix cache held no stale KV
    assert again.output_ids == before.output_ids
    info = await engine._call(engine.servers[0], "/weight_info", method="GET")
    assert info["weight_version"] == str(engine.version)


# --- the agent workflow on vLLM -------------------------------------------------------------


class Spy:
    """Passes requests to the engine and keeps each request with its response, by rid."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.seen: dict[str, tuple[GenerateRequest, GenerateResponse]] = {}

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        resp = await self.engine.agenerate(request)
        self.seen[request.rid] = (request, resp)
        return resp


class AnswerIn:
    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        return RewardResult(float(data["answer"] in completion))


async def test_agent_episodes_keep_the_engines_tokens_and_versions_across_a_weight_update(
    engine: VLLMEngine, tmp_path: Path
) -> None:
    """A group of two calculator episodes: each first reply is answered with the
    calculator's result in the tool role (whatever the model wrote, so that every episode
    has an observation), the second is scored. The first episode to reach its tool turn
    reloads the weights as a new version while the other may still be generating."""
    tok = engine.tokenizer
    weights = tmp_path / "same"
    weights.mkdir()
    (weights / "model.safetensors").symlink_to(Path(engine.model_path) / "model.safetensors")
    v0 = engine.version
    updated: list[bool] = []

    class CalculatorOnce(ToolEnv):
        stepped = False

        async def step(self, reply: ParsedReply, *, last: bool = False) -> Step:
            if last or self.stepped:
                return await self._score(reply)
            self.stepped = True
            if not updated:
                updated.append(True)
                await engine.update_weights(weights, version=v0 + 1)
            call = ToolCall("calculator", {"expression": self.record["expression"]}, "call_0")
            return await super().step(ParsedReply(reply.content, [call]))

    tool = calculator_tool()
    wf = AgentWorkflow(
        tok,
        SamplingParams(temperature=1.0, max_new_tokens=40, seed=7),
        env_factory=lambda: CalculatorOnce([tool], AnswerIn()),
        group_size=2,
        max_turns=2,
        max_total_tokens=500,
    )
    spy = Spy(engine)
    record = {"uid": "q0", "prompt": "What is 347 * 5821?", "expression": "347 * 5821"}
    record["answer"] = "2019887"
    out = await wf.arun_episode(spy, record)  # type: ignore[arg-type]
    assert out is not None and len(out) == 2 and engine.version == v0 + 1

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    listing = tools_system_text([tool.schema()])
    prompt = enc(
        tok.apply_chat_template(
            [{"role": "system", "content": listing}, {"role": "user", "content": record["prompt"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )
    first_versions = []
    for i, traj in enumerate(out):
        (req0, out0), (req1, out1) = spy.seen[f"q0/{i}/0"], spy.seen[f"q0/{i}/1"]
        g0, g1 = out0.output_ids, out1.output_ids
        # SmolLM2 ends a turn with <|im_end|> and a newline; a reply that stopped on
        # <|im_end|> (the engine keeps the stop token) needs only the newline.
        close = "\n" if g0 and g0[-1] == tok.eos_token_id else "<|im_end|>\n"
        observation = enc(f"{close}<|im_start|>tool\n2019887<|im_end|>\n<|im_start|>assistant\n")
        assert req0.input_ids == prompt
        assert req1.input_ids == prompt + g0 + observation  # never re-tokenized
        assert traj.input_ids.tolist() == prompt + g0 + observation + g1
        n0, n_obs = len(prompt), len(observation)
        mask = traj.loss_mask.numpy().tolist()
        assert mask == [0] * n0 + [1] * len(g0) + [0] * n_obs + [1] * len(g1)
        expected_logprobs = [0.0] * n0 + out0.output_logprobs + [0.0] * n_obs + out1.output_logprobs
        np.testing.assert_array_equal(
            traj.logprobs.numpy(), np.asarray(expected_logprobs, dtype=np.float32)
        )
        expected_versions = [-1] * n0 + out0.output_versions + [-1] * n_obs + out1.output_versions
        assert traj.versions.numpy().tolist() == expected_versions
        # A reply started after the update is all the new version; the other episode's
        # first reply may span both.
        assert set(out1.output_versions) == {v0 + 1}
        assert out0.output_versions == sorted(out0.output_versions)
        first_versions.append(set(out0.output_versions))
        assert traj.reward_info["tool_calls"] == 1 and traj.reward_info["tool_success"] == 1
        assert traj.reward_info["turns"] == 2
    assert {v0} in first_versions  # the updating episode's first reply: all the old version
    assert all(v <= {v0, v0 + 1} for v in first_versions)


# --- a run: kill -9 of a rollout actor that runs vLLM ---------------------------------------


def _proc_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _live(pids: list[int]) -> list[int]:
    return [p for p in pids if (f := _proc_fields(p)) is not None and f[0] not in ("Z", "X")]


def _all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def server_groups_of(actor_pid: int) -> list[list[int]]:
    """The process groups of the server guards the actor started (guard, server, engine
    core, workers)."""
    groups = []
    for pid in _all_pids():
        f = _proc_fields(pid)
        if f is None or int(f[1]) != actor_pid:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"server_guard.py" in cmdline:
            groups.append([p for p in _all_pids() if (g := _proc_fields(p)) and int(g[2]) == pid])
    return groups


@pytest.mark.timeout(1200)
async def test_kill_9_of_a_rollout_actor_leaves_no_vllm_and_the_replacement_starts_its_own(
    tmp_path: Path,
) -> None:
    import signal
    import sys

    from e2e_kit import running_up

    from asyncrl.runtime.bus import Bus
    from asyncrl.runtime.nats_server import nats_info_for_run
    from asyncrl.wire.messages import ActorInfo
    from asyncrl.wire.subjects import Subjects

    run_dir = tmp_path / "vkill"
    sets = [
        f"run.dir={tmp_path}",
        "run.name=vkill",
        f"model.path={MODEL}",
        "rollout.engine.type=vllm",
        f"rollout.engine.python={VLLM_PYTHON}",
        "rollout.engine.cpu_kvcache_gib=1",
        "rollout.engine.max_model_len=1024",
        "rollout.lease_ttl=5",
        "trainer.max_steps=3",
        "trainer.checkpoint_every=100",
        # no eval actor: it would start a vLLM server of its own, and a rollout actor that
        # dies before every actor has started ends the run instead of being replaced
        "eval.every=0",
    ]
    argv = [
        sys.executable,
        "-m",
        "asyncrl.entry.cli",
        "up",
        str(REPO / "recipes" / "ci.toml"),
        "--quiet",
    ]
    for s in sets:
        argv += ["--set", s]
    async with running_up(tmp_path, "vkill", argv=argv) as run:
        up = run.proc
        bus = await Bus.connect(nats_info_for_run(run_dir), name="test")
        first: asyncio.Future[ActorInfo] = asyncio.get_running_loop().create_future()

        async def on_beat(info: ActorInfo) -> None:
            if not first.done():
                first.set_result(info)

        try:
            await bus.subscribe(Subjects("vkill").heartbeat("rollout"), ActorInfo, on_beat)
            # heartbeats start once setup is done: the actor's vLLM server is up by then
            victim = await asyncio.wait_for(first, 600)
        finally:
            await bus.close()
        groups = server_groups_of(victim.pid)
        assert len(groups) == 1 and len(groups[0]) >= 3, f"no vLLM server group: {groups}"
        served = groups[0]
        os.kill(victim.pid, signal.SIGKILL)
        async with asyncio.timeout(60):
            while _live(served):  # noqa: ASYNC110 - other processes' lifetimes
                await asyncio.sleep(0.2)
        code = await asyncio.wait_for(up.wait(), 900)
        assert code == 0, (run_dir / "logs" / "up.log").read_text()[-3000:]
    logs = run_dir / "logs"
    assert (logs / "rollout-0-r1.log").is_file(), "no replacement actor"
    vllm_logs = sorted(p.name for p in logs.glob("vllm-*.log"))
    assert len(vllm_logs) == 2, f"the replacement did not start its own server: {vllm_logs}"
    assert f"vllm-{victim.pid}-0.log" in vllm_logs
    assert not [p for p in _all_pids() if b"VLLM::" in _cmdline(p)], "vLLM outlived the run"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""
