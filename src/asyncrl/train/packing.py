"""Splitting a global batch into per-rank micro-batches, and laying one micro-batch out as
model inputs: packed end to end (no padding) or right-padded.

Packed layout: the ``B`` sequences of a micro-batch are concatenated into one row
``input_ids [1, N]`` with ``position_ids`` restarting at 0 for each sequence. transformers
reads the restarts as sequence boundaries and gives every sequence its own causal block
(block-diagonal mask for sdpa/eager, varlen kernels for flash attention), so a packed
forward equals per-sequence forwards with no padding computed at all.

Loss layout: whatever the input layout, per-token loss inputs are gathered as
``[B, T]`` (right-padded to the longest sequence of the micro-batch), the shape
:func:`asyncrl.algo.policy_loss` takes.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncrl.train.batch import Sample
from asyncrl.wire.messages import SampledWith


def _deal(bins: list[list[int]], loads: list[int], world_size: int) -> list[list[list[int]]]:
    """Gives every rank the same number of micro-batches, heaviest first, in a snake order
    so that rank loads stay close."""
    order = sorted(range(len(bins)), key=lambda i: -loads[i])
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    for k, i in enumerate(order):
        rnd, pos = divmod(k, world_size)
        rank = pos if rnd % 2 == 0 else world_size - 1 - pos
        per_rank[rank].append(bins[i])
    return per_rank


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    world_size: int = 1,
    *,
    padded: bool = False,
) -> list[list[list[int]]]:
    """Assigns sequences (by index) to micro-batches, and micro-batches to ranks.

    Returns ``plan[rank][k]``: the sequence indices of rank ``rank``'s ``k``-th micro-batch.
    Every rank gets the same number of micro-batches (FSDP forwards are collective, so a
    rank with fewer would hang the others); a rank may get an empty one, which the engine
    runs as a dummy with zero loss.

    Packed cost of a micro-batch is ``Σ len``; padded cost is ``count · max len``. Each stays
    within ``max_tokens`` unless a single sequence is longer, which then goes alone.
    Packed places sequences longest first, each into the least-loaded of ``n`` bins, with
    ``n`` the smallest multiple of ``world_size`` (from a lower bound up) for which that
    fits: few micro-batches (FSDP gathers the weights once per micro-batch) of even loads
    (ranks run their ``k``-th micro-batches in lockstep). Padded fills length-sorted runs,
    which keeps padding small.
    """
    if max_tokens < 1 or world_size < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and world_size ({world_size}) must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    if padded:
        for i in order:
            # Sorted longest first, so the first sequence of a run sets its padded width.
            if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
                bins[-1].append(i)
            else:
                bins.append([i])
        loads = [len(b) * lengths[b[0]] for b in bins]
    else:
        # Lower bound on the bin count: an oversized sequence fills a bin on its own.
        oversized = sum(1 for n in lengths if n > max_tokens)
        fitting = sum(n for n in lengths if n <= max_tokens)
        n_bins = max(1, oversized + math.ceil(fitting / max_tokens))
        while True:
            n_bins = math.ceil(n_bins / world_size) * world_size
            bins = [[] for _ in range(n_bins)]
            heap = [(0, b) for b in range(n_bins)]  # (load, bin): least-loaded first
            fits = True
            for i in order:
                load, b = heapq.heappop(heap)
                if load > 0 and load + lengths[i] > max_tokens:
                    fits = False
                    break
                bins[b].append(i)
                heapq.heappush(heap, (load + lengths[i], b))
            if fits:
                break
            n_bins += world_size
        loads = [sum(lengths[i] for i in b) for b in bins]
    while len(bins) % world_size:
        bins.append([])
        loads.append(0)
    # Within a micro-batch, keep the batch's order: results are easier to read and debug.
    return [[sorted(b) for b in rank_bins] for rank_bins in _deal(bins, loads, world_size)]


def split_minibatches(lengths: Sequence[int], n: int) -> list[list[int]]:
    """Splits sequences (by index) into ``n`` non-empty minibatches of whole sequences with
    even token counts: longest first, each into the minibatch with the fewest tokens (ties:
    the fewest sequences, then the lowest index). Deterministic, so every rank derives the
    same split; indices within a minibatch keep the batch's order."""
    if not 1 <= n <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {n} minibatches")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, 0, k) for k in range(n)]  # (tokens, sequences, minibatch)
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in order:
        tokens, count, k = heapq.heappop(heap)
        parts[k].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, k))
    return [sorted(part) for part in parts]


@dataclass
class MicroBatch:
    """Model inputs and loss inputs of one micro-batch.

    ``target_index [M]`` are flat indices into ``input_ids.flatten()`` of the tokens whose
    logprob is needed (the loss positions; never a sequence's first token), and
    ``target_row``/``target_col [M]`` their place in the ``[B, T]`` loss layout.
    """

    seq_index: list[int]
    lengths: list[int]
    input_ids: torch.Tensor  # [1, N] packed, [B, T] padded
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: torch.Tensor | None  # [B, T] when padded, None when packed
    cu_seqlens: torch.Tensor | None  # [B + 1] int32 cumulative lengths when packed
    target_index: torch.Tensor  # [M] int64
    target_row: torch.Tensor  # [M] int64
    target_col: torch.Tensor  # [M] int64
    loss_mask_BT: torch.Tensor  # [B, T] bool
    behav_logprobs_BT: torch.Tensor  # [B, T] float32
    old_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    advantages_BT: torch.Tensor  # [B, T] float32
    sampled_with: list[SampledWith | None] = field(default_factory=list)
    """Per sequence, the sampling its calls chose (None: the trainer's); empty when none did."""

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return sum(self.lengths)

    @property
    def num_input_tokens(self) -> int:
        """Tokens the model computes, padding included."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> MicroBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            seq_index=self.seq_index,
            lengths=self.lengths,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=move(self.attention_mask),
            cu_seqlens=move(self.cu_seqlens),
            target_index=self.target_index.to(device),
            target_row=self.target_row.to(device),
            target_col=self.target_col.to(device),
            loss_mask_BT=self.loss_mask_BT.to(device),
            behav_logprobs_BT=self.behav_logprobs_BT.to(device),
            old_logprobs_BT=move(self.old_logprobs_BT),
            ref_logprobs_BT=move(self.ref_logprobs_BT),
            advantages_BT=self.advantages_BT.to(device),
            sampled_with=self.sampled_with,
        )


def _pad_stack(values: Sequence[torch.Tensor], width: int, fill: float | bool = 0) -> torch.Tensor:
    out = torch.full((len(values), width), fill, dtype=values[0].dtype)
    for b, v in enumerate(values):
        out[b, : v.numel()] = v
    return out


def _dummy_sample() -> Sample:
    # Two tokens, no loss: enough for a forward and a (zero) backward on an idle rank.
    return Sample(
        input_ids=torch.zeros(2, dtype=torch.int64),
        loss_mask=torch.zeros(2, dtype=torch.bool),
        behav_logprobs=torch.zeros(2),
        advantages=0.0,
    )


def build_micro_batch(
    samples: Sequence[Sample],
    seq_index: Sequence[int],
    *,
    packed: bool = True,
    all_positions: bool = False,
) -> MicroBatch:
    """Lays out ``samples`` (the micro-batch's sequences, in order) as model and loss inputs.

    An empty ``samples`` gives a two-token dummy with an empty loss mask. With
    ``all_positions`` the targets are every position but each sequence's first, not just the
    loss positions (used to check packing and to score whole sequences).
    """
    samples = list(samples) or [_dummy_sample()]
    lengths = [len(s) for s in samples]
    width = max(lengths)
    loss_mask_BT = _pad_stack([s.loss_mask for s in samples], width, False)
    if all_positions:
        target_BT = _pad_stack([torch.ones(n, dtype=torch.bool) for n in lengths], width, False)
        target_BT[:, 0] = False
    else:
        target_BT = loss_mask_BT
    target_row, target_col = target_BT.nonzero(as_tuple=True)
    if packed:
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        input_ids = torch.cat([s.input_ids for s in samples])[None]
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        attention_mask = None
        cu_seqlens: torch.Tensor | None = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        target_index = starts[target_row] + target_col
    else:
        input_ids = _pad_stack([s.input_ids for s in samples], width, 0)
        position_ids = torch.arange(width).expand(len(samples), width).contiguous()
        attention_mask = _pad_stack([torch.ones(n, dtype=torch.int64) for n in lengths], width, 0)
        cu_seqlens = None
        target_index = target_row * width + target_col

    def optional(name: str) -> torch.Tensor | None:
        values = [getattr(s, name) for s in samples]
        if all(v is None for v in values):
            return None
        if any(v is None for v in values):
            raise ValueError(f"{name} is set on some samples of a micro-batch and not others")
        return _pad_stack(values, width, 0.0)

    return MicroBatch(
        seq_index=list(seq_index),
        lengths=lengths if seq_index else [],
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        target_index=target_index,
        target_row=target_row,
        target_col=target_col,
        loss_mask_BT=loss_mask_BT,
        behav_logprobs_BT=_pad_stack([s.behav_logprobs for s in samples], width, 0.0),
        old_logprobs_BT=optional("old_logprobs"),
        ref_logprobs_BT=optional("ref_logprobs"),
        advantages_BT=_pad_stack([s.advantages_per_token() for s in samples], width, 0.0),
        sampled_with=(
            [s.sampled_with for s in samples]
            if any(s.sampled_with is not None for s in samples)
            else []
        ),
    )
