"""End to end: a ``verifiers`` environment written here trains the ci recipe's tiny model
through ``asyncrl up``, its rollouts going through the rollout actor's endpoint.

The recipe names the environment's file as ``rollout.workflow = "verifiers:<file>"``. The
environment's rubric rewards a reply that begins with a digit, the ci task; prompts are
the recipe's arithmetic records, mapped to the environment's chat. Every trained sample
must be the tokens the endpoint recorded for its episode, and its reward the rubric's
verdict on the text those tokens decode to.

About a minute on two cores (the rollout actor also imports ``verifiers``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from e2e_kit import running_up, up_args
from test_e2e_agent import STEPS, agent_sets, check_trained_tokens_are_the_endpoints, read_jsonl

from asyncrl.endpoint.verifiers_env import import_verifiers
from asyncrl.models.tiny import build_tokenizer
from asyncrl.observe.records import token_digest

pytestmark = pytest.mark.slow

try:
    import_verifiers()
except ImportError as exc:
    pytest.skip(f"verifiers is not usable here: {exc}", allow_module_level=True)

ENV = """
import verifiers as vf
from datasets import Dataset


def starts_with_digit(completion) -> float:
    return 1.0 if str(completion[-1].content or "")[:1].isdigit() else 0.0


def load_environment():
    data = Dataset.from_list([{"question": "1+1", "answer": "2"}])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[starts_with_digit]))
"""


async def test_a_verifiers_environment_trains_on_the_endpoints_tokens(tmp_path: Path) -> None:
    env_file = tmp_path / "digit_env.py"
    env_file.write_text(ENV)
    argv = up_args(tmp_path, "vf", *agent_sets(f"verifiers:{env_file}"))
    async with running_up(tmp_path, "vf", argv=argv) as up:
        code = await asyncio.wait_for(up.proc.wait(), 420)
    assert code == 0
    trained = check_trained_tokens_are_the_endpoints(up.run_dir)
    metrics = read_jsonl(up.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # the reward is the rubric's verdict on the text of the recorded completion
    tokenizer = build_tokenizer()
    verdicts = {}
    for line in (up.run_dir / "endpoint_calls.jsonl").read_text().splitlines():
        entry = json.loads(line)
        (call,) = entry["calls"]  # a single-turn environment: one call per episode,
        (uid,) = entry["uids"]  # one sample
        text = tokenizer.decode(call["completion_ids"], skip_special_tokens=True)
        digest = token_digest(call["prompt_ids"] + call["completion_ids"])
        verdicts[(uid, digest)] = 1.0 if text[:1].isdigit() else 0.0
    for sample in trained:
        assert sample["reward"] == verdicts[(sample["uid"], sample["tokens_sha1"])]
