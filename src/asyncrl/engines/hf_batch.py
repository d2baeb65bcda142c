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
prompts are prefilled once and their rows copied. When there are too few rows or too few
columns to the left of ``L``, the buffers are rebuilt (:meth:`DecodeBatch._relayout`),
dropping free rows and the columns no row uses any more.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.api.inference import SamplingParams
from asyncrl.engines.sampling import LogprobMode, sample_next

COLUMN_SLACK = 64
"""Spare columns allocated past the current need, so that growth (one column per decode
step) triggers a rebuild only every few dozen steps."""


MAX_PREFILL_PADDING = 0.25
"""Prompts of one prefill forward pass are left-padded to the longest; a bucket closes
when padding would exceed this share of its real tokens (compute spent on padding)."""


def _length_buckets(
    items: list[tuple[int, Sequence]], max_padding: float
) -> list[list[tuple[int, Sequence]]]:
    """``items`` grouped by prompt length (shortest first) so that each group's padding
    stays within ``max_padding`` of its real tokens."""
    buckets: list[list[tuple[int, Sequence]]] = []
    real = 0
    for item in sorted(items, key=lambda rs: len(rs[1].prompt)):
        n = len(item[1].prompt)
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
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    finish: str | None = None

    def append(self, token: int, logprob: float, version: int) -> None:
        self.out_ids.append(token)
        self.out_logprobs.append(logprob)
        self.out_versions.append(version)
        if token in self.stop_ids:
            self.finish = "stop"
        elif len(self.out_ids) >= self.max_new:
            self.finish = "length"


@dataclass
class StepResult:
    finished: list[Sequence]
    prefill_rows: int = 0
    prefill_tokens: int = 0
    decode_rows: int = 0
    padded_rows: int = 0
    tokens: int = 0
    relayouts: int = 0


class _WriteThrough:
    """A cache object for prefill: stores each layer's keys/values into the batch's rows
    and columns, and hands them back unchanged (a prefill attends only to itself)."""

    is_compileable = False

    def __init__(self, batch: DecodeBatch, rows_N: torch.Tensor, start: int, end: int) -> None:
        self.batch, self.rows_N, self.start, self.end = batch, rows_N, start, end

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.batch.keys[layer_idx][self.rows_N, :, self.start : self.end] = key
        self.batch.values[layer_idx][self.rows_N, :, self.start : self.end] = value
        return key, value


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
    ) -> None:
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
        shape = (rows, self.n_kv_heads, cols, self.head_dim)
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        self.keys = [torch.zeros(shape, **kw) for _ in range(self.n_layers)]
        self.values = [torch.zeros(shape, **kw) for _ in range(self.n_layers)]
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
        if keep and used:
            idx = torch.tensor(keep, device=self.device)
            dst = slice(left, new_len)
            for layer in range(self.n_layers):
                self.keys[layer][: len(keep), :, dst] = old_k[layer][idx, :, trim : self.length]
                self.values[layer][: len(keep), :, dst] = old_v[layer][idx, :, trim : self.length]
            self.valid_RC[: len(keep), dst] = old_valid[idx, trim : self.length]
        if keep:
            idx = torch.tensor(keep, device=self.device)
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
                self._free(r)

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

        # A GRPO group sends one prompt n times: prefill it once and copy its cache.
        source: dict[tuple[int, ...], int] = {}
        copies: list[tuple[int, int]] = []
        unique: list[tuple[int, Sequence]] = []
        for r, s in zip(rows, admit, strict=True):
            key = tuple(s.prompt)
            if key in source:
                copies.append((r, source[key]))
            else:
                source[key] = r
                unique.append((r, s))
        logits_by_row: dict[int, torch.Tensor] = {}
        for bucket in _length_buckets(unique, self.max_prefill_padding):
            for r, logits_V in zip((r for r, _ in bucket), self._prefill(bucket), strict=True):
                logits_by_row[r] = logits_V
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
        logits_NV = torch.stack([logits_by_row[r] for r in rows])
        rows_N = torch.tensor(rows, device=self.device)
        result.tokens += self._sample(logits_NV, admit, rows_N, version)
        result.prefill_rows = len(admit)
        result.prefill_tokens = sum(len(s.prompt) for _, s in unique)

    def _prefill(self, bucket: list[tuple[int, Sequence]]) -> torch.Tensor:
        """One forward pass over the prompts of ``bucket`` (left-padded to the longest),
        writing their cache into their rows, right-aligned at ``L``; returns the logits
        of each prompt's last position, ``[n, V]``."""
        longest = max(len(s.prompt) for _, s in bucket)
        end = self.length
        ids_NP = torch.zeros(len(bucket), longest, dtype=torch.long)
        valid_NP = torch.zeros(len(bucket), longest, dtype=torch.bool)
        for i, (_, s) in enumerate(bucket):
            n = len(s.prompt)
            ids_NP[i, longest - n :] = torch.tensor(s.prompt, dtype=torch.long)
            valid_NP[i, longest - n :] = True
        ids_NP, valid_NP = ids_NP.to(self.device), valid_NP.to(self.device)
        pos_NP = (valid_NP.long().cumsum(-1) - 1).clamp(min=0)
        causal_PP = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        eye_PP = torch.eye(longest, dtype=torch.bool, device=self.device)
        mask_N1PP = (causal_PP[None] & (valid_NP[:, None, :] | eye_PP[None]))[:, None]
        rows_N = torch.tensor([r for r, _ in bucket], device=self.device)
        out = self.model(
            input_ids=ids_NP,
            attention_mask=mask_N1PP,
            position_ids=pos_NP,
            **{self.cache_kw: _WriteThrough(self, rows_N, end - longest, end)},
            use_cache=True,
            logits_to_keep=1,
        )
        self.valid_RC[rows_N, end - longest : end] = valid_NP
        self.pos_R[rows_N] = valid_NP.sum(-1)
        return out.logits[:, -1]

    def _decode(self, active: list[int], version: int, result: StepResult) -> None:
        if self.length + 1 > self.capacity:
            self._relayout(active, len(active), 0, min_free_cols=1)
            result.relayouts += 1
            active = list(range(len(active)))
        col = self.length
        mask_R11C = self.valid_RC[:, : col + 1].clone()
        mask_R11C[:, col] = True
        out = self.model(
            input_ids=self.next_R[:, None],
            attention_mask=mask_R11C[:, None, None, :],
            position_ids=self.pos_R[:, None],
            **{self.cache_kw: _InPlace(self)},
            use_cache=True,
            logits_to_keep=1,
        )
        rows_A = torch.tensor(active, device=self.device)
        self.valid_RC[rows_A, col] = True
        self.pos_R[rows_A] += 1
        self.length = col + 1
        seqs = [s for s in (self.rows[r] for r in active) if s is not None]
        result.tokens += self._sample(out.logits[rows_A, -1], seqs, rows_A, version)
        result.decode_rows = len(active)
        result.padded_rows = len(self.rows)

    def _sample(
        self, logits_NV: torch.Tensor, seqs: list[Sequence], rows_N: torch.Tensor, version: int
    ) -> int:
        """Samples the next token of ``seqs`` (in rows ``rows_N``) and records it."""
        dev = self.device
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
