"""``rollout.endpoint_sampling = "per_call"``: the endpoint serves a call's own temperature,
top_p and top_k and records them; greedy calls are context, a change of sampling starts a
new sample, each sample says what it was drawn with (``sampled_with``). (The ``recipe``
mode's refusals: tests/test_endpoint.py.)"""

from __future__ import annotations

import openai
import pytest
from scripted_engine import ScriptedEngine

from asyncrl.actors.eval import eval_keys
from asyncrl.api.inference import SamplingParams
from asyncrl.endpoint import OpenAIEndpoint
from asyncrl.endpoint.recording import Call, episode_samples
from asyncrl.models.tiny import build_tokenizer
from asyncrl.wire.messages import SampledWith

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
