"""This machine's GPUs and cores as the processes ``up`` starts see them, known without
importing torch: whether a GPU is visible, the GPUs a process may be given, and the cores
and threads ``up``'s automatic placement (:mod:`asyncrl.launch.core_placement`) gave this
process, which reach it as environment variables (:data:`CPUS_ENV`, :data:`THREADS_ENV`).
"""

from __future__ import annotations

import glob
import os

CPUS_ENV = "ASYNCRL_CPUS"
"""Comma-separated CPU ids ``up`` placed this process on (unset: no placement)."""
THREADS_ENV = "ASYNCRL_THREADS"
"""Torch intra-op threads ``up`` chose for this process (unset: no placement)."""

GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device files of the NVIDIA, ROCm and WSL GPU drivers: without any of them torch finds
no CUDA device, so ``auto`` devices resolve to the CPU."""

NVIDIA_GPU_FILES = "/dev/nvidia[0-9]*"
"""One device file per NVIDIA GPU (``/dev/nvidia0``, ...): how :func:`node_gpus` counts the
GPUs of a machine without importing torch."""

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def gpu_visible() -> bool:
    """Whether a GPU driver's device file exists (:data:`GPU_DEVICE_NODES`) and
    ``CUDA_VISIBLE_DEVICES`` does not hide every device (set empty or to ``-1``, as for a
    CPU job on a GPU machine): otherwise ``auto`` devices resolve to the CPU, known
    without importing torch."""
    visible = os.environ.get(VISIBLE_ENV)
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(map(os.path.exists, GPU_DEVICE_NODES))


def node_gpus() -> list[str]:
    """The GPUs this machine gives the processes it starts, as ``CUDA_VISIBLE_DEVICES``
    entries: that variable's own entries where it is set (a Slurm or container allocation;
    CUDA stops at a ``-1`` entry, and so does this), else ``0`` … ``n-1`` for the n NVIDIA
    device files (:data:`NVIDIA_GPU_FILES`). Known without importing torch."""
    visible = os.environ.get(VISIBLE_ENV)
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return entries[: entries.index("-1")] if "-1" in entries else entries
    return [str(i) for i in range(len(glob.glob(NVIDIA_GPU_FILES)))]


def is_cpu_device(device: str) -> bool:
    """Whether a :data:`~asyncrl.config.schema.Device` choice is this machine's CPU: ``cpu``, or
    ``auto`` where no GPU is visible (:func:`gpu_visible`; decided without importing
    torch)."""
    return device == "cpu" or (device == "auto" and not gpu_visible())


def placed_cpus() -> list[int]:
    """The cores ``up`` placed this process on (:data:`CPUS_ENV`), or []."""
    raw = os.environ.get(CPUS_ENV, "")
    return [int(x) for x in raw.split(",") if x.strip()]


def placed_threads() -> int:
    """The torch threads ``up`` chose for this process (:data:`THREADS_ENV`), or 0."""
    raw = os.environ.get(THREADS_ENV, "")
    return int(raw) if raw.strip() else 0


def pin_cpus(role: str, cpus: list[int]) -> None:
    """Pins this process to ``cpus`` (``<role>.cpus``; empty: leaves it be). Called before
    torch starts its thread pools and before the actor starts workers or servers, which
    inherit the affinity. A CPU this machine lacks fails naming the key."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit(f"{role}.cpus is set, but this platform cannot pin processes")
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise SystemExit(f"{role}.cpus = {cpus}: cannot pin this process ({exc})") from None
