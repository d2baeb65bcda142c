"""Tiny random models and synthetic batches for the train-engine tests."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncrl.config.schema import DType
from asyncrl.models.resolve import TINY_NAME, ModelConfig
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.engine import TrainEngine
from asyncrl.wire.messages import SampledWith

VOCAB = 128


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Runs torch single-threaded. Tiny models gain nothing from a second thread, and on a
    shared, loaded machine OpenMP's spinning workers made each step up to 100× slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_within(got: torch.Tensor, want: torch.Tensor, rel: float, what: str = "") -> None:
    """``got`` equals ``want`` to ``rel`` of ``want``'s largest magnitude."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    err = float((got - want).detach().abs().max()) if want.numel() else 0.0
    assert err <= rel * scale, f"{what}: max error {err:.3g} against scale {scale:.3g}"


def tiny_config(kind: str = "llama", **overrides: Any) -> Any:
    """A 2-layer model of the given family with a 128-token vocabulary."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return cls(**fields)


def random_batch(
    seed: int,
    lengths: list[int] | tuple[int, ...] = (7, 12, 5, 16, 9, 3),
    *,
    per_token_adv: bool = False,
) -> list[Sample]:
    """Sequences whose second half is "generated", with plausible behaviour logprobs
    (around −4.8, the uniform logprob of a 128 vocab) and random advantages."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[max(1, n // 2) :] = True
        behav = torch.where(mask, -4.8 + 0.3 * torch.randn(n, generator=g), 0.0)
        adv: Any = (
            torch.randn(n, generator=g) if per_token_adv else float(torch.randn(1, generator=g))
        )
        batch.append(Sample(ids, mask, behav, adv))
    return batch


def group_batch(
    seed: int,
    sizes: list[int] | tuple[int, ...] = (4, 1, 8),
    *,
    prompt: tuple[int, int] = (18, 30),
    answer: tuple[int, int] = (2, 12),
) -> list[Sample]:
    """GRPO groups as :func:`~asyncrl.train.batch.build_samples` gives them: group ``k``
    is ``sizes[k]`` consecutive samples (``group = k``, each its own episode) of one random
    prompt (length drawn from ``prompt``) and each its own answer (from ``answer``), the
    loss on the answer."""
    g = torch.Generator().manual_seed(seed)

    def draw(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (1,), generator=g))

    batch = []
    for k, size in enumerate(sizes):
        head = torch.randint(0, VOCAB, (draw(prompt),), generator=g)
        for _ in range(size):
            tail = torch.randint(0, VOCAB, (draw(answer),), generator=g)
            mask = torch.cat(
                [torch.zeros(len(head), dtype=torch.bool), torch.ones(len(tail), dtype=torch.bool)]
            )
            behav = torch.where(mask, -4.8 + 0.3 * torch.randn(len(mask), generator=g), 0.0)
            adv = float(torch.randn(1, generator=g))
            batch.append(
                Sample(torch.cat([head, tail]), mask, behav, adv, episode=len(batch), group=k)
            )
    return batch


def multi_turn_group(seed: int, group: int, *, episodes: int = 2) -> list[Sample]:
    """One group of agent episodes of two calls each, as separate samples: the first
    call's sample (prompt, answer 1; loss on answer 1) and the second's (prompt, answer 1,
    a tool reply, answer 2; loss on answer 2 only: answer 1 is its context), and for the
    last episode also the two calls as one continued sample (loss on both answers).
    Episodes differ after the prompt; an episode's samples share its first answer."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (20,), generator=g)
    batch = []
    for e in range(episodes):
        first, tool, second = (
            torch.randint(0, VOCAB, (n,), generator=g) for n in (6 + e, 4, 5 + 2 * e)
        )
        # (tokens, whether they carry a loss) of each sample
        calls = [
            [(prompt, False), (first, True)],
            [(prompt, False), (first, False), (tool, False), (second, True)],
        ]
        if e == episodes - 1:
            calls.append([(prompt, False), (first, True), (tool, False), (second, True)])
        for parts in calls:
            ids = torch.cat([t for t, _ in parts])
            mask = torch.cat([torch.full((len(t),), on) for t, on in parts])
            behav = torch.where(mask, -4.8 + 0.3 * torch.randn(len(ids), generator=g), 0.0)
            adv = float(torch.randn(1, generator=g))
            batch.append(Sample(ids, mask, behav, adv, episode=100 * group + e, group=group))
    return batch


def per_sample_sampling(batch: list[Sample]) -> list[Sample]:
    """``batch`` with some samples drawn at their own temperature and cut (per call)."""
    settings = [
        SampledWith(temperature=0.7),
        None,
        SampledWith(temperature=1.3, top_k=20, top_p=0.9),
    ]
    return [
        dataclasses.replace(s, sampled_with=settings[i % len(settings)])
        for i, s in enumerate(batch)
    ]


def prefix_batch() -> list[Sample]:
    """Groups of 4, 1 and 8 and two multi-turn groups (:func:`multi_turn_group`), some
    samples at their own sampling: the shared-prefix steps' batch."""
    return per_sample_sampling(
        group_batch(7, (4, 1, 8)) + multi_turn_group(8, 3) + multi_turn_group(9, 4, episodes=1)
    )


def prefix_config(**overrides: Any) -> TrainerConfig:
    """The shared-prefix steps' trainer: several 48-token micro-batches, two PPO
    minibatches (so a separate proximal forward), a KL penalty (a reference forward), an
    entropy bonus and per-episode weights; no gradient clipping (gradients are compared
    as they are)."""
    fields: dict[str, Any] = dict(
        max_tokens_per_microbatch=48,
        ppo_minibatches=2,
        optim=OptimConfig(lr=1e-3, grad_clip=None),
        loss=LossConfig(
            loss_agg="seq-mean-token-mean",
            kl_coef=0.1,
            entropy_coef=0.01,
            behav_imp_weight_cap=None,
        ),
    )
    fields.update(overrides)
    return train_config(**fields)


def train_config(**overrides: Any) -> TrainerConfig:
    """The tests' trainer section: AdamW at 1e-3 with weight decay, a cosine schedule over
    10 steps after 2 warmup steps, 24-token micro-batches (several per batch), and no cap
    on the behaviour importance weight."""
    fields: dict[str, Any] = dict(
        optim=OptimConfig(
            lr=1e-3, weight_decay=0.01, warmup_steps=2, schedule="cosine", grad_clip=1.0
        ),
        max_steps=10,
        max_tokens_per_microbatch=24,
        loss=LossConfig(behav_imp_weight_cap=None),
    )
    fields.update(overrides)
    return TrainerConfig(**fields)


def tiny_engine(
    config: TrainerConfig | None = None, *, architecture: Any = None, dtype: DType = "float32"
) -> TrainEngine:
    """A train engine of ``config`` (default :func:`train_config`) on random weights of
    ``architecture`` (default :func:`tiny_config`); the model section only names it."""
    return TrainEngine(
        config or train_config(),
        ModelConfig(path=TINY_NAME, dtype=dtype),
        architecture=architecture if architecture is not None else tiny_config(),
    )


def _rms_norm_float64(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm without its float32 upcast (which rounds every gradient that
    passes a norm to float32)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


class Float64Engine(TrainEngine):
    """A train engine whose model computes in float64: weights, activations, norms, the LM
    head and the gradients' sum over ranks. For exactness tests, where float32 rounding
    would hide a difference of 1e-10."""

    def _load_lm(self) -> Any:
        self.reduce_dtype = torch.float64
        lm = super()._load_lm().double()
        for module in lm.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_float64, module)
        return lm


def float64_engine(config: TrainerConfig | None = None, *, architecture: Any = None) -> TrainEngine:
    """:func:`tiny_engine` in float64 (:class:`Float64Engine`)."""
    return Float64Engine(
        config or train_config(),
        ModelConfig(path=TINY_NAME, dtype="float32"),
        architecture=architecture if architecture is not None else tiny_config(),
    )


def step_gradients(
    engine: TrainEngine, step: Callable[[], dict[str, float]]
) -> tuple[dict[str, float], list[dict[str, torch.Tensor]]]:
    """Runs ``step`` (a train step of ``engine``) without changing a weight: returns its
    stats and, for each optimizer step (one per minibatch), the full gradients it was
    given, by parameter name (collective: every rank must run it). Every minibatch's
    gradients are taken at the same weights."""
    grads: list[dict[str, torch.Tensor]] = []

    def capture(*args: Any, **kwargs: Any) -> None:
        # the gradients the step takes: divided by the optimizer's grad_scale where the
        # engine hands it the clip's factor (TrainEngine._clip_and_step)
        scale = getattr(engine.optimizer, "grad_scale", None)
        got = {}
        for name, param in engine.module.named_parameters():
            if param.grad is not None:
                grad: Any = param.grad
                grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
                got[name] = grad if scale is None else grad / scale
        grads.append(got)

    optimizer_step = engine.optimizer.step
    engine.optimizer.step = capture  # type: ignore[method-assign]
    try:
        stats = step()
    finally:
        engine.optimizer.step = optimizer_step  # type: ignore[method-assign]
    return stats, grads


def full_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every full weight of the engine's model, float32 (collective on all ranks)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in engine.iter_weights(1 << 16, dtype="float32"):
        out.update({k: v.clone() for k, v in bucket})
    return out


def resume_engine() -> TrainEngine:
    """Dropout on, so that resuming must restore the RNG to match."""
    return tiny_engine(architecture=tiny_config(attention_dropout=0.1))


def fsdp_engine() -> TrainEngine:
    """Tied embeddings, gradient checkpointing, dual clip, clip-higher, two PPO minibatches
    and a frozen reference model for the KL penalty: the parts most likely to behave
    differently under FSDP."""
    config = train_config(
        gradient_checkpointing=True,
        ppo_minibatches=2,
        loss=LossConfig(
            eps_clip_high=0.28,
            c_clip=3.0,
            loss_agg="seq-mean-token-mean",
            kl_coef=0.1,
            behav_imp_weight_cap=None,
        ),
    )
    return tiny_engine(config, architecture=tiny_config("qwen2", tie_word_embeddings=True))


def lora_fsdp_engine() -> TrainEngine:
    """:func:`fsdp_engine`'s model and loss (tied embeddings, gradient checkpointing, a KL
    penalty, two minibatches) with rank-4 LoRA adapters (no dropout: each rank draws its
    own masks, so a sharded step would not match one process)."""
    from asyncrl.train.config import LoraConfig

    config = fsdp_engine().config.model_copy(update={"lora": LoraConfig(rank=4, alpha=8)})
    return tiny_engine(config, architecture=tiny_config("qwen2", tie_word_embeddings=True))
