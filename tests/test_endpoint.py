"""The OpenAI-compatible endpoint: the real ``openai`` client (and the Agents SDK) against
the hf engine on the tiny random model or a scripted engine; exact token recording,
continued prompts without re-tokenization, samples, auth and bad requests, the workflow."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from scripted_engine import ScriptedEngine, SpyHF

from asyncrl.actors.eval import eval_keys
from asyncrl.api.inference import SamplingParams
from asyncrl.endpoint import Call, OpenAIAgentWorkflow, OpenAIEndpoint, episode_samples
from asyncrl.endpoint.chat import ChatRenderer, TemplateTraits, normalize_message
from asyncrl.models.tiny import build_tokenizer, tiny_model_dir
from asyncrl.tools.calls import tools_system_text

TOKEN = "test-token"
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SHORT_TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
"""A tool whose listing fits the tiny model's 512 positions."""
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def scripted(reply: Callable[[str], str]) -> ScriptedEngine:
    """Replies with ``reply(prompt text)`` tokenized by the tiny tokenizer, then ``<eos>``;
    logprob -0.5 per token, version 3."""
    return ScriptedEngine(build_tokenizer(), reply, version=3)


def tool_then_answer(prompt: str) -> str:
    """Calls ``add`` first; answers once a tool result is in the prompt."""
    return "The sum is 5." if "<|tool|>" in prompt else ADD_CALL


@pytest.fixture
async def hf_endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with SpyHF(str(tiny_model_dir())) as engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=())
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN, sampling=sampling) as ep:
            yield ep


@pytest.fixture
async def scripted_endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with scripted(tool_then_answer) as engine:
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN) as ep:
            yield ep


def client(url: str, token: str = TOKEN) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=token, max_retries=0)


def encode(ep: OpenAIEndpoint, text: str) -> list[int]:
    return list(ep.tokenizer.encode(text, add_special_tokens=False))


async def test_models_chat_and_completions_record_the_engines_tokens(hf_endpoint):
    ep = hf_endpoint
    engine: SpyHF = ep.engine  # type: ignore[assignment]
    async with client(ep.base_url) as plain:
        models = await plain.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        await plain.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
    async with ep.episode() as rec, client(rec.base_url) as c:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+3?"}]
        first = await c.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[SHORT_TOOL],
            seed=1,  # type: ignore[list-item]
        )
        reply = first.choices[0].message
        assert reply.role == "assistant" and reply.tool_calls is None
        assert first.usage is not None
        assert first.usage.completion_tokens == len(engine.seen[-1].output_ids)
        messages += [
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "call_x", "content": "5"},
        ]
        second = await c.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[SHORT_TOOL],
            max_tokens=5,  # type: ignore[arg-type]
        )
        assert second.choices[0].finish_reason == "length"
        text = await c.completions.create(model="tiny", prompt="1+1=", max_tokens=4)
        await c.completions.create(model="tiny", prompt=[7, 8, 9], max_tokens=3)
    calls = rec.calls
    assert len(calls) == 4  # the call outside the episode is recorded nowhere
    for call, resp in zip(calls, engine.seen[1:], strict=True):
        assert call.prompt_ids == resp.input_ids
        assert call.completion_ids == resp.output_ids
        assert call.logprobs == resp.output_logprobs and call.versions == resp.output_versions
    c1, c2 = calls[0], calls[1]

    system = tools_system_text([SHORT_TOOL["function"]])
    expected_first = f"<|system|>{system}\n<|user|>What is 2+3?\n<|assistant|>"
    assert c1.prompt_ids == encode(ep, expected_first)
    # the tiny template closes an assistant turn with "\n"; the model stopped on length,
    # so all of it is added, then the tool turn and the next generation prompt
    delta = encode(ep, "\n<|tool|>5\n<|assistant|>")
    assert c2.continued_from == 0
    assert c2.prompt_ids == c1.prompt_ids + c1.completion_ids + delta
    assert len(c2.completion_ids) == 5
    assert text.choices[0].text == ep.tokenizer.decode(
        calls[2].completion_ids, skip_special_tokens=True
    )
    assert calls[2].prompt_ids == encode(ep, "1+1=") and calls[3].prompt_ids == [7, 8, 9]

    (merged, *rest) = episode_samples(calls[:2], 1.0)
    assert not rest
    t = merged.trace
    assert t.input_ids == c2.prompt_ids + c2.completion_ids
    n1, g1, nd, g2 = len(c1.prompt_ids), len(c1.completion_ids), len(delta), len(c2.completion_ids)
    assert t.loss_mask == [0] * n1 + [1] * g1 + [0] * nd + [1] * g2
    assert t.logprobs == [0.0] * n1 + c1.logprobs + [0.0] * nd + c2.logprobs
    assert t.versions == [-1] * n1 + [0] * g1 + [-1] * nd + [0] * g2


def call(prompt: list[int], completion: list[int], finish: str = "stop") -> Call:
    n = len(completion)
    return Call(prompt, completion, [-0.25] * n, [7] * n, finish)


def test_episode_samples_merge_extensions_split_the_rest_and_count_calls_to_go():
    calls = [
        call([1, 2], [3, 4]),
        call([1, 2, 3, 4, 5], [6]),  # extends call 0 by one context token
        call([9], [8, 7]),  # a fresh prompt: a new sample
        call([9, 8], [5]),  # not an extension of [9, 8, 7]: a new sample
    ]
    samples = episode_samples(calls, 2.0)
    assert [s.calls for s in samples] == [[0, 1], [2], [3]]
    first = samples[0].trace
    assert first.input_ids == [1, 2, 3, 4, 5, 6]
    assert first.loss_mask == [0, 0, 1, 1, 0, 1]
    assert first.logprobs == [0.0, 0.0, -0.25, -0.25, 0.0, -0.25]
    assert first.versions == [-1, -1, 7, 7, -1, 7]
    # 4 calls: every sample has the episode's reward; one ending at call e has 3 − e to go
    assert [s.reward for s in samples] == [2.0, 2.0, 2.0]
    assert [s.calls_to_go for s in samples] == [2, 1, 0]
    assert episode_samples([], 1.0) == []


async def test_tool_calls_in_openais_shape_and_malformed_ones_as_content():
    replies = {"good": ADD_CALL, "bad": '<tool_call>{"name": "add", "arguments": </tool_call>'}

    def reply(prompt: str) -> str:
        return replies["bad" if "BAD" in prompt else "good"]

    async with scripted(reply) as engine:
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN) as ep:
            async with ep.episode() as rec, client(rec.base_url) as c:
                good = await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "add 2 and 3"}],
                    tools=[ADD_TOOL],  # type: ignore[list-item]
                )
                bad = await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "BAD"}],
                    tools=[ADD_TOOL],  # type: ignore[list-item]
                )
                none = await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "add"}],
                    tools=[ADD_TOOL],  # type: ignore[list-item]
                    tool_choice="none",
                )
    choice = good.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (tc,) = choice.message.tool_calls or []
    assert tc.type == "function" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert re.fullmatch(r"call_[0-9a-f]{12}", tc.id)
    assert bad.choices[0].finish_reason == "stop"
    assert bad.choices[0].message.tool_calls is None
    assert bad.choices[0].message.content == replies["bad"]
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == ADD_CALL
    assert [c.malformed_tool_calls for c in rec.calls] == [0, 1, 0]
    assert rec.metrics()["tool_calls"] == 1 and rec.metrics()["malformed_tool_calls"] == 1


async def test_auth_and_bad_requests_get_openai_errors(scripted_endpoint):
    ep = scripted_endpoint
    assert ep._runner is not None and ep._runner.addresses[0][0] == "127.0.0.1"
    with pytest.raises(ValueError, match=r"127\.0\.0\.1"):
        OpenAIEndpoint(ep.engine, model_name="x", token=TOKEN, host="0.0.0.0")
    for token in ("wrong", ""):
        async with client(ep.base_url, token=token or "none") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()
    user = [{"role": "user", "content": "hi"}]
    url = f"{ep.base_url}/chat/completions"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases: list[tuple[dict[str, str], Any, int, str]] = [
        ({}, {"messages": user}, 401, "API key"),
        (auth, "{not json", 400, "not JSON"),
        (auth, [1, 2], 400, "JSON object"),
        (auth, {"messages": user, "n": 2}, 400, "n must be 1"),
        (auth, {"messages": user, "stream": True}, 400, "stream"),
        (auth, {"messages": user, "tool_choice": "required"}, 400, "tool_choice"),
        (auth, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (auth, {"messages": user, "max_tokens": 10**6}, 400, "cap"),
        (auth, {"messages": user, "temperature": "hot"}, 400, "temperature"),
        (auth, {"messages": user, "tools": [{"type": "web"}]}, 400, "tool"),
        (auth, {"messages": []}, 400, "messages"),
    ]
    async with aiohttp.ClientSession() as http:
        for headers, body, status, words in cases:
            data = body if isinstance(body, str) else json.dumps(body)
            async with http.post(url, data=data, headers=headers) as resp:
                assert resp.status == status, (body, await resp.text())
                error = (await resp.json())["error"]
                assert words in error["message"], (body, error)
        closed = ep.base_url.replace("/v1", "/episodes/nope/v1")
        async with http.post(
            f"{closed}/chat/completions", json={"messages": user}, headers=auth
        ) as r:
            assert r.status == 404 and "not open" in (await r.json())["error"]["message"]
        async with http.post(
            f"{ep.base_url}/completions", json={"prompt": [10**9]}, headers=auth
        ) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"


async def test_a_stop_string_cuts_text_and_tokens():
    async with scripted(lambda _: "hello STOP world") as engine:
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN) as ep:
            rec = ep.open_episode("ep-1")
            async with client(rec.base_url) as c:
                out = await c.completions.create(model="tiny", prompt="say", stop=["STOP"])
                (recorded,) = ep.close_episode("ep-1")
                with pytest.raises(openai.NotFoundError):  # a closed episode records nothing
                    await c.completions.create(model="tiny", prompt="say")
    assert out.choices[0].text == "hello " and out.choices[0].finish_reason == "stop"
    assert recorded.completion_ids == encode(ep, "hello STOP")
    assert recorded.logprobs == [-0.5] * len("hello STOP")


RECIPE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=8)
"""A recipe's ``rollout.sampling`` as the rollout actor hands it to its endpoint."""


async def test_a_call_that_changes_the_sampling_is_refused_before_the_engine():
    """The trainer scores every token with the recipe's sampling, so a call that samples
    otherwise would be trained with the wrong behaviour logprobs: logits [2, 1, 0] give
    π = softmax([2, 1, 0]) = [0.665, 0.245, 0.090] at T = 1 and μ = softmax([2, 1, 0] / 0.7)
    = [17.41, 4.17, 1] / 22.58 = [0.771, 0.185, 0.044] at T = 0.7, importance weights π/μ =
    [0.86, 1.33, 2.03] that nothing flags. Each of these calls gets 400 naming the recipe key
    (greedy, temperature 0, too), and neither the engine nor the episode sees it."""
    refused: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 0.7}, "rollout.sampling.temperature"),
        ({"temperature": 0.0}, "rollout.sampling.temperature"),
        ({"top_p": 0.5}, "rollout.sampling.top_p"),
        ({"top_p": 1.0}, "rollout.sampling.top_p"),  # no cut, where the recipe cuts at 0.9
        ({"extra_body": {"top_k": 5}}, "rollout.sampling.top_k"),
        ({"extra_body": {"top_k": -1}}, "rollout.sampling.top_k"),  # vLLM's "no cut"
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
    ]
    user = [{"role": "user", "content": "hi"}]
    async with scripted(lambda _: "ok") as engine:
        async with OpenAIEndpoint(
            engine, model_name="tiny", token=TOKEN, sampling=RECIPE_SAMPLING
        ) as ep:
            async with ep.episode() as rec, client(rec.base_url) as c:
                for kwargs, key in refused:
                    with pytest.raises(openai.BadRequestError) as chat:
                        await c.chat.completions.create(model="tiny", messages=user, **kwargs)
                    with pytest.raises(openai.BadRequestError) as completion:
                        await c.completions.create(model="tiny", prompt="say", **kwargs)
                    for err in (chat.value, completion.value):
                        assert err.status_code == 400 and key in err.message, (kwargs, err)
                        assert isinstance(err.body, dict), err
                        assert err.body["type"] == "invalid_request_error"
                        assert err.body["param"] == key.rsplit(".", 1)[-1]
                assert engine.requests == [] and rec.calls == []


async def test_a_call_at_the_recipes_sampling_or_with_a_seed_is_served():
    """Values equal to the recipe's are accepted, absent ones take the recipe's, and a seed
    or a smaller budget (which leave the distribution alone) reach the engine: the four
    calls sample at temperature 1.0, top_p 0.9, top_k 20, seeds [None, 7, None, None] and
    budgets [8, 8, 3, 8]."""
    user = [{"role": "user", "content": "hi"}]
    async with scripted(lambda _: "ok") as engine:
        async with OpenAIEndpoint(
            engine, model_name="tiny", token=TOKEN, sampling=RECIPE_SAMPLING
        ) as ep:
            async with ep.episode() as rec, client(rec.base_url) as c:
                await c.chat.completions.create(model="tiny", messages=user)
                await c.chat.completions.create(
                    model="tiny",
                    messages=user,
                    temperature=1.0,
                    top_p=0.9,
                    seed=7,
                    extra_body={"top_k": 20, "min_p": 0.0},
                )
                await c.completions.create(model="tiny", prompt="say", temperature=1, max_tokens=3)
                await c.chat.completions.create(model="tiny", messages=user, presence_penalty=0)
    got = [r.sampling for r in engine.requests]
    assert [(s.temperature, s.top_p, s.top_k) for s in got] == [(1.0, 0.9, 20)] * 4
    assert [s.seed for s in got] == [None, 7, None, None]
    assert [s.max_new_tokens for s in got] == [8, 8, 3, 8]
    assert len(rec.calls) == 4


async def test_an_eval_endpoint_serves_its_greedy_default_and_names_eval_keys():
    """The eval actor's greedy endpoint samples at temperature 0 by default: a call that
    leaves the temperature out, or sends 0, is served greedily; one at 0.7 is refused naming
    ``eval.greedy``, since that is the setting that made this endpoint greedy."""
    greedy = RECIPE_SAMPLING.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": 0})
    user = [{"role": "user", "content": "hi"}]
    async with scripted(lambda _: "ok") as engine:
        async with OpenAIEndpoint(
            engine,
            model_name="tiny",
            token=TOKEN,
            sampling=greedy,
            sampling_keys=eval_keys(greedy),
        ) as ep:
            async with client(ep.base_url) as c:
                await c.chat.completions.create(model="tiny", messages=user)
                await c.chat.completions.create(model="tiny", messages=user, temperature=0)
                with pytest.raises(openai.BadRequestError, match=r"eval\.greedy"):
                    await c.chat.completions.create(model="tiny", messages=user, temperature=0.7)
    assert [r.sampling.temperature for r in engine.requests] == [0.0, 0.0]


AGENT_FILE = """
import json


async def agent(client, data):
    tools = [{TOOL}]
    messages = [{{"role": "user", "content": data["question"]}}]
    first = await client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        args = json.loads(call.function.arguments)
        if data.get("explode"):
            raise RuntimeError("the tool broke")
        result = str(args["a"] + args["b"])
        messages.append({{"role": "tool", "tool_call_id": call.id, "content": result}})
    final = await client.chat.completions.create(model="tiny", messages=messages, tools=tools)
    return 1.0 if "5" in (final.choices[0].message.content or "") else 0.0
"""


async def test_agent_file_through_the_workflow_trains_on_the_recorded_tokens(
    scripted_endpoint, tmp_path: Path
):
    ep = scripted_endpoint
    engine: ScriptedEngine = ep.engine  # type: ignore[assignment]
    path = tmp_path / "agent.py"
    path.write_text(AGENT_FILE.format(TOOL=json.dumps(ADD_TOOL)))
    workflow = OpenAIAgentWorkflow(ep, f"{path}:agent", group_size=2)
    trajectories = await workflow.arun_episode(engine, {"uid": "p1", "question": "2+3?"})
    assert trajectories is not None and len(trajectories) == 2
    assert len(engine.seen) == 4  # two calls per episode
    generated = {tuple(r.output_ids) for r in engine.seen}
    for traj in trajectories:
        assert traj.reward == 1.0 and traj.group_size == 2
        info = traj.reward_info
        assert info["samples"] == 1 and info["calls"] == 2 and info["continued_calls"] == 1
        assert info["tool_calls"] == 1 and info["ok"]
        ids = traj.input_ids.numpy().tolist()
        mask = traj.loss_mask.numpy().tolist()
        # the whole sequence is the last engine request's prompt + its output, and each
        # generated span is exactly one of the engine's outputs
        last = next(r for r in engine.seen if r.input_ids + r.output_ids == ids)
        assert ids[: len(last.input_ids)] == last.input_ids
        spans, start = [], None
        for i, m in enumerate([*mask, 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append(tuple(ids[start:i]))
                start = None
        assert len(spans) == 2 and all(s in generated for s in spans)
        versions = traj.versions.numpy().tolist()
        assert {v for v, m in zip(versions, mask, strict=True) if m} == {3}

    failing = await workflow.arun_episode(engine, {"uid": "p2", "question": "?", "explode": 1})
    assert failing is not None
    for traj in failing:
        assert traj.reward == 0.0 and not traj.reward_info["ok"]
        assert "RuntimeError: the tool broke" in traj.reward_info["reason"]
        assert traj.reward_info["calls"] == 1


async def test_an_openai_agents_sdk_agent_runs_against_the_endpoint(scripted_endpoint):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ep = scripted_endpoint
    used: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        used.append((a, b))
        return a + b

    async with ep.episode() as rec, client(rec.base_url) as c:
        model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=c)
        agent = agents.Agent(name="adder", instructions="Add numbers.", model=model, tools=[add])
        result = await agents.Runner.run(agent, "What is 2+3?")
    assert used == [(2, 3)]
    assert "5" in str(result.final_output)
    assert len(rec.calls) == 2
    first, second = rec.calls
    assert first.tool_calls == 1
    assert second.continued_from == 0
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids
    )
    (sample,) = episode_samples(rec.calls, 1.0)
    assert sample.trace.input_ids == second.prompt_ids + second.completion_ids


async def test_a_continued_prompt_keeps_sampled_tokens_that_the_text_loses():
    # the reply holds a special token: the client sees "ab cd", whose encoding lacks it
    async with scripted(lambda _: "ab<|system|> cd") as engine:
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN) as ep:
            async with ep.episode() as rec, client(rec.base_url) as c:
                messages: list[Any] = [{"role": "user", "content": "q"}]
                first = await c.chat.completions.create(model="tiny", messages=messages)
                assert first.choices[0].message.content == "ab cd"
                messages += [
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "again"},
                ]
                await c.chat.completions.create(model="tiny", messages=messages)
                # the same chat from another start is not a continuation: rendered fresh
                await c.chat.completions.create(model="tiny", messages=messages[1:])
    c1, c2, c3 = rec.calls
    assert c1.completion_ids == [*encode(ep, "ab<|system|> cd"), engine.tokenizer.eos_token_id]
    # the model stopped on <eos>; the template's "\n" end of turn is still to come
    assert c2.prompt_ids == c1.prompt_ids + c1.completion_ids + encode(
        ep, "\n<|user|>again\n<|assistant|>"
    )
    fresh = encode(ep, "<|user|>q\n<|assistant|>ab cd\n<|user|>again\n<|assistant|>")
    assert c2.prompt_ids != fresh
    assert c3.continued_from is None
    assert c3.prompt_ids == encode(ep, "<|assistant|>ab cd\n<|user|>again\n<|assistant|>")


def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from asyncrl.models.resolve import resolve_model_path

    path = Path(resolve_model_path("smollm2-135m-instruct"))
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip("the offline SmolLM2-135M copy is absent")
    return AutoTokenizer.from_pretrained(path)


def test_smollm2_continuation_skips_the_im_end_the_model_generated():
    tok = smollm2_tokenizer()
    renderer = ChatRenderer(tok)
    assert renderer.traits == TemplateTraits(
        renders_tools=False, renders_tool_calls=False, has_tool_role=True
    )
    previous = [normalize_message({"role": "user", "content": "2+3?"})]
    new = [normalize_message({"role": "tool", "tool_call_id": "c", "content": "5"})]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    generated = [*tok.encode("Hi", add_special_tokens=False), im_end]
    tail = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    delta = renderer.continuation_ids(previous, new, None, generated, stopped=True)
    assert delta == tok.encode(tail, add_special_tokens=False)
    # cut by length, the model wrote no <|im_end|>: the whole end of turn is added
    cut = renderer.continuation_ids(previous, new, None, generated[:1], stopped=False)
    assert cut == tok.encode("<|im_end|>" + tail, add_special_tokens=False)


TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>TOOLS {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_through_its_own_argument():
    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    renderer = ChatRenderer(tok)
    assert renderer.traits == TemplateTraits(True, True, True)
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
        ],
    }
    messages = [normalize_message(m) for m in ({"role": "user", "content": "q"}, reply)]
    text = renderer.render(messages, [ADD_TOOL], generation_prompt=True)
    # (HF renders templates with trim_blocks: no newline after a block tag)
    assert text == '<|system|>TOOLS add <|user|>q<|assistant|>CALL add{"a": 2}<|assistant|>'
    # the tiny template renders neither: the listing goes to the system turn, calls to text
    plain = ChatRenderer(build_tokenizer())
    text = plain.render(messages, [ADD_TOOL], generation_prompt=False)
    listing = tools_system_text([ADD_TOOL["function"]])
    assert text == (
        f"<|system|>{listing}\n<|user|>q\n"
        '<|assistant|><tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n'
    )


async def test_a_stopped_engine_answers_503_and_the_workflow_drops_the_group(
    scripted_endpoint, tmp_path: Path
):
    ep = scripted_endpoint
    await ep.engine.stop()
    path = tmp_path / "agent.py"
    path.write_text(AGENT_FILE.format(TOOL=json.dumps(ADD_TOOL)))
    workflow = OpenAIAgentWorkflow(ep, f"{path}:agent", group_size=2)
    assert await workflow.arun_episode(ep.engine, {"uid": "p", "question": "?"}) is None
    async with ep.episode() as rec, client(rec.base_url) as c:
        with pytest.raises(openai.InternalServerError, match="503"):
            await c.completions.create(model="tiny", prompt="x")
    assert rec.aborted and rec.calls == []
