"""The broadcast as SGLang's servers take it (an engine that joins with protocol
``"sglang"``): the trainer's side of SGLang's ``/init_weights_update_group`` and
``/update_weights_from_distributed`` (SGLang 0.5.23), read from SGLang's own code.

**The group.** The server joins as rank ``rank_offset + tp_rank`` through
``init_custom_process_group(init_method="tcp://host:port", world_size, rank,
group_name, backend)``: a ``tcp://`` rendezvous whose rank 0 hosts the store, so a rank
above 0 connects as a client to the trainer's existing store, and the group's keys live
under ``PrefixStore(group_name, store)``, which torch's ``_new_process_group_helper``
scopes further (``<group_name>/``, then the device). Rank 0 here runs that same helper
on the same prefix, so both ends derive the same keys whatever torch does inside. The
server creates its side without a timeout of its own (torch's default, 30 minutes):
every step on this side keeps ``weights.timeout_s``, and a send that does not complete
drops the engine as on asyncrl's wire.

**A version** is one broadcast per tensor from rank 0, in the order of the names the
server is given (the manifest of :func:`~asyncrl.weights.wire.pack`, which the trainer
puts in the object store under :func:`tensors_key` before it announces the version); the
server allocates each tensor from its name, dtype and shape, and loads them all once
received.
"""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING, Any

from asyncrl.api.inference import TensorSpec
from asyncrl.weights import wire
from asyncrl.weights.wire import Packed, timeout_of, unpack

if TYPE_CHECKING:
    from asyncrl.runtime.bus import Bus

PROTOCOL = "sglang"

KEEP_LISTS = 4
"""Tensor lists kept in the object store: an engine reads the one of the version it is
receiving, which is at most a version or two behind the newest."""


def tensors_key(group: str, epoch: int, version: int) -> str:
    """The object-store key of a version's tensor list (the same on both sides)."""
    return f"sglang-{group}-e{epoch}-v{version:06d}"


def tensor_specs(manifest: bytes) -> list[TensorSpec]:
    """The tensors of a :class:`~asyncrl.weights.wire.Packed` manifest, in sending order."""
    return [
        TensorSpec(e["name"], e["dtype"], tuple(e["shape"]))
        for e in json.loads(manifest)["tensors"]
    ]


async def put_tensor_list(
    bus: Bus, bucket: str, group: str, packed: Packed, kept: list[str]
) -> None:
    """Puts a version's tensor list in the object store once; ``kept``: the keys put so
    far, oldest first (those beyond :data:`KEEP_LISTS` are deleted)."""
    key = tensors_key(group, packed.epoch, packed.version)
    if key in kept:
        return
    await bus.put_blob(bucket, key, packed.manifest)
    kept.append(key)
    while len(kept) > KEEP_LISTS:
        await bus.delete_blob(bucket, kept.pop(0))


async def get_tensor_list(bus: Bus, bucket: str, key: str) -> list[TensorSpec]:
    buf = io.BytesIO()
    await bus.get_blob(bucket, key, buf)
    return tensor_specs(buf.getvalue())


def open_group(
    store: Any, group_name: str, backend: str, timeout_s: float, device: str, world_size: int = 2
) -> Any:
    """Rank 0 of the group an SGLang server forms for ``group_name`` (blocks until every
    rank arrives or the timeout)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, GroupName, _new_process_group_helper

    wire.GROUPS_OPENED = True
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    group, _ = _new_process_group_helper(
        world_size,
        0,
        [],
        Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=GroupName(group_name),
        timeout=timeout_of(timeout_s),
    )
    return group


def send_version(group: Any, packed: Packed, device: str, timeout_s: float) -> None:
    """One broadcast per tensor, in the manifest's order (all issued, then awaited: the
    server posts all its receives before it waits too)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    tensors = [t.to(device, non_blocking=True) for _, t in unpack(packed.manifest, packed.buckets)]
    works = [group.broadcast([t], opts) for t in tensors]
    for work in works:
        work.wait(timeout_of(timeout_s))


__all__ = [
    "KEEP_LISTS",
    "PROTOCOL",
    "get_tensor_list",
    "open_group",
    "put_tensor_list",
    "send_version",
    "tensor_specs",
    "tensors_key",
]
