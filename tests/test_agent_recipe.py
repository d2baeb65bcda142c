"""Agents in a recipe: the ``rollout.agent`` keys and what ``asyncrl check`` refuses, agent
code told apart from an episode function, the workflow a rollout actor builds (tools from
the recipe, agent code on its endpoint), and the ``agent/...`` metrics of both kinds of
agent workflow, against hand-computed numbers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from scripted_engine import ScriptedEngine
from workflow_kit import workflow_from

from asyncrl.config.checks import generation_budget, recipe_problems
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.config.workflow import AgentCodeWorkflowConfig, AgentWorkflowConfig, WorkflowParts
from asyncrl.endpoint import OpenAIAgentWorkflow, OpenAIEndpoint
from asyncrl.models.tiny import build_tokenizer
from asyncrl.observe.records import agent_metrics
from asyncrl.wire.messages import Array, Trajectory
from asyncrl.workflows.agent import AgentWorkflow
from asyncrl.workflows.code import FunctionWorkflow
from asyncrl.workflows.loader import SpecError

REPO = Path(__file__).resolve().parent.parent

USER_CODE = textwrap.dedent(
    '''
    import json

    import openai


    def shout(text: str) -> str:
        """Says it louder.

        Args:
            text: what to say.
        """
        return text.upper()


    async def agent(client, data):
        return 1.0


    async def annotated(llm: openai.AsyncOpenAI, data):
        return 1.0


    async def episode(engine, item):
        return []


    async def neither(model, data):
        return 1.0


    def environment():
        raise RuntimeError("not called by checks")


    REPLY_THEN_TOOL = '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'


    async def tool_agent(client, data):
        tools = [{"type": "function", "function": {"name": "shout", "parameters": {}}}]
        messages = [{"role": "user", "content": data["question"]}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        reply = first.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        errors = {}
        for call in reply.tool_calls or []:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": args["text"]})
        errors["raised"] = 1
        final = await client.chat.completions.create(model="m", messages=messages, tools=tools)
        return {"reward": 0.5, "tool_success": len(reply.tool_calls or []), "tool_errors": errors,
                "tool_latency_s": 0.25}
    '''
)


@pytest.fixture
def code(tmp_path: Path) -> Path:
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    return path


def problems(*sets: str) -> list[str]:
    return recipe_problems(load_recipe(None, list(sets)))[0]


def test_the_recipe_keys_and_their_defaults() -> None:
    r = load_recipe(None).rollout
    assert r.agent.tools == ["calculator", "python"] and r.agent.mcp == []
    assert (r.agent.parser, r.agent.max_total_tokens, r.agent.tool_timeout) == ("hermes", 2048, 10)
    assert (r.agent.system_prompt, r.agent.env) == ("", "")
    assert (r.endpoint, r.endpoint_port, r.endpoint_record) == (None, 0, False)
    mcp = load_recipe(
        None, ['rollout.agent.mcp=[{command = "python", args = ["s.py"], env = {A = "1"}}]']
    ).rollout.agent.mcp
    assert (mcp[0].command, mcp[0].args, mcp[0].env) == ("python", ["s.py"], {"A": "1"})


def test_specs_in_the_recipe_file_are_found_beside_it(tmp_path: Path, code: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[rollout]\nworkflow = "agent"\n[rollout.agent]\n'
        'tools = ["calculator", "user_code.py:shout"]\nenv = "user_code.py:environment"\n'
    )
    agent = load_recipe(recipe).rollout.agent
    assert agent.tools == ["calculator", f"{code}:shout"]
    assert agent.env == f"{code}:environment"


def test_check_refuses_bad_agent_keys_naming_them(code: Path) -> None:
    agent = "rollout.workflow=agent"
    assert problems(agent) == []
    assert problems(agent, f'rollout.agent.tools=["calculator", "{code}:shout"]') == []
    (err,) = problems(agent, 'rollout.agent.tools=["shell"]')
    assert "rollout.agent.tools[0] = 'shell' is no built-in tool (calculator, python)" in err
    (err,) = problems(agent, f'rollout.agent.tools=["{code}:missing"]')
    assert "rollout.agent.tools[0]" in err and "no attribute 'missing'" in err
    (err,) = problems(agent, f'rollout.agent.tools=["{code}:REPLY_THEN_TOOL"]')
    assert "rollout.agent.tools[0]" in err and "not a function" in err
    (err,) = problems(agent, 'rollout.agent.tools=["calculator", "calculator"]')
    assert "two tools share a name" in err
    (err,) = problems(agent, "rollout.agent.parser=pythonic")
    assert "rollout.agent.parser = 'pythonic' is unknown: known hermes" in err
    (err,) = problems(agent, "rollout.agent.max_total_tokens=256")
    assert "rollout.agent.max_total_tokens = 256" in err
    assert "rollout.sampling.max_new_tokens = 256" in err
    (err,) = problems(agent, f"rollout.agent.env={code}:nothing")
    assert "rollout.agent.env" in err
    (err,) = problems(agent, 'rollout.agent.mcp=[{command = "no-such-mcp-server-7"}]')
    assert "rollout.agent.mcp[0].command = 'no-such-mcp-server-7' is not an installed" in err
    with pytest.raises(RecipeError) as bad:
        load_recipe(None, [f"rollout.workflow={code}:neither"])
    err = str(bad.value)
    assert "rollout.workflow" in err and "async def agent(client, data)" in err
    assert "async def episode(engine, item)" in err
    (err,) = problems(f"rollout.workflow={code}:agent", "rollout.endpoint=false")
    assert "rollout.endpoint = false" in err
    assert problems(f"rollout.workflow={code}:agent") == []
    # the agent workflow's generation budget: per turn, within the total
    recipe = load_recipe(None, [agent, "rollout.max_turns=3"])
    assert generation_budget(recipe) == 3 * 256
    capped = load_recipe(None, [agent, "rollout.max_turns=3", "rollout.agent.max_total_tokens=600"])
    assert generation_budget(capped) == 600


def test_asyncrl_check_prints_the_key(code: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", "--set", "rollout.workflow=agent",
         "--set", 'rollout.agent.tools=["shell"]'],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "rollout.agent.tools[0] = 'shell'" in out.stdout + out.stderr


async def test_agent_code_and_episode_functions_are_told_apart(code: Path) -> None:
    tok = build_tokenizer()
    async with ScriptedEngine(tok, ["hi"]) as engine:
        async with OpenAIEndpoint(engine, model_name="m", token="t") as ep:
            for name in ("agent", "annotated"):
                wf = workflow_from(f"{code}:{name}", endpoint=ep, group_size=3)
                assert isinstance(wf, OpenAIAgentWorkflow) and wf.group_size == 3
            with pytest.raises(SpecError, match=r"rollout\.endpoint = true"):
                workflow_from(f"{code}:agent")
            assert isinstance(workflow_from(f"{code}:episode", endpoint=ep), FunctionWorkflow)
            with pytest.raises(RecipeError, match="neither form"):
                workflow_from(f"{code}:neither")
    agent_code = load_recipe(None, [f"rollout.workflow={code}:agent"]).rollout
    assert isinstance(agent_code.workflow, AgentCodeWorkflowConfig)
    assert agent_code.workflow.fn == f"{code}:agent"
    assert agent_code.serves_endpoint
    assert not load_recipe(None, [f"rollout.workflow={code}:episode"]).rollout.serves_endpoint
    assert load_recipe(None, ["rollout.endpoint=true"]).rollout.serves_endpoint
    assert not agent_code.workflow.scores_inline(agent_code)
    agent = load_recipe(None, ["rollout.workflow=agent"]).rollout
    assert agent.workflow.scores_inline(agent)
    # the table says the same as the shorthand
    table = load_recipe(
        None, ["rollout.workflow.type=agent_code", f"rollout.workflow.fn={code}:agent"]
    )
    assert table.rollout.workflow == agent_code.workflow


async def test_the_agent_workflow_gets_the_recipes_tools_and_limits(code: Path) -> None:
    recipe = load_recipe(
        None,
        [
            "rollout.workflow=agent",
            f'rollout.agent.tools=["calculator", "python", "{code}:shout"]',
            "rollout.agent.tool_timeout=3",
            "rollout.agent.max_total_tokens=300",
            "rollout.agent.system_prompt=Use tools.",
            "rollout.max_turns=3",
        ],
    )
    tools = AgentWorkflowConfig.tools(recipe.rollout.agent)
    assert [t.name for t in tools] == ["calculator", "python", "shout"]
    assert tools[0].timeout_s == 3 and tools[2].timeout_s == 3
    assert tools[1].timeout_s == 3 + 10  # the sandbox's wall clock (3 s) ends it first
    assert await tools[2].call({"text": "hi"}) == "HI"
    tok = build_tokenizer()
    async with ScriptedEngine(tok, ["4"]) as engine:
        r = recipe.rollout
        parts = WorkflowParts(engine.tokenizer, r.sampling.params(), r.group_size, tools=tools)
        parts.reward = object()  # type: ignore[assignment]
        wf = r.workflow.build(r, parts)
    assert isinstance(wf, AgentWorkflow)
    assert (wf.max_turns, wf.max_total_tokens, wf.group_size) == (3, 300, recipe.rollout.group_size)
    env = wf.env_factory()
    start = await env.reset({"question": "q"})
    assert start.messages[0] == {"role": "system", "content": "Use tools."}
    assert [t.name for t in start.tools] == ["calculator", "python", "shout"]


async def test_agent_code_reports_the_agent_metrics_and_records_its_calls(
    code: Path, tmp_path: Path
) -> None:
    """A scripted engine calls the tool in the first reply and answers in the second, for
    both episodes of the group: 2 turns and 1 parsed call each; the agent reports 1
    success and 1 ``raised``; the endpoint's added latency is the calls' own."""
    tok = build_tokenizer()
    call = '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
    async with ScriptedEngine(tok, lambda p: "ok" if "<|tool|>" in p else call) as engine:
        async with OpenAIEndpoint(engine, model_name="m", token="t") as ep:
            wf = workflow_from(f"{code}:tool_agent", endpoint=ep, group_size=2)
            wf.record_path = tmp_path / "calls.jsonl"
            out = await wf.arun_episode(engine, {"uid": "p", "question": "q"})
    assert out is not None and len(out) == 2
    for traj in out:
        info = traj.reward_info
        assert traj.reward == 0.5
        assert (info["turns"], info["tool_calls"], info["tool_success"]) == (2, 1, 1)
        assert info["tool_errors"] == {"raised": 1} and info["tool_latency_s"] == 0.25
        assert info["endpoint_added_latency_s"] > 0
    metrics = agent_metrics(out)
    added = sum(t.reward_info["endpoint_added_latency_s"] for t in out) / 2
    assert metrics == {
        "agent/turns": 2.0,
        "agent/tool_calls": 1.0,
        "agent/tool_success": 1.0,
        "agent/tool_latency_s": 0.25,
        "agent/endpoint_added_latency_s": pytest.approx(added),
        "agent/tool_errors/raised": 2.0,
    }
    recorded = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [r["uids"] for r in recorded] == [["p/0"], ["p/1"]]
    for traj, entry in zip(out, recorded, strict=True):
        _, second = entry["calls"]
        assert second["continued_from"] == 0
        ids = second["prompt_ids"] + second["completion_ids"]
        assert traj.input_ids.numpy().tolist() == ids


def info_traj(info: dict[str, Any]) -> Trajectory:
    return Trajectory(
        uid="p/0",
        prompt_uid="p",
        group_index=0,
        group_size=1,
        input_ids=Array.of([1, 2], "int32"),
        loss_mask=Array.of([0, 1], "bool"),
        logprobs=Array.of([0.0, -1.0], "float32"),
        versions=Array.of([-1, 0], "int32"),
        reward=0.0,
        reward_info=info,
    )


def test_agent_metrics_mix_samples_that_know_tool_success_and_those_that_do_not() -> None:
    """Two built-in agent samples (3 calls, 2 ok, 0.6 s; 1 call, 0 ok, 0.2 s) and two of
    agent code that report nothing (2 parsed calls, 1 malformed; 4 turns at 0.01 s and
    2 turns at 0.04 s added per call)."""
    batch = [
        info_traj({"turns": 2, "tool_calls": 3, "tool_success": 2, "tool_errors": {"raised": 1},
                   "tool_latency_s": 0.6}),
        info_traj({"turns": 1, "tool_calls": 1, "tool_success": 0,
                   "tool_errors": {"timeout": 1}, "tool_latency_s": 0.2}),
        info_traj({"turns": 4, "tool_calls": 2, "tool_errors": {"malformed": 1},
                   "endpoint_added_latency_s": 0.01}),
        info_traj({"turns": 2, "tool_calls": 0, "tool_errors": {},
                   "endpoint_added_latency_s": 0.04}),
        info_traj({"ok": True}),  # not an agent sample
    ]  # fmt: skip
    m = agent_metrics(batch)
    assert m["agent/turns"] == pytest.approx((2 + 1 + 4 + 2) / 4)
    assert m["agent/tool_calls"] == pytest.approx((3 + 1 + 2 + 0) / 4)
    assert m["agent/tool_success"] == pytest.approx(2 / 4)  # of the 4 calls whose fate is known
    assert m["agent/tool_latency_s"] == pytest.approx(0.8 / 4)
    assert m["agent/endpoint_added_latency_s"] == pytest.approx((4 * 0.01 + 2 * 0.04) / 6)
    assert (m["agent/tool_errors/raised"], m["agent/tool_errors/timeout"]) == (1.0, 1.0)
    assert m["agent/tool_errors/malformed"] == 1.0
    assert agent_metrics([info_traj({})]) == {}


async def test_an_episode_without_a_call_fails_the_group_naming_why(code: Path) -> None:
    tok = build_tokenizer()
    async with ScriptedEngine(tok, ["x"]) as engine:
        async with OpenAIEndpoint(engine, model_name="m", token="t") as ep:
            wf = workflow_from(f"{code}:agent", endpoint=ep, group_size=2)
            with pytest.raises(RuntimeError, match="made no call to the endpoint"):
                await wf.arun_episode(engine, {"uid": "p", "question": "q"})


MCP_SERVER = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("test")


    @server.tool()
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers."""
        return a * b


    server.run()
    '''
)


async def test_a_rollout_actor_opens_mcp_tools_and_serves_the_endpoint_with_its_own_key(
    tmp_path: Path,
) -> None:
    """In a run without a NATS token the actor makes a key of its own; the MCP server and
    the endpoint live as long as the actor (teardown ends both and removes the file)."""
    import openai

    from asyncrl.actors.rollout import RolloutActor
    from asyncrl.runtime.actor import ActorContext
    from asyncrl.runtime.nats_server import NatsInfo

    server = tmp_path / "server.py"
    server.write_text(MCP_SERVER)
    recipe = load_recipe(
        None,
        [
            "rollout.workflow=agent",
            'rollout.agent.tools=["calculator"]',
            f'rollout.agent.mcp=[{{command = "{sys.executable}", args = ["{server}"]}}]',
            "rollout.endpoint=true",
        ],
    )
    ctx = ActorContext("r", tmp_path, NatsInfo(url="nats://127.0.0.1:1"), recipe, "rollout-t")
    actor = RolloutActor(ctx)
    actor.engine = ScriptedEngine(build_tokenizer(), lambda prompt: "hello")
    tools = await recipe.rollout.workflow.open_tools(recipe.rollout, actor._resources)
    assert tools is not None and [t.name for t in tools] == ["calculator", "multiply"]
    assert await tools[1].call({"a": 6, "b": 7}) == "42"
    await actor._serve_endpoint(actor.engine)
    about_file = tmp_path / "endpoints" / "rollout-t.json"
    about = json.loads(about_file.read_text())
    assert about_file.stat().st_mode & 0o777 == 0o600
    assert not about["api_key_is_run_token"] and len(about["api_key"]) >= 24
    async with openai.AsyncOpenAI(base_url=about["url"], api_key=about["api_key"]) as client:
        out = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert out.choices[0].message.content == "hello"
    await actor.teardown()
    assert not about_file.exists()
    async with openai.AsyncOpenAI(
        base_url=about["url"], api_key=about["api_key"], max_retries=0
    ) as client:
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()
