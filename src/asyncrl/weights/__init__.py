"""Weight transports: how a new policy gets from the trainer to the inference engines.

One family behind one interface (:mod:`asyncrl.api.weights`): the trainer side's
``publish(weights)`` gets a version (its HF export, or its named tensors, whichever the
transport wants) to the engines and announces it with ``WeightsUpdated``; the engine side
(:mod:`asyncrl.weights.receiver`) takes every announcement as it arrives (``announce``)
and yields the newest weights staged for the engine (``receive``). Members:

- ``dir`` and ``object_store`` (:mod:`~asyncrl.weights.files`): safetensors in a folder
  every actor reads, or in the run's NATS object store;
- ``collective`` (:mod:`~asyncrl.weights.collective`; the engine's side in
  :mod:`~asyncrl.weights.engine_side`, the bytes on the wire in
  :mod:`~asyncrl.weights.wire`, SGLang's own protocol in
  :mod:`~asyncrl.weights.sglang_wire`): a torch.distributed broadcast in buckets, one
  two-rank group per engine, every step bounded by ``weights.timeout_s``;
- ``cuda_ipc`` (:mod:`~asyncrl.weights.cuda_ipc`): CUDA IPC handles of the trainer's
  tensors, mapped by an engine on the same GPU.

:mod:`~asyncrl.weights.build` builds both sides for a recipe. This package's root imports
no torch; :func:`choose` resolves ``weights.transport = "auto"``.
"""

from asyncrl.weights.choose import choose
from asyncrl.weights.config import TransportKind, WeightsConfig

__all__ = ["TransportKind", "WeightsConfig", "choose"]
