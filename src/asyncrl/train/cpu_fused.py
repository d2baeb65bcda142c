"""The trainer's elementwise parts and its attention in C on the CPU in float32: RMSNorm,
rotary positions and SiLU(gate) · up, each one pass forward and one backward, and the
packed row's causal attention, one call a layer forward and one backward.

In eager PyTorch each of these is several operations over the step's activations, each
reading and writing a whole ``[tokens, hidden]`` or ``[tokens, intermediate]`` tensor:
transformers' RMSNorm is a square, a mean, an rsqrt and two products (and their
backwards); rotary positions two products, a concatenation, a negation and a sum for the
queries and again for the keys; the MLP's activation a SiLU and a product. On a CPU trainer
step of SmolLM2-135M in float32 on one thread those three made ~8% of the step and
elementwise work as a whole 17%, the matmuls ~71% (bench/README, "The trainer's
elementwise parts in C"). Here each is one C function
over whole rows (the kernel library of :mod:`asyncrl.engines.cpu_linear`, AVX-512), inside
a ``torch.autograd.Function`` whose backward is one more: the same values within float32
rounding (``tests/test_cpu_fused.py`` holds each function and a train step's every
gradient against transformers' own at 1e-5).

:func:`install` puts them on a llama or qwen2 model's decoder layers (norms, attention, MLP
and the final norm; :func:`unsupported` names why another model is not taken) by giving
those modules forwards of their own that call the same linear layers, so LoRA adapters,
FSDP's hooks and gradient checkpointing see the modules as before. A call whose tensors are
not float32 on the CPU (a bfloat16 autocast, say) goes through the module's own forward.

Attention (:class:`AttentionFn`): the trainer's packed rows (:mod:`asyncrl.train.attention`)
hold many short segments, a group's prompt and each of its completions, and torch's
attention took one call, a gather and a split for each (40 a layer on the long workload's
step; ~13 ms a layer forward and backward on one thread), most of it per-call overhead;
the kernel takes the whole row in one call each way, reads a group's prompt keys where they
are (no gather) and adds their gradients up there: ~6 ms (bench/README, "The trainer's
attention in C").

Each pass shares its work between torch's threads (the library's OpenMP region runs on the
pool torch's own operations use): the rows, tokens or (for attention) segments are cut into
tasks and each thread takes the next when it is free, so a thread slowed by another
process on its core (generation beside the trainer on two cores) takes fewer tasks instead
of holding the others at the end of a fixed share. A task writes only its own rows, and
attention's backward gives each group's prompt keys to one task a key head, so a pass
gives the same bits on any number of threads.

The trainer installs them where it computes in float32 on the CPU and does not compile its
layers (``trainer.cpu_fused``); a call takes them while torch runs on at most
:data:`MAX_THREADS` threads.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

import torch

from asyncrl.engines import cpu_decode, cpu_linear
from asyncrl.train import attention


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


MAX_THREADS = 2
"""With more than this many torch threads a call goes through the module's own forward: the
C passes are measured on one and two threads only (bench/trainer.py --modes fused; two
cores are all the machines they were written on have)."""


MAX_HEADS_PER_KEY_HEAD = 64
"""The attention kernel takes up to this many query heads a key head (it scores a block's
rows of all of them together); a model with more goes through the registered function."""


def _threads() -> int:
    """The threads a C pass shares its work between: torch's, on the calling thread."""
    return torch.get_num_threads()


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    """Whether a call takes the C path: ``tensors`` float32 on the CPU, and torch on at most
    :data:`MAX_THREADS` threads."""
    return torch.get_num_threads() <= MAX_THREADS and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors
    )


class RMSNormFn(torch.autograd.Function):
    """transformers' RMSNorm, ``w * (x / sqrt(mean(x^2) + eps))``, over the last dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        fn = cpu_linear.kernel()
        assert fn is not None
        x = x.contiguous()
        d = x.shape[-1]
        rows = x.numel() // d
        out = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32)
        w = weight.contiguous()
        fn.rms_forward(
            _ptr(x), rows, d, _ptr(w), ctypes.c_float(eps), _ptr(out), _ptr(rstd), _threads()
        )
        ctx.save_for_backward(x, w, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        fn = cpu_linear.kernel()
        assert fn is not None
        x, w, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        d = x.shape[-1]
        dx = torch.empty_like(x)
        dw = torch.zeros(d, dtype=torch.float32)
        fn.rms_backward(
            _ptr(x), _ptr(grad), x.numel() // d, d, _ptr(w), _ptr(rstd), _ptr(dx), _ptr(dw),
            _threads(),
        )  # fmt: skip
        return dx, (dw if ctx.needs_input_grad[1] else None), None


class SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up``, elementwise."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fn = cpu_linear.kernel()
        assert fn is not None
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        fn.swiglu_forward(_ptr(gate), _ptr(up), gate.numel(), _ptr(out), _threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fn = cpu_linear.kernel()
        assert fn is not None
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        fn.swiglu_backward(
            _ptr(gate), _ptr(up), _ptr(grad), gate.numel(), _ptr(d_gate), _ptr(d_up), _threads()
        )
        return d_gate, d_up


def _rope(fn: Any, x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: int) -> Any:
    """Rotary positions over ``x_BTHD`` (``[B, T, heads, hd]``, rows of ``hd`` contiguous),
    into a new ``[B, T, heads, hd]`` tensor; ``back``: the backward's map instead."""
    B, T, H, D = x_BTHD.shape
    if x_BTHD.stride(3) != 1:
        x_BTHD = x_BTHD.contiguous()
    out = torch.empty((B, T, H, D), dtype=torch.float32)
    for b in range(B):
        xb = x_BTHD[b]
        cb, sb = cos[b if cos.shape[0] > 1 else 0], sin[b if sin.shape[0] > 1 else 0]
        code = fn.rope(
            _ptr(xb), T, H, D, xb.stride(0), xb.stride(1), _ptr(cb), _ptr(sb), _ptr(out[b]), back,
            _threads(),
        )  # fmt: skip
        if code:
            raise RuntimeError(f"the rotary kernel declined a head dim of {D} (code {code})")
    return out


class RopeFn(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` of ``x`` ``[B, heads, T, hd]`` (a transposed view
    of a ``[B, T, heads, hd]`` projection, as transformers makes it), ``cos`` and ``sin``
    ``[B or 1, T, hd]``; the result is laid out as transformers' is, ``[B, T, heads, hd]``
    in memory, seen as ``[B, heads, T, hd]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        fn = cpu_linear.kernel()
        assert fn is not None
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope(fn, x.transpose(1, 2), cos, sin, 0).transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        fn = cpu_linear.kernel()
        assert fn is not None
        cos, sin = ctx.saved_tensors
        return _rope(fn, grad.transpose(1, 2), cos, sin, 1).transpose(1, 2), None, None


class AttentionFn(torch.autograd.Function):
    """Causal attention over the segments of one packed row (the trainer's layout,
    :mod:`asyncrl.train.attention`): ``q`` ``[1, T, heads, hd]``, ``k`` and ``v`` ``[1, T,
    kv heads, hd]`` (rows of ``hd`` contiguous, heads ``hd`` apart), ``cu_q`` and ``cu_k``
    the segments' cumulative query and key counts (int64), ``key_index`` (int64, or None:
    each segment's own positions) the row's position of each segment's every key, so that a
    group's completions read its prompt's keys where they are and their gradients add up
    there. Returns ``[1, T, heads, hd]``. One C call a layer forward and one backward, in
    place of a torch attention call, a gather and a split per segment; the backward
    computes the scores again from each row's saved log-sum (no ``[queries, keys]`` matrix
    is kept)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        key_index: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        fn = cpu_linear.kernel()
        assert fn is not None
        _, T, H, D = q.shape
        q, k, v = (_heads_packed(t) for t in (q, k, v))
        kt = _transposed(k)
        out = torch.empty((1, T, H, D), dtype=torch.float32)
        lse = torch.empty((T, H), dtype=torch.float32)
        code = fn.attn_forward(
            _ptr(q), q.stride(1), _ptr(kt), kt.shape[2], _ptr(v), v.stride(1),
            *_segment_args(q, k, cu_q, cu_k, key_index, scale), _ptr(out), _ptr(lse), _threads(),
        )  # fmt: skip
        if code:
            raise RuntimeError(f"the attention kernel declined the call (code {code})")
        ctx.save_for_backward(q, k, v, kt, out, lse)
        ctx.segments = (cu_q, cu_k, key_index, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        fn = cpu_linear.kernel()
        assert fn is not None
        q, k, v, kt, out, lse = ctx.saved_tensors
        cu_q, cu_k, key_index, scale = ctx.segments
        grad = grad.contiguous()
        vt = _transposed(v)
        dq = torch.empty_like(out)
        dk = torch.zeros((1, k.shape[1], k.shape[2], k.shape[3]), dtype=torch.float32)
        dv = torch.zeros_like(dk)
        code = fn.attn_backward(
            _ptr(q), q.stride(1), _ptr(k), k.stride(1), _ptr(kt), _ptr(vt), kt.shape[2],
            *_segment_args(q, k, cu_q, cu_k, key_index, scale),
            _ptr(out), _ptr(grad), _ptr(lse), _ptr(dq), _ptr(dk), _ptr(dv), _threads(),
        )  # fmt: skip
        if code:
            raise RuntimeError(f"the attention kernel declined the backward (code {code})")
        return dq, dk, dv, None, None, None, None


def _heads_packed(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[1, T, heads, hd]`` with each token's heads side by side, contiguous rows of
    ``hd`` (a projection's view is already; anything else is copied)."""
    if t.stride(3) != 1 or t.stride(2) != t.shape[3]:
        t = t.contiguous()
    return t


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[1, T, heads, hd]`` as ``[heads, hd, T + 32]``, the 32 columns past the row
    zero (the kernel reads whole blocks of 32 keys)."""
    _, T, H, D = t.shape
    out = torch.empty((H, D, T + 32), dtype=torch.float32)
    out[:, :, T:] = 0.0
    out[:, :, :T] = t[0].permute(1, 2, 0)
    return out


def _index(t: torch.Tensor) -> torch.Tensor:
    """An index tensor as the kernel reads it: int64, contiguous, on the CPU."""
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def _segment_args(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    key_index: torch.Tensor | None,
    scale: float,
) -> tuple[Any, ...]:
    """The kernel's arguments from the head counts to the scale."""
    return (
        q.shape[2], k.shape[2], q.shape[3], q.shape[1], cu_q.numel() - 1, _ptr(cu_q), _ptr(cu_k),
        None if key_index is None else _ptr(key_index), float(scale),
    )  # fmt: skip


# --- the modules' forwards ----------------------------------------------------------------


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if not _fp32_cpu(hidden_states, weight):
        return self._asyncrl_forward(hidden_states)  # type: ignore[no-any-return]
    return RMSNormFn.apply(hidden_states, weight, float(self.variance_epsilon))  # type: ignore[no-any-return]


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if not _fp32_cpu(x):
        return self._asyncrl_forward(x)  # type: ignore[no-any-return]
    return self.down_proj(SwiGLUFn.apply(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


def _attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' llama/qwen2 attention forward without a KV cache (a training forward
    sees whole sequences), the rotary positions by :class:`RopeFn`, a packed row's
    attention (the trainer's ``asyncrl_varlen`` with segment bounds, no mask, no dropout)
    by :class:`AttentionFn` and any other by the registered function; the module's own
    forward where the call does not take the C path (:func:`_fp32_cpu`), brings a cache or
    is set to transformers' eager attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415 - transformers is heavy; loaded with the model anyway

    attend = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation)
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if attend is None or cached or not _fp32_cpu(hidden_states):
        # transformers' eager attention (not a registered function), a cache, or a call
        # that does not take the C path
        return self._asyncrl_forward(  # type: ignore[no-any-return]
            hidden_states, position_embeddings, attention_mask, **kwargs
        )
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    assert position_embeddings is not None
    cos, sin = position_embeddings
    if cos.requires_grad or sin.requires_grad or not _fp32_cpu(cos, sin):
        raise RuntimeError("the fused attention forward takes float32 positions, not trained")
    q, k = RopeFn.apply(q, cos, sin), RopeFn.apply(k, cos, sin)
    cu_q = kwargs.get("cu_seq_lens_q")
    if (
        cu_q is not None
        and self.config._attn_implementation == attention.ATTN_IMPLEMENTATION
        and attention_mask is None
        and q.shape[0] == 1
        and q.shape[1] <= MAX_HEADS_PER_KEY_HEAD * k.shape[1]
        and not (self.training and self.attention_dropout)
    ):
        # a packed row (the trainer's): its segments in one C call
        key_index = kwargs.get("key_index")
        cu_k = kwargs["cu_seq_lens_k"] if key_index is not None else cu_q
        out = AttentionFn.apply(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            _index(cu_q), _index(cu_k), None if key_index is None else _index(key_index),
            float(self.scaling),
        )  # fmt: skip
        return self.o_proj(out.reshape(*input_shape, -1)), None
    out, weights = attend(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def unsupported(model: Any) -> str | None:
    """Why :func:`install` would not take ``model``, or None where it would."""
    if cpu_linear.kernel() is None:
        return "the CPU kernel library is not available here (see the log's warning)"
    cfg = model.config
    why = cpu_decode.kind_problem(cfg)
    if why is not None:
        return why
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, name) for name in ("layers", "norm")):
        return "not a decoder with layers and norm"
    if cfg._attn_implementation in (None, "eager"):
        return "eager attention (the fused forward calls a registered attention function)"
    for layer in inner.layers:
        why = cpu_decode.layer_problem(layer)
        if why is not None:
            return why
        hd = int(getattr(layer.self_attn, "head_dim", 0))
        if hd <= 0 or hd % 2:
            return f"head_dim {hd}, not even"
    return None


def install(model: Any) -> int:
    """Gives ``model``'s decoder layers and final norm the fused forwards; returns the
    layers done (0 where :func:`unsupported` says why not). Idempotent."""
    if unsupported(model) is not None:
        return 0
    inner = model.model
    for layer in inner.layers:
        _give(layer.input_layernorm, _norm_forward)
        _give(layer.post_attention_layernorm, _norm_forward)
        _give(layer.mlp, _mlp_forward)
        _give(layer.self_attn, _attention_forward)
    _give(inner.norm, _norm_forward)
    return len(inner.layers)


def _give(module: Any, forward: Any) -> None:
    """``module``'s forward becomes ``forward``, which falls back to the one it had
    (``_asyncrl_forward``: the class's, or one a caller set on the instance)."""
    if "_asyncrl_forward" not in module.__dict__:
        module._asyncrl_forward = module.forward
    module.forward = types.MethodType(forward, module)
