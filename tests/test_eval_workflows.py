"""The eval actor on the workflows that are no single reply: agent code runs through an
endpoint of the eval's own per job, whose default sampling is the job's (greedy, or k
seeded samples) and which closes with the actor; a ``multi_turn`` run is scored on whole
episodes of feedback turns; a user's ``episode`` workflow is built with the job's sampling
and samples per prompt. A scripted engine writes the replies, so every number is known
beforehand."""

from __future__ import annotations

import asyncio
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from actor_helpers.eval_kit import eval_actor
from scripted_engine import ScriptedEngine

from asyncrl.endpoint import OpenAIAgentWorkflow
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.workflows.multi_turn import DEFAULT_FEEDBACK

USER_CODE = textwrap.dedent(
    '''
    from asyncrl.workflows.rlvr import RLVRWorkflow


    async def agent(client, data):
        """Asks, and if the reply has no boxed answer asks once more; 1 if the answer is
        the record's."""
        messages = [{"role": "user", "content": data["question"]}]
        for _ in range(2):
            out = await client.chat.completions.create(model="m", messages=messages)
            text = out.choices[0].message.content or ""
            if "boxed" in text:
                break
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "Box it."}]
        return 1.0 if f"boxed{{{data['answer']}}}" in text else 0.0


    def episode(tokenizer, sampling, group_size, reward):
        return RLVRWorkflow(tokenizer, sampling, group_size, reward)
    '''
)


def reply(prompt_text: str) -> str:
    """Per question, with what the chat holds since it:

    - 12 * 34: unboxed first, right once asked again (agent code: 2 calls, right;
      multi_turn: no boxed answer scores 0, right after the feedback);
    - 5 * 6: wrong every time (agent code: 1 call; multi_turn: every turn);
    - 7 * 8: right at once."""
    since = prompt_text.rsplit("What is", 1)[1]
    if since.startswith(" 12 * 34?"):
        asked_again = "Box it." in since or DEFAULT_FEEDBACK in since
        return "\\boxed{408}" if asked_again else "about four hundred"
    if since.startswith(" 5 * 6?"):
        return "\\boxed{31}"
    return "\\boxed{56}"


@pytest.fixture
def code(tmp_path: Path) -> Path:
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    return path


async def refused(port: int) -> bool:
    """Whether nothing listens on ``port`` of localhost any more."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def test_agent_code_is_evaluated_through_the_evals_own_endpoint(
    tmp_path: Path, nats_server: NatsInfo, code: Path
) -> None:
    actor = await eval_actor(tmp_path, nats_server, [f"rollout.workflow={code}:agent"], reply)
    (job,) = actor.jobs
    (workflow,) = job.workflows
    assert isinstance(workflow, OpenAIAgentWorkflow)
    endpoint = workflow.endpoint
    assert endpoint.sampling == job.sampling and endpoint.sampling.temperature == 0
    out = await actor.evaluate()
    assert out["eval/accuracy"] == pytest.approx(2 / 3)  # the agent's own rewards
    engine = actor.engine
    assert isinstance(engine, ScriptedEngine)
    # every call of the agent reached the engine through the endpoint: 2 + 1 + 1
    assert len(engine.requests) == 4
    assert all(r.sampling.temperature == 0 for r in engine.requests)
    assert out["eval/turns"] == pytest.approx(4 / 3)
    assert out["eval/tool_call_rate"] == 0.0
    assert actor.reward_pool.scored == 0  # the agent scored
    # an episode's length counts the tokens of all its calls
    assert out["eval/response_length"] == pytest.approx(sum(map(len, engine.outputs)) / 3)
    assert await refused(endpoint.port) is False
    await actor.teardown()
    assert await refused(endpoint.port)


async def test_sampled_agent_code_runs_each_sample_on_an_endpoint_seeded_apart(
    tmp_path: Path, nats_server: NatsInfo, code: Path
) -> None:
    """An endpoint gives every call one seed: the k samples of a prompt through one
    endpoint would be one draw k times on a seeded engine."""
    sets = [f"rollout.workflow={code}:agent", "eval.k=2", "eval.temperature=0.7"]
    actor = await eval_actor(tmp_path, nats_server, sets, reply)
    endpoints = [w.endpoint for job in actor.jobs for w in job.workflows]
    assert [len(job.workflows) for job in actor.jobs] == [1, 2]
    assert len({e.port for e in endpoints}) == 3
    out = await actor.evaluate()
    assert out["eval/accuracy"] == pytest.approx(2 / 3)
    assert out["eval/mean@2"] == pytest.approx(2 / 3) and out["eval/pass@2"] == pytest.approx(2 / 3)
    engine = actor.engine
    assert isinstance(engine, ScriptedEngine)
    assert len(engine.requests) == 4 + 2 * 4
    greedy = [r for r in engine.requests if r.sampling.temperature == 0]
    sampled = Counter(r.sampling.seed for r in engine.requests if r.sampling.temperature == 0.7)
    assert len(greedy) == 4
    # two seeds, one per sample, each taken by all 4 calls of its sample's episodes
    assert None not in sampled and sorted(sampled.values()) == [4, 4]
    again = await actor.evaluate()
    assert {k: v for k, v in again.items() if k != "_tokens"} == {
        k: v for k, v in out.items() if k != "_tokens"
    }
    repeated = Counter(r.sampling.seed for r in engine.requests[12:] if r.sampling.temperature)
    assert repeated == sampled  # the same draws at every version
    await actor.teardown()
    for e in endpoints:
        assert await refused(e.port)


async def test_a_multi_turn_run_is_evaluated_on_whole_episodes(
    tmp_path: Path, nats_server: NatsInfo
) -> None:
    actor = await eval_actor(
        tmp_path,
        nats_server,
        ["rollout.workflow=multi_turn", "rollout.max_turns=3", "rollout.turn_discount=0.5"],
        reply,
    )
    out = await actor.evaluate()
    # 12 * 34 right on the second turn (0.5), 5 * 6 never, 7 * 8 at once
    assert out["eval/accuracy"] == pytest.approx((0.5 + 0 + 1) / 3)
    engine = actor.engine
    assert isinstance(engine, ScriptedEngine)
    assert len(engine.requests) == 2 + 3 + 1
    assert all(r.sampling.temperature == 0 for r in engine.requests)
    assert actor.reward_pool.scored == 6  # each turn, inline
    assert "eval/tool_call_rate" not in out  # no tools: no tool metrics
    assert out["eval/response_length"] == pytest.approx(sum(map(len, engine.outputs)) / 3)


async def test_sampled_multi_turn_episodes_are_seeded_per_sample_and_turn(
    tmp_path: Path, nats_server: NatsInfo
) -> None:
    sets = ["rollout.workflow=multi_turn", "rollout.max_turns=3", "rollout.turn_discount=0.5"]
    actor = await eval_actor(tmp_path, nats_server, [*sets, "eval.greedy=false", "eval.k=2"], reply)
    out = await actor.evaluate()
    assert out["eval/mean@2"] == pytest.approx(0.5) and out["eval/pass@2"] == pytest.approx(2 / 3)
    requests = actor.engine.requests
    assert len(requests) == 2 * 6
    seeds = [r.sampling.seed for r in requests]
    assert None not in seeds and len(set(seeds)) == 12  # per prompt, sample and turn
    assert all(r.sampling.temperature == 1.0 for r in requests)


async def test_an_episode_workflow_is_built_with_each_jobs_sampling(
    tmp_path: Path, nats_server: NatsInfo, code: Path
) -> None:
    actor = await eval_actor(
        tmp_path,
        nats_server,
        [
            f'rollout.workflow={{type = "episode", fn = "{code}:episode"}}',
            "eval.k=3",
            "eval.temperature=0.5",
        ],
        reply,
    )
    out = await actor.evaluate()
    # single replies: 12 * 34 is unboxed (0), 5 * 6 wrong, 7 * 8 right
    assert out["eval/accuracy"] == pytest.approx(1 / 3)
    assert out["eval/mean@3"] == pytest.approx(1 / 3) and out["eval/pass@3"] == pytest.approx(1 / 3)
    requests = actor.engine.requests
    assert len(requests) == 3 + 3 * 3
    greedy = [r for r in requests if r.sampling.temperature == 0]
    sampled = [r.sampling.seed for r in requests if r.sampling.temperature == 0.5]
    assert len(greedy) == 3 and len(sampled) == 9
    assert None not in sampled and len(set(sampled)) == 9
