"""Model loading, the logprob head, and FSDP2 sharding beside the model.

:class:`TokenLogprobs` wraps a transformers causal LM so that one ``forward`` returns the
logprobs the loss needs, computing logits only at those positions and only a chunk at a
time: a ``[tokens, vocab]`` float32 logits tensor for a 150k vocabulary would otherwise be
the largest activation of the step. It is also the FSDP root, which matters: the
embeddings, final norm and LM head live in the root's parameter group and are gathered by
the root's forward hook, so everything that touches them must run inside that forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from asyncrl.algo.truncation import cut_logprobs, kept_mask

Setting = float | torch.Tensor
"""A sampler setting (temperature, top_k or top_p): one value for every row, or a ``[M]``
tensor with each target's own (samples whose calls chose their sampling,
``rollout.endpoint_sampling = "per_call"``)."""


def rows_of(setting: Setting, start: int, end: int) -> Setting:
    """Rows ``start:end`` of a per-row setting; a scalar as it is."""
    return setting[start:end] if isinstance(setting, torch.Tensor) else setting


HeadPrecision = Literal["float32", "tf32"]
"""How the LM head's float32 matmuls run on CUDA: ``float32`` (IEEE, as on the CPU) or
``tf32`` (tensor cores: inputs rounded to 10 mantissa bits, float32 accumulation and
output). The CPU always computes in float32."""


@contextmanager
def head_matmuls(precision: HeadPrecision, device: torch.device) -> Iterator[None]:
    """Runs the float32 matmuls inside with ``precision`` on a CUDA ``device``; restores
    the process's setting after. The setting is torch's, for the whole process: another
    thread's float32 CUDA matmuls meanwhile run as TF32 too (a trainer process runs no
    other model). Nothing changes on the CPU or for ``float32``."""
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    before = flags.fp32_precision
    flags.fp32_precision = "tf32"
    try:
        yield
    finally:
        flags.fp32_precision = before


def choose_head_precision(
    chosen: Literal["auto"] | HeadPrecision, compute_dtype: torch.dtype, device: torch.device
) -> HeadPrecision:
    """``auto``: tf32 on CUDA under a 16-bit compute dtype, whose forward already rounds
    far more than tf32 does; float32 otherwise. Other choices as they are."""
    if chosen != "auto":
        return chosen
    half = compute_dtype in (torch.bfloat16, torch.float16)
    return "tf32" if half and device.type == "cuda" else "float32"


def head_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The LM head's compute dtype: float32, or float64 for a float64 model (exactness
    tests compare float64 forwards to 1e-10, which float32 logits would round away)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _cuts(top_k: Setting, top_p: Setting) -> bool:
    """Whether any row has a top-k or top-p cut. Scalars are judged in Python, so the
    common case (the recipe's one setting) adds no tensor work and no device sync per
    chunk."""
    if isinstance(top_k, torch.Tensor) or isinstance(top_p, torch.Tensor):
        return bool((torch.as_tensor(top_k) > 0).any()) or bool(
            (torch.as_tensor(top_p) < 1.0).any()
        )
    return top_k > 0 or top_p < 1.0


def _chunk_logq(
    hidden_MH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_M: torch.Tensor,
    temperature: Setting,
    top_k: Setting,
    top_p: Setting,
    never_sampled: torch.Tensor | None = None,
    precision: HeadPrecision = "float32",
) -> tuple[torch.Tensor, bool]:
    """``[M, V]`` ``log q`` of :func:`chunk_logprobs` (−inf outside the cut and on
    ``never_sampled``), in :func:`head_dtype`, and whether it is finite everywhere (finite
    logits given): nothing was cut and no token id is ``never_sampled``."""
    dtype = head_dtype(hidden_MH)
    device = hidden_MH.device
    with torch.autocast(device.type, enabled=False), head_matmuls(precision, device):
        logits_MV = F.linear(
            hidden_MH.to(dtype), weight_VH.to(dtype), None if bias_V is None else bias_V.to(dtype)
        )
    if never_sampled is not None:
        logits_MV = logits_MV.index_fill(-1, never_sampled, float("-inf"))
    rows = logits_MV.shape[0]
    if isinstance(temperature, torch.Tensor):
        logits_MV = logits_MV / temperature.to(logits_MV)[:, None]
    elif temperature != 1.0:
        logits_MV = logits_MV / temperature
    logq_MV = torch.log_softmax(logits_MV, dim=-1)
    cut = _cuts(top_k, top_p)
    if cut:
        top_k_M = torch.as_tensor(top_k, dtype=torch.int64, device=logq_MV.device).expand(rows)
        top_p_M = torch.as_tensor(top_p, dtype=torch.float64, device=logq_MV.device).expand(rows)
        keep_MV = kept_mask(logq_MV, top_k_M, top_p_M)
        keep_MV = keep_MV.scatter(-1, targets_M[:, None], True)
        logq_MV = cut_logprobs(logits_MV, keep_MV)
    return logq_MV, never_sampled is None and not cut


def _entropy(logq_MV: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """``H = −Σ q·log q`` per row. ``finite``: ``log q`` holds no ``−inf``
    (:func:`_chunk_logq` says), which spares three passes over ``[M, V]``."""
    if finite:
        return -(logq_MV.exp() * logq_MV).sum(dim=-1)
    # log q set to 0 outside K before the product: 0·(−inf) would be NaN, in the value and
    # in the gradient (where() after the product still sends 0·(−inf) backward)
    finite_logq_MV = torch.where(torch.isfinite(logq_MV), logq_MV, torch.zeros_like(logq_MV))
    return -(logq_MV.exp() * finite_logq_MV).sum(dim=-1)


def chunk_logprobs(
    hidden_MH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_M: torch.Tensor,
    temperature: Setting,
    top_k: Setting = 0,
    top_p: Setting = 1.0,
    entropy: bool = True,
    never_sampled: torch.Tensor | None = None,
    precision: HeadPrecision = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and entropy per row, of the distribution a sampler with these
    settings draws from. With logits ``z = h·Wᵀ + b`` computed in float32 (``z_v = −∞``
    for the token ids ``never_sampled``, a vision model's image placeholders, which the
    engines never sample either)::

        log p = log_softmax(z / T)
        K     = kept_mask(log p, top_k, top_p) ∪ {y}        (no gradient through the choice)
        log q = log p − logsumexp_{v∈K} log p    on K,  −inf elsewhere
        returns  log q[y],  H(q) = −Σ_{v∈K} q·log q

    Without a cut (``top_k = 0``, ``top_p = 1``), ``q = p``. Each setting is one value or
    one per row (:data:`Setting`). ``entropy=False`` returns
    zeros for ``H`` (no pass over the vocabulary for it). The target always belongs to
    ``K``: it was sampled, so the sampler kept it, and a token at the cut's edge that the
    trainer's slightly different logits would drop must not get logprob −inf.

    The matmul runs in float32 whatever the compute dtype (hidden states and a bf16-gathered
    weight are upcast, autocast is off; a float64 model keeps float64): logits rounded to
    bf16 before the softmax would err by up to ~1e-2 in every logprob. ``precision="tf32"``
    lets CUDA's tensor cores run it (:data:`HeadPrecision`): on SmolLM2's hidden states
    that errs by ~1e-3 a logprob on average, against ~4e-2 for a bf16 forward of the model.
    """
    logq_MV, finite = _chunk_logq(
        hidden_MH, weight_VH, bias_V, targets_M, temperature, top_k, top_p, never_sampled,
        precision,
    )  # fmt: skip
    picked_M = logq_MV.gather(-1, targets_M[:, None]).squeeze(-1)
    if not entropy:
        return picked_M, torch.zeros_like(picked_M)
    return picked_M, _entropy(logq_MV, finite)


class FusedLogprobs(torch.autograd.Function):
    """:func:`chunk_logprobs` over all rows, chunk by chunk, with one LM-head matmul per
    chunk in forward and none recomputed in backward.

    Forward keeps each chunk's ``log q`` (``[chunk, V]`` float32: the one activation the
    gradient needs), so backward starts from it. With upstream gradients ``g`` (of the
    logprob) and ``e`` (of the entropy) per row, and ``s = z / T``::

        ∂ log q[y] / ∂s_v = 1[v = y] − q_v               (v ∈ K; 0 outside)
        ∂ H / ∂s_v        = −q_v · (log q_v + H)          (v ∈ K; 0 outside)
        ∂L/∂z = (g · (1_y − q) − e · q ⊙ (log q + H)) / T

    then ``∂L/∂h = ∂L/∂z · W`` and ``∂L/∂W = ∂L/∂zᵀ · h`` per chunk, in float32 (float64
    for a float64 model, :func:`head_dtype`; the same ``precision`` as forward). The kept set
    carries no gradient, as in :func:`chunk_logprobs`, whose autograd gives the same values.
    Memory: ``rows · V`` floats live from forward to backward (the checkpointed form holds
    one chunk's logits, computing them twice).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_MH: torch.Tensor,
        weight_VH: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_M: torch.Tensor,
        temperature: Setting,
        top_k: Setting,
        top_p: Setting,
        entropy: bool,
        chunk_tokens: int,
        never_sampled: torch.Tensor | None = None,
        precision: HeadPrecision = "float32",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # An output that the loss does not use (the entropy, without an entropy bonus) gets
        # None in backward, not a tensor of zeros whose gradient would take four passes
        # over every chunk's [chunk, V] to come out zero.
        ctx.set_materialize_grads(False)
        logprobs, entropies, logqs = [], [], []
        finite = []  # per chunk: log q has no −inf (no cut, no never-sampled id)
        for start in range(0, targets_M.numel(), chunk_tokens):
            end = start + chunk_tokens
            logq_MV, chunk_finite = _chunk_logq(
                hidden_MH[start:end], weight_VH, bias_V, targets_M[start:end],
                rows_of(temperature, start, end), rows_of(top_k, start, end),
                rows_of(top_p, start, end), never_sampled, precision,
            )  # fmt: skip
            finite.append(chunk_finite)
            logprobs.append(logq_MV.gather(-1, targets_M[start:end, None]).squeeze(-1))
            entropies.append(
                _entropy(logq_MV, chunk_finite) if entropy else torch.zeros_like(logprobs[-1])
            )
            logqs.append(logq_MV)
        lp_M, ent_M = torch.cat(logprobs), torch.cat(entropies)
        ctx.save_for_backward(hidden_MH, weight_VH, bias_V, targets_M, ent_M, *logqs)
        ctx.temperature, ctx.entropy, ctx.chunk_tokens = temperature, entropy, chunk_tokens
        ctx.finite = finite
        ctx.precision = precision
        return lp_M, ent_M

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_lp_M: torch.Tensor | None, grad_ent_M: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden_MH, weight_VH, bias_V, targets_M, ent_M, *logqs = ctx.saved_tensors
        step = ctx.chunk_tokens
        dtype = head_dtype(hidden_MH)
        h_MH, w_VH = hidden_MH.to(dtype), weight_VH.to(dtype)
        grad_h = torch.zeros_like(h_MH) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w_VH) if ctx.needs_input_grad[1] else None
        grad_b = (
            torch.zeros(w_VH.shape[0], dtype=dtype, device=w_VH.device)
            if bias_V is not None and ctx.needs_input_grad[2]
            else None
        )
        device = hidden_MH.device
        with torch.autocast(device.type, enabled=False), head_matmuls(ctx.precision, device):
            for i, logq_MV in enumerate(logqs):
                rows = slice(i * step, i * step + logq_MV.shape[0])
                # ∂L/∂z = q ⊙ (a + b·(log q + H)) + g/T at the target, with a = −g/T and
                # b = −e/T per row: two passes over [chunk, V] without entropy, four with
                zero_M = torch.zeros(logq_MV.shape[0], dtype=dtype, device=logq_MV.device)
                g_M = zero_M if grad_lp_M is None else grad_lp_M[rows].to(dtype)
                temperature = rows_of(ctx.temperature, rows.start, rows.stop)
                if isinstance(temperature, torch.Tensor):
                    temperature = temperature.to(g_M)
                g_M = g_M / temperature
                grad_MV = logq_MV.exp()
                if ctx.entropy and grad_ent_M is not None:
                    b_M = grad_ent_M[rows].to(dtype) / -temperature
                    # log q + H, with log q read as 0 outside the cut
                    term_MV = (
                        logq_MV.add(ent_M[rows, None])
                        if ctx.finite[i]
                        else torch.nan_to_num(logq_MV, neginf=0.0).add_(ent_M[rows, None])
                    )
                    term_MV.mul_(b_M[:, None]).sub_(g_M[:, None])
                    grad_MV.mul_(term_MV)
                    del term_MV
                else:
                    grad_MV.mul_(-g_M[:, None])
                grad_MV.scatter_add_(-1, targets_M[rows, None], g_M[:, None])
                if grad_h is not None:
                    grad_h[rows] = grad_MV @ w_VH
                if grad_w is not None:
                    grad_w.addmm_(grad_MV.t(), h_MH[rows])
                if grad_b is not None:
                    grad_b += grad_MV.sum(dim=0)
        return (
            None if grad_h is None else grad_h.to(hidden_MH.dtype),
            None if grad_w is None else grad_w.to(weight_VH.dtype),
            None if grad_b is None else grad_b.to(bias_V.dtype),
            None, None, None, None, None, None, None, None,
        )  # fmt: skip


def hf_model(lm: nn.Module) -> Any:
    """The transformers model inside ``lm``: a peft model's base model, else ``lm``."""
    get_base = getattr(lm, "get_base_model", None)
    return get_base() if callable(get_base) else lm


class TokenLogprobs(nn.Module):
    """``forward(...) -> (logprobs [M], entropies [M])`` of chosen tokens under a causal LM.

    The LM is ``self.lm`` (a transformers ``*ForCausalLM``); its state-dict names, prefixed
    with ``lm.``, are those of the HF checkpoint. With gradients, the LM head runs once per
    chunk (:class:`FusedLogprobs`), or with ``recompute_head`` under activation
    checkpointing: one chunk of logits alive at a time, computed again in backward.

    A vision-language model (``vision=True``, transformers' image-text-to-text class) runs
    its base model instead of the decoder alone, so that the image features (from the
    ``image_inputs`` of each forward) replace the placeholder embeddings before the
    language model; ``never_sampled`` (its placeholder ids) get logit −∞ before the
    softmax, as in the engines' sampling. Both are off for a text model.

    ``head_precision`` (:data:`HeadPrecision`) is how the head's matmuls run on CUDA, in
    forward and in the fused backward (the checkpointed form's backward stays float32).
    """

    def __init__(
        self,
        lm: nn.Module,
        *,
        chunk_tokens: int = 2048,
        recompute_head: bool = False,
        vision: bool = False,
        never_sampled: Sequence[int] = (),
        head_precision: HeadPrecision = "float32",
    ) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.recompute_head = recompute_head
        self.head_precision: HeadPrecision = head_precision
        self.vision = vision
        # a buffer, so that it follows the module to its device
        self.never_sampled: torch.Tensor | None
        self.register_buffer(
            "never_sampled",
            torch.tensor(sorted(never_sampled)) if never_sampled else None,
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_index: torch.Tensor,
        temperature: Setting = 1.0,
        cu_seqlens: torch.Tensor | None = None,
        max_len: int = 0,
        top_k: Setting = 0,
        top_p: Setting = 1.0,
        with_entropy: bool = False,
        source_index: torch.Tensor | None = None,
        key_index: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_len_k: int = 0,
        image_inputs: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob of ``input_ids.flatten()[i]`` given what precedes it, for each ``i`` in
        ``target_index`` (flat indices, never the first token of a sequence), under the
        sampled distribution of :func:`chunk_logprobs`, predicted from the hidden state at
        the matching ``source_index`` (default: ``target_index − 1``, the token before).

        Returns ``(logprobs [M], entropy [M])``; the entropy is zeros unless
        ``with_entropy``. Both come from the same logits, so the entropy (a statistic, or a
        bonus in the loss with its gradient) costs no extra LM-head pass.

        Args:
            input_ids: ``[B, T]`` (``B = 1`` when packed).
            position_ids: ``[B, T]``, restarting at 0 for each packed sequence.
            attention_mask: ``[B, T]`` padding mask, or None when packed.
            target_index: ``[M]`` int64.
            cu_seqlens: ``[n + 1]`` int32 cumulative lengths of the packed sequences, for
                attention backends that take boundaries (``asyncrl_varlen``,
                ``flash_attention_2``); others ignore it and read ``position_ids``.
            max_len: the longest packed sequence (segment).
            temperature, top_k, top_p: the sampler's temperature and cut (0 and 1: none),
                one value or one per target (``[M]``, :data:`Setting`).
            source_index: ``[M]`` int64, where the token before each target is: a sample's
                first token after a shared prefix is predicted by the prefix's last.
            key_index, cu_seqlens_k, max_len_k: with shared prefixes, the row positions
                whose keys each segment attends, cut per segment, and the most of them
                (``asyncrl_varlen``, :mod:`asyncrl.train.attention`).
            image_inputs: a vision model's pixel inputs of the row(s)
                (:class:`~asyncrl.train.vision.ImageInputs`); Qwen2-VL's ``position_ids``
                are then its 3-D rotary ones (``[4, 1, N]`` packed, ``[3, B, T]`` padded).
        """
        # A vision model runs its base model (vision tower, projector, language model):
        # image features replace the placeholders' embeddings before the language model.
        lm: Any = self.lm
        decoder = hf_model(lm).model if self.vision else lm.get_decoder()
        boundaries: dict[str, Any] = {}
        if cu_seqlens is not None:
            boundaries = {
                "cu_seq_lens_q": cu_seqlens,
                "cu_seq_lens_k": cu_seqlens,
                "max_length_q": max_len,
                "max_length_k": max_len,
            }
        if key_index is not None:
            boundaries.update(
                key_index=key_index, cu_seq_lens_k=cu_seqlens_k, max_length_k=max_len_k
            )
        out = decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **(image_inputs or {}),
            **boundaries,
        )
        hidden_NH = out.last_hidden_state.flatten(0, 1)
        if source_index is None:
            source_index = target_index - 1
        hidden_MH = hidden_NH.index_select(0, source_index)
        targets_M = input_ids.flatten().index_select(0, target_index)
        head: Any = self.lm.get_output_embeddings()  # type: ignore[operator]
        weight_VH, bias_V = head.weight, getattr(head, "bias", None)
        if targets_M.numel() and torch.is_grad_enabled() and not self.recompute_head:
            fused: tuple[torch.Tensor, torch.Tensor] = FusedLogprobs.apply(  # type: ignore[no-untyped-call]
                hidden_MH, weight_VH, bias_V, targets_M, temperature,
                top_k, top_p, with_entropy, self.chunk_tokens, self.never_sampled,
                self.head_precision,
            )  # fmt: skip
            return fused
        logprobs, entropies = [], []
        for start in range(0, targets_M.numel(), self.chunk_tokens):
            end = start + self.chunk_tokens
            args = (
                hidden_MH[start:end], weight_VH, bias_V, targets_M[start:end],
                rows_of(temperature, start, end), rows_of(top_k, start, end),
                rows_of(top_p, start, end),
            )  # fmt: skip
            if torch.is_grad_enabled():
                # Recomputed in backward, so only one chunk of logits is ever alive.
                lp_M, ent_M = checkpoint(
                    chunk_logprobs, *args, with_entropy, self.never_sampled,
                    self.head_precision, use_reentrant=False,
                )  # fmt: skip
            else:
                lp_M, ent_M = chunk_logprobs(
                    *args, with_entropy, self.never_sampled, self.head_precision
                )
            logprobs.append(lp_M)
            entropies.append(ent_M)
        if not logprobs:
            # Keep the graph connected to every parameter group: an idle rank must still
            # run a backward that reduce-scatters (zero) gradients like the others.
            zero = weight_VH.sum() * 0.0 + (0.0 if bias_V is None else bias_V.sum() * 0.0)
            empty = hidden_MH.sum(dim=-1).to(head_dtype(hidden_MH)) * 0.0 + zero
            return empty, empty
        return torch.cat(logprobs), torch.cat(entropies)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of every HF model inside ``model``: modules whose class is in
    some ``_no_split_modules`` (the unit transformers itself never splits)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_fsdp(
    model: nn.Module,
    mesh: Any,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shards ``model`` in place with FSDP2: each decoder layer is one unit, the root (the
    embeddings, final norm, LM head and anything else left) another.

    Parameters stay float32 shards (the master weights, and the optimizer's); they are
    gathered in ``param_dtype`` for compute and gradients are reduce-scattered in
    ``reduce_dtype`` (bf16 compute with fp32 reduction on GPUs; fp32 on CPU/gloo). Tied
    embeddings stay tied because both ends live in the root group.
    """

    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=reduce_dtype,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
