"""The broadcast's wire, apart from everything else: how one version is laid out and sent
over a two-rank torch.distributed group, and the thread that owns a group.

This file imports only the standard library (torch inside the functions), so a process
that has torch but not asyncrl's dependencies (an inference server's workers) can load it
by its path. See :mod:`asyncrl.weights.collective` for the protocol around it.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

NamedTensors = list[tuple[str, "torch.Tensor"]]
"""Full weights as ``(HF parameter name, tensor)`` pairs."""

T = TypeVar("T")

MAGIC = 0x57454947
"""The first header word ("WEIG"): a receive that reads anything else is out of step."""

GRAVEYARD: list[Any] = []
"""Groups that failed, kept referenced (never destroyed) until the process exits."""

STALL_ENV = "ASYNCRL_FAULT_STALL_WEIGHTS"
"""Fault injection for tests, ``<file>:<version>``: the first engine (of all processes
sharing ``<file>``) to receive a version at least ``<version>`` creates ``<file>`` with its
process id and stops in the middle of that broadcast (after its header), as an engine
that hangs or dies there would; a test then kills it. Unset in real runs."""

GROUPS_OPENED = False
"""Whether this process ever made a group: it then leaves without the interpreter's
finalization (:func:`asyncrl.train.torchrun.exit_rank`), where gloo threads could abort."""


@dataclass
class Packed:
    """One version as it travels: the manifest and the flat buckets."""

    version: int
    epoch: int
    manifest: bytes
    buckets: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buckets)


def pack(tensors: NamedTensors, bucket_bytes: int, version: int, epoch: int) -> Packed:
    """Lays ``tensors`` out in flat byte buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own); the manifest says where each one is."""
    import torch

    entries: list[dict[str, Any]] = []
    groups: list[list[torch.Tensor]] = [[]]
    size = 0
    for name, t in tensors:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        n = int(flat.numel())
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "bucket": len(groups) - 1,
                "offset": size,
                "nbytes": n,
            }
        )
        groups[-1].append(flat)
        size += n
    buckets = [torch.cat(g) if len(g) > 1 else g[0].clone() for g in groups if g]
    manifest = json.dumps({"tensors": entries, "buckets": [int(b.numel()) for b in buckets]})
    return Packed(version, epoch, manifest.encode(), buckets)


def unpack(manifest: bytes, buckets: list[torch.Tensor]) -> NamedTensors:
    """The named tensors of received buckets, as views of them (no copy)."""
    import torch

    out: NamedTensors = []
    for e in json.loads(manifest)["tensors"]:
        raw = buckets[e["bucket"]][e["offset"] : e["offset"] + e["nbytes"]]
        out.append((e["name"], raw.view(getattr(torch, e["dtype"])).view(e["shape"])))
    return out


def timeout_of(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_store(host: str, timeout_s: float) -> Any:
    """The rendezvous store the trainer hosts, on a free port of ``host``."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, True, timeout=timeout_of(timeout_s), wait_for_workers=False)


def open_pair(
    store: Any, prefix: str, rank: int, backend: str, timeout_s: float, device: str
) -> Any:
    """The two-rank group of one engine (blocks until both ranks arrive or the timeout)."""
    import torch.distributed as dist

    global GROUPS_OPENED
    GROUPS_OPENED = True
    scoped = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        import torch

        torch.cuda.set_device(torch.device(device))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout_of(timeout_s)
        return dist.ProcessGroupNCCL(scoped, rank, 2, options)
    return dist.ProcessGroupGloo(scoped, rank, 2, timeout_of(timeout_s))


def _broadcast(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait(timeout_of(timeout_s))


def send_version(group: Any, packed: Packed, device: str, timeout_s: float) -> None:
    """Rank 0's side of one version (see the module docstring for the layout)."""
    import torch

    header = torch.tensor(
        [MAGIC, packed.version, packed.epoch, len(packed.manifest)], dtype=torch.int64
    )
    _broadcast(group, header.to(device), timeout_s)
    manifest = torch.frombuffer(bytearray(packed.manifest), dtype=torch.uint8)
    _broadcast(group, manifest.to(device), timeout_s)
    for bucket in packed.buckets:
        _broadcast(group, bucket.to(device, non_blocking=True), timeout_s)


def recv_version(group: Any, device: str, timeout_s: float) -> tuple[int, int, NamedTensors]:
    """The engine's side: ``(version, epoch, named tensors)`` on ``device``."""
    import torch

    header = torch.zeros(4, dtype=torch.int64, device=device)
    _broadcast(group, header, timeout_s)
    magic, version, epoch, manifest_len = (int(x) for x in header.cpu())
    if magic != MAGIC:
        raise RuntimeError(f"weight broadcast out of step (header word {magic:#x})")
    _stall_if_asked(version)
    manifest_t = torch.zeros(manifest_len, dtype=torch.uint8, device=device)
    _broadcast(group, manifest_t, timeout_s)
    manifest = manifest_t.cpu().numpy().tobytes()
    buckets = []
    for size in json.loads(manifest)["buckets"]:
        bucket = torch.empty(int(size), dtype=torch.uint8, device=device)
        _broadcast(group, bucket, timeout_s)
        buckets.append(bucket)
    return version, epoch, unpack(manifest, buckets)


def _stall_if_asked(version: int) -> None:
    """See :data:`STALL_ENV`."""
    spec = os.environ.get(STALL_ENV, "")
    if not spec:
        return
    path, _, at = spec.rpartition(":")
    if version < int(at):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # another engine stalled already
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(3600)


def bury(group: Any) -> None:
    """Aborts a failed group where the backend can, and keeps it referenced."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:
        pass
    GRAVEYARD.append(group)


class Lane:
    """One daemon thread that runs a group's jobs one after the other (a daemon, so a job
    stuck in a dead peer's collective never holds the process at exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)


__all__ = [
    "GRAVEYARD",
    "MAGIC",
    "STALL_ENV",
    "Lane",
    "NamedTensors",
    "Packed",
    "bury",
    "open_pair",
    "open_store",
    "pack",
    "recv_version",
    "send_version",
    "unpack",
]
