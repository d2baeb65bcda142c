"""Splits one train step's global batch into per-rank shards: each rank's sequences, its
micro-batches and the global numbers its loss needs, laid out as four flat tensors.

Rank 0 plans the step (:func:`plan_shards`) and each rank trains on its own
:class:`TrainShard` alone, with the loss and gradients of the whole batch: a micro-batch's
loss is weighted by its share of its minibatch's aggregation units, counted over all ranks
(``units_total``), and ``norm_len`` is the batch's. The seq-mean aggregations count
episodes: each sample carries the loss tokens of its episode within its minibatch
(``episode_tokens``), counted over all ranks, so an episode whose samples land in several
micro-batches or ranks still weighs once. The split is the one every rank would
derive from the global batch: minibatches by :func:`split_minibatches`, then each
minibatch's micro-batches by :func:`plan_micro_batches`, every rank getting as many
micro-batches as the others (FSDP forwards are collective). With ``trainer.share_prefix``
the samples of a group that share a prompt are planned together
(:func:`~asyncrl.train.packing.sharing_sets`), and each sample carries its group, so that
the rank that trains them forwards that prompt once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Literal

import torch

from asyncrl.algo.loss import agg_count
from asyncrl.train.batch import Batch, Sample
from asyncrl.train.config import TrainerConfig
from asyncrl.train.packing import plan_micro_batches, sharing_sets, split_minibatches
from asyncrl.wire.messages import SampledWith

ProximalMode = Literal["free", "given", "behaviour"]
MODES: tuple[ProximalMode, ...] = ("free", "given", "behaviour")

_META = 10
"""Leading int64 fields of a packed shard (see :meth:`TrainShard.to_tensors`)."""


@dataclasses.dataclass
class TrainShard:
    """One rank's part of a train step.

    Attributes:
        samples: this rank's sequences, in the global batch's order.
        minibatches: ``minibatches[k][m]``: indices into ``samples`` of this rank's
            ``m``-th micro-batch of minibatch ``k`` (possibly empty: a dummy).
        units_total: per minibatch, its aggregation units over all ranks
            (:func:`~asyncrl.algo.loss.agg_count`), at least 1.
        norm_len: the loss's ``norm_len`` (``loss.norm_len``, else the batch's longest
            loss span).
        mode: where the proximal logprobs come from: ``free`` (the training forward,
            detached), ``given`` (the samples' ``old_logprobs``), ``behaviour`` (none).
        fill_proximal: whether samples without ``old_logprobs`` get them from a no-grad
            forward first (all ranks agree: it is collective).
        fill_ref: whether samples without ``ref_logprobs`` are scored by the reference
            model first (collective too).
        sequences, tokens, loss_tokens: the global batch's counts (for the statistics).
        episode_tokens: per sample, the loss tokens of its episode's samples in its
            minibatch, over all ranks (:func:`~asyncrl.algo.loss.tokens_per_episode`); empty:
            every sample is its own episode.
    """

    samples: list[Sample]
    minibatches: list[list[list[int]]]
    units_total: list[int]
    norm_len: float
    mode: ProximalMode
    fill_proximal: bool
    fill_ref: bool
    sequences: int
    tokens: int
    loss_tokens: int
    episode_tokens: list[int] = dataclasses.field(default_factory=list)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ints int64, mask uint8, floats float32)``: the shard as three flat CPU
        tensors for point-to-point sends. ``ints`` holds the header (counts, flags, the
        bits of ``norm_len``), each sample's length, flags, episode tokens, sampling and
        group (−1: none), the plan, the token ids and, last, the samples' image references
        (a JSON list of each sample's paths, as UTF-8 bytes, one per int; none without
        images); ``mask`` the loss masks; ``floats`` the behaviour logprobs, the per-token
        advantages and the ``old``/``ref`` logprobs that are set."""
        s = self.samples
        images = (
            json.dumps([list(x.images) for x in s]).encode() if any(x.images for x in s) else b""
        )
        has_old = [x.old_logprobs is not None for x in s]
        has_ref = [x.ref_logprobs is not None for x in s]
        header = [
            len(s),
            len(self.minibatches),
            MODES.index(self.mode),
            int(self.fill_proximal),
            int(self.fill_ref),
            self.sequences,
            self.tokens,
            self.loss_tokens,
            _bits(self.norm_len),
            len(images),
        ]
        plan: list[int] = []
        for k, micro in enumerate(self.minibatches):
            plan += [self.units_total[k], len(micro)]
            for mb in micro:
                plan += [len(mb), *mb]
        episode_tokens = self.episode_tokens or [x.num_loss_tokens for x in s]
        per_sample = (
            [len(x) for x in s]
            + [int(f) for f in has_old]
            + [int(f) for f in has_ref]
            + episode_tokens
            + [v for x in s for v in _sampling_ints(x.sampled_with)]
            + [-1 if x.group is None else x.group for x in s]
        )
        ints = torch.cat(
            [
                torch.tensor(header + per_sample + plan, dtype=torch.int64),
                *(x.input_ids for x in s),
                torch.frombuffer(bytearray(images), dtype=torch.uint8).to(torch.int64)
                if images
                else _empty(torch.int64),
            ]
        )
        mask = torch.cat([x.loss_mask for x in s]).to(torch.uint8) if s else _empty(torch.uint8)
        floats = torch.cat(
            [
                _empty(torch.float32),
                *(x.behav_logprobs for x in s),
                *(x.advantages_per_token() for x in s),
                *(x.old_logprobs for x in s if x.old_logprobs is not None),
                *(x.ref_logprobs for x in s if x.ref_logprobs is not None),
            ]
        )
        return ints, mask, floats

    @classmethod
    def from_tensors(
        cls, ints: torch.Tensor, mask: torch.Tensor, floats: torch.Tensor
    ) -> TrainShard:
        """The shard :meth:`to_tensors` laid out."""
        meta = ints[:_META]
        n, n_minibatches, mode, fill_prox, fill_ref, sequences, tokens, loss_tokens = meta[
            :8
        ].tolist()
        norm_len = _float(int(meta[8]))
        n_image_bytes = int(meta[9])
        if n_image_bytes:
            blob = bytes(ints[len(ints) - n_image_bytes :].to(torch.uint8).tolist())
            ints = ints[: len(ints) - n_image_bytes]
            images = [tuple(paths) for paths in json.loads(blob)]
        else:
            images = [()] * n
        pos = _META
        head = ints[pos : pos + _PER_SAMPLE * n].tolist()
        lengths, has_old, has_ref = head[:n], head[n : 2 * n], head[2 * n : 3 * n]
        episode_tokens = head[3 * n : 4 * n]
        sampled_with = [_sampling_of(head[4 * n + 4 * i : 4 * n + 4 * i + 4]) for i in range(n)]
        groups = [None if g < 0 else g for g in head[8 * n : 9 * n]]
        pos += _PER_SAMPLE * n
        minibatches: list[list[list[int]]] = []
        units_total: list[int] = []
        for _ in range(n_minibatches):
            units, n_micro = ints[pos : pos + 2].tolist()
            pos += 2
            micro = []
            for _ in range(n_micro):
                size = int(ints[pos])
                micro.append(ints[pos + 1 : pos + 1 + size].tolist())
                pos += 1 + size
            minibatches.append(micro)
            units_total.append(units)
        samples = []
        if n:
            ids = torch.split(ints[pos:], lengths)
            masks = torch.split(mask.bool(), lengths)
            total = sum(lengths)
            behav = torch.split(floats[:total], lengths)
            adv = torch.split(floats[total : 2 * total], lengths)
            old, rest = _take(floats[2 * total :], lengths, has_old)
            ref, _ = _take(rest, lengths, has_ref)
            samples = [
                Sample(
                    ids[i],
                    masks[i],
                    behav[i],
                    adv[i],
                    old[i],
                    ref[i],
                    sampled_with=sampled_with[i],
                    group=groups[i],
                    images=images[i],
                )
                for i in range(n)
            ]
        return cls(
            samples=samples,
            minibatches=minibatches,
            units_total=units_total,
            norm_len=norm_len,
            mode=MODES[mode],
            fill_proximal=bool(fill_prox),
            fill_ref=bool(fill_ref),
            sequences=sequences,
            tokens=tokens,
            loss_tokens=loss_tokens,
            episode_tokens=episode_tokens,
        )


_PER_SAMPLE = 9
"""int64 fields per sample in a packed shard: length, has old, has ref, episode tokens,
the four of its sampling (:func:`_sampling_ints`) and its group."""


def _bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64))


def _float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64))


def _sampling_ints(sampled_with: SampledWith | None) -> list[int]:
    """A sample's :class:`~asyncrl.wire.messages.SampledWith` as four int64s (set or not,
    the temperature's and top_p's float64 bits, top_k): exact, whatever the value."""
    if sampled_with is None:
        return [0, 0, 0, 0]
    s = sampled_with
    return [1, _bits(s.temperature), s.top_k, _bits(s.top_p)]


def _sampling_of(ints: Sequence[int]) -> SampledWith | None:
    present, temperature, top_k, top_p = ints
    if not present:
        return None
    return SampledWith(temperature=_float(temperature), top_k=top_k, top_p=_float(top_p))


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(0, dtype=dtype)


def _take(
    flat: torch.Tensor, lengths: Sequence[int], present: Sequence[int]
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per sample, its slice of ``flat`` where ``present`` (in order), else None; and what
    is left of ``flat``."""
    out: list[torch.Tensor | None] = []
    pos = 0
    for n, here in zip(lengths, present, strict=True):
        out.append(flat[pos : pos + n] if here else None)
        pos += n if here else 0
    return out, flat[pos:]


def plan_shards(batch: Batch, config: TrainerConfig, world_size: int) -> list[TrainShard]:
    """The shards of one train step on the global ``batch``, one per rank.

    Raises ValueError, before anything is sent, for a batch the step cannot take: empty,
    fewer sequences than ``ppo_minibatches``, or ``old_logprobs`` on some samples but not
    all (without ``trainer.loss.proximal = "recompute"`` to fill the rest).
    """
    if not batch:
        raise ValueError("empty batch")
    loss_cfg = config.loss
    if config.ppo_minibatches > len(batch):
        raise ValueError(
            f"ppo_minibatches={config.ppo_minibatches} exceeds the batch's {len(batch)} sequences"
        )
    missing = [s.old_logprobs is None for s in batch]
    free = (
        loss_cfg.proximal == "recompute"
        and all(missing)
        and config.ppo_minibatches == 1
        and not loss_cfg.separate_proximal_forward
    )
    fill_proximal = loss_cfg.proximal == "recompute" and any(missing) and not free
    given = fill_proximal or not any(missing)
    if not given and not all(missing):
        raise ValueError("old_logprobs must be set on all samples or none")
    mode: ProximalMode = "free" if free else "given" if given else "behaviour"
    fill_ref = loss_cfg.kl_coef > 0 and any(s.ref_logprobs is None for s in batch)
    norm_len = loss_cfg.norm_len or float(max(1, max(s.num_loss_tokens for s in batch)))

    lengths = [len(s) for s in batch]
    # per rank, per minibatch, per micro-batch: global indices
    plans: list[list[list[list[int]]]] = [[] for _ in range(world_size)]
    units_total = []
    episode_tokens = [0] * len(batch)
    for idx in split_minibatches(lengths, config.ppo_minibatches):
        # An episode's loss tokens within this minibatch (its loss is this minibatch's own).
        per_episode: dict[tuple[int, int], int] = {}
        keys = [(0, i) if (e := batch[i].episode) is None else (1, e) for i in idx]
        for i, key in zip(idx, keys, strict=True):
            per_episode[key] = per_episode.get(key, 0) + batch[i].num_loss_tokens
        for i, key in zip(idx, keys, strict=True):
            episode_tokens[i] = per_episode[key]
        # Shares n_b / N_b of whole episodes: an integer up to rounding.
        units = sum(
            agg_count(
                batch[i].loss_mask[None], loss_cfg.loss_agg, torch.tensor([episode_tokens[i]])
            )
            for i in idx
        )
        units_total.append(max(1, round(units)))
        max_tokens = config.max_tokens_per_microbatch
        per_rank = plan_micro_batches(
            [lengths[i] for i in idx],
            max_tokens,
            world_size,
            padded=not config.packing,
            shared=(
                sharing_sets([batch[i] for i in idx], max_tokens) if config.shares_prefix else ()
            ),
        )
        for rank, micro in enumerate(per_rank):
            plans[rank].append([[idx[j] for j in mb] for mb in micro])
    shards = []
    for rank_plan in plans:
        mine = sorted(i for micro in rank_plan for mb in micro for i in mb)
        local = {g: i for i, g in enumerate(mine)}
        shards.append(
            TrainShard(
                samples=[batch[i] for i in mine],
                minibatches=[[[local[g] for g in mb] for mb in micro] for micro in rank_plan],
                units_total=units_total,
                norm_len=norm_len,
                mode=mode,
                fill_proximal=fill_proximal,
                fill_ref=fill_ref,
                sequences=len(batch),
                tokens=sum(lengths),
                loss_tokens=sum(s.num_loss_tokens for s in batch),
                episode_tokens=[episode_tokens[g] for g in mine],
            )
        )
    return shards
