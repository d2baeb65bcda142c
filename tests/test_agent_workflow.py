"""The agent workflow: a scripted engine makes the tool calls happen, so the trajectory can
be checked token by token (prompt + engine outputs + rendered observations, masks,
versions); the tiny random model runs the same workflow for real."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from scripted_engine import ScriptedEngine
from transformers import AutoTokenizer
from workflow_kit import workflow_from

from asyncrl.api.inference import SamplingParams
from asyncrl.api.reward import RewardResult
from asyncrl.engines.hf import HFEngine
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.observe.records import agent_metrics
from asyncrl.tools.base import function_tool
from asyncrl.tools.builtin import calculator_tool
from asyncrl.tools.calls import compact_tools_text, tools_system_text
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import Trajectory
from asyncrl.workflows.agent import AgentWorkflow, ChatFormat


class ExactAnswer:
    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        return RewardResult(1.0 if completion.strip() == data["answer"] else 0.0)


def scripted(tokenizer: Any, replies: list[str]) -> ScriptedEngine:
    """Replies with the given texts in order, logprob -0.25 per token; the version goes up
    after every reply, as if the weights were updated between turns."""
    return ScriptedEngine(tokenizer, replies, logprob=-0.25, advance_version=True)


class ToolsTemplate:
    """The tiny tokenizer behind a template that renders ``tools=`` itself and refuses the
    ``tool`` role (so results must come as a user turn)."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **kw: Any
    ) -> Any:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("no tool role")
        text = self.inner.apply_chat_template(messages, **kw)
        return f"TOOLS {json.dumps(tools)}\n{text}" if tools else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir()))


RECORD = {"uid": "p0", "prompt": "What is 123 * 4567?", "answer": "561741"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 4567"}}</tool_call>'
SP = SamplingParams(max_new_tokens=256)


def enc(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, system: str) -> list[int]:
    """RECORD's question after the system message ``system``, ready for the first reply."""
    chat = [{"role": "system", "content": system}, {"role": "user", "content": RECORD["prompt"]}]
    return enc(
        tokenizer, tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def spans_check(traj: Trajectory, generated: list[tuple[int, int]], versions: list[int]) -> None:
    mask = traj.loss_mask.numpy().astype(bool)
    expected = np.zeros_like(mask)
    for start, end in generated:
        expected[start:end] = True
    np.testing.assert_array_equal(mask, expected)
    got_versions = traj.versions.numpy()
    assert (got_versions[~mask] == -1).all() and (traj.logprobs.numpy()[~mask] == 0).all()
    assert (traj.logprobs.numpy()[mask] == -0.25).all()
    for (start, end), version in zip(generated, versions, strict=True):
        assert (got_versions[start:end] == version).all()
    assert decode(encode(traj), Trajectory) == traj


async def test_a_tool_call_trajectory_is_prompt_outputs_and_observations(tokenizer: Any) -> None:
    engine = scripted(tokenizer, [f"Let me compute. {CALL}", "561741"])
    tool = calculator_tool()
    wf = AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tools=[tool], max_turns=4)
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]

    system = tools_system_text([tool.schema()])
    prompt = prompt_ids(tokenizer, system)
    out0, out1 = engine.outputs
    # The tiny template: <|role|>content\n. The model's EOS is no part of it, so the turn
    # is closed with the template's "\n" after it.
    observation = enc(tokenizer, "\n<|tool|>561741\n<|assistant|>")
    ids = traj.input_ids.tolist()
    assert ids == prompt + out0 + observation + out1
    assert engine.requests[1].input_ids == prompt + out0 + observation  # never re-tokenized
    n0 = len(prompt) + len(out0)
    spans_check(traj, [(len(prompt), n0), (n0 + len(observation), len(ids))], versions=[0, 1])
    assert traj.reward == 1.0 and traj.completion == "561741" and traj.finish_reason == "stop"
    info = traj.reward_info
    assert (info["turns"], info["tool_calls"], info["tool_success"]) == (2, 1, 1)
    assert info["tool_errors"] == {} and info["ok"] is True


async def test_bad_calls_are_observations_and_counted(tokenizer: Any) -> None:
    replies = [
        '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{oops</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        "42",
    ]
    engine = scripted(tokenizer, replies)
    wf = AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tools=[calculator_tool()])
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    info = traj.reward_info
    assert (info["turns"], info["tool_calls"], info["tool_success"]) == (3, 3, 0)
    assert info["tool_errors"] == {"unknown_tool": 1, "malformed": 1, "bad_arguments": 1}
    assert traj.reward == 0.0
    seen = tokenizer.decode(engine.requests[1].input_ids[-40:])
    assert "no tool named 'search'" in tokenizer.decode(engine.requests[1].input_ids)
    assert seen.endswith("<|assistant|>")
    metrics = agent_metrics([traj, traj])
    assert metrics["agent/turns"] == 3 and metrics["agent/tool_calls"] == 3
    assert metrics["agent/tool_success"] == 0.0
    assert metrics["agent/tool_errors/malformed"] == 2


async def test_max_turns_ends_with_the_last_reply_scored(tokenizer: Any) -> None:
    engine = scripted(tokenizer, [CALL, CALL])
    wf = AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tools=[calculator_tool()], max_turns=2)
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    assert len(engine.requests) == 2
    assert traj.reward == 0.0 and traj.reward_info["turns"] == 2
    assert traj.reward_info["tool_calls"] == 1  # the last turn's call was not run
    assert traj.input_ids.tolist()[-len(engine.outputs[1]) :] == engine.outputs[1]


async def test_the_total_token_budget_bounds_the_sequence(tokenizer: Any) -> None:
    prompt_len = len(
        ChatFormat(tokenizer).prompt_ids(
            [{"role": "user", "content": RECORD["prompt"]}], [calculator_tool()]
        )
    )
    budget = prompt_len + len(enc(tokenizer, CALL)) + 1 + 5
    engine = scripted(tokenizer, [CALL, "561741 is the answer"])
    wf = AgentWorkflow(
        tokenizer, SP, reward=ExactAnswer(), tools=[calculator_tool()], max_total_tokens=budget
    )
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    # The observation would leave no room for a reply: the episode ends after one turn.
    assert len(engine.requests) == 1 and len(traj.input_ids.tolist()) <= budget
    assert traj.reward_info["turns"] == 1 and traj.reward == 0.0


async def test_templates_that_render_tools_and_lack_a_tool_role(tokenizer: Any) -> None:
    wrapped = ToolsTemplate(tokenizer)
    chat = ChatFormat(wrapped)
    assert chat.renders_tools and not chat.tool_role
    engine = scripted(tokenizer, [CALL, "561741"])
    wf = AgentWorkflow(wrapped, SP, reward=ExactAnswer(), tools=[calculator_tool()])
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    text = tokenizer.decode(traj.input_ids.tolist())
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "calculator"')
    assert (
        "<tool>" not in text
        and "<|user|><tool_response>\n561741\n</tool_response>\n<|assistant|>" in text
    )
    assert traj.reward == 1.0


async def test_a_plain_reward_is_one_turn(tokenizer: Any) -> None:
    engine = scripted(tokenizer, [f"561741 {CALL}"])
    wf = AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tools=(), system_prompt="Be brief.")
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    assert traj.reward == 1.0 and traj.reward_info["turns"] == 1
    assert traj.reward_info["tool_calls"] == 0
    assert "<tools>" not in tokenizer.decode(engine.requests[0].input_ids)


@pytest.fixture
async def engine() -> AsyncIterator[HFEngine]:
    async with HFEngine(str(tiny_model_dir())) as eng:
        yield eng


async def test_the_tiny_model_runs_agent_episodes(engine: HFEngine) -> None:
    def f(x: int) -> int:
        """Doubles."""
        return 2 * x

    # The tiny model has 512 positions and one token per character: a short tool, shown
    # compactly by a template that renders tools itself.
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=3)
    wf = AgentWorkflow(
        ToolsTemplate(engine.tokenizer),
        sampling,
        reward=ExactAnswer(),
        tools=[function_tool(f)],
        group_size=2,
        max_total_tokens=500,
    )
    out = await wf.arun_episode(engine, RECORD)
    assert out is not None and len(out) == 2
    for i, traj in enumerate(out):
        assert traj.uid == f"p0/{i}" and traj.reward == 0.0
        mask = traj.loss_mask.numpy().astype(bool)
        assert mask.sum() == 8 and mask[-8:].all()  # random text: no call, one turn
        assert traj.reward_info["turns"] == 1


async def test_the_recipe_name_agent_builds_it_with_the_builtin_tools(tokenizer: Any) -> None:
    wf = workflow_from(
        "agent",
        "rollout.max_turns=3",
        "rollout.agent.max_total_tokens=4096",
        tokenizer=tokenizer,
        sampling=SP,
        reward=ExactAnswer(),
        group_size=2,
    )
    assert isinstance(wf, AgentWorkflow) and (wf.group_size, wf.max_turns) == (2, 3)
    engine = scripted(tokenizer, ["561741", "561741"])
    out = await wf.arun_episode(engine, RECORD)
    assert out is not None and [t.reward for t in out] == [1.0, 1.0]
    prompt = tokenizer.decode(engine.requests[0].input_ids)
    assert '"name": "calculator"' in prompt and '"name": "python"' in prompt
    with pytest.raises(ValueError, match="unknown built-in tool 'shell'"):
        AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tools=["shell"])


def test_the_compact_listing_is_a_line_a_tool_and_one_example_call() -> None:
    schemas = [calculator_tool().schema(), function_tool(lambda: "x", name="now").schema()]
    assert compact_tools_text(schemas) == (
        "Tools:\n"
        "- calculator(expression: string): Evaluates an arithmetic expression and returns "
        "its value.\n"
        "- now()\n"
        'Call a tool like this: <tool_call>{"name": "calculator", "arguments": '
        '{"expression": "..."}}</tool_call>'
    )


async def test_a_compact_listing_replaces_the_templates_own(tokenizer: Any) -> None:
    wrapped = ToolsTemplate(tokenizer)  # a template that renders tools= itself
    engine = scripted(tokenizer, [CALL, "561741"])
    wf = workflow_from(
        "agent",
        'rollout.agent.tools=["calculator"]',
        'rollout.agent.tool_listing="compact"',
        tokenizer=wrapped,
        sampling=SP,
        reward=ExactAnswer(),
        group_size=1,
    )
    [traj] = await wf.arun_episode(engine, RECORD)  # type: ignore[misc]
    system = compact_tools_text([calculator_tool().schema()])
    prompt = prompt_ids(tokenizer, system)
    assert traj.input_ids.tolist()[: len(prompt)] == prompt  # no "TOOLS [...]" block
    assert traj.reward == 1.0 and traj.reward_info["tool_success"] == 1
    template = ChatFormat(wrapped).prompt_ids(
        [{"role": "user", "content": "q"}], [calculator_tool()]
    )
    assert tokenizer.decode(template).startswith("TOOLS [")  # the default stays the template's
    with pytest.raises(ValueError, match="tool_listing 'short'"):
        AgentWorkflow(tokenizer, SP, reward=ExactAnswer(), tool_listing="short")
