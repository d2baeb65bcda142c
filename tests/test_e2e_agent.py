"""End to end: agent code as the workflow of ``asyncrl up``, through each rollout actor's
OpenAI-compatible endpoint, on the ci recipe's tiny model.

Two agent files, written by the tests: one with the ``openai`` client and a tool of its
own, whose episodes are two chats (so two samples each, both trained), one with the OpenAI
Agents SDK. Each trains for a few steps, and then every trained
sample's tokens (their fingerprint in ``trained_samples.jsonl``) must be the tokens the
engine generated and the endpoint recorded (``rollout.endpoint_record``), never a
re-tokenization of the text the agent saw.

The tiny model has 512 positions and a character-level tokenizer, so the tools are short
and the agents send the question without its instruction. Its replies are random text:
tool calls rarely parse, which the token check does not need (tests/test_endpoint.py runs
tool calls through the endpoint with a scripted engine).

Each test starts a whole run (about a minute on two cores)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_kit import running_up, up_args

from asyncrl.observe.records import token_digest
from asyncrl.runtime.nats_server import nats_info_for_run

pytestmark = pytest.mark.slow

STEPS = 3

OPENAI_AGENT = """
import json

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}}}}]


def calc(x):
    return str(sum(int(t) for t in x.split("+") if t.strip().isdigit()))


async def agent(client, data):
    question = data["question"].split("?")[0]
    messages = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        result = calc(json.loads(call.function.arguments).get("x", ""))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not reply.tool_calls:
        messages.append({"role": "user", "content": "?"})
    final = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    text = final.choices[0].message.content or ""
    # a fresh chat: the episode's second sample
    check = [{"role": "user", "content": "Sure? " + text[:8]}]
    await client.chat.completions.create(model="m", messages=check)
    return {"reward": 1.0 if text.lstrip()[:1].isdigit() else 0.0,
            "tool_success": len(reply.tool_calls or [])}
"""

SDK_AGENT = '''
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from agents import set_tracing_disabled

set_tracing_disabled(True)


@function_tool
def c() -> str:
    """Sum."""
    return "0"


async def agent(client, data):
    model = OpenAIChatCompletionsModel(model="m", openai_client=client)
    bot = Agent(name="a", instructions="Add.", model=model, tools=[c])
    result = await Runner.run(bot, data["question"].split("?")[0], max_turns=2)
    return 1.0 if str(result.final_output).lstrip()[:1].isdigit() else 0.0
'''


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def agent_sets(workflow: str) -> list[str]:
    """The recipe of a short run whose ``workflow`` goes through the endpoint, with every
    call recorded (as :func:`check_trained_tokens_are_the_endpoints` expects)."""
    return [
        f"rollout.workflow={workflow}",
        "rollout.endpoint_record=true",
        "rollout.group_size=4",
        "rollout.max_concurrent=8",
        "buffer.batch_size=2",
        "buffer.max_concurrent=8",
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint_every={STEPS}",
    ]


def recorded_samples(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """An episode's calls as its samples: runs of calls each of whose prompt extends the
    call before (what was sampled, told by token ids alone)."""
    samples: list[list[dict[str, Any]]] = []
    for call in calls:
        if samples:
            head = samples[-1][-1]["prompt_ids"] + samples[-1][-1]["completion_ids"]
            if call["prompt_ids"][: len(head)] == head:
                samples[-1].append(call)
                continue
        samples.append([call])
    return samples


def check_trained_tokens_are_the_endpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Every trained sample is tokens the endpoint recorded for its episode: a run of
    calls each continuing the one before, the last call's prompt ids and completion ids."""
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert len({t["prompt_uid"] for t in trained}) == STEPS * 2
    recorded: dict[str, list[list[dict[str, Any]]]] = {}
    for entry in read_jsonl(run_dir / "endpoint_calls.jsonl"):
        samples = recorded_samples(entry["calls"])
        assert len(samples) == len(entry["uids"])
        for uid, sample in zip(entry["uids"], samples, strict=True):
            recorded.setdefault(uid, []).append(sample)
    for sample in trained:
        matches = [
            calls
            for calls in recorded.get(sample["uid"], [])
            if token_digest(calls[-1]["prompt_ids"] + calls[-1]["completion_ids"])
            == sample["tokens_sha1"]
        ]
        assert matches, f"no recorded episode has the tokens of trained sample {sample['uid']}"
        calls = matches[0]
        assert all(c["continued_from"] is not None for c in calls[1:])  # not re-encoded
        assert sample["response_tokens"] == sum(len(c["completion_ids"]) for c in calls)
        assert all(v >= 0 for c in calls for v in c["versions"])
    return trained


async def wait_for_file(folder: Path, pattern: str, proc: asyncio.subprocess.Process) -> Path:
    async with asyncio.timeout(180):
        while True:
            found = sorted(folder.glob(pattern)) if folder.is_dir() else []  # noqa: ASYNC240
            if found:
                return found[0]
            assert proc.returncode is None, f"the run ended before {folder / pattern} appeared"
            await asyncio.sleep(0.2)


async def test_an_openai_client_agent_trains_on_the_endpoints_tokens(tmp_path: Path) -> None:
    agent_file = tmp_path / "agent.py"
    agent_file.write_text(OPENAI_AGENT)
    argv = up_args(tmp_path, "agent", *agent_sets(f"{agent_file}:agent"))
    async with running_up(tmp_path, "agent", argv=argv) as up:
        about_file = await wait_for_file(up.run_dir / "endpoints", "rollout-*.json", up.proc)
        about = json.loads(about_file.read_text())
        assert about_file.stat().st_mode & 0o777 == 0o600
        # the endpoint answers outside agent code with the run's token, and only with it
        token = nats_info_for_run(up.run_dir).token
        assert about["api_key"] == token and about["api_key_is_run_token"]
        assert about["url"].startswith("http://127.0.0.1:")
        async with openai.AsyncOpenAI(base_url=about["url"], api_key=token) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny-random-llama"]
        async with openai.AsyncOpenAI(base_url=about["url"], api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        code = await asyncio.wait_for(up.proc.wait(), 420)
    assert code == 0
    assert not about_file.exists()  # removed when the actor ended
    assert "killing" not in (up.run_dir / "logs" / "up.log").read_text()  # it ended by itself
    assert "HTTP Request" not in (up.run_dir / "logs" / "rollout-0.log").read_text()
    check_trained_tokens_are_the_endpoints(up.run_dir)
    metrics = read_jsonl(up.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    trained = read_jsonl(up.run_dir / "trained_samples.jsonl")
    assert len(trained) == STEPS * 2 * 4 * 2  # two samples per episode, both trained
    for m in metrics:
        assert m["agent/turns"] == 3.0  # every episode calls three times
        assert m["agent/endpoint_added_latency_s"] > 0
        assert m["agent/tool_success"] == (1.0 if m["agent/tool_calls"] else 0.0)


async def test_an_openai_agents_sdk_agent_trains_on_the_endpoints_tokens(tmp_path: Path) -> None:
    pytest.importorskip("agents")
    agent_file = tmp_path / "sdk_agent.py"
    agent_file.write_text(SDK_AGENT)
    argv = up_args(tmp_path, "sdk", *agent_sets(f"{agent_file}:agent"))
    async with running_up(tmp_path, "sdk", argv=argv) as up:
        code = await asyncio.wait_for(up.proc.wait(), 420)
    assert code == 0
    check_trained_tokens_are_the_endpoints(up.run_dir)
    metrics = read_jsonl(up.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["agent/turns"] >= 1.0 for m in metrics)
