"""``rollout.endpoint_sampling = "per_call"``: the endpoint serves a call's own temperature,
top_p and top_k and records them; greedy calls are context, a change of sampling starts a
new sample, each sample says what it was drawn with (``sampled_with``); the trajectory a
rollout actor publishes carries it; ``asyncrl check`` refuses the key where no call goes
through the endpoint. (The ``recipe`` mode's refusals: tests/test_endpoint.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from actor_helpers.buffer_kit import context, recipe
from scripted_engine import ScriptedEngine, SpyHF

from asyncrl.actors.eval import eval_keys
from asyncrl.actors.generation import build_workflow
from asyncrl.actors.rollout import RolloutActor
from asyncrl.api.inference import SamplingParams
from asyncrl.config.checks import recipe_problems
from asyncrl.config.recipe import load_recipe
from asyncrl.endpoint import OpenAIEndpoint
from asyncrl.endpoint.recording import Call, episode_samples
from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.models.tiny import build_tokenizer, tiny_model_dir
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.codec import decode
from asyncrl.wire.messages import Prompt, SampledWith, Trajectory

TOKEN = "test-token"
RECIPE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=8)
"""A recipe's ``rollout.sampling`` as the rollout actor hands it to its endpoint."""
USER = [{"role": "user", "content": "hi"}]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0)


async def test_per_call_serves_and_records_each_calls_own_sampling() -> None:
    """What a call sends replaces the endpoint's setting for that call (top_k −1: no cut,
    0; temperature 0: greedy), what it leaves out stays the endpoint's; settings the
    engines do not implement are refused as in the recipe mode."""
    async with ScriptedEngine(build_tokenizer(), lambda _: "ok") as engine:
        async with OpenAIEndpoint(
            engine,
            model_name="tiny",
            token=TOKEN,
            sampling=RECIPE_SAMPLING,
            sampling_mode="per_call",
        ) as ep:
            async with ep.episode() as rec, client(rec.base_url) as c:
                await c.chat.completions.create(
                    model="tiny", messages=USER, temperature=0.5, extra_body={"top_k": 5}
                )
                await c.chat.completions.create(model="tiny", messages=USER, temperature=0)
                await c.completions.create(
                    model="tiny", prompt="say", top_p=0.5, extra_body={"top_k": -1}
                )
                await c.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
                for kwargs, param in (
                    ({"extra_body": {"min_p": 0.1}}, "min_p"),
                    ({"presence_penalty": 0.5}, "presence_penalty"),
                    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
                ):
                    with pytest.raises(openai.BadRequestError) as refused:
                        await c.chat.completions.create(model="tiny", messages=USER, **kwargs)
                    assert isinstance(refused.value.body, dict)
                    assert refused.value.body["param"] == param
    served = [(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) for r in engine.requests]
    assert served == [(0.5, 5, 0.9), (0.0, 20, 0.9), (1.0, 0, 0.5), (1.0, 20, 0.9)]
    assert [r.sampling.max_new_tokens for r in engine.requests] == [8, 8, 8, 3]
    assert [c.drawn for c in rec.calls] == served


async def test_a_per_call_eval_endpoint_serves_a_call_off_its_greedy_default() -> None:
    """Nothing is trained from an eval: its greedy endpoint serves a call at 0.7 in the
    per_call mode (the recipe mode refuses it naming ``eval.greedy``)."""
    greedy = RECIPE_SAMPLING.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": 0})
    async with ScriptedEngine(build_tokenizer(), lambda _: "ok") as engine:
        async with OpenAIEndpoint(
            engine,
            model_name="tiny",
            token=TOKEN,
            sampling=greedy,
            sampling_keys=eval_keys(greedy),
            sampling_mode="per_call",
        ) as ep:
            async with client(ep.base_url) as c:
                await c.chat.completions.create(model="tiny", messages=USER)
                await c.chat.completions.create(model="tiny", messages=USER, temperature=0.7)
    assert [r.sampling.temperature for r in engine.requests] == [0.0, 0.7]


def call(
    prompt: list[int],
    completion: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Call:
    """A call as the endpoint records it: logprob −0.25 and version 7 per token."""
    n = len(completion)
    return Call(
        prompt,
        completion,
        [-0.25] * n,
        [7] * n,
        "stop",
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )


def test_a_greedy_call_is_context_and_joins_any_sample() -> None:
    """Call 1 (greedy) continues call 0 (sampled at 0.5, top-k 5): its completion [6, 7] is
    context, mask 0, logprob 0, version −1; call 2 continues at call 0's sampling and
    joins too. The sample is drawn with (0.5, 5, 1.0)."""
    calls = [
        call([1, 2], [3, 4], 0.5, 5),
        call([1, 2, 3, 4, 5], [6, 7], 0.0),
        call([1, 2, 3, 4, 5, 6, 7, 8], [9], 0.5, 5),
    ]
    (sample,) = episode_samples(calls, 1.0, RECIPE_SAMPLING)
    t = sample.trace
    assert t.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert t.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert t.logprobs == [0, 0, -0.25, -0.25, 0, 0, 0, 0, -0.25]
    assert t.versions == [-1, -1, 7, 7, -1, -1, -1, -1, 7]
    assert sample.calls == [0, 1, 2]
    assert sample.sampled_with == SampledWith(temperature=0.5, top_k=5, top_p=1.0)


def test_an_episode_of_greedy_calls_trains_no_token() -> None:
    (sample,) = episode_samples([call([1, 2], [3], 0.0), call([1, 2, 3, 4], [5], 0.0)], 1.0)
    assert sample.trace.loss_mask == [0] * 5 and sample.trace.versions == [-1] * 5
    assert sample.sampled_with is None  # nothing of it is trained


def test_a_change_of_sampling_starts_a_new_sample() -> None:
    """Call 1 continues call 0 at another temperature: its own sample, whose context is its
    whole prompt; call 2 continues call 1 at call 1's sampling and joins it. Calls to go
    count as for samples that do not continue one another."""
    calls = [
        call([1, 2], [3, 4], 0.5),
        call([1, 2, 3, 4, 5], [6], 0.8),
        call([1, 2, 3, 4, 5, 6, 7], [8], 0.8),
    ]
    first, second = episode_samples(calls, 1.0)
    assert first.trace.input_ids == [1, 2, 3, 4] and first.trace.loss_mask == [0, 0, 1, 1]
    assert second.trace.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert second.trace.loss_mask == [0, 0, 0, 0, 0, 1, 0, 1]
    assert [first.calls, second.calls] == [[0], [1, 2]]
    assert [first.calls_to_go, second.calls_to_go] == [2, 0]
    assert first.sampled_with == SampledWith(temperature=0.5)
    assert second.sampled_with == SampledWith(temperature=0.8)


def test_the_endpoints_own_sampling_is_no_sampled_with() -> None:
    """Calls at the endpoint's sampling (sent or not) give the samples of the recipe mode,
    with ``sampled_with`` None; one at another sampling does not join them. A call served
    at a greedy default (an eval's greedy endpoint) is generated, not context."""
    own = RECIPE_SAMPLING
    calls = [call([1, 2], [3], 1.0, 20, 0.9), call([1, 2, 3, 4], [5], 1.0, 20, 0.9)]
    (sample,) = episode_samples(calls, 1.0, own)
    assert sample.trace.loss_mask == [0, 0, 1, 0, 1] and sample.sampled_with is None
    other = call([1, 2, 3, 4, 5, 6], [7], 1.0, 0)
    first, second = episode_samples([*calls, other], 1.0, own)
    assert second.sampled_with == SampledWith(temperature=1.0, top_k=0, top_p=1.0)
    assert first.sampled_with is None and second.calls == [2]
    greedy = SamplingParams(temperature=0.0)
    (evaluated,) = episode_samples([call([1, 2], [3, 4], 0.0)], 1.0, greedy)
    assert evaluated.trace.loss_mask == [0, 0, 1, 1] and evaluated.sampled_with is None


PER_CALL_AGENT = """
async def agent(client, data):
    messages = [{"role": "user", "content": data["question"]}]
    first = await client.chat.completions.create(
        model="m", messages=messages, temperature=0.5, seed=1, extra_body={"top_k": 5}
    )
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "again"},
    ]
    await client.chat.completions.create(model="m", messages=messages, temperature=0)
    return 1.0
"""


async def test_a_rollout_actor_publishes_the_sampling_its_agent_chose(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    """Agent code on the tiny model through a rollout actor's endpoint (per_call): a call
    at 0.5 / top-k 5, then a greedy one continuing it. The engine sampled each call as it
    asked; the scored trajectories on the stream carry (0.5, 5, 1.0), and the greedy
    call's tokens are context."""
    path = tmp_path / "agent.py"
    path.write_text(PER_CALL_AGENT)
    r = recipe(
        f"rollout.workflow={path}:agent",
        'rollout.endpoint_sampling="per_call"',
        "rollout.sampling.max_new_tokens=6",
    )
    actor = RolloutActor(context(tmp_path, nats_server, r, "r0"))
    actor._bus = await Bus.connect(nats_server, name="r0")
    engine = actor.engine = SpyHF(str(tiny_model_dir()))
    await engine.start()
    await ensure_trajectory_stream(bus, actor.subjects)
    try:
        await actor._serve_endpoint(engine)
        actor.workflow = build_workflow(
            actor,
            engine,
            r.rollout.sampling.params(),
            2,
            reward=None,
            endpoint=actor.endpoint,
            tools=None,
        )
        await actor._episode(Prompt(uid="e0-1", data={"question": "2+3"}), "lease-1")
    finally:
        await actor.bus.close()
        await actor.teardown()
    served = [(q.sampling.temperature, q.sampling.top_k) for q in engine.requests]
    assert sorted(served) == [(0.0, 0), (0.0, 0), (0.5, 5), (0.5, 5)]
    published = await scored(bus, actor)
    # one sample per episode: the greedy call continued the first, as its context
    assert sorted(t.uid for t in published) == ["e0-1/0", "e0-1/1"]
    for t in published:
        assert t.sampled_with == SampledWith(temperature=0.5, top_k=5, top_p=1.0)
        ids, mask = t.input_ids.numpy().tolist(), t.loss_mask.numpy().astype(bool)
        # the engine's calls whose prompt and output the sequence begins with (both
        # episodes make the same seeded first call)
        made = {
            q.sampling.temperature: resp
            for q, resp in zip(engine.requests, engine.seen, strict=True)
            if ids[: len(resp.input_ids) + len(resp.output_ids)] == resp.input_ids + resp.output_ids
        }
        first, greedy = made[0.5], made[0.0]
        assert ids == greedy.input_ids + greedy.output_ids
        assert [i for i, m in zip(ids, mask, strict=True) if m] == first.output_ids
        assert not mask[len(greedy.input_ids) :].any()


async def scored(bus: Bus, actor: RolloutActor) -> list[Trajectory]:
    """The scored trajectories on the run's stream."""
    s = actor.subjects
    state = (await bus.js.stream_info(s.stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(s.stream, seq)
        assert msg.subject == s.scored and msg.data is not None
        out.append(decode(msg.data, Trajectory))
    return out


def test_check_refuses_per_call_where_no_call_goes_through_the_endpoint(
    tmp_path: Path,
) -> None:
    per_call = 'rollout.endpoint_sampling="per_call"'
    for workflow in ("rlvr", "multi_turn", "agent"):
        errors, _ = recipe_problems(load_recipe(None, [f"rollout.workflow={workflow}", per_call]))
        assert len(errors) == 1, errors
        assert "rollout.endpoint_sampling" in errors[0] and repr(workflow) in errors[0]
    agent = tmp_path / "agent.py"
    agent.write_text("async def agent(client, data):\n    return 1.0\n")
    episode = tmp_path / "episode.py"
    episode.write_text("async def episode(engine, item):\n    return []\n")
    fine: list[Any] = [
        [f"rollout.workflow={agent}:agent"],
        [f"rollout.workflow={episode}:episode", "rollout.endpoint=true"],
    ]
    for sets in fine:
        assert recipe_problems(load_recipe(None, [*sets, per_call]))[0] == [], sets
    (err,) = recipe_problems(load_recipe(None, [f"rollout.workflow={episode}:episode", per_call]))[
        0
    ]
    assert "rollout.endpoint_sampling" in err
    assert load_recipe(None).rollout.endpoint_sampling == "recipe"
