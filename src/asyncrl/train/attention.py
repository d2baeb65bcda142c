"""Causal attention over packed sequences without a ``[N, N]`` mask.

transformers isolates packed sequences by building a block-diagonal mask from the
position restarts. That is exact, but sdpa then scores all ``N²`` query/key pairs of the
packed row (and a mask of ``N²`` bytes is built per forward), where the sequences need only
``Σ L²``: on 8k-token micro-batches of GSM8K-length sequences that is ~20× the attention
work, and packing loses to padding. This backend attends within each sequence only, from
the ``cu_seq_lens_q`` boundaries that the engine passes down through the model's
``**kwargs`` (the names transformers' own flash-attention path uses):

- CUDA, bf16/fp16: one flash varlen kernel (``torch.nn.attention.varlen``) when this torch
  has it;
- otherwise: one causal sdpa call per sequence (on the CPU, a bf16 or fp16 sequence of
  up to :data:`CPU_FLOAT32_KEYS` keys computed in float32, which is faster there).

Without boundaries it is plain causal attention per row, which is exact for the real
tokens of right-padded rows (a real token only sees earlier, real tokens); padded
positions get garbage that the engine never reads.

Shared prefixes (``trainer.share_prefix``): a segment may attend to more keys than it has
queries. ``key_index`` lists the row positions whose keys and values the segments attend
(segment after segment: a shared prefix's, then the segment's own) and ``cu_seq_lens_k``
cuts it per segment. Each segment's ``L`` queries attend its ``K ≥ L`` keys causally from
the bottom-right corner: query ``i`` sees keys ``0 … i + K − L``, so all of the prefix and
its own tokens up to itself. The CPU path gives sdpa that mask explicitly; flash varlen
aligns its causal mask to the same corner when keys outnumber queries.

Registered with transformers as ``asyncrl_varlen`` on import of this module.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "asyncrl_varlen"


def _repeat_kv(states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, H_kv, T, D] -> [B, H_kv·n_rep, T, D]`` (grouped-query attention)."""
    return states if n_rep == 1 else states.repeat_interleave(n_rep, dim=1)


def _flash_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 - absent before torch 2.9: the fallback is the padded path
    except ImportError:
        return None
    return varlen_attn


_VARLEN = _flash_varlen()
# The varlen API changed between torch releases: is_causal (≤ 2.11) became window_size.
_VARLEN_PARAMS = set(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else set()


def _varlen_cuda(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor],
    max_len: tuple[int, int],
    scale: float | None,
) -> torch.Tensor:
    """Flash varlen on one packed row, ``cu_seqlens`` and ``max_len`` for the queries and
    the keys; returns ``[1, T, H, D]``."""
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q_BHTD, k_BHTD, v_BHTD))  # [T, H, D]
    kwargs: dict[str, Any] = {}
    if scale is not None:
        if "scale" in _VARLEN_PARAMS:
            kwargs["scale"] = scale
        else:  # the kernel's own scale is 1/√D; fold the model's into the queries
            q = q * (scale * math.sqrt(q.shape[-1]))
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    else:
        n_rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(n_rep, dim=1) for t in (k, v))
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32) for cu in cu_seqlens)
    out = _VARLEN(q, k, v, cu_q, cu_k, *max_len, **kwargs)
    return out[None]  # type: ignore[no-any-return]


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on for the query's device (a
    bf16 model over float32 master weights computes q/k/v in bf16, but the rotary
    embedding's float32 cos/sin hand them back in float32; sdpa would cast them down
    itself), else the query's own."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _flash_applies(query: torch.Tensor, dtype: torch.dtype, dropout_p: float) -> bool:
    """Whether the flash varlen kernel takes the call: a torch that has it, CUDA, compute
    in bf16 or fp16 (``dtype``), no dropout."""
    return (
        _VARLEN is not None
        and query.is_cuda
        and dtype in (torch.bfloat16, torch.float16)
        and dropout_p == 0.0
    )


def _bottom_right_causal(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """``[n_q, n_k]`` bool: query ``i`` sees keys ``0 … i + n_k − n_q``."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(n_k - n_q)


def varlen_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [B, Hq, T, D]``, ``key``/``value``
    ``[B, Hkv, T, D]`` → ``([B, T, Hq, D], None)``.

    Packed rows (``B = 1``) carry their boundaries in ``cu_seq_lens_q`` (``[n + 1]``
    cumulative lengths) and ``max_length_q``; with shared prefixes, also ``key_index``,
    ``cu_seq_lens_k`` and ``max_length_k`` (the module docstring). Refuses attention
    variants it does not implement (sliding windows, logit soft-capping, attention sinks)
    rather than silently computing plain attention for them.
    """
    if (
        getattr(module, "sliding_window", None)
        or kwargs.get("softcap")
        or kwargs.get("s_aux") is not None
    ):
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} implements plain causal attention only; "
            f"use attn_implementation='sdpa' for {type(module).__name__}"
        )
    n_rep = query.shape[1] // key.shape[1]
    dropout_p = dropout if module.training else 0.0
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(
            query,
            _repeat_kv(key, n_rep),
            _repeat_kv(value, n_rep),
            is_causal=True,
            dropout_p=dropout_p,
            scale=scaling,
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got batch {query.shape[0]}")
    key_index = kwargs.get("key_index")
    cu_seqlens_k = cu_seqlens
    if key_index is not None:
        # one gather per layer; its backward adds each copy's gradient back to its position
        key, value = key.index_select(2, key_index), value.index_select(2, key_index)
        cu_seqlens_k = kwargs["cu_seq_lens_k"]
    dtype = compute_dtype(query)
    if _flash_applies(query, dtype, dropout_p):
        # Cast here: without it a float32 query under bf16 autocast missed this kernel
        # and took the loop below, one sdpa (cuDNN) call per segment and layer, about 2 ms
        # of host time each (make gpu-check on an H100, 1.5B shape, 16k tokens a step:
        # 4.37 s a step before, 1.04 s after).
        query, key, value = (t.to(dtype) for t in (query, key, value))
        max_q = int(kwargs.get("max_length_q") or int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
        max_k = int(kwargs.get("max_length_k") or max_q) if key_index is not None else max_q
        out = _varlen_cuda(query, key, value, (cu_seqlens, cu_seqlens_k), (max_q, max_k), scaling)
        return out.contiguous(), None
    if query.device.type == "cpu":
        # Grouped-query heads by sdpa itself (the same values; on the CPU a third less time
        # than repeating the keys and values a layer, and summing their gradients back),
        # and autocast off (it is on only where dtype is narrow): each segment's sdpa gets
        # the dtype _per_segment chose for it.
        narrow = dtype in (torch.bfloat16, torch.float16)
        with torch.autocast("cpu", enabled=False):
            out = _per_segment(
                query, key, value, cu_seqlens, cu_seqlens_k, dropout_p, scaling,
                dtype=dtype if narrow else None, float32_keys=CPU_FLOAT32_KEYS if narrow else 0,
                gqa=n_rep > 1,
            )  # fmt: skip
    else:
        key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
        out = _per_segment(query, key, value, cu_seqlens, cu_seqlens_k, dropout_p, scaling)
    return out.transpose(1, 2).contiguous(), None


# A bf16 (or fp16) segment of at most this many keys attends in float32 on the CPU. The
# CPU's fused attention kernel runs such short segments slower in bf16 than in float32,
# casts included (2-core Intel Xeon with AMX, 9 heads of 64, forward and backward: 120
# keys 3.1 against 1.5 ms, 64 queries on 184 keys 1.9 against 1.5 ms, 300 keys 6.8 against
# 6.3 ms; from ~350 keys bf16 is the faster: 384 keys 8.2 against 8.8 ms); the scores are
# float32 sums either way.
CPU_FLOAT32_KEYS = 320


@torch.compiler.disable(recursive=True)
def _per_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    dropout_p: float,
    scaling: float | None,
    *,
    dtype: torch.dtype | None = None,
    float32_keys: int = 0,
    gqa: bool = False,
) -> torch.Tensor:
    """One sdpa call per segment of a packed row → ``[1, Hq, T, D]``. Kept out of
    ``torch.compile`` (``trainer.compile``): the segments' count is the data's, so a traced
    loop was a graph per count, each compiled forward and backward (a step whose micro-batch
    held one more sequence compiled the layer again); eager, the compiled layer has one graph
    before attention and one after, whatever the batch.

    ``dtype``: what every segment is computed in and the result's dtype (default: as the
    inputs come), except that a segment of at most ``float32_keys`` keys is computed in
    float32 (:data:`CPU_FLOAT32_KEYS`), its output cast to ``dtype``. ``gqa``: ``key`` and
    ``value`` have fewer heads than ``query`` (grouped-query attention, sdpa's
    ``enable_gqa``)."""
    bounds = cu_seqlens.tolist()
    sizes = [e - s for s, e in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {bounds} does not cover the row of {query.shape[2]}")
    bounds_k = bounds if cu_seqlens_k is cu_seqlens else cu_seqlens_k.tolist()
    sizes_k = [e - s for s, e in itertools.pairwise(bounds_k)]
    if len(sizes_k) != len(sizes) or bounds_k[-1] != key.shape[2]:
        raise ValueError(f"cu_seq_lens_k {bounds_k} does not match the keys of {bounds}")
    # split(), not one slice per sequence: a slice's backward writes its gradient into a
    # zero tensor of the whole row, so n slices cost n full-row fills and adds per tensor
    # per layer; split's backward is one concatenation. Each row is cast once per dtype
    # that some segment needs.
    dtype = dtype or query.dtype
    wide = [0 < float32_keys and n_k <= float32_keys for n_k in sizes_k]
    splits = {
        as_dtype: list(
            zip(
                query.to(as_dtype).split(sizes, dim=2),
                key.to(as_dtype).split(sizes_k, dim=2),
                value.to(as_dtype).split(sizes_k, dim=2),
                strict=True,
            )
        )
        for as_dtype in {torch.float32 if w else dtype for w in wide}
    }
    kwargs: dict[str, Any] = {"enable_gqa": True} if gqa else {}
    pieces = []
    for i, (n_q, n_k) in enumerate(zip(sizes, sizes_k, strict=True)):
        q, k, v = splits[torch.float32 if wide[i] else dtype][i]
        if n_q == n_k:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout_p, scale=scaling, **kwargs
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=_bottom_right_causal(n_q, n_k, q.device),
                dropout_p=dropout_p, scale=scaling, **kwargs,
            )  # fmt: skip
        pieces.append(out)
    if all(wide):  # one cast of the row rather than one a segment
        return torch.cat(pieces, dim=2).to(dtype)
    return torch.cat([piece.to(dtype) for piece in pieces], dim=2)


def register() -> None:
    """Makes ``attn_implementation="asyncrl_varlen"`` known to transformers (idempotent)."""

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_causal_attention)


register()
