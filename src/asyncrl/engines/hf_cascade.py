"""Decode attention that reads a prefix shared by many rows once: cascade attention.

In an agent run every row of the hf engine's decode batch begins with the same system
prompt (and a GRPO group's rows with the same prompt). Each row holds a copy of those
keys and values in its own columns of :class:`~asyncrl.engines.hf_batch.DecodeBatch`, so
plain attention reads the shared prefix once per row and step: on a CPU that is most of a
decode step's memory traffic once the prefix is a few hundred tokens.

Here one decode step's attention is split in two parts over disjoint columns and merged:

- **the shared part**: every query of the rows that share the prefix against one copy of
  its ``P`` keys and values (a reference row's), as one matrix product per key head;
- **the window**: every row's queries against the columns from ``w0`` to ``L``, each row
  masked to what it does not take from the shared part (its own tail; all of a row outside
  the group).

Each part gives unnormalised outputs with their row maxima and sums; the merge rescales
both to a common maximum (the log-sum-exp identity), which is exact up to float rounding.
Rows share a prefix only where their copies are *the same bits*: copied from the same
blocks of the prefix cache, or the leader whose prefill filled those blocks
(:attr:`~asyncrl.engines.hf_batch.Sequence.kv_chain`), so a row's attention reads
exactly the keys it would have read from its own columns.

Both parts run torch's CPU flash kernel, which gives each query's log-sum-exp beside its
output; the engine plans cascade steps on the CPU only, where decode attention is bound by
memory traffic (on a GPU the hf engine's decode is bound by the host, and two kernels a
layer would cost more than they spare). The attention function is registered with
transformers as ``asyncrl_decode`` and is the hf engine's on the CPU: outside a decode
step that set a plan it prefills grouped-query heads without copying them
(:func:`grouped_attention`), and is transformers' own SDPA attention otherwise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "asyncrl_decode"


@dataclass
class CascadePlan:
    """One decode step's split (see the module). ``group_G``: the rows that share the
    prefix; its keys are those of row ``ref``, columns ``[ref_start, ref_start + P)``; the
    window part covers the columns ``[w0, L]``."""

    group_G: torch.Tensor
    ref: int
    ref_start: int
    prefix: int
    w0: int
    window_bias: torch.Tensor
    """``[R, 1, 1, W]`` in the model's dtype: 0 where a row reads a window column, −inf
    where not."""


_local = threading.local()


def current_plan() -> CascadePlan | None:
    plan: CascadePlan | None = getattr(_local, "plan", None)
    return plan


def set_plan(plan: CascadePlan | None) -> None:
    """The plan of the decode step this thread runs next (None: plain attention)."""
    _local.plan = plan


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel over ``q [B, K, n, d]``, ``k, v [B, K, m, d]`` (one key head per
    query group, so grouped-query heads need no copies): ``(out [B, K, n, d], log-sum-exp
    [B, K, n])``; ``bias``: added to the scores (−inf masks)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse


def cascade_attention(
    plan: CascadePlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query [R, H, 1, d]`` of one decode step against the rows' keys and values ``[R,
    kv heads, L + 1, d]`` (CPU tensors), split as ``plan`` says; returns ``[R, 1, H, d]``."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    per_kv = heads // kv_heads
    # a key head's query heads become its queries: [R, K, g, d]
    q_RKgD = query.reshape(rows, kv_heads, per_kv, dim)
    # the window: every row against columns w0..L, masked per row
    out, lse = _flash(q_RKgD, key[:, :, plan.w0 :], value[:, :, plan.w0 :], scale, plan.window_bias)
    # the shared part: the group's queries against one copy of the prefix
    group = plan.group_G
    n = group.numel()
    cols = slice(plan.ref_start, plan.ref_start + plan.prefix)
    q_1KND = q_RKgD.index_select(0, group).transpose(0, 1).reshape(1, kv_heads, n * per_kv, dim)
    ref = slice(plan.ref, plan.ref + 1)
    s_out, s_lse = _flash(q_1KND, key[ref, :, cols], value[ref, :, cols], scale, None)
    s_out = s_out.reshape(kv_heads, n, per_kv, dim).transpose(0, 1)  # [n, K, g, d]
    s_lse = s_lse.reshape(kv_heads, n, per_kv).transpose(0, 1)  # [n, K, g]
    w_lse = lse[group]
    both = torch.logaddexp(s_lse, w_lse)
    merged = (
        s_out.to(both.dtype) * torch.exp(s_lse - both)[..., None]
        + out[group].to(both.dtype) * torch.exp(w_lse - both)[..., None]
    )
    out = out.index_copy(0, group, merged.to(out.dtype))
    return out.reshape(rows, heads, dim)[:, None]


def decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: cascade attention when this thread's decode step
    set a plan, grouped heads without copies for a CPU prefill, SDPA otherwise."""
    plan = current_plan()
    if plan is not None and query.shape[2] == 1:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cascade_attention(plan, query, key, value, scale), None
    if _grouped_prefill(module, query, attention_mask, dropout, kwargs):
        return grouped_attention(query, key, value, attention_mask, scaling), None
    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out, weights


def _grouped_prefill(
    module: Any,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether :func:`grouped_attention` takes the call: a CPU prefill (several queries a
    row) of grouped-query heads under an explicit mask, nothing else asked of attention."""
    return (
        query.device.type == "cpu"
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and mask is not None
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not kwargs.get("output_attentions", False)
    )


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """A prefill's masked attention with each key head read by its group of query heads:
    ``query [N, H, T, d]``, ``key``/``value [N, kv heads, P, d]``, ``mask [N, 1, T, P]``;
    returns ``[N, T, H, d]``. transformers' SDPA path copies every key and value head once
    per query head of its group first when a mask is given (``repeat_kv``: on the CPU that
    copy and the threefold reading made a prefill's attention over a 480-token prompt 3.4×
    slower, with SmolLM2's 9 query heads over 3 key heads); the CPU kernels take the groups
    as they are, bit for bit the same result."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def register() -> None:
    """Makes ``attn_implementation="asyncrl_decode"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, decode_attention)


register()
