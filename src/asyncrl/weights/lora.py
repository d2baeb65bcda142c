"""LoRA adapters as files, and merging one into base weights: the one definition that the
trainer's merged export and the hf engine's adapter updates share.

An adapter directory is what ``peft`` writes: ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors``, whose keys
are ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
(``[out, in]`` → ``[out, r]``). Merged, the module's weight is::

    W' = W + (lora_alpha / r) · B @ A          (float32, then cast to W's dtype)

torch is imported on first use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is an adapter directory (rather than full weights)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


@dataclass
class LoraAdapter:
    """An adapter in memory: ``factors[weight name] = (A [r, in], B [out, r])``, the
    weight named as in the base model's HF state dict (``model.layers.0.self_attn.q_proj
    .weight``), and the scale ``lora_alpha / r``."""

    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def adapter_from_tensors(
    tensors: dict[str, torch.Tensor], config: dict[str, object]
) -> LoraAdapter:
    """The adapter of peft-named ``tensors`` (an ``adapter_model.safetensors``) and its
    ``adapter_config.json`` contents. Raises on a config this merge does not implement."""
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError("rsLoRA and DoRA adapters are not supported: plain LoRA only")
    if config.get("fan_in_fan_out"):
        raise ValueError("fan_in_fan_out adapters (Conv1D layers) are not supported")
    rank = int(config["r"])  # type: ignore[call-overload]
    scale = float(config["lora_alpha"]) / rank  # type: ignore[arg-type]
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for side in ("lora_A", "lora_B"):
            marker = f".{side}.weight"
            if name.endswith(marker):
                parts.setdefault(name.removesuffix(marker) + ".weight", {})[side] = tensor
                break
        else:
            raise ValueError(f"{key!r} is no LoRA factor (lora_A / lora_B weight)")
    factors = {}
    for weight, sides in parts.items():
        if set(sides) != {"lora_A", "lora_B"}:
            raise ValueError(f"the adapter of {weight!r} lacks one of lora_A / lora_B")
        factors[weight] = (sides["lora_A"], sides["lora_B"])
    return LoraAdapter(scale=scale, factors=factors)


def read_adapter(path: str | Path) -> LoraAdapter:
    """The adapter in directory ``path`` (as peft writes it), on the CPU."""
    from safetensors.torch import load_file  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

    root = Path(path)
    config = json.loads((root / ADAPTER_CONFIG).read_text())
    return adapter_from_tensors(load_file(str(root / ADAPTER_WEIGHTS)), config)


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale · b @ a`` computed in float32 on ``weight``'s device, in
    ``weight``'s dtype; a new tensor (``weight`` is not changed)."""
    import torch  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

    delta = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
    return (weight.float() + scale * delta).to(weight.dtype)
