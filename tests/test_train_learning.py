"""Learning: GRPO with the train engine teaches a tiny random model a verifiable task.

Task: the prompt is ``[BOS, x]`` with a digit token ``x``; the model samples two tokens and
earns the share of them equal to ``x`` (copy it, twice). A random model scores ~1/16.
Sampling is plain torch on the engine's own model, so the behaviour policy is the current
policy (on-policy GRPO).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from train_helpers.tiny import one_torch_thread, tiny_config

from asyncrl.algo.advantages import group_advantages
from asyncrl.models.resolve import TINY_NAME, ModelConfig
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.engine import TrainEngine

VOCAB, BOS, DIGITS = 16, 0, range(1, 9)
GROUP, PROMPTS, NEW_TOKENS = 8, 16, 2


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@torch.no_grad()
def sample(
    engine: TrainEngine, prompts_B: torch.Tensor, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples NEW_TOKENS per prompt at temperature T: ``(ids [B, 2+N], logprobs [B, N])``."""
    engine.lm.eval()
    ids = torch.stack([torch.full_like(prompts_B, BOS), prompts_B], dim=1)
    logprobs = []
    for _ in range(NEW_TOKENS):
        logits = engine.lm(input_ids=ids).logits[:, -1].float() / engine.config.temperature
        logp_BV = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp_BV.exp(), 1, generator=g)
        logprobs.append(logp_BV.gather(1, tok))
        ids = torch.cat([ids, tok], dim=1)
    return ids, torch.cat(logprobs, dim=1)


def rewards_of(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, 2:] == ids[:, 1:2]).float().mean(dim=1)


@pytest.mark.slow
def test_grpo_learns_to_copy() -> None:
    engine = TrainEngine(
        TrainerConfig(
            optim=OptimConfig(lr=3e-3, grad_clip=1.0),
            max_tokens_per_microbatch=8192,
            loss=LossConfig(proximal="behaviour", behav_imp_weight_cap=None),
        ),
        ModelConfig(path=TINY_NAME),
        architecture=tiny_config(vocab_size=VOCAB, max_position_embeddings=16),
    )
    g = torch.Generator().manual_seed(0)
    digits = torch.tensor(list(DIGITS))

    def evaluate() -> float:
        prompts = digits.repeat(32)
        return float(rewards_of(sample(engine, prompts, g)[0]).mean())

    assert evaluate() <= 0.2
    for _ in range(200):
        prompts = digits[torch.randint(len(digits), (PROMPTS,), generator=g)].repeat_interleave(
            GROUP
        )
        ids, logprobs = sample(engine, prompts, g)
        rewards = rewards_of(ids)
        # prompts repeat GROUP times in a row: a row per group
        advantages = group_advantages(rewards.reshape(PROMPTS, GROUP)).reshape(-1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, 2:] = True
        behav = torch.zeros(ids.shape)
        behav[:, 2:] = logprobs
        batch = [Sample(ids[i], mask[i], behav[i], float(advantages[i])) for i in range(len(ids))]
        engine.train_step(batch)
        if float(rewards.mean()) >= 0.95:
            break
    assert evaluate() >= 0.9
