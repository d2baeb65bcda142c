"""An eval actor as its setup leaves it, on a scripted engine with the ``math`` reward in
this process and three held-out questions whose answers are known."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripted_engine import ScriptedEngine
from transformers import AutoTokenizer

from asyncrl.actors.eval import EvalActor
from asyncrl.api.reward import RewardResult
from asyncrl.config.recipe import load_recipe
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.rewards.math_reward import math_reward
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.nats_server import NatsInfo

RECORDS = [
    {"question": f"What is {a} * {b}?", "prompt": f"What is {a} * {b}?", "answer": str(a * b)}
    for a, b in ((12, 34), (5, 6), (7, 8))
]


class InlineMath:
    """The ``math`` reward in this process, with the reward pool's ``score`` and
    ``aclose``; counts its calls."""

    def __init__(self) -> None:
        self.scored = 0

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        self.scored += 1
        return RewardResult(math_reward(completion, data))

    async def aclose(self) -> None:
        pass


async def eval_actor(
    tmp_path: Path, nats: NatsInfo, overrides: list[str], reply: Callable[[str], str]
) -> EvalActor:
    """An eval actor of the recipe with ``overrides`` after ``prepare_jobs``: its engine
    answers each prompt's text with ``reply``, its records are :data:`RECORDS`."""
    recipe = load_recipe(None, ["eval.every=4", "trainer.max_steps=8", *overrides])
    actor = EvalActor(ActorContext(run_name="t", run_dir=tmp_path, nats=nats, recipe=recipe))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    actor.engine = ScriptedEngine(tokenizer, reply)
    actor.reward_pool = InlineMath()
    actor.records = [dict(r) for r in RECORDS]
    await actor.prepare_jobs()
    return actor
