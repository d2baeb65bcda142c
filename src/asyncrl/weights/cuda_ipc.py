"""``cuda_ipc``: an engine on the trainer's GPU maps the trainer's tensors through CUDA IPC
handles and copies them into its weights on the device, with no host copy.

The trainer packs each version into flat device buckets (the ``collective`` layout,
:func:`~asyncrl.weights.collective.pack`), exports each bucket's IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``) and puts the handles, a few KiB, in
the object store; the announcement names that blob. The engine opens the handles, views
its tensors in the mapped buckets and copies them in its pause. The trainer keeps the
buckets of the newest :data:`KEEP` versions alive, so that a handle an engine opens late
still maps live memory. GPU only: ``asyncrl check`` refuses it where trainer and engine do
not share a CUDA device.
"""

from __future__ import annotations

import asyncio
import pickle
from collections import deque

from asyncrl.api.weights import NamedTensors, WeightPublisher, Weights
from asyncrl.runtime.bus import Bus
from asyncrl.weights.wire import Packed, pack, unpack
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects

KEEP = 2
"""Versions whose device buckets the trainer keeps alive for engines still mapping them."""


def export_handles(packed: Packed) -> bytes:
    """The IPC handles of ``packed``'s device buckets, with its manifest, as bytes."""
    from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

    handles = [reduce_tensor(b) for b in packed.buckets]
    return pickle.dumps(
        {
            "version": packed.version,
            "epoch": packed.epoch,
            "manifest": packed.manifest,
            "handles": handles,
        }
    )


def open_handles(blob: bytes, device: str) -> tuple[int, int, NamedTensors, str, None]:
    """Maps the buckets of an exported version; ``(version, epoch, tensors, via)``. The
    blob comes from the run's own object store, written by its trainer."""
    about = pickle.loads(blob)
    buckets = [fn(*args) for fn, args in about["handles"]]
    return about["version"], about["epoch"], unpack(about["manifest"], buckets), "cuda_ipc", None


class CudaIpcPublisher(WeightPublisher):
    """The trainer side: device buckets kept alive, handles through the object store."""

    kind = "cuda_ipc"

    def __init__(self, bus: Bus, subjects: Subjects, *, dtype: str, device: str) -> None:
        super().__init__(bus, subjects)
        self.dtype, self.device = dtype, device
        self._alive: deque[tuple[str, Packed]] = deque()

    async def publish(self, weights: Weights) -> WeightsUpdated:
        def export() -> tuple[Packed, bytes]:
            tensors = [(n, t.to(self.device)) for n, t in weights.tensors(self.dtype)]
            packed = pack(tensors, 1 << 62, weights.version, weights.epoch)
            return packed, export_handles(packed)

        packed, blob = await asyncio.to_thread(export)
        key = f"ipc-e{weights.epoch}-v{weights.version:06d}"
        await self.bus.put_blob(self.subjects.weights_bucket, key, blob)
        msg = await self.announce(weights, key)
        self._alive.append((key, packed))
        while len(self._alive) > KEEP:
            old, _ = self._alive.popleft()
            await self.bus.delete_blob(self.subjects.weights_bucket, old)
        return msg


__all__ = ["CudaIpcPublisher", "export_handles", "open_handles"]
