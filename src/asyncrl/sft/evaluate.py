"""Held-out accuracy of an SFT run: one greedy answer per held-out prompt, decoded by the
``hf`` inference engine from an exported HF directory and scored by the reward function
in its worker pool, as the eval actor scores a GRPO run's published weights (the same
engine, prompt encoding and reward; here in process, without NATS).

    eval/accuracy = mean over prompts of reward(greedy answer, record)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.data.loaders import Record
from asyncrl.engines.hf import HFEngine
from asyncrl.models.resolve import ModelConfig
from asyncrl.rewards import RewardPool
from asyncrl.workflows.base import chat_messages, encode_chat


async def _greedy_accuracy(
    model_dir: Path,
    records: list[Record],
    *,
    reward: str,
    max_new_tokens: int,
    dtype: str,
    system_prompt: str | None,
) -> dict[str, float]:

    engine = HFEngine(ModelConfig(path=str(model_dir), dtype=dtype))
    await engine.start()
    try:
        tokenizer = engine.tokenizer
        greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
        async with asyncio.TaskGroup() as tg:
            gens = [
                tg.create_task(
                    engine.agenerate(
                        GenerateRequest(
                            input_ids=encode_chat(tokenizer, chat_messages(rec, system_prompt)),
                            sampling=greedy,
                        )
                    )
                )
                for rec in records
            ]
    finally:
        await engine.stop()
    texts = [tokenizer.decode(g.result().output_ids, skip_special_tokens=True) for g in gens]
    lengths = [len(g.result().output_ids) for g in gens]
    clipped = sum(g.result().finish_reason == "length" for g in gens)
    async with RewardPool(reward, workers=1) as pool:
        rewards = [(await pool.score(t, rec)).reward for t, rec in zip(texts, records, strict=True)]
    n = max(1, len(records))
    return {
        "eval/accuracy": sum(rewards) / n,
        "eval/prompts": float(len(records)),
        "eval/response_length": sum(lengths) / n,
        "eval/clip_ratio": clipped / n,
    }


def greedy_accuracy(model_dir: Path, records: list[Record], **kwargs: Any) -> dict[str, float]:
    """``eval/accuracy``, ``eval/response_length`` and ``eval/clip_ratio`` of the model in
    ``model_dir`` on ``records`` (see the module docstring). Keyword arguments: ``reward``
    (a ``reward.fn`` spec), ``max_new_tokens``, ``dtype``, ``system_prompt``."""
    return asyncio.run(_greedy_accuracy(model_dir, records, **kwargs))


__all__ = ["greedy_accuracy"]
