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
from dataclasses import dataclass, field
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
    """One version as it travels: the manifest and the flat buckets. ``readers`` counts
    the sends under way from these buckets: a publisher reuses the buckets of an older
    version for a newer one only when none reads them (fresh pages cost more than the
    copy into them)."""

    version: int
    epoch: int
    manifest: bytes
    buckets: list[torch.Tensor]
    readers: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buckets)

    def reading(self, delta: int) -> None:
        with self._lock:
            self.readers += delta


def pack(
    tensors: NamedTensors,
    bucket_bytes: int,
    version: int,
    epoch: int,
    *,
    into: list[torch.Tensor] | None = None,
) -> Packed:
    """Lays ``tensors`` out in flat byte buckets of at most ``bucket_bytes`` (a larger
    tensor gets a bucket of its own); the manifest says where each one is. ``into``:
    buckets of an earlier version to write into, used when their sizes fit."""
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
    groups = [g for g in groups if g]
    sizes = [sum(int(f.numel()) for f in g) for g in groups]
    if into is None or [int(b.numel()) for b in into] != sizes:
        into = [
            torch.empty(n, dtype=torch.uint8, device=g[0].device)
            for n, g in zip(sizes, groups, strict=True)
        ]
    for bucket, g in zip(into, groups, strict=True):
        torch.cat(g, out=bucket)  # a copy: the trainer's tensors change at its next step
    manifest = json.dumps({"tensors": entries, "buckets": sizes})
    return Packed(version, epoch, manifest.encode(), into)


class BucketPool:
    """Receive buffers given back once their weights are loaded, taken again for a later
    version of the same layout (at most ``keep`` sets are kept)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[list[torch.Tensor]] = []
        self._lock = threading.Lock()

    def take(self, sizes: list[int], device: str) -> list[torch.Tensor]:
        import torch

        with self._lock:
            for i, buckets in enumerate(self._free):
                if [int(b.numel()) for b in buckets] == sizes and str(buckets[0].device) == str(
                    torch.device(device)
                ):
                    return self._free.pop(i)
        return [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]

    def give(self, buckets: list[torch.Tensor]) -> None:
        with self._lock:
            if buckets and len(self._free) < self.keep:
                self._free.append(buckets)


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


def recv_version(
    group: Any, device: str, timeout_s: float, pool: BucketPool | None = None
) -> tuple[int, int, NamedTensors, list[torch.Tensor]]:
    """The engine's side: ``(version, epoch, named tensors, buckets)`` on ``device``. The
    tensors are views of the buckets, which come from ``pool`` where given: the caller
    gives them back once it has loaded the tensors."""
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
    sizes = [int(n) for n in json.loads(manifest)["buckets"]]
    pool = pool or BucketPool(keep=0)
    buckets = pool.take(sizes, device)
    try:
        for bucket in buckets:
            _broadcast(group, bucket, timeout_s)
    except BaseException:
        pool.give(buckets)
        raise
    return version, epoch, unpack(manifest, buckets), buckets


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
    "BucketPool",
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
