"""Workflows on the tiny random model: RLVR groups, multi-turn token-in/token-out, loading
user workflows; and SmolLM2 answering a GSM8K question end to end (slow)."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from workflow_kit import workflow_from

from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.api.reward import RewardResult
from asyncrl.config.recipe import RecipeError
from asyncrl.data import gsm8k_records, read_jsonl
from asyncrl.engines.hf import HFEngine
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.rewards import RewardPool
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.workflows.base import encode_chat
from asyncrl.workflows.code import FunctionWorkflow
from asyncrl.workflows.multi_turn import DEFAULT_FEEDBACK, MultiTurnWorkflow
from asyncrl.workflows.rlvr import RLVRWorkflow

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture
async def engine() -> AsyncIterator[HFEngine]:
    async with HFEngine(str(tiny_model_dir())) as eng:
        yield eng


class Recording:
    """Passes calls to a real engine and keeps every request and response."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[GenerateRequest, GenerateResponse]] = []

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        response = await self.engine.agenerate(request)
        self.calls.append((request, response))
        return response


class ScriptedScorer:
    """Gives the rewards of a script in order, to steer a multi-turn episode."""

    def __init__(self, rewards: list[float]) -> None:
        self.rewards = list(rewards)
        self.seen: list[tuple[str, dict[str, Any]]] = []

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        self.seen.append((completion, data))
        return RewardResult(self.rewards.pop(0))


def check_layout(traj: Trajectory, generated: list[tuple[int, int]]) -> None:
    """``generated`` = [(start, end)) spans of policy tokens; everything else is context."""
    mask = traj.loss_mask.numpy().astype(bool)
    expected = np.zeros_like(mask)
    for start, end in generated:
        expected[start:end] = True
    np.testing.assert_array_equal(mask, expected)
    assert (traj.versions.numpy()[~mask] == -1).all()
    assert (traj.versions.numpy()[mask] == 0).all()
    assert (traj.logprobs.numpy()[~mask] == 0).all()
    assert (traj.logprobs.numpy()[mask] < 0).all()
    assert decode(encode(traj), Trajectory) == traj  # survives the wire


SP = SamplingParams(max_new_tokens=12, stop_token_ids=())


async def test_rlvr_group_without_reward_leaves_scoring_to_the_reward_actor(engine: HFEngine):
    rec = Recording(engine)
    wf = RLVRWorkflow(engine.tokenizer, SP, group_size=3)
    item = {"uid": "e0-7", "prompt": "What is 1+1?", "answer": "2"}
    out = await wf.arun_episode(rec, item)  # type: ignore[arg-type]
    assert out is not None and len(out) == 3
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": "What is 1+1?"}])
    for i, traj in enumerate(out):
        assert traj.uid == f"e0-7/{i}" and traj.prompt_uid == "e0-7"
        assert (traj.group_index, traj.group_size) == (i, 3)
        assert traj.reward is None and traj.data == {"prompt": "What is 1+1?", "answer": "2"}
        assert traj.input_ids.dtype == "int32" and traj.logprobs.dtype == "float32"
        ids = traj.input_ids.tolist()
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 12
        check_layout(traj, [(len(prompt), len(ids))])
        assert traj.completion == engine.tokenizer.decode(
            ids[len(prompt) :], skip_special_tokens=True
        )
        assert traj.finish_reason == "length"
    assert engine.stats.max_decode_batch == 3  # the group was generated together


REWARD_FILE = textwrap.dedent(
    """
    def answer_is_yes(completion, data):
        return 1.0 if data["answer"] == "yes" else 0.0
    """
)


async def test_rlvr_scores_inline_with_a_reward_pool(engine: HFEngine, tmp_path: Path):
    (tmp_path / "r.py").write_text(REWARD_FILE)
    async with RewardPool(f"{tmp_path / 'r.py'}:answer_is_yes", workers=1) as pool:
        wf = RLVRWorkflow(engine.tokenizer, SP, group_size=2, reward=pool)
        yes = await wf.arun_episode(engine, Prompt(uid="p1", data={"prompt": "?", "answer": "yes"}))
        no = await wf.arun_episode(engine, {"uid": "p2", "prompt": "?", "answer": "no"})
    assert yes is not None and no is not None
    assert [t.reward for t in yes] == [1.0, 1.0] and [t.reward for t in no] == [0.0, 0.0]
    assert yes[0].reward_info == {"ok": True, "reason": ""}


async def test_seeded_groups_are_reproducible_and_distinct(engine: HFEngine):
    wf = RLVRWorkflow(engine.tokenizer, SP.model_copy(update={"seed": 11}), group_size=2)
    a = await wf.arun_episode(engine, {"uid": "u", "prompt": "hello"})
    b = await wf.arun_episode(engine, {"uid": "u", "prompt": "hello"})
    assert a is not None and b is not None
    assert [t.input_ids for t in a] == [t.input_ids for t in b]
    assert a[0].input_ids != a[1].input_ids


async def test_multi_turn_is_token_in_token_out_until_max_turns(engine: HFEngine):
    rec = Recording(engine)
    scorer = ScriptedScorer([0.0, 0.0, 0.0])
    wf = MultiTurnWorkflow(engine.tokenizer, SP, reward=scorer, max_turns=3, turn_discount=0.5)
    out = await wf.arun_episode(rec, {"uid": "m", "prompt": "2+2?", "answer": "4"})  # type: ignore[arg-type]
    assert out is not None and len(out) == 1
    traj = out[0]
    assert len(rec.calls) == 3 and len(scorer.seen) == 3
    spans = []
    for turn, (req, resp) in enumerate(rec.calls):
        start = len(req.input_ids)
        spans.append((start, start + len(resp.output_ids)))
        if turn:  # the previous turn's prompt and output, unchanged, then only new text
            prev_req, prev_resp = rec.calls[turn - 1]
            head = prev_req.input_ids + prev_resp.output_ids
            assert req.input_ids[: len(head)] == head
            between = engine.tokenizer.decode(req.input_ids[len(head) :])
            # the turn ends with "\n", less what of it the model happened to write last
            end = "\n"
            last = engine.tokenizer.decode(prev_resp.output_ids[-1:])
            if last and end.startswith(last):
                end = end[len(last) :]
            assert between == f"{end}<|user|>{DEFAULT_FEEDBACK}\n<|assistant|>"
    last_req, last_resp = rec.calls[-1]
    assert traj.input_ids.tolist() == last_req.input_ids + last_resp.output_ids
    check_layout(traj, spans)
    assert traj.reward == 0.0 and traj.reward_info["turns"] == 3
    assert scorer.seen[0][1] == {"prompt": "2+2?", "answer": "4"}


async def test_multi_turn_stops_at_the_first_positive_reward_and_discounts_it(engine: HFEngine):
    scorer = ScriptedScorer([0.0, 1.0])
    wf = MultiTurnWorkflow(engine.tokenizer, SP, reward=scorer, max_turns=4, turn_discount=0.9)
    out = await wf.arun_episode(engine, {"uid": "m2", "prompt": "hi", "answer": "x"})
    assert out is not None
    assert out[0].reward == pytest.approx(0.9)
    assert out[0].reward_info["turn_rewards"] == [0.0, 1.0]


USER_WORKFLOWS = textwrap.dedent(
    """
    from asyncrl.workflows.rlvr import RLVRWorkflow

    class Greedy(RLVRWorkflow):
        def __init__(self, tokenizer, sampling):
            super().__init__(tokenizer, sampling.model_copy(update={"temperature": 0.0}))

    def factory(tokenizer, group_size, **rest):
        return Greedy(tokenizer, rest["sampling"])

    async def episode(engine, item):
        return []
    """
)


async def test_workflows_from_names_files_and_modules(engine: HFEngine, tmp_path: Path):
    (tmp_path / "flows.py").write_text(USER_WORKFLOWS)
    options: dict[str, Any] = {"tokenizer": engine.tokenizer, "sampling": SP, "group_size": 2}
    assert isinstance(workflow_from("rlvr", **options), RLVRWorkflow)
    greedy = workflow_from(f"{tmp_path}/flows.py:Greedy", **options)
    assert isinstance(greedy, RLVRWorkflow) and greedy.sampling.temperature == 0.0
    assert type(workflow_from(f"{tmp_path}/flows.py:factory", **options)).__name__ == "Greedy"
    fn = workflow_from(f"{tmp_path}/flows.py:episode")
    assert isinstance(fn, FunctionWorkflow)
    assert await fn.arun_episode(engine, {"uid": "x"}) == []
    assert isinstance(workflow_from("asyncrl.workflows.rlvr:RLVRWorkflow", **options), RLVRWorkflow)
    with pytest.raises(RecipeError, match="not one of"):
        workflow_from("nope")
    with pytest.raises(RecipeError, match="no attribute"):
        workflow_from(f"{tmp_path}/flows.py:missing")


@pytest.mark.slow
@pytest.mark.skipif(not GSM8K_TEST.is_file(), reason="offline GSM8K copy absent")
async def test_smollm2_answers_a_gsm8k_question_through_rlvr_with_a_reward():
    record = gsm8k_records(read_jsonl(GSM8K_TEST, limit=1))[0]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48, seed=0)
    async with (
        HFEngine("smollm2-135m-instruct") as eng,
        RewardPool("math", workers=1, timeout=30.0) as pool,
    ):
        wf = RLVRWorkflow(eng.tokenizer, sampling, group_size=2, reward=pool)
        out = await wf.arun_episode(eng, {"uid": "gsm8k-0", **record})
    assert out is not None and len(out) == 2
    for traj in out:
        assert traj.reward in (0.0, 1.0) and traj.reward_info["ok"]
        assert traj.completion.strip()  # real text, not an empty answer
        assert traj.data["answer"] == "18"
        n_gen = int(traj.loss_mask.numpy().sum())
        assert 0 < n_gen <= 48 and traj.finish_reason in ("stop", "length")
