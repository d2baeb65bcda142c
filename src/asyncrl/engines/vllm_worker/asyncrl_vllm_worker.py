"""asyncrl's weight broadcast inside a vLLM worker (``--worker-extension-cls
asyncrl_vllm_worker.WeightBroadcast``).

vLLM mixes this class into its worker class; the engine calls its methods through the
server's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``), one call per method:

- ``asyncrl_join(where)``: joins the trainer's rendezvous store and forms the two-rank
  group with the trainer's rank 0, as rank 1, on this worker's device;
- ``asyncrl_receive()``: receives one version into a staging area held by the worker and
  returns ``{"version", "epoch"}``;
- ``asyncrl_load(epoch, version)``: swaps that staged version into the model (vLLM's
  in-place reload, as for a directory) and drops it and every older one staged.

Arguments travel as one JSON string (the endpoint passes strings through). This module is
loaded from a folder of its own on the server's ``PYTHONPATH``, where asyncrl is not
installed: it loads asyncrl's wire module (standard library and torch only) by its file
path. Each worker would need a group of its own, so a server with more than one worker
(tensor or pipeline parallel) is refused at the join.

**A receive holds the engine's loop.** vLLM runs a ``collective_rpc`` between its steps,
so generation waits while the bytes arrive; the pause of a weight update covers only the
load.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

WIRE_PATH = Path(__file__).resolve().parent.parent.parent / "weights" / "wire.py"
"""asyncrl's wire module, beside this folder in the package."""

WIRE_MODULE = "asyncrl_weights_wire"

STAGED_LIMIT = 2
"""Versions held staged at once, the oldest dropped first. Two, because the next version
may arrive while the load of the one before waits its turn in vLLM's loop; the rollout
actor loads the newest it has received, so more would only hold memory."""


def load_wire() -> Any:
    """asyncrl's wire module, loaded by path once per process (registered before it runs:
    its dataclasses look their module up)."""
    if WIRE_MODULE in sys.modules:
        return sys.modules[WIRE_MODULE]
    spec = importlib.util.spec_from_file_location(WIRE_MODULE, WIRE_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load asyncrl's wire module from {WIRE_PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[WIRE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[WIRE_MODULE]
        raise
    return module


class WeightBroadcast:
    """The worker's side of asyncrl's broadcast (the methods vLLM's worker gains). Names
    carry an ``asyncrl_`` prefix: vLLM refuses an extension whose names its worker has."""

    def asyncrl_join(self, where: str) -> dict[str, Any]:

        w = json.loads(where)
        worker: Any = self
        world = worker.vllm_config.parallel_config.world_size
        if world != 1:
            raise RuntimeError(
                f"asyncrl's weight broadcast reaches a vLLM server of one worker, this one "
                f"has {world} (tensor/pipeline parallel): use the object store"
            )
        wire = load_wire()
        old = getattr(self, "asyncrl_group", None)
        if old is not None:  # a join again: the trainer dropped the old group
            wire.bury(old)
        self.asyncrl_group = None
        device = str(getattr(worker, "device", "cpu"))
        timeout = datetime.timedelta(seconds=float(w["timeout_s"]))
        store = dist.TCPStore(
            w["host"], int(w["port"]), None, False, timeout=timeout, wait_for_workers=False
        )
        self.asyncrl_group = wire.open_pair(
            store, w["prefix"], 1, w["backend"], float(w["timeout_s"]), device
        )
        self.asyncrl_device = device
        self.asyncrl_timeout_s = float(w["timeout_s"])
        return {"device": device, "pid": os.getpid()}

    def asyncrl_receive(self) -> dict[str, Any]:
        group = getattr(self, "asyncrl_group", None)
        if group is None:
            raise RuntimeError("not in asyncrl's weight broadcast: join first")
        wire = load_wire()
        try:
            version, epoch, tensors, _ = wire.recv_version(
                group, self.asyncrl_device, self.asyncrl_timeout_s
            )
        except BaseException:
            wire.bury(group)  # out of step: a later receive could only misread
            self.asyncrl_group = None
            raise
        staged = self._asyncrl_staged()
        staged[(epoch, version)] = tensors
        while len(staged) > STAGED_LIMIT:
            del staged[min(staged)]
        return {"version": version, "epoch": epoch}

    def asyncrl_load(self, epoch: int, version: int) -> dict[str, Any]:
        staged = self._asyncrl_staged()
        key = (int(epoch), int(version))
        if key not in staged:
            raise RuntimeError(
                f"version {version} (epoch {epoch}) is not staged; staged: {sorted(staged)}"
            )
        tensors = staged[key]
        worker: Any = self
        try:
            worker.reload_weights(weights_iterator=iter(tensors))
        finally:
            for k in [k for k in staged if k <= key]:
                del staged[k]
        return {"version": version, "epoch": epoch, "tensors": len(tensors)}

    def _asyncrl_staged(self) -> dict[tuple[int, int], Any]:
        """``(epoch, version)`` -> the named tensors received (views of their buckets)."""
        if getattr(self, "asyncrl_staging", None) is None:
            self.asyncrl_staging: dict[tuple[int, int], Any] = {}
        return self.asyncrl_staging


__all__ = ["WeightBroadcast", "load_wire"]
