"""The decode batch of the hf engine: sequences in rows of a preallocated KV cache.

Layout. Every layer's keys and values live in one buffer ``[rows R, kv heads, columns C,
head dim]``. All rows are *right-aligned*: the token each row feeds next goes into column
``L`` for every row at once, so one decode step is one forward pass of ``R`` tokens that
writes one column in place (no per-step concatenation). A row's prompt occupies the
columns just left of ``L`` when it joins; ``valid[r, c]`` marks which columns hold its
tokens, everything else is masked out.

Joining. New sequences take free rows and are prefilled in buckets of similar prompt
length (left-padded to the bucket's longest), writing their keys and values straight into
their rows; their first token is sampled from the prefill's last position. Identical
prompts are prefilled once and their rows copied; a prompt prefilled at an earlier step
under the same weights (a group's sample that joins after its siblings because the batch
was full) is copied whole from the prefix cache, with its last position's logits, and is
not computed again. When there are too few rows or too few columns to the left of ``L``,
the buffers are rebuilt (:meth:`DecodeBatch._relayout`), dropping free rows and the
columns no row uses any more.

Reuse. A sequence that finishes (``stop`` or ``length``) leaves the keys and values of its
tokens in the :class:`~asyncrl.engines.hf_prefix.PrefixCache`. A joining prompt that
begins with cached blocks (an agent's next turn; a prompt with a shared system prompt) has
that prefix copied into its row's first columns, and only its tail is prefilled: the
tail's queries attend to the whole row (:class:`_WriteThroughPast`). Rows with a cached
prefix are bucketed by tail length, apart from the rows prefilled from scratch, which run
exactly as without the cache.

Shared prefixes in decode. Rows whose first columns hold the same bits (copied from the
same cached blocks, or the leader whose prefill filled them; a group's identical prompts,
copied from one prefill: :attr:`Sequence.kv_chain`) are decoded with cascade attention
(:mod:`asyncrl.engines.hf_cascade`): their queries read one copy of the shared prefix, and
each row's own columns only past it. A step that would spare fewer key columns than
:data:`MIN_SHARED_SAVING` runs plain attention.

Images. A sequence with image inputs (``Sequence.pixels``) is prefilled alone, in its own
forward pass with its pixel inputs, then decodes in the shared batch like any row. For
Qwen2-VL that prefill takes the 3-D rotary positions of the whole prompt
(:func:`~asyncrl.models.vision.mrope_position_ids`) and the row's next position is one
past their largest, not the prompt's length: the row carries the model's rope delta in
``pos_R``, and its decode steps feed plain positions from there, equal on all three axes,
as the model's own generation does. Positions are always given explicitly, so the model's
own ``rope_deltas`` state is never read nor written. The prefix cache never holds nor
serves an image sequence's keys (two images of one size give the same token ids and
different keys); identical prompts share one prefill only when their image references are
identical too. For a vision model, the image placeholder ids are masked to −∞ before
every sample (:func:`~asyncrl.models.vision.mask_placeholders`), text rows included.

Masks are passed to the model as 4-D boolean tensors, so transformers' mask builders and
cache classes are bypassed. A padding query attends to itself: a fully masked row would
make SDPA return NaN, which would then poison the cache. Buffers are zeroed before use for
the same reason (a NaN times a zero attention weight is still NaN).

Everything here runs in the engine's single model thread; nothing is shared. Models are
full-attention decoders whose attention layers call ``update(k, v, layer)`` on the cache
object passed to the model and take an explicit ``position_ids`` (Llama, Qwen2, Mistral and
their kin). The cache goes in under the keyword the model's ``forward`` names:
``cache`` in recent transformers releases, ``past_key_values`` in older ones (5.24 warns
that the old name goes away in 5.40).
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.api.inference import SamplingParams
from asyncrl.engines import cpu_decode, hf_cascade
from asyncrl.engines.hf_prefix import BLOCK_TOKENS, Prefilled, PrefixCache
from asyncrl.engines.sampling import LogprobMode, sample_next
from asyncrl.models.vision import mask_placeholders, mrope_position_ids

COLUMN_SLACK = 64
"""Spare columns allocated past the current need, so that growth (one column per decode
step) triggers a rebuild only every few dozen steps."""


MIN_SHARED_SAVING = 2048
"""Key columns (per layer and key head) that cascade attention must spare a decode step
before the step takes it: plain attention reads every row's columns from the buffer's
first, cascade reads one copy of the prefix and every row's from ``w0``. SmolLM2's decode
on one CPU core, the two alternating step by step on one batch: 1.43x faster for 32 rows
sharing 432 tokens, 1.06x for 8 sharing 432 or 32 sharing 128, no faster below about
1,500 columns spared (32 rows sharing 48 tokens, 16 sharing 64)."""


MAX_PREFILL_PADDING = 0.25
"""Prompts of one prefill forward pass are left-padded to the longest; a bucket closes
when padding would exceed this share of its real tokens (compute spent on padding)."""


def _length_buckets(items: list[_Join], max_padding: float) -> list[list[_Join]]:
    """``items`` grouped by the length of the tail they prefill (shortest first) so that
    each group's padding stays within ``max_padding`` of its real tokens."""
    buckets: list[list[_Join]] = []
    real = 0
    for item in sorted(items, key=lambda j: j.tail):
        n = item.tail
        bucket = buckets[-1] if buckets else None
        if bucket is not None and (len(bucket) + 1) * n <= (1 + max_padding) * (real + n):
            bucket.append(item)
            real += n
        else:
            buckets.append([item])
            real = n
    return buckets


@dataclass(eq=False)
class Sequence:
    """One segment in flight. Created by the engine, owned by the model thread while it
    runs, handed back when finished."""

    key: int
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    max_new: int
    generator: torch.Generator | None = None
    images: tuple[str, ...] = ()
    """The prompt's image references; with ``pixels``, their inputs to the model (a batch
    of one, on the CPU). A sequence with pixels is prefilled alone and bypasses the prefix
    cache."""
    pixels: dict[str, torch.Tensor] | None = None
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    finish: str | None = None
    kv_chain: tuple[int, ...] = ()
    """Ids of the prefix cache's blocks whose very keys and values the sequence's first
    ``kv_chain_tokens`` columns hold (copied from them, or copied into them from this
    sequence's own prefill); empty when none."""
    kv_chain_tokens: int = 0

    def append(self, token: int, logprob: float, version: int) -> None:
        self.out_ids.append(token)
        self.out_logprobs.append(logprob)
        self.out_versions.append(version)
        if token in self.stop_ids:
            self.finish = "stop"
        elif len(self.out_ids) >= self.max_new:
            self.finish = "length"


@dataclass
class _Join:
    """A sequence joining the batch in ``row``, its first ``cached`` prompt tokens taken
    from the prefix cache (``kv``, ``[layers, 2, kv heads, cached, head dim]``)."""

    row: int
    seq: Sequence
    cached: int = 0
    kv: torch.Tensor | None = None

    @property
    def tail(self) -> int:
        """Prompt tokens the prefill computes."""
        return len(self.seq.prompt) - self.cached


@dataclass
class StepResult:
    finished: list[Sequence]
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefix_hit_tokens: int = 0
    decode_rows: int = 0
    padded_rows: int = 0
    tokens: int = 0
    relayouts: int = 0
    shared_rows: int = 0
    """Rows whose decode read a shared prefix once (cascade attention), and its length."""
    shared_tokens: int = 0


class _WriteThrough:
    """A cache object for prefill: stores each layer's keys/values into the batch's rows
    and columns, and hands them back unchanged (a prefill attends only to itself)."""

    is_compileable = False

    def __init__(self, batch: DecodeBatch, rows_N: torch.Tensor, start: int, end: int) -> None:
        self.batch, self.start, self.end = batch, start, end
        self.rows = _as_span(rows_N)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.batch.keys[layer_idx][self.rows, :, self.start : self.end] = key
        self.batch.values[layer_idx][self.rows, :, self.start : self.end] = value
        return key, value


def _uninitialised(shape: tuple[int, ...], **kw: Any) -> torch.Tensor:
    """Memory for the batch's keys and values, as it comes (a test fills it with NaN)."""
    return torch.empty(shape, **kw)


def _as_span(rows_N: torch.Tensor) -> torch.Tensor | slice:
    """``rows_N`` as a slice where they are consecutive ascending rows (the rows a join
    fills usually are): indexing a buffer with it gives a view, where a row tensor copies
    the rows out (and an assignment scatters them back)."""
    first = int(rows_N[0])
    n = rows_N.numel()
    if torch.equal(rows_N, torch.arange(first, first + n, device=rows_N.device)):
        return slice(first, first + n)
    return rows_N


class _WriteThroughPast:
    """A cache object for prefilling tails after cached prefixes: the queries are columns
    ``[end - T, end)``, the keys ``[end - P, end)`` (the prefix already in the rows). Each
    layer's new keys/values are written into the rows except at padding queries, whose
    columns may hold a shorter tail's prefix; returns the rows' keys/values of all ``P``
    columns."""

    is_compileable = False

    def __init__(
        self,
        batch: DecodeBatch,
        rows_N: torch.Tensor,
        end: int,
        keys: int,
        query_N1T1: torch.Tensor,
    ) -> None:
        self.batch, self.end, self.keys = batch, end, keys
        self.rows = _as_span(rows_N)
        self.query_N1T1 = query_N1T1

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = key.shape[2]
        out = []
        for buf, new in ((self.batch.keys[layer_idx], key), (self.batch.values[layer_idx], value)):
            # a view of the buffer where the rows are a span (written in place), else a copy
            rows_NHPD = buf[self.rows, :, self.end - self.keys : self.end]
            tail_NHTD = rows_NHPD[:, :, -t:]
            tail_NHTD.copy_(torch.where(self.query_N1T1, new, tail_NHTD))
            if not isinstance(self.rows, slice):
                buf[self.rows, :, self.end - t : self.end] = tail_NHTD
            out.append(rows_NHPD)
        return out[0], out[1]


class _InPlace:
    """A cache object for decode: writes column ``L`` in place and returns views of
    columns ``[0, L]``."""

    is_compileable = False

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch = batch

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, col = self.batch, self.batch.length
        b.keys[layer_idx][:, :, col : col + 1] = key
        b.values[layer_idx][:, :, col : col + 1] = value
        return b.keys[layer_idx][:, :, : col + 1], b.values[layer_idx][:, :, : col + 1]


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model``'s ``forward`` takes a cache object: ``cache`` in
    transformers releases that renamed it, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class DecodeBatch:
    """Continuous batching state: rows, the in-place KV cache, and one step of work."""

    def __init__(
        self,
        model: Any,
        *,
        max_positions: int,
        logprob_mode: LogprobMode = "processed",
        max_prefill_padding: float = MAX_PREFILL_PADDING,
        prefix_cache_bytes: int = 0,
        placeholder_ids: list[int] | None = None,
        shared_prefix_attention: bool = True,
        decode_layers: bool = False,
    ) -> None:
        """``placeholder_ids``: a vision model's image tokens, never sampled (None or empty
        for a text model). ``shared_prefix_attention``: decode rows that share cached
        prefix blocks with cascade attention (a text model under SDPA on the CPU, with the
        prefix cache on); the model's attention implementation becomes ``asyncrl_decode``.
        ``decode_layers``: decode steps a decoder layer at a time in C
        (:mod:`~asyncrl.engines.cpu_decode`) where the model is one it computes (a float32
        llama or qwen2 on the CPU with the kernel's linear layers) and the step one it
        takes; every other step through the model."""
        cfg = model.config.get_text_config()
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"the hf engine runs full-attention decoders only; this model has layers "
                f"{sorted(set(layer_types))}"
            )
        self.max_prefill_padding = max_prefill_padding
        self.model = model
        self.cache_kw = cache_keyword(model)
        self.max_positions = max_positions
        self.logprob_mode: LogprobMode = logprob_mode
        self.n_layers = cfg.num_hidden_layers
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        block_bytes = (
            self.n_layers
            * 2
            * self.n_kv_heads
            * BLOCK_TOKENS
            * self.head_dim
            * param.element_size()
        )
        self.prefix = PrefixCache(prefix_cache_bytes, block_bytes)
        self._own_ids = itertools.count(-1, -1)
        self.placeholder_ids = list(placeholder_ids or [])
        # Qwen2-VL computes 3-D rotary positions from the image grids; Idefics3's are 1-D
        self.mrope = hasattr(getattr(model, "model", None), "get_rope_index")
        image_token = getattr(model.config, "image_token_id", None)
        self.image_token_id = -1 if image_token is None else int(image_token)
        # On the CPU the engine's own attention function: it prefills grouped-query heads
        # without copying them (hf_cascade.grouped_attention) and runs the cascade steps
        cpu_sdpa = (
            self.device.type == "cpu"
            and not self.placeholder_ids
            and getattr(model.config, "_attn_implementation", None) == "sdpa"
        )
        self.cascade = shared_prefix_attention and cpu_sdpa and self.prefix.enabled
        if cpu_sdpa:
            model.set_attn_implementation(hf_cascade.ATTN_IMPLEMENTATION)
        self.layers: cpu_decode.DecodeLayers | None = None
        if decode_layers and not self.placeholder_ids and cpu_decode.unsupported(model) is None:
            self.layers = cpu_decode.DecodeLayers(model)
        self.rows: list[Sequence | None] = []
        self.length = 0  # L: the column the next decode step writes
        self._reset_buffers(0, 0)

    # --- bookkeeping ------------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        return [r for r, s in enumerate(self.rows) if s is not None]

    @property
    def capacity(self) -> int:
        return self.valid_RC.shape[1]

    def _reset_buffers(self, rows: int, cols: int) -> None:
        """New buffers; the keys and values are not initialised (:meth:`_relayout` fills the
        columns left of ``L``: a column from ``L`` on is written before anything reads it,
        by the decode step that writes column ``L`` of every row or by a prefill)."""
        shape = (rows, self.n_kv_heads, cols, self.head_dim)
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        self.keys = [_uninitialised(shape, **kw) for _ in range(self.n_layers)]
        self.values = [_uninitialised(shape, **kw) for _ in range(self.n_layers)]
        self.valid_RC = torch.zeros(rows, cols, dtype=torch.bool, device=self.device)
        self.next_R = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.pos_R = torch.zeros(rows, dtype=torch.long, device=self.device)

    def _first_used_column(self, rows: list[int]) -> int:
        if not rows:
            return self.length
        used_C = self.valid_RC[rows, : self.length].any(dim=0)
        nz = used_C.nonzero()
        return int(nz[0]) if nz.numel() else self.length

    def _relayout(self, keep: list[int], n_rows: int, left: int, min_free_cols: int) -> None:
        """Rebuilds the buffers with ``n_rows`` rows; old rows ``keep`` become rows
        ``0..len(keep)-1``. Columns no kept row uses are dropped, then ``left`` empty columns
        are added on the left, and at least ``min_free_cols`` columns stay free past ``L``."""
        trim = self._first_used_column(keep)
        used = self.length - trim
        new_len = left + used
        cols = new_len + max(min_free_cols, COLUMN_SLACK, new_len // 2)
        old_k, old_v, old_valid = self.keys, self.values, self.valid_RC
        old_next, old_pos, old_rows = self.next_R, self.pos_R, self.rows
        self._reset_buffers(n_rows, cols)
        # Columns left of L hold the kept rows' keys and values, zeros elsewhere: masked
        # columns are still read by the attention kernels (times a zero weight), so they
        # must hold numbers; columns from L on are left as they are (see _reset_buffers).
        idx = torch.tensor(keep, device=self.device) if keep else None
        kept = len(keep) if keep and used else 0
        src = _as_span(idx) if idx is not None and kept else None
        for layer in range(self.n_layers):
            for buf, old in ((self.keys[layer], old_k[layer]), (self.values[layer], old_v[layer])):
                if src is not None:
                    buf[:kept, :, :left].zero_()
                    buf[:kept, :, left:new_len] = old[src, :, trim : self.length]
                buf[kept:, :, :new_len].zero_()
        if src is not None:
            self.valid_RC[:kept, left:new_len] = old_valid[src, trim : self.length]
        if idx is not None:
            self.next_R[: len(keep)] = old_next[idx]
            self.pos_R[: len(keep)] = old_pos[idx]
        self.rows = [old_rows[r] for r in keep] + [None] * (n_rows - len(keep))
        self.length = new_len

    def abort_all(self) -> list[Sequence]:
        """Ends every running sequence with ``abort`` and forgets the cache."""
        aborted = [s for s in self.rows if s is not None]
        for s in aborted:
            s.finish = "abort"
        self.rows, self.length = [], 0
        self._reset_buffers(0, 0)
        return aborted

    # --- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, admit: list[Sequence], drop: set[int], version: int) -> StepResult:
        """Drops the sequences keyed in ``drop``, prefills ``admit``, then decodes one token
        for every running row. Returns the sequences that finished."""
        result = StepResult(finished=[])
        self.prefix.at_version(version)
        for r, s in enumerate(self.rows):
            if s is not None and s.key in drop:
                self._free(r)
        if admit:
            self._admit(admit, version, result)
            self._collect_finished(result)
        self._maybe_compact(result)
        active = self.active
        if active:
            self._decode(active, version, result)
            self._collect_finished(result)
        if not self.active and self.rows:
            self.rows, self.length = [], 0
            self._reset_buffers(0, 0)
        return result

    def _free(self, row: int) -> None:
        self.rows[row] = None
        self.valid_RC[row] = False

    def _collect_finished(self, result: StepResult) -> None:
        for r, s in enumerate(self.rows):
            if s is not None and s.finish is not None:
                result.finished.append(s)
                if s.finish != "abort" and s.pixels is None:
                    # the last token was sampled and never fed: its keys were not computed
                    self._offer(r, s.prompt + s.out_ids[:-1])
                self._free(r)

    def _offer(self, row: int, tokens: list[int]) -> list[int]:
        """Offers the prefix cache the keys and values of ``tokens``, which ``row`` holds
        in the columns just left of ``L``; returns the ids of the blocks made from them."""
        if not self.prefix.enabled:
            return []
        start = self.length - len(tokens)
        return self.prefix.insert(tokens, lambda a, b: self._read_row(row, start + a, start + b))

    def _read_row(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of the keys and values ``row`` holds in columns ``start..end-1``:
        ``[layers, 2, kv heads, end - start, head dim]``."""
        cols = slice(start, end)
        layers = [
            buf[layer][row, :, cols]
            for layer in range(self.n_layers)
            for buf in (self.keys, self.values)
        ]
        return torch.stack(layers).unflatten(0, (self.n_layers, 2))

    def _admit(self, admit: list[Sequence], version: int, result: StepResult) -> None:
        active = self.active
        free = [r for r, s in enumerate(self.rows) if s is None]
        longest = max(len(s.prompt) for s in admit)
        trim = self._first_used_column(active)
        left = max(0, longest - (self.length - trim))
        if len(free) < len(admit) or left > 0 or self.length + 1 > self.capacity:
            self._relayout(active, len(active) + len(admit), left, min_free_cols=1)
            result.relayouts += 1
            free = [r for r, s in enumerate(self.rows) if s is None]
        rows = free[: len(admit)]
        for r, s in zip(rows, admit, strict=True):
            self.rows[r] = s
            self.valid_RC[r] = False
            s.kv_chain, s.kv_chain_tokens = (), 0

        # A GRPO group sends one prompt n times: prefill it once and copy its cache.
        source: dict[tuple[tuple[int, ...], tuple[str, ...]], int] = {}
        copies: list[tuple[int, int]] = []
        cold: list[_Join] = []
        warm: list[_Join] = []
        # A prompt that misses the cache but begins with the same block as another one
        # joining now (a shared system prompt, say after a weight update emptied the cache)
        # waits for that one's prefill, which is then offered to the cache, and looks again.
        leaders: dict[tuple[int, ...], _Join] = {}
        followed: dict[int, _Join] = {}
        waiting: list[_Join] = []
        vision: list[_Join] = []
        # a prompt prefilled earlier under these weights, kept whole: no forward pass
        whole: list[tuple[int, Prefilled]] = []
        for r, s in zip(rows, admit, strict=True):
            tokens = tuple(s.prompt)
            key = (tokens, s.images)
            if key in source:
                copies.append((r, source[key]))
                continue
            source[key] = r
            if s.pixels is not None:
                vision.append(_Join(r, s))
                continue
            prefilled = self.prefix.prompt(s.prompt)
            if prefilled is not None:
                whole.append((r, prefilled))
                continue
            join = self._lookup(r, s)
            first = (
                tokens[:BLOCK_TOKENS] if self.prefix.enabled and len(tokens) > BLOCK_TOKENS else ()
            )
            if join.cached:
                warm.append(join)
            elif first in leaders:
                followed[leaders[first].row] = leaders[first]
                waiting.append(join)
            else:
                if first:
                    leaders[first] = join
                cold.append(join)
        logits_by_row: dict[int, torch.Tensor] = {}
        self._prefill_joins(cold, logits_by_row)
        for leader in followed.values():
            # a leader missed the cache: the blocks of its prompt are made from its row
            seq = leader.seq
            made = tuple(self._offer(leader.row, seq.prompt))
            if made and self.prefix.chain(seq.prompt, len(made) * BLOCK_TOKENS) == made:
                seq.kv_chain, seq.kv_chain_tokens = made, len(made) * BLOCK_TOKENS
        late: list[_Join] = []
        for join in waiting:
            join = self._lookup(join.row, join.seq)
            (warm if join.cached else late).append(join)
        for join in warm:
            self._fill_prefix(join)
        self._prefill_joins(late, logits_by_row)
        self._prefill_joins(warm, logits_by_row)
        for join in vision:
            logits_by_row[join.row] = self._prefill_vision(join)
        for join in cold + late + warm:
            self._keep_prompt(join.row, logits_by_row[join.row])
        for r, prefilled in whole:
            self._fill_prompt(r, prefilled)
            logits_by_row[r] = prefilled.logits
        if copies:
            dst = torch.tensor([d for d, _ in copies], device=self.device)
            src = torch.tensor([c for _, c in copies], device=self.device)
            cols = slice(self.length - longest, self.length)
            for layer in range(self.n_layers):
                self.keys[layer][dst, :, cols] = self.keys[layer][src, :, cols]
                self.values[layer][dst, :, cols] = self.values[layer][src, :, cols]
            self.valid_RC[dst] = self.valid_RC[src]
            self.pos_R[dst] = self.pos_R[src]
            for d, c in copies:
                logits_by_row[d] = logits_by_row[c]
                dst_seq, src_seq = self.rows[d], self.rows[c]
                assert dst_seq is not None and src_seq is not None
                self._own_chain(src_seq)
                dst_seq.kv_chain = src_seq.kv_chain
                dst_seq.kv_chain_tokens = src_seq.kv_chain_tokens
        logits_NV = torch.stack([logits_by_row[r] for r in rows])
        rows_N = torch.tensor(rows, device=self.device)
        result.tokens += self._sample(logits_NV, admit, rows_N, version)
        result.prefill_rows = len(admit)
        result.prefill_tokens = sum(j.tail for j in cold + late + warm + vision)
        result.prefix_hit_tokens = sum(j.cached for j in warm) + sum(
            p.kv.shape[3] for _, p in whole
        )

    def _own_chain(self, seq: Sequence) -> None:
        """Gives ``seq``, whose prompt its own prefill computed, ids for its prompt's
        columns where it has none, so that the rows copied from it share them (negative:
        no cache block has them)."""
        if not seq.kv_chain:
            n = len(seq.prompt)
            seq.kv_chain = tuple(next(self._own_ids) for _ in range(-(-n // BLOCK_TOKENS)))
            seq.kv_chain_tokens = n

    def _keep_prompt(self, row: int, logits_V: torch.Tensor) -> None:
        """Keeps the prompt ``row`` has just prefilled, whole, with its last logits
        (:meth:`PrefixCache.keep_prompt`)."""
        if not self.prefix.enabled:
            return
        seq = self.rows[row]
        assert seq is not None
        self._own_chain(seq)
        kv = self._read_row(row, self.length - len(seq.prompt), self.length)
        self.prefix.keep_prompt(
            seq.prompt, Prefilled(kv, logits_V.clone(), seq.kv_chain, seq.kv_chain_tokens)
        )

    def _fill_prompt(self, row: int, prefilled: Prefilled) -> None:
        """Writes a prompt kept whole into ``row``, right-aligned at ``L``."""
        seq = self.rows[row]
        assert seq is not None
        n = len(seq.prompt)
        self._fill_prefix(_Join(row, seq, n, prefilled.kv))  # all of it: no tail
        self.valid_RC[row, self.length - n : self.length] = True
        self.pos_R[row] = n
        seq.kv_chain, seq.kv_chain_tokens = prefilled.chain, prefilled.chain_tokens

    def _lookup(self, row: int, seq: Sequence) -> _Join:
        """``seq`` joining in ``row`` with what the prefix cache holds of its prompt, and
        the ids of the very blocks it copies (a later offer may evict them and make others
        under the same tokens)."""
        cached, kv, seq.kv_chain = self.prefix.lookup_blocks(seq.prompt)
        seq.kv_chain_tokens = cached
        return _Join(row, seq, cached, kv)

    def _fill_prefix(self, join: _Join) -> None:
        """Copies the cached prefix of ``join``'s prompt into the first columns of its row,
        which ends at ``L``."""
        assert join.kv is not None
        cols = slice(self.length - len(join.seq.prompt), self.length - join.tail)
        for layer in range(self.n_layers):
            self.keys[layer][join.row, :, cols] = join.kv[layer, 0]
            self.values[layer][join.row, :, cols] = join.kv[layer, 1]
        join.kv = None

    def _prefill_joins(self, joins: list[_Join], logits_by_row: dict[int, torch.Tensor]) -> None:
        """Prefills ``joins`` in length buckets; records each row's last logits."""
        for bucket in _length_buckets(joins, self.max_prefill_padding):
            bucket.sort(key=lambda j: j.row)  # consecutive rows are written in place
            for join, logits_V in zip(bucket, self._prefill(bucket), strict=True):
                logits_by_row[join.row] = logits_V

    def _prefill(self, bucket: list[_Join]) -> torch.Tensor:
        """One forward pass over the tails of ``bucket``'s prompts (left-padded to the
        longest, ``T`` tokens), writing their cache into their rows, right-aligned at ``L``;
        returns the logits of each prompt's last position, ``[n, V]``. The keys span the
        longest whole prompt, ``P`` columns: a row's cached prefix is in place already."""
        tail = max(j.tail for j in bucket)
        whole = max(len(j.seq.prompt) for j in bucket)
        end, dev = self.length, self.device
        ids_NT = torch.zeros(len(bucket), tail, dtype=torch.long)
        query_NT = torch.zeros(len(bucket), tail, dtype=torch.bool)
        key_NP = torch.zeros(len(bucket), whole, dtype=torch.bool)
        cached_N1 = torch.tensor([[j.cached] for j in bucket], dtype=torch.long)
        for i, j in enumerate(bucket):
            ids_NT[i, tail - j.tail :] = torch.tensor(j.seq.prompt[j.cached :], dtype=torch.long)
            query_NT[i, tail - j.tail :] = True
            key_NP[i, whole - len(j.seq.prompt) :] = True
        pos_NT = (cached_N1 + query_NT.long().cumsum(-1) - 1).clamp(min=0)
        ids_NT, query_NT, key_NP, pos_NT = (t.to(dev) for t in (ids_NT, query_NT, key_NP, pos_NT))
        # query i sits in key column whole - tail + i; a padding query attends to itself
        query_col_T1 = torch.arange(whole - tail, whole, device=dev)[:, None]
        key_col_1P = torch.arange(whole, device=dev)[None, :]
        causal_TP, self_TP = key_col_1P <= query_col_T1, key_col_1P == query_col_T1
        mask_N1TP = (causal_TP[None] & (key_NP[:, None, :] | self_TP[None]))[:, None]
        rows_N = torch.tensor([j.row for j in bucket], device=dev)
        cache: _WriteThrough | _WriteThroughPast
        if whole == tail:  # nothing cached: the tails are the whole prompts
            cache = _WriteThrough(self, rows_N, end - tail, end)
        else:
            cache = _WriteThroughPast(self, rows_N, end, whole, query_NT[:, None, :, None])
        out = self.model(
            input_ids=ids_NT,
            attention_mask=mask_N1TP,
            position_ids=pos_NT,
            **{self.cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.valid_RC[rows_N, end - whole : end] = key_NP
        self.pos_R[rows_N] = torch.tensor([len(j.seq.prompt) for j in bucket], device=dev)
        return out.logits[:, -1]

    def _prefill_vision(self, join: _Join) -> torch.Tensor:
        """One forward pass over ``join``'s whole prompt with its pixel inputs, writing its
        keys and values into its row, right-aligned at ``L``; returns the last position's
        logits, ``[V]``, and leaves the row's next position in ``pos_R``."""
        s, end, dev = join.seq, self.length, self.device
        assert s.pixels is not None
        n = len(s.prompt)
        ids_1T = torch.tensor([s.prompt], dtype=torch.long, device=dev)
        inputs = {k: v.to(dev) for k, v in s.pixels.items()}
        if self.mrope:
            inputs["mm_token_type_ids"] = (ids_1T == self.image_token_id).long()
            pos = mrope_position_ids(self.model, {"input_ids": ids_1T, **inputs})  # [3, 1, T]
        else:
            pos = torch.arange(n, device=dev)[None]
        mask_11TT = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None]
        rows_N = torch.tensor([join.row], device=dev)
        out = self.model(
            input_ids=ids_1T,
            attention_mask=mask_11TT,
            position_ids=pos,
            **inputs,
            **{self.cache_kw: _WriteThrough(self, rows_N, end - n, end)},
            use_cache=True,
            logits_to_keep=1,
        )
        self.valid_RC[join.row, end - n : end] = True
        self.pos_R[join.row] = int(pos.max()) + 1
        return out.logits[0, -1]

    def _decode(self, active: list[int], version: int, result: StepResult) -> None:
        if self.length + 1 > self.capacity:
            self._relayout(active, len(active), 0, min_free_cols=1)
            result.relayouts += 1
            active = list(range(len(active)))
        col = self.length
        mask_RC = self.valid_RC[:, : col + 1].clone()
        mask_RC[:, col] = True
        plan = self._shared_plan(active, mask_RC) if self.cascade else None
        if plan is not None:
            result.shared_rows, result.shared_tokens = plan.group_G.numel(), plan.prefix
        logits_RV = None
        if plan is None and self.layers is not None and self.layers.ready(len(self.rows)):
            logits_RV = self.layers.logits(self.next_R, self.pos_R, mask_RC, self.keys, self.values)
        if logits_RV is None:
            logits_RV = self._model_logits(mask_RC, plan)
        rows_A = torch.tensor(active, device=self.device)
        self.valid_RC[rows_A, col] = True
        self.pos_R[rows_A] += 1
        self.length = col + 1
        seqs = [s for s in (self.rows[r] for r in active) if s is not None]
        # every row active (the usual step): the logits as they are, no gathered copy
        every = len(active) == len(self.rows)
        logits_AV = logits_RV if every else logits_RV[rows_A]
        result.tokens += self._sample(logits_AV, seqs, rows_A, version)
        result.decode_rows = len(active)
        result.padded_rows = len(self.rows)

    def _model_logits(
        self, mask_RC: torch.Tensor, plan: hf_cascade.CascadePlan | None
    ) -> torch.Tensor:
        """The decode step through the model's own layers (cascade attention where ``plan``
        is one): each row's next-token logits ``[R, V]``, attending to the columns
        ``mask_RC`` allows; writes column ``L`` of the keys and values."""
        hf_cascade.set_plan(plan)
        try:
            out = self.model(
                input_ids=self.next_R[:, None],
                attention_mask=mask_RC[:, None, None, :],
                position_ids=self.pos_R[:, None],
                **{self.cache_kw: _InPlace(self)},
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            hf_cascade.set_plan(None)
        logits_RV: torch.Tensor = out.logits[:, -1]
        return logits_RV

    def _shared_plan(
        self, active: list[int], mask_RC: torch.Tensor
    ) -> hf_cascade.CascadePlan | None:
        """This decode step's cascade split (``mask_RC``: what each row attends to, the
        column ``L`` included), or None where plain attention is as cheap: the rows with the
        most common first cached block are the group, their longest common chain the shared
        prefix."""
        chained = [(r, s) for r in active if (s := self.rows[r]) is not None and s.kv_chain]
        if len(chained) < 2:
            return None
        first = Counter(s.kv_chain[0] for _, s in chained).most_common(1)[0][0]
        group = [(r, s) for r, s in chained if s.kv_chain[0] == first]
        if len(group) < 2:
            return None
        chains = [s.kv_chain for _, s in group]
        blocks = 0
        while blocks < min(map(len, chains)) and len({c[blocks] for c in chains}) == 1:
            blocks += 1
        prefix = min(blocks * BLOCK_TOKENS, *(s.kv_chain_tokens for _, s in group))
        if prefix < BLOCK_TOKENS:
            return None
        col = mask_RC.shape[1] - 1
        start_R = mask_RC.to(torch.uint8).argmax(dim=1)  # each row's first column
        end_R = start_R.clone()  # where each row's own columns begin
        group_G = torch.tensor([r for r, _ in group], device=self.device)
        end_R[group_G] += prefix
        w0 = int(end_R.min())
        if len(self.rows) * w0 - prefix < MIN_SHARED_SAVING:
            return None
        window_RW = mask_RC[:, w0:] & (
            torch.arange(w0, col + 1, device=self.device)[None, :] >= end_R[:, None]
        )
        bias_RW = torch.zeros(window_RW.shape, dtype=self.dtype, device=self.device)
        bias_RW.masked_fill_(~window_RW, float("-inf"))
        ref = group[0][0]
        return hf_cascade.CascadePlan(
            group_G=group_G,
            ref=ref,
            ref_start=int(start_R[ref]),
            prefix=prefix,
            w0=w0,
            window_bias=bias_RW[:, None, None, :],
        )

    def _sample(
        self, logits_NV: torch.Tensor, seqs: list[Sequence], rows_N: torch.Tensor, version: int
    ) -> int:
        """Samples the next token of ``seqs`` (in rows ``rows_N``) and records it."""
        dev = self.device
        if self.placeholder_ids:
            logits_NV = mask_placeholders(logits_NV, self.placeholder_ids)
        tokens_N, logprobs_N = sample_next(
            logits_NV,
            torch.tensor([s.sampling.temperature for s in seqs], device=dev),
            torch.tensor([s.sampling.top_k for s in seqs], device=dev),
            torch.tensor([s.sampling.top_p for s in seqs], device=dev),
            [s.generator for s in seqs],
            self.logprob_mode,
        )
        self.next_R[rows_N] = tokens_N
        for s, tok, lp, pos in zip(
            seqs, tokens_N.tolist(), logprobs_N.tolist(), self.pos_R[rows_N].tolist(), strict=True
        ):
            s.append(tok, lp, version)
            if s.finish is None and pos + 1 >= self.max_positions:
                s.finish = "length"  # the next token would have no position left
        return len(seqs)

    def _maybe_compact(self, result: StepResult) -> None:
        """Drops free rows once they are a quarter of the batch: a free row costs a full
        row of compute every step until it is refilled, a rebuild costs one copy."""
        free = len(self.rows) - len(self.active)
        if free and 4 * free >= len(self.rows):
            self._relayout(self.active, len(self.active), 0, min_free_cols=1)
            result.relayouts += 1
