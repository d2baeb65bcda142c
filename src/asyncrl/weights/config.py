"""The recipe's ``[weights]`` section: how new weights travel from the trainer to the
inference engines. Imports no torch, so ``asyncrl check`` stays instant."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.schema import Section

TransportKind = Literal["dir", "object_store", "collective", "cuda_ipc"]
"""A concrete transport (``auto`` resolves to one of these, :func:`asyncrl.weights.choose`)."""


class WeightsConfig(Section):
    transport: Literal["auto", "dir", "object_store", "collective", "cuda_ipc"] = "auto"
    """How weights reach the engines. ``dir``: a folder every actor can read (a shared
    file system); ``object_store``: the run's NATS object store (any network that reaches
    NATS); ``collective``: a torch.distributed broadcast from the trainer's rank 0 to each
    engine (NCCL between GPUs, gloo on the CPU), with the object store as the fallback;
    ``cuda_ipc``: an engine on the trainer's GPU maps the trainer's tensors (no copy).
    ``auto``: ``cuda_ipc`` when trainer and engine share a GPU, else ``collective`` when
    the engines can receive a broadcast, else ``object_store``; ``asyncrl check`` prints
    the choice and why."""
    bucket_mb: int = Field(256, gt=0)
    """``collective``: tensors travel in flat buckets of at most this many MiB (a tensor
    larger than a bucket travels alone)."""
    timeout_s: float = Field(120.0, gt=0)
    """``collective``: seconds any one group formation or broadcast may take. An engine
    that does not keep up in time is dropped from the broadcast (it then loads from the
    object store) and the trainer goes on."""
    address: str = ""
    """``collective``: the address of the trainer's rank 0 that engines connect to for
    the rendezvous (announced over NATS). Empty: 127.0.0.1 for a run whose NATS server
    listens only there, else this host's name."""
