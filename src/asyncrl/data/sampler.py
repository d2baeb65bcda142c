"""Deterministic shuffling and sharding of a dataset, with a resumable position.

Epoch e visits the indices ``permutation(seed, e)``; shard k of n takes every n-th of
them starting at k, so the shards of one epoch are disjoint and together cover the data
(up to n − 1 dropped at the tail, so every shard has the same length). The position is
``(epoch, offset)``: ``state()`` and ``restore()`` carry it through a checkpoint, and a
restored sampler continues with exactly the indices the original would have given.
"""

from __future__ import annotations

import random
from typing import Any


def epoch_permutation(size: int, seed: int, epoch: int) -> list[int]:
    """The visiting order of epoch ``epoch``: a fixed function of (size, seed, epoch)."""
    order = list(range(size))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


class ShardSampler:
    """Indices into a dataset of ``size`` items, shuffled per epoch, for one shard."""

    def __init__(
        self, size: int, seed: int = 0, shard: int = 0, num_shards: int = 1, shuffle: bool = True
    ) -> None:
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} of {num_shards} does not exist")
        if size < num_shards:
            raise ValueError(f"{size} items cannot fill {num_shards} shards")
        self.size, self.seed, self.shard, self.num_shards = size, seed, shard, num_shards
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._shard_order(0)

    @property
    def per_epoch(self) -> int:
        """Indices this shard yields per epoch."""
        return self.size // self.num_shards

    def _shard_order(self, epoch: int) -> list[int]:
        order = (
            epoch_permutation(self.size, self.seed, epoch)
            if self.shuffle
            else list(range(self.size))
        )
        return order[self.shard : self.per_epoch * self.num_shards : self.num_shards]

    def next(self) -> tuple[int, int]:
        """``(epoch, index)`` of the next item; epochs roll over forever."""
        if self.offset >= len(self._order):
            self.epoch += 1
            self.offset = 0
            self._order = self._shard_order(self.epoch)
        index = self._order[self.offset]
        self.offset += 1
        return self.epoch, index

    def take(self, n: int) -> list[tuple[int, int]]:
        return [self.next() for _ in range(n)]

    def state(self) -> dict[str, Any]:
        """The position, and what it is valid for (a different dataset cannot restore it)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "size": self.size,
            "seed": self.seed,
            "shard": self.shard,
            "num_shards": self.num_shards,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from ``state()``; raises if it was taken for another dataset or shard."""
        for key in ("size", "seed", "shard", "num_shards"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state is for {key}={state[key]}, not {getattr(self, key)}"
                )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._shard_order(self.epoch)
