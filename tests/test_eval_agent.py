"""The eval actor on agent runs: held-out prompts become episodes of the recipe's own
workflow (tool calls run, the final answer is scored) and the record adds the tool-call
rate and success; rlvr runs are single-turn (the rlvr workflow). A scripted engine writes the
calls, so every number is known beforehand."""

from __future__ import annotations

from pathlib import Path

import pytest
from actor_helpers.eval_kit import eval_actor

from asyncrl.actors.eval import tool_metrics
from asyncrl.runtime.nats_server import NatsInfo


def call(expression: str) -> str:
    return (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        "</tool_call>"
    )


def reply(prompt_text: str) -> str:
    """Per question, with what the chat holds since the question:

    - 12 * 34: a call, then the boxed result (right: 1 call, 1 success, 2 turns);
    - 5 * 6: a wrong answer at once (no call, 1 turn);
    - 7 * 8: a malformed call (the expression unquoted), then a good call, then the
      result (right: 2 calls, 1 success, 3 turns)."""
    since = prompt_text.rsplit("What is", 1)[1]
    if since.startswith(" 12 * 34?"):
        return "\\boxed{408}" if "408" in since else call("12 * 34")
    if since.startswith(" 5 * 6?"):
        return "\\boxed{31}"
    if "56" in since:
        return "The answer is \\boxed{56}."
    if "could not be read" in since:
        return call("7 * 8")
    return '<tool_call>{"name": "calculator", "arguments": {"expression": 7 * 8}}</tool_call>'


AGENT = ["rollout.workflow=agent", "rollout.max_turns=3", 'rollout.agent.tools=["calculator"]']


def test_tool_metrics_count_parsable_calls_and_successes() -> None:
    infos = [
        {"turns": 2, "tool_calls": 1, "tool_success": 1, "tool_errors": {}},
        {"turns": 1, "tool_calls": 0, "tool_success": 0, "tool_errors": {}},
        # only a malformed call: tried, but not a parsable call
        {"turns": 2, "tool_calls": 1, "tool_success": 0, "tool_errors": {"malformed": 1}},
        {"turns": 3, "tool_calls": 3, "tool_success": 1, "tool_errors": {"unknown_tool": 2}},
    ]
    assert tool_metrics(infos) == {
        "eval/tool_call_rate": 2 / 4,
        "eval/tool_success": 2 / 5,
        "eval/turns": 8 / 4,
    }
    assert tool_metrics([]) == {}
    assert tool_metrics(infos[1:2])["eval/tool_success"] == 0.0  # no calls: no division


async def test_an_agent_run_is_evaluated_in_episodes_of_its_workflow(
    tmp_path: Path, nats_server: NatsInfo
) -> None:
    actor = await eval_actor(tmp_path, nats_server, AGENT, reply)
    out = await actor.evaluate()
    assert out["eval/accuracy"] == pytest.approx(2 / 3)
    assert out["eval/tool_call_rate"] == pytest.approx(2 / 3)
    assert out["eval/tool_success"] == pytest.approx(2 / 3)  # 3 calls, 2 succeeded
    assert out["eval/turns"] == pytest.approx((2 + 1 + 3) / 3)
    assert out["eval/clip_ratio"] == 0.0
    engine = actor.engine
    assert len(engine.requests) == 6  # one request per reply
    assert all(r.sampling.temperature == 0 for r in engine.requests)
    # the recipe's tools were shown, and no others
    first = engine.tokenizer.decode(engine.requests[0].input_ids)
    assert '"name": "calculator"' in first and '"name": "python"' not in first
    lengths = [len(o) for o in engine.outputs]
    assert out["eval/response_length"] == pytest.approx(sum(lengths) / 3)


async def test_sampled_agent_episodes_give_pass_and_mean_at_k(
    tmp_path: Path, nats_server: NatsInfo
) -> None:
    actor = await eval_actor(
        tmp_path, nats_server, [*AGENT, "eval.greedy=false", "eval.k=2"], reply
    )
    out = await actor.evaluate()
    assert out["eval/mean@2"] == pytest.approx(2 / 3) and out["eval/pass@2"] == pytest.approx(2 / 3)
    assert "eval/accuracy" not in out
    assert out["eval/tool_call_rate"] == pytest.approx(2 / 3)  # from the sampled episodes
    assert len(actor.engine.requests) == 12
    seeds = {r.sampling.seed for r in actor.engine.requests}
    assert None not in seeds and len(seeds) > 1  # each sample its own fixed seed


async def test_an_rlvr_run_is_still_evaluated_single_turn(
    tmp_path: Path, nats_server: NatsInfo
) -> None:
    actor = await eval_actor(tmp_path, nats_server, [], reply)
    out = await actor.evaluate()
    # one reply per prompt, no tools shown, no calls run: the 12 * 34 call is scored as it
    # stands (its last number is not the product)
    assert len(actor.engine.requests) == 3
    assert "calculator" not in actor.engine.tokenizer.decode(actor.engine.requests[0].input_ids)
    assert out["eval/accuracy"] == 0.0
    assert "eval/tool_call_rate" not in out
