"""``verifiers`` environments written here, run through a real OpenAIEndpoint over a
scripted engine (known replies, so known rewards) and the hf engine on the tiny random
model: rubric rewards (group functions see the whole group), the tool round trip,
failures that score 0 with a reason, the trajectories' tokens being the engine's, loading
and its errors, and the mapping of prompt records."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from scripted_engine import ScriptedEngine, SpyHF
from workflow_kit import workflow_from

from asyncrl.api.inference import GenerateResponse, SamplingParams
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.endpoint import OpenAIEndpoint
from asyncrl.endpoint.verifiers_env import (
    VerifiersWorkflow,
    import_verifiers,
    load_verifiers_env,
    rollout_input,
    verifiers_records,
    verifiers_workflow,
)
from asyncrl.models.tiny import build_tokenizer, tiny_model_dir
from asyncrl.wire.messages import Trajectory
from asyncrl.workflows.loader import SpecError

try:
    import_verifiers()
except ImportError as exc:
    pytest.skip(f"verifiers is not usable here: {exc}", allow_module_level=True)

TOKEN = "test-token"
SYSTEM = "Answer with the number."
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

ENV_FILE = '''
import verifiers as vf
from datasets import Dataset

ROWS = [
    {"question": "2+3?", "answer": "5"},
    {"question": "4+4?", "answer": "8"},
    {"question": "1+1?", "answer": "2"},
]


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct(completion, answer) -> float:
    return 1.0 if answer in str(completion[-1].content or "") else 0.0


def group_size(completions) -> list[float]:
    return [float(len(completions))] * len(completions)


class BrokenRubric(vf.Rubric):
    async def score_group(self, states):
        raise RuntimeError("the judge is down")


class Breaks(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise KeyError("no such room")


def load_environment(kind="single", system_prompt="Answer with the number."):
    data = Dataset.from_list(ROWS)
    if kind == "single":
        # group_size is a group reward function: weight 0.1 per member of the group scored
        rubric = vf.Rubric(funcs=[correct, group_size], weights=[1.0, 0.1])
        return vf.SingleTurnEnv(dataset=data, system_prompt=system_prompt, rubric=rubric)
    if kind == "completion":
        return vf.SingleTurnEnv(
            dataset=data, system_prompt=system_prompt, rubric=vf.Rubric(funcs=[correct]),
            message_type="completion",
        )
    if kind == "tool":
        return vf.ToolEnv(dataset=data, tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]))
    if kind == "rubric_raises":
        return vf.SingleTurnEnv(dataset=data, rubric=BrokenRubric(funcs=[correct]))
    if kind == "rollout_raises":
        return Breaks(dataset=data, max_turns=3, rubric=vf.Rubric(funcs=[correct]))
    return "not an environment"
'''


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "arith_env.py"
    path.write_text(ENV_FILE)
    return path


def answers(prompt: str) -> str:
    """Right for 2+3 and 1+1, wrong for 4+4; calls ``add`` until a tool result is in."""
    if "call the tool" in prompt:
        return "The sum is 5." if "<|tool|>" in prompt else ADD_CALL
    if "EMPTY" in prompt:
        return ""
    right = {"2+3?": "It is 5.", "1+1?": "2"}
    # the question ends the chat's user turn, or the joined texts of the completions route
    return next(
        (a for q, a in right.items() if f"{q}\n<|assistant|>" in prompt or prompt.endswith(q)), "7"
    )


@pytest.fixture
async def endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with ScriptedEngine(build_tokenizer(), answers, version=3) as engine:
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN) as ep:
            yield ep


def encode(ep: OpenAIEndpoint, text: str) -> list[int]:
    return list(ep.tokenizer.encode(text, add_special_tokens=False))


def generated_spans(traj: Trajectory) -> list[list[int]]:
    """The runs of loss-mask-1 tokens, in order."""
    ids, mask = traj.input_ids.numpy().tolist(), traj.loss_mask.numpy().tolist()
    spans: list[list[int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            spans.append([])
        if m:
            spans[-1].append(ids[i])
    return spans


def assert_engine_tokens(traj: Trajectory, seen: list[GenerateResponse]) -> GenerateResponse:
    """The trajectory is exactly one engine request's prompt + output, every generated span
    is one of the engine's outputs with its logprobs and versions, and the rest is context."""
    ids = traj.input_ids.numpy().tolist()
    last = next(r for r in seen if r.input_ids + r.output_ids == ids)
    outputs = [r.output_ids for r in seen]
    assert all(span in outputs for span in generated_spans(traj))
    mask = traj.loss_mask.numpy().tolist()
    logprobs = traj.logprobs.numpy().tolist()
    versions = traj.versions.numpy().tolist()
    by_output = {tuple(r.output_ids): r for r in seen}
    start = 0
    for span in generated_spans(traj):
        start = next(
            i for i in range(start, len(ids)) if ids[i : i + len(span)] == span and mask[i]
        )
        resp = by_output[tuple(span)]
        assert logprobs[start : start + len(span)] == pytest.approx(resp.output_logprobs)
        assert versions[start : start + len(span)] == resp.output_versions
        start += len(span)
    assert all(
        lp == 0.0 and v == -1 for lp, v, m in zip(logprobs, versions, mask, strict=True) if not m
    )
    return last


async def test_single_turn_env_is_scored_by_its_rubric_over_the_whole_group(endpoint, env_file):
    ep = endpoint
    engine: ScriptedEngine = ep.engine  # type: ignore[assignment]
    workflow = verifiers_workflow(str(env_file), endpoint=ep, group_size=2)
    records = verifiers_records(workflow.env)
    assert [r["prompt"] for r in records] == ["2+3?", "4+4?", "1+1?"]
    rewards = {}
    for i, record in enumerate(records):
        trajectories = await workflow.arun_episode(engine, {"uid": f"p{i}", **record})
        assert trajectories is not None and len(trajectories) == 2
        rewards[record["prompt"]] = [t.reward for t in trajectories]
        for traj in trajectories:
            assert traj.reward_info["ok"] and traj.reward_info["calls"] == 1
            right = float(record["answer"] != "8")
            metrics = {"correct": right, "group_size": 2.0, "num_turns": 1.0}
            assert traj.reward_info["rubric_metrics"] == metrics
            last = assert_engine_tokens(traj, engine.seen)
            # the chat the environment built: its system prompt, then the question
            text = f"<|system|>{SYSTEM}\n<|user|>{record['prompt']}\n<|assistant|>"
            assert last.input_ids == encode(ep, text)
            assert traj.data["answer"] == record["answer"]
    # correct (weight 1) + 0.1 × the size of the group the group function saw (2)
    assert rewards == {
        "2+3?": [pytest.approx(1.2)] * 2,
        "4+4?": [pytest.approx(0.2)] * 2,
        "1+1?": [pytest.approx(1.2)] * 2,
    }
    assert len(engine.seen) == 6


async def test_tool_env_round_trips_a_python_tool_in_one_sample(endpoint, env_file):
    ep = endpoint
    engine: ScriptedEngine = ep.engine  # type: ignore[assignment]
    workflow = VerifiersWorkflow(ep, str(env_file), env_args={"kind": "tool"}, group_size=2)
    record = {"uid": "t", "prompt": "2+3? call the tool", "answer": "5"}
    trajectories = await workflow.arun_episode(engine, record)
    assert trajectories is not None and len(trajectories) == 2
    assert len(engine.seen) == 4  # a tool call and an answer per rollout
    for traj in trajectories:
        assert traj.reward == 1.0
        info = traj.reward_info
        assert info["tool_calls"] == 1 and info["continued_calls"] == 1 and info["samples"] == 1
        assert info["rubric_metrics"] == {
            "correct": 1.0,
            "num_turns": 2.0,
            "total_tool_calls": 1.0,
            "add_calls": 1.0,
        }
        assert_engine_tokens(traj, engine.seen)
        first, second = generated_spans(traj)
        assert first == [*encode(ep, ADD_CALL), ep.tokenizer.eos_token_id]
        assert second == [*encode(ep, "The sum is 5."), ep.tokenizer.eos_token_id]
        # the second call continued the first call's tokens: the end of the assistant turn,
        # the tool's result in the template's tool turn, the next generation prompt
        first_prompt = next(r.input_ids for r in engine.seen if r.output_ids == first)
        delta = encode(ep, "\n<|tool|>5\n<|assistant|>")
        assert traj.input_ids.numpy().tolist() == first_prompt + first + delta + second
        text = ep.tokenizer.decode(first_prompt)
        assert '"name": "add"' in text  # the environment's tool, listed by the endpoint
        assert text.endswith("<|user|>2+3? call the tool\n<|assistant|>")


@pytest.mark.filterwarnings("ignore:message_type is deprecated")
async def test_a_completion_environment_calls_the_completions_route(endpoint, env_file):
    ep = endpoint
    engine: ScriptedEngine = ep.engine  # type: ignore[assignment]
    workflow = VerifiersWorkflow(ep, str(env_file), env_args={"kind": "completion"})
    record = verifiers_records(workflow.env, limit=1)[0]
    (traj,) = await workflow.arun_episode(engine, {"uid": "c", **record}) or []
    assert traj.reward == 1.0
    last = assert_engine_tokens(traj, engine.seen)
    # /v1/completions: the chat's texts joined, no chat template
    assert last.input_ids == encode(ep, f"{SYSTEM}\n\n2+3?")


def test_sampling_args_that_change_the_recipes_sampling_are_refused_when_built(endpoint, env_file):
    """The endpoint samples at the recipe's sampling (here SamplingParams' defaults:
    temperature 1.0, top_p 1.0, top_k 0) and refuses any call that asks for another, so an
    environment that sets its own would score 0 on every rollout: the workflow refuses it
    when built, naming the recipe key; the recipe's own values (and a seed) are accepted."""
    ep = endpoint
    for args, key in [
        ({"temperature": 0.7}, "rollout.sampling.temperature"),
        ({"top_p": 0.95}, "rollout.sampling.top_p"),
        ({"extra_body": {"top_k": 50}}, "rollout.sampling.top_k"),
    ]:
        with pytest.raises(ValueError, match=re.escape(key)):
            VerifiersWorkflow(ep, str(env_file), sampling_args=args)
    same = {"temperature": 1.0, "seed": 3, "extra_body": {"top_k": 0}}
    assert VerifiersWorkflow(ep, str(env_file), sampling_args=same).sampling_args["seed"] == 3
    # an endpoint that serves each call its own sampling takes them; a penalty it cannot
    ep.sampling_mode = "per_call"
    own = {"temperature": 0.7, "top_p": 0.95, "extra_body": {"top_k": 50}}
    assert VerifiersWorkflow(ep, str(env_file), sampling_args=own).sampling_args == own
    with pytest.raises(ValueError, match="presence_penalty"):
        VerifiersWorkflow(ep, str(env_file), sampling_args={"presence_penalty": 0.5})


@pytest.mark.parametrize(
    ("args", "prompt", "reason"),
    [
        ({"kind": "rubric_raises"}, "2+3?", "the rubric raised RuntimeError: the judge is down"),
        ({"kind": "rollout_raises"}, "2+3?", "the rollout raised KeyError: 'no such room'"),
        ({}, "EMPTY", "the rollout stopped on EmptyModelResponseError"),
    ],
)
async def test_a_failing_rollout_or_rubric_scores_zero_with_the_reason(
    endpoint, env_file, args, prompt, reason
):
    ep = endpoint
    workflow = VerifiersWorkflow(ep, str(env_file), env_args=args, group_size=2)
    trajectories = await workflow.arun_episode(ep.engine, {"uid": "f", "prompt": prompt})
    assert trajectories is not None and len(trajectories) == 2
    for traj in trajectories:
        assert traj.reward == 0.0 and not traj.reward_info["ok"]
        assert reason in traj.reward_info["reason"]
        assert_engine_tokens(traj, ep.engine.seen)  # type: ignore[attr-defined]


async def test_the_hf_engine_on_the_tiny_model_trains_on_its_own_tokens(env_file):
    async with SpyHF(str(tiny_model_dir())) as engine:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=())
        async with OpenAIEndpoint(engine, model_name="tiny", token=TOKEN, sampling=sampling) as ep:
            workflow = verifiers_workflow(str(env_file), endpoint=ep, group_size=3)
            record = verifiers_records(workflow.env, limit=1)[0]
            trajectories = await workflow.arun_episode(engine, {"uid": "h", **record})
    assert trajectories is not None and len(trajectories) == 3
    assert len(engine.seen) == 3
    tokenizer = build_tokenizer()
    for traj in trajectories:
        assert_engine_tokens(traj, engine.seen)
        ids = traj.input_ids.numpy()[traj.loss_mask.numpy().astype(bool)].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        # 0.3 from the group function, plus 1 where the random characters hold the answer
        # "5"; an empty reply fails the rollout (0)
        expected = 0.3 + float("5" in text) if traj.reward_info["ok"] else 0.0
        assert traj.reward == pytest.approx(expected)


def test_records_and_rollout_inputs_follow_the_environments_formatting(env_file):
    env = load_verifiers_env(str(env_file), {"system_prompt": "Be brief."})
    (first, *_) = verifiers_records(env)
    assert first["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
    ]
    assert first["prompt"] == "2+3?" and first["answer"] == "5" and first["example_id"] == 0
    assert first["question"] == "2+3?" and first["info"] == {}
    assert rollout_input(env, first)["prompt"] == first["messages"]
    assert verifiers_records(env, split="eval", limit=2)[1]["prompt"] == "4+4?"  # train's

    env.few_shot = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]
    plain = rollout_input(env, {"prompt": "6+1?", "answer": "7", "solution": "7", "id": 9})
    system = {"role": "system", "content": "Be brief."}
    assert plain["prompt"] == [system, *env.few_shot, {"role": "user", "content": "6+1?"}]
    assert plain["answer"] == "7" and plain["info"] == {} and plain["example_id"] == 0
    assert plain["solution"] == "7" and plain["id"] == 9  # columns for reward functions
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}]
    assert rollout_input(env, {"messages": own})["prompt"] == own
    with pytest.raises(KeyError, match="no messages, prompt or question"):
        rollout_input(env, {"answer": "1"})
    with pytest.raises(ValueError, match="'train' or 'eval'"):
        verifiers_records(env, split="test")


def test_loading_by_module_hub_id_and_file_and_its_errors(
    env_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    vf = import_verifiers()
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("arith_env", "someone/arith-env", str(env_file)):
        env = load_verifiers_env(spec, {"kind": "tool"})
        assert isinstance(env, vf.ToolEnv) and env.env_args == {"kind": "tool"}
    assert load_verifiers_env(str(env_file)).env_id == "arith_env"

    (tmp_path / "no_loader.py").write_text("X = 1\n")
    cases: list[tuple[str, dict[str, Any], type[Exception], str]] = [
        ("no_loader", {}, SpecError, "has no load_environment()"),
        ("no_such_env_module", {}, SpecError, "cannot import module 'no_such_env_module'"),
        (str(tmp_path / "absent.py"), {}, SpecError, "does not exist"),
        ("arith_env", {"colour": "red"}, TypeError, "unexpected keyword argument 'colour'"),
        ("arith_env", {"kind": "other"}, TypeError, "returned a str, not a verifiers"),
    ]
    for spec, args, error, words in cases:
        with pytest.raises(error) as info:
            load_verifiers_env(spec, args)
        assert words in str(info.value), (spec, str(info.value))


def test_loading_keeps_the_processs_signal_handlers(env_file):
    def on_term(signum: int, frame: Any) -> None:
        raise AssertionError("not to be called")

    previous = signal.signal(signal.SIGTERM, on_term)
    on_int = signal.getsignal(signal.SIGINT)
    try:
        load_verifiers_env(str(env_file))  # the Environment installs its own handlers
        assert signal.getsignal(signal.SIGTERM) is on_term
        assert signal.getsignal(signal.SIGINT) is on_int
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_missing_verifiers_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # what `import` then raises on
    with pytest.raises(ImportError, match=r"pip install 'asyncrl\[agents\]'"):
        import_verifiers()


# --- the recipe: rollout.workflow = "verifiers:<env>" --------------------------------------


async def test_a_verifiers_spec_builds_the_workflow_on_the_endpoint(
    env_file: Path, endpoint: OpenAIEndpoint
) -> None:
    spec = f"verifiers:{env_file}"
    tool = 'rollout.agent.env_args={kind = "tool"}'
    assert load_recipe(None, [f"rollout.workflow={spec}"]).rollout.workflow.needs_endpoint
    built = workflow_from(spec, tool, endpoint=endpoint, group_size=3)
    assert isinstance(built, VerifiersWorkflow) and built.group_size == 3
    with pytest.raises(SpecError, match=r"rollout\.endpoint"):
        workflow_from(spec, tool, group_size=3)
    with pytest.raises(RecipeError, match=r"rollout\.workflow\.verifiers\.env"):
        workflow_from("verifiers:", endpoint=endpoint)


def test_check_refuses_a_verifiers_env_that_does_not_load_naming_the_key(
    env_file: Path, tmp_path: Path
) -> None:
    from asyncrl.config.checks import recipe_problems

    def problems(*sets: str) -> list[str]:
        return recipe_problems(load_recipe(None, list(sets)))[0]

    spec = f"rollout.workflow=verifiers:{env_file}"
    assert problems(spec) == []
    (err,) = problems(spec, 'rollout.agent.env_args={kind = "nothing"}')
    assert "rollout.agent.env_args" in err and "not a verifiers Environment" in err
    (err,) = problems(spec, "rollout.agent.env_args={colour = 1}")
    assert "rollout.workflow" in err and "colour" in err
    (err,) = problems(spec, "rollout.endpoint=false")
    assert "rollout.endpoint = false" in err
    no_loader = tmp_path / "plain.py"
    no_loader.write_text("X = 1\n")
    (err,) = problems(f"rollout.workflow=verifiers:{no_loader}")
    assert "has no load_environment()" in err
    with pytest.raises(RecipeError, match=r"rollout\.workflow: file .*missing_env\.py"):
        load_recipe(None, [f"rollout.workflow=verifiers:{tmp_path}/missing_env.py"])
    # a file named in a recipe is found beside the recipe
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[rollout]\nworkflow = "verifiers:{env_file.name}"\n')
    assert load_recipe(recipe).rollout.workflow.code() == str(env_file)
