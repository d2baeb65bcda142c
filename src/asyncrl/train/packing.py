"""Splitting a global batch into per-rank micro-batches, and laying one micro-batch out as
model inputs: packed end to end (no padding) or right-padded.

Packed layout: the ``B`` sequences of a micro-batch are concatenated into one row
``input_ids [1, N]`` with ``position_ids`` restarting at 0 for each sequence. transformers
reads the restarts as sequence boundaries and gives every sequence its own causal block
(block-diagonal mask for sdpa/eager, varlen kernels for flash attention), so a packed
forward equals per-sequence forwards with no padding computed at all.

Shared prefixes (``trainer.share_prefix``, packed only): the samples of one group
(:attr:`Sample.group`) in a micro-batch that start with the same tokens put that common
prefix in the row once, as a segment of its own, and each then only its own tokens, at the
positions that continue the prefix's (``p, p + 1, …`` after a prefix of ``p`` tokens). A
sample's segment attends to the prefix's keys and values, then causally to its own (the
``key_index`` and ``cu_seqlens_k`` of :class:`MicroBatch`, read by
:mod:`asyncrl.train.attention`), so every token sees exactly what it would see in a row of
its own, and the prefix's gradient gathers every sample's.

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

MIN_SHARED_PREFIX = 16
"""The shortest prefix worth sharing: below it the tokens saved do not pay for the extra
segment and its gathered keys."""

SharedSet = tuple[list[int], int]
"""Samples (positions in a list) that share a prefix, and its length in tokens."""


def common_prefix(ids: Sequence[torch.Tensor]) -> int:
    """The length of the longest common prefix of the token rows ``ids``, at most the
    shortest's length − 1: every sample keeps at least its last token to itself, so each
    has a segment of its own after the prefix."""
    n = min(x.numel() for x in ids) - 1
    first = ids[0]
    for x in ids[1:]:
        differ = (x[:n] != first[:n]).nonzero()
        if differ.numel():
            n = int(differ[0])
    return max(0, n)


def sharing_sets(
    samples: Sequence[Sample],
    max_tokens: int | None = None,
    *,
    min_prefix: int = MIN_SHARED_PREFIX,
) -> list[SharedSet]:
    """The samples that share a prefix, by position in ``samples``: per group
    (:attr:`Sample.group`; None is no group), its samples without images (whose image
    features and positions are their own) with their :func:`common_prefix` ``p``, where there are at least two and ``p ≥ min_prefix``.
    Packed, a set costs ``p + Σ (L − p)`` tokens; with ``max_tokens``, a set that costs more
    is cut into runs of consecutive samples that each fit (sharing the same ``p``), and a
    run of one sample shares nothing. Samples that share nothing are in no set.

    Every sample of a set keeps its own loss: one whose loss tokens lie inside the prefix
    (a multi-turn sample whose generated tokens another sample has as context) has them
    predicted from the prefix's hidden states, which are the same for every sample of the
    set (:func:`build_micro_batch`'s ``source_index``)."""
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        if s.group is not None and not s.images:
            by_group.setdefault(s.group, []).append(i)
    sets: list[SharedSet] = []
    for members in by_group.values():
        if len(members) < 2:
            continue
        p = common_prefix([samples[i].input_ids for i in members])
        if p < min_prefix:
            continue
        run: list[int] = []
        cost = p
        for i in members:
            own = len(samples[i]) - p
            if run and max_tokens is not None and cost + own > max_tokens:
                if len(run) > 1:
                    sets.append((run, p))
                run, cost = [], p
            run.append(i)
            cost += own
        if len(run) > 1:
            sets.append((run, p))
    return sets


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
    shared: Sequence[SharedSet] = (),
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

    ``shared`` (packed only; :func:`sharing_sets`): sets of sequences that forward their
    common prefix of ``p`` tokens once. Each set is placed whole, as one item of cost
    ``p + Σ (len − p)``, so that its sequences meet in one micro-batch.
    """
    if max_tokens < 1 or world_size < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and world_size ({world_size}) must be >= 1")
    if padded and shared:
        raise ValueError("shared prefixes need packed micro-batches")
    bins: list[list[int]] = []
    loads: list[int] = []
    if padded:
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            # Sorted longest first, so the first sequence of a run sets its padded width.
            if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
                bins[-1].append(i)
            else:
                bins.append([i])
        loads = [len(b) * lengths[b[0]] for b in bins]
    else:
        # Items placed whole: each shared set, and every other sequence alone.
        in_set = {i for members, _ in shared for i in members}
        items = [
            (p + sum(lengths[i] - p for i in members), sorted(members)) for members, p in shared
        ]
        items += [(lengths[i], [i]) for i in range(len(lengths)) if i not in in_set]
        items.sort(key=lambda item: (-item[0], item[1][0]))
        # Lower bound on the bin count: an oversized item fills a bin on its own.
        oversized = sum(1 for cost, _ in items if cost > max_tokens)
        fitting = sum(cost for cost, _ in items if cost <= max_tokens)
        n_bins = max(1, oversized + math.ceil(fitting / max_tokens))
        while True:
            n_bins = math.ceil(n_bins / world_size) * world_size
            bins = [[] for _ in range(n_bins)]
            loads = [0] * n_bins
            heap = [(0, b) for b in range(n_bins)]  # (load, bin): least-loaded first
            fits = True
            for cost, members in items:
                load, b = heapq.heappop(heap)
                if load > 0 and load + cost > max_tokens:
                    fits = False
                    break
                bins[b] += members
                loads[b] = load + cost
                heapq.heappush(heap, (load + cost, b))
            if fits:
                break
            n_bins += world_size
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
    logprob is needed (the loss positions; never a sequence's first token),
    ``source_index [M]`` those of the hidden states that predict them (the token before
    each, in its sequence: ``target_index − 1`` except where a shared prefix lies between,
    e.g. a sample's first token after its prefix is predicted by the prefix's last), and
    ``target_row``/``target_col [M]`` their place in the ``[B, T]`` loss layout. Several
    targets may share a source (samples with loss tokens inside a shared prefix).

    Packed, the row is cut into segments (``cu_seqlens``: a sequence, a shared prefix, or
    the part of a sample after its prefix). Where some segment attends to another's keys
    too, ``key_index [K]`` lists, segment after segment, the row positions whose keys and
    values each attends (its prefix's, then its own), and ``cu_seqlens_k`` cuts that list
    per segment; None where every segment attends to itself alone.
    """

    seq_index: list[int]
    lengths: list[int]
    input_ids: torch.Tensor  # [1, N] packed, [B, T] padded
    position_ids: torch.Tensor  # as input_ids; Qwen2-VL: [4, 1, N] packed, [3, B, T] padded
    attention_mask: torch.Tensor | None  # [B, T] when padded, None when packed
    cu_seqlens: torch.Tensor | None  # [S + 1] int32 cumulative segment lengths when packed
    target_index: torch.Tensor  # [M] int64
    source_index: torch.Tensor  # [M] int64
    target_row: torch.Tensor  # [M] int64
    target_col: torch.Tensor  # [M] int64
    loss_mask_BT: torch.Tensor  # [B, T] bool
    behav_logprobs_BT: torch.Tensor  # [B, T] float32
    old_logprobs_BT: torch.Tensor | None
    ref_logprobs_BT: torch.Tensor | None
    advantages_BT: torch.Tensor  # [B, T] float32
    sampled_with: list[SampledWith | None] = field(default_factory=list)
    """Per sequence, the sampling its calls chose (None: the trainer's); empty when none did."""
    key_index: torch.Tensor | None = None  # [K] int64, packed with shared prefixes
    cu_seqlens_k: torch.Tensor | None = None  # [S + 1] int32, packed with shared prefixes
    max_len_q: int = 0
    """The longest segment (packed) or sequence."""
    max_len_k: int = 0
    """The most keys a segment attends to (``max_len_q`` without shared prefixes)."""
    image_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """A vision-language model's image inputs of the micro-batch's samples (pixel values
    and their grids or masks, :class:`~asyncrl.train.vision.ImageInputs`); empty for text."""

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return sum(self.lengths)

    @property
    def num_input_tokens(self) -> int:
        """Tokens the model computes, padding included, a shared prefix once."""
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
            source_index=self.source_index.to(device),
            target_row=self.target_row.to(device),
            target_col=self.target_col.to(device),
            loss_mask_BT=self.loss_mask_BT.to(device),
            behav_logprobs_BT=self.behav_logprobs_BT.to(device),
            old_logprobs_BT=move(self.old_logprobs_BT),
            ref_logprobs_BT=move(self.ref_logprobs_BT),
            advantages_BT=self.advantages_BT.to(device),
            sampled_with=self.sampled_with,
            key_index=move(self.key_index),
            cu_seqlens_k=move(self.cu_seqlens_k),
            max_len_q=self.max_len_q,
            max_len_k=self.max_len_k,
            image_inputs={k: v.to(device) for k, v in self.image_inputs.items()},
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


@dataclass
class _Layout:
    """The model inputs of a micro-batch and where its targets are (:class:`MicroBatch`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_index: torch.Tensor
    source_index: torch.Tensor
    max_len_q: int
    max_len_k: int
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    key_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None


@dataclass
class _Row:
    """A packed row being laid out: its token ids, position ids and segments."""

    ids: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    segment_lens: list[int] = field(default_factory=list)
    key_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per segment, the ``[start, end)`` row spans whose keys it attends, in order."""
    size: int = 0

    def add(self, ids: torch.Tensor, start: int, prefix: tuple[int, int] | None) -> int:
        """Appends a segment of ``ids`` at positions ``start, start + 1, …``, attending to
        the row span ``prefix`` (when given) before itself; returns its row offset."""
        at, n = self.size, ids.numel()
        self.ids.append(ids)
        self.positions.append(torch.arange(start, start + n))
        self.segment_lens.append(n)
        self.key_spans.append([*([prefix] if prefix else []), (at, at + n)])
        self.size += n
        return at


def _packed(
    samples: Sequence[Sample],
    target_row: torch.Tensor,
    target_col: torch.Tensor,
    *,
    share_prefix: bool,
) -> _Layout:
    """The packed layout: each sample's tokens in order, a shared prefix
    (:func:`sharing_sets`) once, before the first sample of its set."""
    prefix_B = [0] * len(samples)
    first_B = list(range(len(samples)))  # the sample whose place holds the prefix
    sets = sharing_sets(samples) if share_prefix else []
    for members, p in sets:
        for b in members:
            prefix_B[b], first_B[b] = p, members[0]
    row = _Row()
    prefix_at = [0] * len(samples)
    own_at = [0] * len(samples)
    for b, s in enumerate(samples):
        p = prefix_B[b]
        if p and first_B[b] == b:
            prefix_at[b] = row.add(s.input_ids[:p], 0, None)
        prefix = (prefix_at[first_B[b]], prefix_at[first_B[b]] + p) if p else None
        own_at[b] = row.add(s.input_ids[p:], p, prefix)
    p_B = torch.tensor(prefix_B)
    prefix_at_B = torch.tensor([prefix_at[first_B[b]] for b in range(len(samples))])
    own_at_B = torch.tensor(own_at)

    def flat(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Row position of token ``cols`` of sample ``rows``: in its prefix, or its own."""
        p = p_B[rows]
        return torch.where(cols < p, prefix_at_B[rows] + cols, own_at_B[rows] + cols - p)

    key_lens = [sum(end - start for start, end in spans) for spans in row.key_spans]
    layout = _Layout(
        input_ids=torch.cat(row.ids)[None],
        position_ids=torch.cat(row.positions)[None],
        cu_seqlens=torch.tensor([0, *row.segment_lens]).cumsum(0).to(torch.int32),
        target_index=flat(target_row, target_col),
        source_index=flat(target_row, target_col - 1),
        max_len_q=max(row.segment_lens),
        max_len_k=max(key_lens),
    )
    if sets:
        layout.key_index = torch.cat(
            [torch.arange(start, end) for spans in row.key_spans for start, end in spans]
        )
        layout.cu_seqlens_k = torch.tensor([0, *key_lens]).cumsum(0).to(torch.int32)
    return layout


def build_micro_batch(
    samples: Sequence[Sample],
    seq_index: Sequence[int],
    *,
    packed: bool = True,
    all_positions: bool = False,
    share_prefix: bool = False,
) -> MicroBatch:
    """Lays out ``samples`` (the micro-batch's sequences, in order) as model and loss inputs.

    An empty ``samples`` gives a two-token dummy with an empty loss mask. With
    ``all_positions`` the targets are every position but each sequence's first, not just the
    loss positions (used to check packing and to score whole sequences). With
    ``share_prefix`` (packed only), the samples of each :func:`sharing_sets` set put their
    common prefix in the row once.
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
        layout = _packed(samples, target_row, target_col, share_prefix=share_prefix)
    else:
        target_index = target_row * width + target_col
        layout = _Layout(
            input_ids=_pad_stack([s.input_ids for s in samples], width, 0),
            position_ids=torch.arange(width).expand(len(samples), width).contiguous(),
            attention_mask=_pad_stack(
                [torch.ones(n, dtype=torch.int64) for n in lengths], width, 0
            ),
            target_index=target_index,
            source_index=target_index - 1,
            max_len_q=width,
            max_len_k=width,
        )

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
        input_ids=layout.input_ids,
        position_ids=layout.position_ids,
        attention_mask=layout.attention_mask,
        cu_seqlens=layout.cu_seqlens,
        target_index=layout.target_index,
        source_index=layout.source_index,
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
        key_index=layout.key_index,
        cu_seqlens_k=layout.cu_seqlens_k,
        max_len_q=layout.max_len_q,
        max_len_k=layout.max_len_k,
    )
