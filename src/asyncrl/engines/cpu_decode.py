"""The hf engine's decode step on the CPU in float32, a decoder layer at a time in C.

A decode step of a few dozen rows or fewer spends most of its time reading the weights
(:mod:`~asyncrl.engines.cpu_linear`'s products), and the rest on some forty small torch
operations a layer (the norms, the rotary positions, the cache writes, attention, the
activation, the residual additions), each a few microseconds of dispatch over a tensor of
a few kilobytes: on SmolLM2-135M about 20 ms of a 70-80 ms step of 4-12 rows on one
core. Here each decoder layer of such a step is one call into the kernel's library
(``asyncrl_decode_layer``), which does all of it over the same products (the packed
copies :class:`~asyncrl.engines.cpu_linear.DecodeLinear` keeps): RMSNorm, the q/k/v
products, rotary positions, the new keys and values written into the batch's buffers,
attention reading each key head once for the query heads that share it and only the
columns a row may see, the output product, RMSNorm, gate and up products, silu(gate) ×
up and the down product, each residual added in place. The embedding, the rotary table
and the final norm stay torch's; the LM head is the kernel's product at every row count.

The same arithmetic as transformers' layers up to the order of float sums and the
exponential (a polynomial of relative error under 2e-7); each row is computed on its own,
so a row's logits are the same bits whatever other rows share the step. For decoders of
the llama and qwen2 kinds (:func:`unsupported` says why another model is not), steps of 1
to :data:`~asyncrl.engines.cpu_linear.MAX_ROWS` rows on torch's single thread; the engine
runs other steps, and steps with cascade attention, through the model as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from asyncrl.engines import cpu_linear

KINDS = ("llama", "qwen2")
"""``model_type`` s whose decoder layers the C layer computes: pre-norm RMSNorm, rotary
positions on every head, grouped-query attention scaled by ``head_dim ** -0.5``, a SiLU
gated MLP, residuals added."""


LINEARS = (
    ("q", "self_attn", "q_proj"),
    ("k", "self_attn", "k_proj"),
    ("v", "self_attn", "v_proj"),
    ("o", "self_attn", "o_proj"),
    ("gate", "mlp", "gate_proj"),
    ("up", "mlp", "up_proj"),
    ("down", "mlp", "down_proj"),
)
"""A layer's products: the C structure's field, the submodule and its linear layer."""


class _Linear(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((field, _Linear) for field, _, _ in LINEARS),
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps1", ctypes.c_float),
        ("eps2", ctypes.c_float),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


def _heads(cfg: Any) -> tuple[int, int, int]:
    """A decoder config's query heads, key heads and head size."""
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, getattr(cfg, "num_key_value_heads", None) or heads, hd


def kind_problem(cfg: Any) -> str | None:
    """Why a model of config ``cfg`` is not a plain llama/qwen2 decoder (one of
    :data:`KINDS`, SiLU, full attention in every layer), or None where it is."""
    kind = getattr(cfg, "model_type", None)
    if kind not in KINDS:
        return f"model_type {kind!r} is not one of {', '.join(KINDS)}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r}, not silu"
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ):
        return "sliding-window attention"
    return None


def layer_problem(layer: Any) -> str | None:
    """Why a decoder ``layer`` of a :func:`kind_problem`-free model is not one the C code
    computes (per-head query/key norms, norms other than RMSNorm), or None where it is."""
    if any(hasattr(layer.self_attn, name) for name in ("q_norm", "k_norm")):
        return "per-head query/key norms"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            return f"{type(norm).__name__} is not an RMSNorm"
    return None


def unsupported(model: Any) -> str | None:
    """Why :class:`DecodeLayers` cannot run ``model``'s decode steps, or None where it can:
    a float32 text decoder of :data:`KINDS` on the CPU whose linear layers are the
    kernel's (:func:`~asyncrl.engines.cpu_linear.install`)."""
    cfg = model.config
    why = kind_problem(cfg)
    if why is not None:
        return why
    inner = getattr(model, "model", None)
    if inner is None or not all(
        hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        return "not a decoder with embed_tokens, layers, norm and rotary_emb"
    heads, kv_heads, hd = _heads(cfg)
    if hd % 16 or hd > 512 or heads % kv_heads or heads // kv_heads > 64:
        return f"head_dim {hd} (a multiple of 16 up to 512) or {heads}/{kv_heads} heads"
    if not isinstance(getattr(model, "lm_head", None), cpu_linear.DecodeLinear):
        return "its LM head is not the kernel's (float32 on the CPU, the kernel compiled)"
    for layer in inner.layers:
        why = layer_problem(layer)
        if why is not None:
            return why
        scaling = float(getattr(layer.self_attn, "scaling", hd**-0.5))
        if abs(scaling - hd**-0.5) > 1e-12 * hd**-0.5:
            return "attention not scaled by head_dim ** -0.5"
        for _, part, name in LINEARS:
            if not isinstance(getattr(getattr(layer, part), name, None), cpu_linear.DecodeLinear):
                return f"{part}.{name} is not the kernel's"
    return None


class DecodeLayers:
    """A decode step of ``model`` (see :func:`unsupported`) through the C layer: the
    logits of each row's next token. Holds one C structure a layer, its weights' fields
    filled again where a weight's packed copy or storage moved."""

    def __init__(self, model: Any) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the C decode layers cannot run this model: {reason}")
        fn = cpu_linear.kernel()
        if fn is None:
            raise ValueError("the C decode layers need the CPU kernel, which cannot run here")
        self._layer_fn = fn.layer
        self.model = model
        self.heads, self.kv_heads, self.head_dim = _heads(model.config)
        self.hidden = model.config.hidden_size
        self.scale = self.head_dim**-0.5
        self.layers = list(model.model.layers)
        self._linears = [
            [getattr(getattr(layer, part), name) for _, part, name in LINEARS]
            for layer in self.layers
        ]
        self._structs = [_Layer() for _ in self.layers]
        self._filled: list[tuple[int, ...] | None] = [None] * len(self.layers)
        for s, layer in zip(self._structs, self.layers, strict=True):
            s.eps1 = float(layer.input_layernorm.variance_epsilon)
            s.eps2 = float(layer.post_attention_layernorm.variance_epsilon)

    def _fill(self, i: int) -> bool:
        """Points layer ``i``'s structure at its weights (packed again where changed);
        False where a weight or bias is not laid out as the C layer reads it (contiguous),
        as a weight replaced by a strided tensor would be."""
        layer, s, linears = self.layers[i], self._structs[i], self._linears[i]
        packed = [m.packed_weight() for m in linears]
        key = tuple(p.data_ptr() for p in packed) + tuple(m.weight.data_ptr() for m in linears)
        key += (layer.input_layernorm.weight.data_ptr(),)
        key += (layer.post_attention_layernorm.weight.data_ptr(),)
        if self._filled[i] == key:
            return True
        if not all(
            m.weight.is_contiguous() and (m.bias is None or m.bias.is_contiguous()) for m in linears
        ):
            return False
        for (field, _, _), m, p in zip(LINEARS, linears, packed, strict=True):
            lin = getattr(s, field)
            lin.packed, lin.weight = p.data_ptr(), m.weight.data_ptr()
            lin.bias = None if m.bias is None else m.bias.data_ptr()
            lin.n, lin.k = m.weight.shape
        s.norm1 = layer.input_layernorm.weight.data_ptr()
        s.norm2 = layer.post_attention_layernorm.weight.data_ptr()
        self._filled[i] = key
        return True

    def ready(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs here: 1 to 32 rows, torch on one thread
        (the kernel's products are single-threaded; with more threads torch's are faster),
        without autograd, and the weights' layout the kernel's (contiguous: a weight made
        column-major by :func:`~asyncrl.engines.hf.column_major_linears` is not)."""
        return (
            1 <= rows <= cpu_linear.MAX_ROWS
            and torch.get_num_threads() == 1
            and not torch.is_grad_enabled()
            and self.model.lm_head.weight.is_contiguous()
        )

    def logits(
        self,
        ids_R: torch.Tensor,
        pos_R: torch.Tensor,
        mask_RC: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor | None:
        """One decode step: ``ids_R`` each row's token at position ``pos_R``, attending to
        the columns ``mask_RC [R, C]`` allows of its row of each layer's ``keys`` /
        ``values`` ``[R, kv heads, ≥ C, head_dim]``, whose column ``C - 1`` it writes.
        Returns the logits ``[R, V]``, or None where the C layer declined (the caller runs
        the step another way; column ``C - 1`` is written again then)."""
        rows, cols = mask_RC.shape
        inner = self.model.model
        x_RD = inner.embed_tokens(ids_R).contiguous()
        cos_R1D, sin_R1D = inner.rotary_emb(x_RD[:, None], pos_R[:, None])
        cos_RD = cos_R1D[:, 0].to(torch.float32).contiguous()
        sin_RD = sin_R1D[:, 0].to(torch.float32).contiguous()
        mask_u8 = mask_RC.contiguous().view(torch.uint8)
        for i, s in enumerate(self._structs):
            k, v = keys[i], values[i]
            if (
                k.shape[0] != rows
                or k.shape[2] < cols
                or k.stride(3) != 1
                or k.stride(2) != self.head_dim
                or k.stride() != v.stride()
                or not self._fill(i)
            ):
                return None
            s.keys, s.values = k.data_ptr(), v.data_ptr()
            s.row_stride, s.head_stride = k.stride(0), k.stride(1)
            code = self._layer_fn(
                ctypes.byref(s),
                x_RD.data_ptr(),
                rows,
                self.hidden,
                self.heads,
                self.kv_heads,
                self.head_dim,
                cos_RD.data_ptr(),
                sin_RD.data_ptr(),
                mask_u8.data_ptr(),
                cols,
                self.scale,
            )
            if code != 0:
                return None
        head = self.model.lm_head
        h_RD = inner.norm(x_RD)
        # the kernel's product at every row count (MKL's at 1-3 rows would make a row's
        # logits depend on how many rows it is stepped with)
        return cpu_linear.product(h_RD, rows, head.weight, head.bias, head.packed_weight)
