"""LoRA in the train engine: adapters put into the model (through ``peft``, before FSDP2
shards it), and the two exports of an adapted model, the adapter alone and the merged
full weights.

Under ``peft`` the model's parameters are named ``base_model.model.<module>.base_layer
.weight`` (the frozen base weight of an adapted layer), ``...lora_A.default.weight`` and
``...lora_B.default.weight`` (the adapter), and ``base_model.model.<name>`` for the rest.
Only the adapters require grad. The exports use the names of peft's files
(:mod:`asyncrl.weights.lora`) and of the base model's HF checkpoint.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from safetensors.torch import save_file
from torch import nn

from asyncrl.train import dcp
from asyncrl.train.config import LoraConfig
from asyncrl.weights.lora import ADAPTER_WEIGHTS, PEFT_PREFIX, merged

ADAPTER_NAME = "default"


def apply_lora(
    lm: nn.Module, config: LoraConfig, *, seed: int = 0, exclude: Sequence[str] = ()
) -> nn.Module:
    """``lm`` with adapters on its ``target_modules`` (a ``peft`` model around it): A
    random (Kaiming, drawn from ``seed``), B zero, so the adapted model starts as the base
    model exactly; only the adapters require grad. ``exclude``: full names of modules
    that get none even where their name matches (a vision tower's linear layers: the
    engines load adapters into the language model only).

    Every rank must pass the same ``seed``: FSDP2 keeps each rank's own slice of the
    tensor it is given, so adapters drawn from per-rank RNG streams would be stitched
    together from different initialisations."""

    excluded = set(exclude)
    unmatched = [
        name for name in config.target_modules if not set(_decoder_linears(lm, name)) - excluded
    ]
    if unmatched:
        present = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in lm.named_modules()
                if _in_decoder_linear(n, m) and n not in excluded
            }
        )
        raise ValueError(
            f"trainer.lora.target_modules: {unmatched} match no linear layer of the model's "
            f"decoder layers; its linear layers there are {present}"
        )
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        exclude_modules=sorted(excluded) or None,
        bias="none",
    )
    with warnings.catch_warnings():
        # peft asks transformers 5 by the method name it deprecated; nothing to act on
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(lm, peft_config)  # type: ignore[arg-type,no-any-return]


def _in_decoder_linear(name: str, module: nn.Module) -> bool:
    """Whether ``module`` (named ``name`` in the model) is a linear layer inside one of the
    numbered decoder layers (``...layers.<i>....``)."""
    parts = name.split(".")
    return isinstance(module, nn.Linear) and any(
        p in ("layers", "h", "blocks") and i + 1 < len(parts) and parts[i + 1].isdigit()
        for i, p in enumerate(parts)
    )


def _decoder_linears(lm: nn.Module, target: str) -> list[str]:
    """The decoder layers' linear layers whose last name component is ``target``."""
    return [
        n
        for n, m in lm.named_modules()
        if n.rsplit(".", 1)[-1] == target and _in_decoder_linear(n, m)
    ]


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_key(name: str) -> str:
    """The key of parameter ``name`` in peft's ``adapter_model.safetensors`` (no adapter
    name): ``...q_proj.lora_A.default.weight`` → ``...q_proj.lora_A.weight``."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def base_key(name: str) -> str:
    """The HF checkpoint name of a base parameter: ``base_model.model.X.base_layer.weight``
    → ``X.weight``."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def export_adapter(
    path: str | os.PathLike[str], lm: nn.Module, *, dtype: torch.dtype | None = None
) -> None:
    """Writes the adapter of the peft model ``lm`` as peft does (``adapter_config.json``,
    ``adapter_model.safetensors``), in ``dtype`` (default: as trained). Collective: each
    adapter tensor is gathered; rank 0 writes."""

    rank, _ = dcp._rank_world()
    tensors: dict[str, torch.Tensor] = {}
    for name, param in lm.named_parameters():
        if not is_adapter_param(name):
            continue
        full = dcp._full(param.detach())
        if rank == 0:
            tensors[adapter_key(name)] = full.to("cpu", dtype or full.dtype, copy=True)
    if rank == 0:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(root / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_lm: Any = lm
        peft_lm.peft_config[ADAPTER_NAME].save_pretrained(str(root))
    dcp._barrier()


def iter_merged_weights(
    lm: nn.Module, bucket_bytes: int, *, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`~asyncrl.train.dcp.iter_full_weights` of the peft model ``lm`` with
    every adapter merged into its base weight (:func:`asyncrl.weights.lora.merged`, in float32),
    under the base model's HF names. Collective, with the same bucket count on every rank
    (rank 0 gets the tensors).

    peft lists an adapted layer's ``base_layer.weight`` before its ``lora_A`` and
    ``lora_B``, so a base weight waits (across buckets if need be) until both arrive."""
    peft_lm: Any = lm
    scale = (
        float(peft_lm.peft_config[ADAPTER_NAME].lora_alpha) / peft_lm.peft_config[ADAPTER_NAME].r
    )
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> its gathered parts
    for bucket in dcp.iter_full_weights(lm, bucket_bytes, dtype=torch.float32):
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            if name.endswith(".base_layer.weight") or is_adapter_param(name):
                layer = name.removesuffix(".base_layer.weight").split(".lora_")[0]
                part = "A" if ".lora_A." in name else "B" if ".lora_B." in name else "W"
                parts = waiting.setdefault(layer, {})
                parts[part] = tensor
                if len(parts) == 3:
                    del waiting[layer]
                    weight = merged(parts["W"], parts["A"], parts["B"], scale)
                    out.append((base_key(layer) + ".weight", weight.to(dtype or weight.dtype)))
            else:
                out.append((base_key(name), tensor.to(dtype or tensor.dtype)))
        yield out
    if waiting:
        raise RuntimeError(f"adapted layers without all of W, A, B: {sorted(waiting)[:3]}")
