"""The SFT engine: the train engine (FSDP2 model, packed micro-batches, fused LM head,
optimizer, schedule, checkpoints, export) stepped with the masked cross-entropy of
:mod:`asyncrl.sft.loss` instead of the policy loss.

Same distributed contract as :class:`~asyncrl.train.engine.TrainEngine`: under torchrun
every rank builds the engine and calls each method with the same global batch, which the
engine splits over ranks and micro-batches itself.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from asyncrl.sft.loss import masked_ce
from asyncrl.train.batch import Batch
from asyncrl.train.engine import TrainEngine


class SFTEngine(TrainEngine):
    """A :class:`TrainEngine` with an SFT step and a held-out loss."""

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the global ``batch`` (each sample's ``loss_mask`` marks
        its answer tokens): forward and backward of :func:`masked_ce` over this rank's
        micro-batches, the gradient norm clipped, then step and version + 1. A step whose
        gradient norm is not finite changes no weight (counted in ``skipped_nonfinite``).
        Collective. Returns ``loss`` (the batch's token-mean cross-entropy), ``grad_norm``,
        ``lr``, token counts and timings."""
        t0 = time.perf_counter()
        num_tokens = sum(s.num_loss_tokens for s in batch)
        lr = self._apply_lr()
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for mb in self._micro_batches(batch):
            loss = masked_ce(self._logprobs_BT(mb), mb.loss_mask_BT, num_tokens)
            # FSDP averages gradients over ranks; the world-size factor makes that average
            # the sum of the ranks' parts, which is the global token mean.
            (loss * self.world_size).backward()
            loss_sum += loss.detach()
        if self.distributed:
            dist.all_reduce(loss_sum)
        grad_norm = self._clip_and_step()
        if not math.isfinite(grad_norm):
            self.skipped_nonfinite += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.version += 1
        self._sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(s) for s in batch)
        return {
            "loss": float(loss_sum),
            "grad_norm": grad_norm,
            "lr": lr,
            "step": float(self.step),
            "sequences": float(len(batch)),
            "tokens": float(tokens),
            "loss_tokens": float(num_tokens),
            "skipped_nonfinite": float(self.skipped_nonfinite),
            "time/step_s": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9),
        }

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> float:
        """The token-mean cross-entropy of ``batch``'s answer tokens under the current
        weights (no gradient, no step). Collective."""
        self.module.eval()
        num_tokens = sum(s.num_loss_tokens for s in batch)
        loss_sum = torch.zeros((), device=self.device)
        for mb in self._micro_batches(batch):
            loss_sum += masked_ce(self._logprobs_BT(mb), mb.loss_mask_BT, num_tokens)
        self._reshard()
        if self.distributed:
            dist.all_reduce(loss_sum)
        return float(loss_sum)


__all__ = ["SFTEngine"]
