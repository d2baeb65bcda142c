"""The gradient-invariance cases (``tests/test_train_invariance.py``): loss settings,
micro-batch layouts and batches under which one minibatch's gradient must not change,
computed in float64 on the tiny model, in this process or, for :func:`world2_cases`, on
two ranks under torchrun.

A case's gradient is the one its train step hands the optimizer, read without stepping
(:func:`~train_helpers.tiny.step_gradients`), with no gradient clipping: AdamW would
normalise a wrong scale away, and a clipped norm hides it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, get_args

import torch

from asyncrl.algo.config import LossAgg
from asyncrl.models.resolve import TINY_NAME, ModelConfig
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train.batch import Sample
from asyncrl.train.config import LoraConfig
from train_helpers.tiny import (
    VOCAB,
    Float64Engine,
    random_batch,
    step_gradients,
    tiny_config,
    train_config,
)

AGGS: tuple[str, ...] = get_args(LossAgg)

KL_COEF = 0.1
ENTROPY_COEF = 0.01

TERMS: dict[str, dict[str, Any]] = {
    "pg": {},
    "kl+entropy": {"kl_coef": KL_COEF, "entropy_coef": ENTROPY_COEF},
    "kl-in-reward": {"kl_coef": KL_COEF, "kl_in": "reward", "kl_type": "k1"},
}
"""The loss terms beside the policy gradient: none; the KL penalty to the reference model
in the loss (k2, the default) and the entropy bonus; the KL penalty in the reward (k1:
each token's advantage takes the KL still to come in its sequence)."""

LAYOUTS: dict[str, dict[str, Any]] = {
    "whole": {"max_tokens_per_microbatch": 4096},
    "per-sequence": {"max_tokens_per_microbatch": 1},
    "accumulated": {"max_tokens_per_microbatch": 24},
    "padded": {"packing": False, "max_tokens_per_microbatch": 4096},
    "padded-per-sequence": {"packing": False, "max_tokens_per_microbatch": 1},
}
"""How a minibatch is cut into micro-batches: all in one packed micro-batch (``whole``,
the reference), one sequence per micro-batch (the gradient accumulated over them), packed
micro-batches of at most 24 tokens (several sequences each, an episode's samples in
different ones), and the same right-padded instead of packed."""

REFERENCE = "whole"

LORA = LoraConfig(rank=4, alpha=8)

EPISODE = 4
"""The episode id of the long sample that :func:`segmented` cuts."""

CUTS = (12, 18)
"""Where the long sample is cut into three segments: loss spans of 8, 6 and 6 tokens."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One train step: its loss settings, layout, world size and batch.

    ``batch``: ``episodes`` (:func:`episode_batch`), ``segments`` (the same with its long
    sample cut into segments of its episode, :func:`segmented`), ``separate`` (cut, each
    segment an episode of its own). ``norm_len``: ``loss.norm_len`` (None: the batch's
    longest loss span)."""

    agg: str
    terms: str = "pg"
    lora: bool = False
    layout: str = REFERENCE
    world: int = 1
    batch: str = "episodes"
    norm_len: float | None = None

    @property
    def id(self) -> str:
        parts = [self.agg, self.terms, "lora" if self.lora else "full", self.layout]
        parts += [f"world{self.world}", self.batch]
        if self.norm_len is not None:
            parts.append(f"norm_len{self.norm_len:g}")
        return "/".join(parts)

    def reference(self) -> Case:
        """The same loss on the unsplit batch, one micro-batch, one process."""
        return dataclasses.replace(self, layout=REFERENCE, world=1, batch="episodes")

    def config(self) -> TrainerConfig:
        loss = LossConfig(
            loss_agg=self.agg,  # type: ignore[arg-type]
            behav_imp_weight_cap=None,
            norm_len=self.norm_len,
            **TERMS[self.terms],
        )
        return train_config(
            optim=OptimConfig(lr=1e-3, grad_clip=None),
            loss=loss,
            lora=LORA if self.lora else LoraConfig(),
            **LAYOUTS[self.layout],
        )

    def samples(self) -> list[Sample]:
        return BATCHES[self.batch]()


def continued_sample(seed: int, *, length: int = 24, prompt: int = 4) -> Sample:
    """One long answer (``length − prompt`` generated tokens after a ``prompt``), its own
    episode (:data:`EPISODE`)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    mask = torch.arange(length) >= prompt
    behav = torch.where(mask, -4.8 + 0.3 * torch.randn(length, generator=g), 0.0)
    return Sample(ids, mask, behav, float(torch.randn(1, generator=g)), episode=EPISODE)


def segmented(sample: Sample, cuts: tuple[int, ...], *, episode: int | None) -> list[Sample]:
    """``sample`` cut at ``cuts`` into consecutive samples, as a call that continues a
    sample at another sampling starts a new one: each carries the
    whole context before it (the earlier segments' tokens, without loss) and the loss on
    its own span; all take the sample's advantage and the ``episode`` id given."""
    bounds = [0, *cuts, len(sample)]
    out = []
    for start, end in itertools.pairwise(bounds):
        mask = sample.loss_mask[:end] & (torch.arange(end) >= start)
        behav = torch.where(mask, sample.behav_logprobs[:end], 0.0)
        out.append(Sample(sample.input_ids[:end], mask, behav, sample.advantages, episode=episode))
    return out


def episode_batch() -> list[Sample]:
    """Six short sequences (:func:`~train_helpers.tiny.random_batch`: loss on their second
    half), the second and fourth one episode of two samples (agent calls that do not
    continue one another), the fifth with no episode id, and a long continued answer
    (:func:`continued_sample`, the batch's longest loss span)."""
    short = random_batch(11)
    episodes = [0, 1, 2, 1, None, 3]
    batch = [dataclasses.replace(s, episode=e) for s, e in zip(short, episodes, strict=True)]
    return [*batch, continued_sample(12)]


def segments_batch() -> list[Sample]:
    """:func:`episode_batch` with its long answer cut at :data:`CUTS`, the segments one
    episode."""
    *short, long = episode_batch()
    return [*short, *segmented(long, CUTS, episode=EPISODE)]


def separate_batch() -> list[Sample]:
    """:func:`segments_batch` with each segment an episode of its own."""
    *short, long = episode_batch()
    cut = segmented(long, CUTS, episode=None)
    return [*short, *(dataclasses.replace(s, episode=100 + k) for k, s in enumerate(cut))]


BATCHES: dict[str, Callable[[], list[Sample]]] = {
    "episodes": episode_batch,
    "segments": segments_batch,
    "separate": separate_batch,
}


def _offset_policy(lm: torch.nn.Module) -> None:
    """Moves every trainable weight by seeded noise (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in lm.parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=g, dtype=torch.float64)
                param.add_(0.02 * noise.to(param.dtype))


class OffsetEngine(Float64Engine):
    """A float64 engine whose policy starts a small random step away from the reference
    model: at the reference itself the KL penalty has no gradient (k2's is d·∇d with
    d = 0), and LoRA's B starts at 0, which leaves A's gradient 0."""

    def _wrap(self, lm: torch.nn.Module) -> torch.nn.Module:
        if any(p.requires_grad for p in lm.parameters()):  # the policy, not the reference
            _offset_policy(lm)
        return super()._wrap(lm)


def offset_engine(config: TrainerConfig) -> OffsetEngine:
    """An :class:`OffsetEngine` of ``config`` on the tiny model (as
    :func:`~train_helpers.tiny.float64_engine` builds one)."""
    return OffsetEngine(
        config, ModelConfig(path=TINY_NAME, dtype="float32"), architecture=tiny_config()
    )


Result = tuple[float, dict[str, torch.Tensor]]
"""A step's loss and its gradients by parameter name."""


def run_batch(
    config: TrainerConfig,
    batch: list[Sample],
    step: Callable[[OffsetEngine, list[Sample]], dict[str, float]],
) -> Result:
    """The loss and gradient of one train step on ``batch``, run by ``step(engine, batch)``
    (collective under torchrun; rank 0's loss is the step's, the others' 0)."""
    engine = offset_engine(config)
    stats, grads = step_gradients(engine, lambda: step(engine, batch))
    (only,) = grads  # one minibatch: one optimizer step
    return stats.get("loss", 0.0), only


def run_case(case: Case, step: Callable[[OffsetEngine, list[Sample]], dict[str, float]]) -> Result:
    """``case``'s loss and gradient (:func:`run_batch`)."""
    return run_batch(case.config(), case.samples(), step)


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``‖got − want‖ / ‖want‖`` over all parameters together."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    diff = sum(float((got[k] - want[k]).double().square().sum()) for k in want)
    norm = sum(float(want[k].double().square().sum()) for k in want)
    return (diff / norm) ** 0.5


def world2_cases() -> list[Case]:
    """The two-rank cases, run in one torchrun (``worker.py invariance``), for every
    aggregation: one micro-batch per rank; micro-batches of several sequences, an
    episode's samples in two of them, without the KL and entropy terms and, apart, with
    them under LoRA; right-padded, with one rank idle (a dummy micro-batch); the segmented
    episode a sequence per micro-batch, its segments (and another episode's samples) on
    both ranks."""
    cases = []
    for agg in AGGS:
        cases += [
            Case(agg, "kl+entropy", layout="whole", world=2),
            Case(agg, "pg", layout="accumulated", world=2),
            Case(agg, "kl+entropy", lora=True, layout="accumulated", world=2),
            Case(agg, "kl+entropy", layout="padded", world=2),
            Case(agg, "kl+entropy", layout="per-sequence", world=2, batch="segments"),
        ]
    return cases
