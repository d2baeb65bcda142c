"""The server engines' shared machinery against in-test servers speaking vLLM's payloads:
routing, retries, error text, pausing across a weight update, and server processes
(health timeout naming the log, no orphan after ``kill -9`` of the parent)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from fake_servers import FakeModel, RunningServer, vllm_app

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.engines.config import VLLMEngineConfig
from asyncrl.engines.remote import Router, Server, routing_key
from asyncrl.engines.server import ServerError
from asyncrl.engines.vllm import VLLMEngine, completion_payload, parse_completion

TESTS = Path(__file__).resolve().parent
FAKE = TESTS / "fake_servers.py"
MODEL = "tiny-random-llama"


def engine_for(urls: list[str], **options: Any) -> VLLMEngine:
    return VLLMEngine(MODEL, VLLMEngineConfig(urls=urls, retry_backoff=0.01, **options))


def request(
    rid: str, prompt: list[int] | None = None, n: int = 8, **sampling: object
) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, stop_token_ids=(), **sampling)  # type: ignore[arg-type]
    return GenerateRequest(input_ids=prompt or [5, 6, 7], sampling=sp, rid=rid)


# --- payloads -------------------------------------------------------------------------------


def test_completion_payload_carries_token_ids_and_the_stop_convention() -> None:
    req = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9, seed=4),
        rid="u/0",
    )
    body = completion_payload("policy", req, 9, "u/0-x")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 9
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["top_k"] == 5
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["seed"] == 4
    assert "stop_token_ids" not in body and "ignore_eos" not in body  # the model's EOS stops
    only = req.model_copy(
        update={"sampling": req.sampling.model_copy(update={"stop_token_ids": (9,)})}
    )
    body = completion_payload("policy", only, 9, "r")
    assert body["stop_token_ids"] == [9] and body["ignore_eos"] is True


def test_parse_completion_keeps_partial_tokens_of_an_abort_and_rejects_a_mismatch() -> None:
    req = request("u/0")
    body = {
        "choices": [
            {
                "finish_reason": "abort",
                "token_ids": [4, 5],
                "logprobs": {"token_logprobs": [-0.5, -1.5], "tokens": ["a", "b"]},
            }
        ]
    }
    out = parse_completion(req, body)
    assert (out.output_ids, out.output_logprobs, out.finish_reason) == (
        [4, 5],
        [-0.5, -1.5],
        "abort",
    )
    empty = parse_completion(
        req, {"choices": [{"finish_reason": "abort", "token_ids": [], "logprobs": None}]}
    )
    assert empty.output_ids == [] and empty.finish_reason == "abort"
    body["choices"][0]["logprobs"]["token_logprobs"] = [-0.5]
    with pytest.raises(ServerError, match="2 tokens but 1 logprobs"):
        parse_completion(req, body)


# --- routing --------------------------------------------------------------------------------


def test_router_keeps_a_group_on_one_server_and_sends_new_groups_to_the_least_loaded() -> None:
    a, b = Server("http://a"), Server("http://b")
    router = Router([a, b])
    first = router.pick("g1")
    first.inflight += 1
    second = router.pick("g2")
    assert second is not first
    second.inflight += 3
    assert router.pick("g1") is first  # affinity beats load
    assert router.pick("g3") is first  # least loaded
    assert routing_key("uid-7/3") == "uid-7" and routing_key("uid-7/3/1") == "uid-7"
    assert routing_key("") is None


async def test_groups_stick_to_a_server_and_spread_across_servers() -> None:
    m0, m1 = FakeModel(step_s=0.005), FakeModel(step_s=0.005)
    async with RunningServer(vllm_app(m0), m0) as s0, RunningServer(vllm_app(m1), m1) as s1:
        async with engine_for([s0.url, s1.url]) as engine:
            prompts = {"g0": [3, 4], "g1": [10, 11], "g2": [20, 21], "g3": [30, 31]}
            async with asyncio.TaskGroup() as tg:
                for g, p in prompts.items():
                    for i in range(3):
                        tg.create_task(engine.agenerate(request(f"{g}/{i}", p, n=4)))
    groups0 = {tuple(p) for p in m0.prompts}
    groups1 = {tuple(p) for p in m1.prompts}
    assert len(m0.prompts) == len(m1.prompts) == 6  # two groups of three each
    assert not groups0 & groups1  # a group never split over servers
    assert len(groups0) == len(groups1) == 2


# --- errors ---------------------------------------------------------------------------------


async def test_a_dropped_connection_is_retried() -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(vllm_app(model), model) as server:
        async with engine_for([server.url], retries=2) as engine:
            model.drop_connections = 2
            out = await engine.agenerate(request("u/0", n=3))
    assert out.output_ids == [8, 9, 10] and out.finish_reason == "length"
    assert len(model.prompts) == 1  # the two dropped attempts never reached generation


async def test_connection_errors_beyond_the_retries_name_the_attempts() -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(vllm_app(model), model) as server:
        async with engine_for([server.url], retries=1) as engine:
            model.drop_connections = 5
            with pytest.raises(ServerError, match=r"/v1/completions: connection failed 2 times"):
                await engine.agenerate(request("u/0", n=3))


async def test_the_servers_own_error_text_reaches_the_caller() -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(vllm_app(model, max_model_len=4096), model) as server:
        async with engine_for([server.url]) as engine:
            # the engine caps the budget at the context it read from /v1/models: undo that
            engine.servers[0].info["max_model_len"] = 10**6
            with pytest.raises(
                ServerError, match=r"HTTP 400: .*cannot be greater than max_model_len=4096"
            ):
                await engine.agenerate(request("u/0", n=5000))


async def test_a_full_context_ends_with_length_without_asking_the_server() -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(vllm_app(model, max_model_len=8), model) as server:
        async with engine_for([server.url]) as engine:
            out = await engine.agenerate(request("u/0", [1, 2, 3, 4, 5], n=10))
    assert out.output_ids == [6, 7, 8] and out.finish_reason == "length"  # 8 - 5 tokens


# --- pausing across a weight update ---------------------------------------------------------


async def test_generation_interrupted_by_an_update_resumes_with_two_versions(
    tmp_path: Path,
) -> None:
    model = FakeModel(step_s=0.01)
    weights = tmp_path / "v1"
    weights.mkdir()
    async with RunningServer(vllm_app(model), model) as server:
        async with engine_for([server.url]) as engine:
            tasks = [
                asyncio.ensure_future(engine.agenerate(request(f"g/{i}", n=30))) for i in range(3)
            ]
            await model.after_tokens(3 * 5).wait()  # some tokens under version 0
            await engine.pause()
            await engine.update_weights(weights, version=1)
            assert not model.jobs  # nothing runs on the server during the load
            await engine.resume()
            outs = await asyncio.gather(*tasks)
    for out in outs:
        assert len(out.output_ids) == 30 and out.finish_reason == "length"
        assert out.output_ids == [(8 + k) % 50 for k in range(30)]  # continued, not restarted
        k = out.output_versions.index(1)
        assert 0 < k < 30 and set(out.output_versions[:k]) == {0}
        assert set(out.output_versions[k:]) == {1}
        # the tokens after the update came from the new weights, the ones before from the old
        assert out.output_logprobs[:k] == [-1.0] * k and out.output_logprobs[k:] == [-2.0] * (
            30 - k
        )
    # the resubmitted prompts are prompt + partial tokens
    resumed = [p for p in model.prompts if len(p) > 3]
    assert len(resumed) == 3 and all(p[:3] == [5, 6, 7] for p in resumed)
    calls = model.calls[: [c[0] for c in model.calls].index("resume") + 1]
    assert [c[0] for c in calls] == [
        "pause",
        "collective_rpc",
        "reset_prefix_cache",
        "update_weight_version",
        "resume",
    ]
    assert calls[0][1] == "abort"
    assert calls[1][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
    assert calls[3][1] == "1"


async def test_a_request_queued_by_the_paused_server_is_aborted_and_resubmitted(
    tmp_path: Path,
) -> None:
    """A request sent just before the pause but reaching the server after it is queued there;
    the engine aborts it so that the pause completes, then resubmits it."""
    model = FakeModel(step_s=0.01)
    async with RunningServer(vllm_app(model), model) as server:
        async with engine_for([server.url]) as engine:
            model.pause()  # the server is paused behind the engine's back
            task = asyncio.ensure_future(engine.agenerate(request("q/0", n=5)))
            await model.job_arrived.wait()
            async with asyncio.timeout(10):
                await engine.pause()  # returns only because the queued request was aborted
            assert ("abort_requests", None) in model.calls
            await engine.resume()
            out = await task
    assert out.output_ids == [8, 9, 10, 11, 12] and out.output_versions == [0] * 5


async def test_a_failed_load_names_the_server_error_and_keeps_the_version(tmp_path: Path) -> None:
    model = FakeModel(step_s=0.001)
    async with RunningServer(vllm_app(model), model) as server:
        async with engine_for([server.url]) as engine:
            with pytest.raises(ServerError, match=r"HTTP 500: .*is not a directory"):
                await engine.update_weights(tmp_path / "missing", version=1)
            assert engine.version == 0 and not engine.paused
            with pytest.raises(TypeError, match="directory"):
                await engine.update_weights(iter([]), version=1)


# --- server processes -----------------------------------------------------------------------


def fake_command() -> list[str]:
    return [sys.executable, str(FAKE), "vllm"]


async def test_started_servers_serve_and_stop_with_the_engine(tmp_path: Path) -> None:
    config = VLLMEngineConfig(command=fake_command(), servers=2, startup_timeout=60)
    engine = VLLMEngine(MODEL, config, log_dir=tmp_path)
    async with engine:
        pids = [s.process.proc.pid for s in engine.servers]  # type: ignore[union-attr]
        out = await engine.agenerate(request("u/0", n=4))
        assert out.output_ids == [8, 9, 10, 11]
        logs = sorted(os.listdir(tmp_path))
        assert len(logs) == 2 and all(name.startswith(f"vllm-{os.getpid()}-") for name in logs)
    for pid in pids:
        assert not alive(pid)


async def test_a_server_that_never_gets_healthy_fails_naming_its_log(tmp_path: Path) -> None:
    config = VLLMEngineConfig(command=fake_command(), args=["--never-healthy"], startup_timeout=2)
    engine = VLLMEngine(MODEL, config, log_dir=tmp_path)
    with pytest.raises(ServerError, match=r"not healthy after 2 s; see its log .*vllm-\d+-0\.log"):
        await engine.start()
    assert engine.servers[0].process.returncode is not None  # type: ignore[union-attr]


async def test_a_server_that_dies_at_start_fails_with_its_last_words(tmp_path: Path) -> None:
    config = VLLMEngineConfig(command=fake_command(), args=["--die-at-start"], startup_timeout=60)
    engine = VLLMEngine(MODEL, config, log_dir=tmp_path)
    with pytest.raises(ServerError, match=r"(?s)has exited.*told to die at start"):
        await engine.start()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


PARENT = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    from pathlib import Path
    from asyncrl.engines.server import ServerProcess

    async def main():
        out, hostile = Path(sys.argv[1]), sys.argv[2] == "hostile"
        if hostile:  # the guard inherits this mask: the parent-death SIGTERM stays pending
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        # the "server" starts a grandchild, as vLLM starts its engine core
        code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
        server = ServerProcess([sys.executable, "-c", code], url="http://x", log_path=out / "server.log")
        server.start()
        if hostile and os.fork() == 0:  # a forked child holds the pipe's write end on
            time.sleep(60)
            os._exit(0)
        # written whole under another name, then renamed: the test never reads it half-written
        out.joinpath("guard.tmp").write_text(str(server.proc.pid))
        out.joinpath("guard.tmp").rename(out / "guard.pid")
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("parent_kind", ["plain", "hostile"])
def test_no_server_survives_kill_9_of_its_parent(tmp_path: Path, parent_kind: str) -> None:
    """``hostile``: the parent blocked SIGTERM before starting the guard and a forked child
    of it keeps the pipe open, so only the guard's watch on its parent id is left."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), parent_kind])
    try:
        guard_file = tmp_path / "guard.pid"
        deadline = time.monotonic() + 30
        group: list[int] = []
        while time.monotonic() < deadline:
            if guard_file.exists():
                guard = int(guard_file.read_text())
                group = members(guard)
                if len(group) >= 3:  # guard, server, grandchild
                    break
            time.sleep(0.05)
        assert len(group) >= 3, f"the server group never formed: {group}"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(p) for p in group):
            time.sleep(0.1)
        assert not [p for p in group if alive(p)], "processes outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found
