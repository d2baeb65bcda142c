"""The unit of training data: one sequence with its loss inputs.

Alignment convention (shared by the sampler, :class:`Sample` and
``TrainEngine.compute_logprobs``): every per-token array has the length of ``input_ids``,
and the value at position ``t`` belongs to token ``t``. A logprob at ``t`` is
``log p(input_ids[t] | input_ids[:t])``; position 0 has no context, so its logprob is 0
and ``loss_mask[0]`` must be False. Where ``loss_mask`` is False (prompt, environment
tokens) logprobs are 0 by convention and never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def _as_tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=dtype)
    # torch.tensor copies: numpy views of wire bytes are read-only, and torch warns on those.
    return torch.tensor(value, dtype=dtype)


@dataclass
class Sample:
    """One sequence (prompt + generated tokens) ready for the trainer.

    Attributes:
        input_ids: ``[L]`` int64 token ids.
        loss_mask: ``[L]`` bool, True on the generated tokens that carry a loss.
        behav_logprobs: ``[L]`` float32, the behaviour (sampling) policy's logprobs of the
            temperature-scaled distribution, 0 where ``loss_mask`` is False.
        advantages: a scalar (one per sequence, GRPO) or ``[L]`` float32 per token.
        old_logprobs: ``[L]`` float32 proximal-policy logprobs (decoupled PPO), or None.
        ref_logprobs: ``[L]`` float32 reference-policy logprobs for the KL penalty, or None.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    behav_logprobs: torch.Tensor
    advantages: torch.Tensor | float
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.input_ids = _as_tensor(self.input_ids, torch.int64)
        self.loss_mask = _as_tensor(self.loss_mask, torch.bool)
        self.behav_logprobs = _as_tensor(self.behav_logprobs, torch.float32)
        self.advantages = _as_tensor(self.advantages, torch.float32)
        if self.old_logprobs is not None:
            self.old_logprobs = _as_tensor(self.old_logprobs, torch.float32)
        if self.ref_logprobs is not None:
            self.ref_logprobs = _as_tensor(self.ref_logprobs, torch.float32)
        if self.input_ids.ndim != 1 or self.input_ids.numel() < 1:
            raise ValueError(
                f"input_ids must be 1-D and non-empty, got {tuple(self.input_ids.shape)}"
            )
        n = self.input_ids.numel()
        per_token = {
            "loss_mask": self.loss_mask,
            "behav_logprobs": self.behav_logprobs,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
        }
        if self.advantages.ndim != 0:
            per_token["advantages"] = self.advantages
        for name, value in per_token.items():
            if value is not None and tuple(value.shape) != (n,):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, input_ids ({n},)")
        if bool(self.loss_mask[0]):
            raise ValueError("loss_mask[0] must be False: the first token has no logprob")

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def advantages_per_token(self) -> torch.Tensor:
        """``[L]`` advantages, broadcasting a per-sequence scalar."""
        adv = self.advantages
        assert isinstance(adv, torch.Tensor)
        return adv.expand(len(self)) if adv.ndim == 0 else adv


Batch = Sequence[Sample]
"""A global training batch: every rank passes the same list, in the same order."""
