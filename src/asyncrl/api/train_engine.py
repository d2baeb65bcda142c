"""The train-engine contract: what the trainer ranks' protocol (:mod:`asyncrl.train.commands`)
and the trainer actor call on the engine of each rank.

Distributed contract: under torchrun every rank holds an engine built from the same
config, and every method below except the read-only properties is *collective*: every
rank calls it, in the same order, with the same arguments (``train_shard`` excepted,
which each rank calls with its own shard of one split planned on rank 0). Methods block
(torch work): async code calls them from a worker thread. The engine owns the training's
progress, ``step`` and ``version``, which its checkpoint saves and restores.

:class:`asyncrl.train.engine.TrainEngine` (GRPO) and :class:`asyncrl.sft.engine.SFTEngine`
implement it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from asyncrl.train.config import TrainerConfig
    from asyncrl.train.shard import TrainShard


class TrainEngineProtocol(Protocol):
    """The engine of one trainer rank."""

    @property
    def config(self) -> TrainerConfig:
        """The recipe's ``trainer`` section the engine was built from (rank 0 plans each
        step's shards with it)."""
        ...

    @property
    def step(self) -> int:
        """Train steps taken (skipped non-finite steps included)."""
        ...

    @property
    def version(self) -> int:
        """The policy version of the current weights: 0 at the start, + 1 per train step."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, None if none is known (exports then carry weights only)."""
        ...

    def train_shard(self, shard: TrainShard) -> dict[str, float]:
        """One train step on this rank's ``shard`` of the global batch (version + 1);
        returns the step's statistics (rank 0's are the batch's)."""
        ...

    def export_weights(self, path: str | os.PathLike[str]) -> None:
        """Writes what a weight update publishes at ``path`` (rank 0 writes): the full HF
        directory, or a LoRA adapter alone (``trainer.lora.publishes_adapter``)."""
        ...

    def iter_weights(
        self, bucket_bytes: int = 256 << 20, *, dtype: str | None = None, copy: bool = True
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights as buckets of ``(HF name, CPU tensor)`` in ``dtype``; rank 0 gets
        them, other ranks empty buckets. Every rank must exhaust the iterator.
        ``copy=False``: a tensor needing no cast or gather may be the live parameter."""
        ...

    def offload(self) -> tuple[int, float]:
        """Moves parameters and optimizer state to host memory (colocation); returns
        (device bytes freed, seconds): (0, 0.0) where nothing moves."""
        ...

    def onload(self) -> tuple[int, float]:
        """Brings back what :meth:`offload` moved; returns (device bytes taken, seconds)."""
        ...

    def save_checkpoint(
        self, path: str | os.PathLike[str], extra_state: dict[str, Any] | None = None
    ) -> None:
        """A resumable checkpoint (model, optimizer, RNG, step, version, ``extra_state``) in
        the directory ``path``."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restores what :meth:`save_checkpoint` saved (the world size may differ); returns
        its ``extra_state``."""
        ...


__all__ = ["TrainEngineProtocol"]
