"""Environments: a reward is an environment without tools; a ToolEnv runs calls until the
model answers without one."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.api.reward import RewardResult
from asyncrl.tools.base import function_tool
from asyncrl.tools.builtin import calculator_tool
from asyncrl.tools.calls import parse_hermes
from asyncrl.workflows.tool_env import RewardEnv, ToolEnv, tool_counts


class ExactAnswer:
    """1.0 when the completion is the record's answer."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        self.seen.append(completion)
        return RewardResult(1.0 if completion == data["answer"] else 0.0)


RECORD = {"prompt": "What is 123 * 4567?", "answer": "561741"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 4567"}}</tool_call>'


async def test_a_reward_is_an_environment_without_tools() -> None:
    scorer = ExactAnswer()
    env = RewardEnv(scorer, system_prompt="Be brief.")
    first = await env.reset(RECORD)
    assert first.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 123 * 4567?"},
    ]
    assert first.tools == []
    step = await env.step(parse_hermes(f"{CALL} 561741"))  # no tools: calls are not run
    assert (step.done, step.reward, step.messages) == (True, 1.0, [])
    assert step.info == {"ok": True, "reason": ""}
    assert scorer.seen == ["561741"]


async def test_tool_env_runs_calls_then_scores_the_answer() -> None:
    scorer = ExactAnswer()
    env = ToolEnv([calculator_tool()], scorer)
    first = await env.reset(RECORD)
    assert [t.name for t in first.tools] == ["calculator"]

    step = await env.step(parse_hermes(f"Let me compute. {CALL}"))
    assert not step.done and step.reward is None
    assert step.messages == [
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "561741"}
    ]
    assert step.info["tool_calls"] == 1 and step.info["tool_success"] == 1
    assert step.info["tool_errors"] == {}

    bad = await env.step(parse_hermes('<tool_call>{"name": "nope"}</tool_call><tool_call>{oops'))
    assert not bad.done
    assert [m["tool_call_id"] for m in bad.messages] == ["call_0", "call_malformed_0"]
    assert bad.info["tool_errors"] == {"unknown_tool": 1, "malformed": 1}
    assert bad.info["tool_success"] == 0

    end = await env.step(parse_hermes("561741"))
    assert (end.done, end.reward) == (True, 1.0)
    assert scorer.seen == ["561741"]


async def test_the_last_turn_is_scored_without_running_its_calls() -> None:
    ran = asyncio.Event()

    def mark() -> str:
        """Marks that it ran."""
        ran.set()
        return "ran"

    env = ToolEnv([function_tool(mark)], ExactAnswer())
    await env.reset(RECORD)
    end = await env.step(parse_hermes('<tool_call>{"name": "mark"}</tool_call>'), last=True)
    assert (end.done, end.reward) == (True, 0.0) and not ran.is_set()


async def test_calls_of_one_turn_run_concurrently() -> None:
    both = asyncio.Barrier(2)

    async def meet(who: str) -> str:
        """Waits for the other call of the turn."""
        async with asyncio.timeout(5):
            await both.wait()
        return who

    env = ToolEnv([function_tool(meet)], ExactAnswer())
    await env.reset(RECORD)
    text = "".join(
        f'<tool_call>{{"name": "meet", "arguments": {{"who": "{w}"}}}}</tool_call>' for w in "ab"
    )
    step = await env.step(parse_hermes(text))
    assert [m["content"] for m in step.messages] == ["a", "b"]
    assert step.info["tool_success"] == 2


def test_tool_counts_of_no_results() -> None:
    assert tool_counts([]) == {
        "tool_calls": 0,
        "tool_success": 0,
        "tool_errors": {},
        "tool_latency_s": 0,
    }
