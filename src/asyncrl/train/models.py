"""Model loading, the logprob head, and FSDP2 sharding beside the model.

:class:`TokenLogprobs` wraps a transformers causal LM so that one ``forward`` returns the
logprobs the loss needs, computing logits only at those positions and only a chunk at a
time: a ``[tokens, vocab]`` float32 logits tensor for a 150k vocabulary would otherwise be
the largest activation of the step. It is also the FSDP root, which matters: the
embeddings, final norm and LM head live in the root's parameter group and are gathered by
the root's forward hook, so everything that touches them must run inside that forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# Importing the module registers "asyncrl_varlen" with transformers.
from asyncrl.algo.truncation import cut_logprobs, kept_mask
from asyncrl.train.attention import ATTN_IMPLEMENTATION


def load_causal_lm(
    model: Any,
    *,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    seed: int = 0,
    gguf_file: str | None = None,
) -> nn.Module:
    """A transformers causal LM in float32 (the master weights), on the CPU.

    ``model`` is a local directory or hub id (loaded with ``AutoModelForCausalLM``), or a
    ``PretrainedConfig`` for a random init seeded with ``seed`` (every rank builds the
    same weights, so sharding needs no broadcast).
    """
    from transformers import AutoModelForCausalLM

    if isinstance(model, str):
        kwargs: dict[str, Any] = {
            "dtype": torch.float32,
            "attn_implementation": attn_implementation,
        }
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        lm = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        if gguf_file is not None:
            # The weights are dequantised on load; a quantizer left attached would make the
            # export claim a quantised checkpoint.
            lm.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(lm.config, "quantization_config"):
                del lm.config.quantization_config
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(
                model, dtype=torch.float32, attn_implementation=attn_implementation
            )
    lm.config.use_cache = False
    return lm  # type: ignore[no-any-return]


def chunk_logprobs(
    hidden_MH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_M: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and entropy per row, of the distribution a sampler with these
    settings draws from. With logits ``z = h·Wᵀ + b`` computed in float32::

        log p = log_softmax(z / T)
        K     = kept_mask(log p, top_k, top_p) ∪ {y}        (no gradient through the choice)
        log q = log p − logsumexp_{v∈K} log p    on K,  −inf elsewhere
        returns  log q[y],  H(q) = −Σ_{v∈K} q·log q

    Without a cut (``top_k = 0``, ``top_p = 1``), ``q = p``. ``entropy=False`` returns
    zeros for ``H`` (no pass over the vocabulary for it). The target always belongs to
    ``K``: it was sampled, so the sampler kept it, and a token at the cut's edge that the
    trainer's slightly different logits would drop must not get logprob −inf.

    The matmul runs in float32 whatever the compute dtype (hidden states and a bf16-gathered
    weight are upcast, autocast is off): logits rounded to bf16 before the softmax would
    err by up to ~1e-2 in every logprob.
    """
    with torch.autocast(hidden_MH.device.type, enabled=False):
        logits_MV = F.linear(
            hidden_MH.float(), weight_VH.float(), None if bias_V is None else bias_V.float()
        )
    if temperature != 1.0:
        logits_MV = logits_MV / temperature
    logq_MV = torch.log_softmax(logits_MV, dim=-1)
    if top_k > 0 or top_p < 1.0:
        rows = logits_MV.shape[0]
        keep_MV = kept_mask(
            logq_MV,
            torch.full((rows,), top_k, dtype=torch.int64),
            torch.full((rows,), top_p, dtype=torch.float64),
        )
        keep_MV = keep_MV.scatter(-1, targets_M[:, None], True)
        logq_MV = cut_logprobs(logits_MV, keep_MV)
    picked_M = logq_MV.gather(-1, targets_M[:, None]).squeeze(-1)
    if not entropy:
        return picked_M, torch.zeros_like(picked_M)
    # log q set to 0 outside K before the product: 0·(−inf) would be NaN, in the value and
    # in the gradient (where() after the product still sends 0·(−inf) backward)
    finite_logq_MV = torch.where(torch.isfinite(logq_MV), logq_MV, torch.zeros_like(logq_MV))
    return picked_M, -(logq_MV.exp() * finite_logq_MV).sum(dim=-1)


class TokenLogprobs(nn.Module):
    """``forward(...) -> (logprobs [M], entropies [M])`` of chosen tokens under a causal LM.

    The LM is ``self.lm`` (a transformers ``*ForCausalLM``); its state-dict names, prefixed
    with ``lm.``, are those of the HF checkpoint.
    """

    def __init__(self, lm: nn.Module, *, chunk_tokens: int = 2048) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        target_index: torch.Tensor,
        temperature: float = 1.0,
        cu_seqlens: torch.Tensor | None = None,
        max_len: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob of ``input_ids.flatten()[i]`` given what precedes it, for each ``i`` in
        ``target_index`` (flat indices, never the first token of a sequence), under the
        sampled distribution of :func:`chunk_logprobs`.

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
            max_len: the longest packed sequence.
            top_k, top_p: the sampler's cut (0 and 1: none).
        """
        decoder: Any = self.lm.get_decoder()  # type: ignore[operator]
        boundaries: dict[str, Any] = {}
        if cu_seqlens is not None:
            boundaries = {
                "cu_seq_lens_q": cu_seqlens,
                "cu_seq_lens_k": cu_seqlens,
                "max_length_q": max_len,
                "max_length_k": max_len,
            }
        out = decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **boundaries,
        )
        hidden_NH = out.last_hidden_state.flatten(0, 1)
        # The logits that predict token i come from the hidden state at i − 1.
        hidden_MH = hidden_NH.index_select(0, target_index - 1)
        targets_M = input_ids.flatten().index_select(0, target_index)
        head: Any = self.lm.get_output_embeddings()  # type: ignore[operator]
        weight_VH, bias_V = head.weight, getattr(head, "bias", None)
        logprobs, entropies = [], []
        for start in range(0, targets_M.numel(), self.chunk_tokens):
            end = start + self.chunk_tokens
            args = (hidden_MH[start:end], weight_VH, bias_V, targets_M[start:end], temperature)
            if torch.is_grad_enabled():
                # Recomputed in backward, so only one chunk of logits is ever alive.
                lp_M, ent_M = checkpoint(
                    chunk_logprobs, *args, top_k, top_p, with_entropy, use_reentrant=False
                )
            else:
                lp_M, ent_M = chunk_logprobs(*args, top_k, top_p, with_entropy)
            logprobs.append(lp_M)
            entropies.append(ent_M)
        if not logprobs:
            # Keep the graph connected to every parameter group: an idle rank must still
            # run a backward that reduce-scatters (zero) gradients like the others.
            zero = weight_VH.sum() * 0.0 + (0.0 if bias_V is None else bias_V.sum() * 0.0)
            empty = hidden_MH.sum(dim=-1).float() * 0.0 + zero
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
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=reduce_dtype,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
