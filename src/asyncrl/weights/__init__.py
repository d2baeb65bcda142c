"""Weight transports: how a new policy gets from the trainer to the inference engines.

One family behind one interface (:mod:`asyncrl.weights.base`): the trainer side
``publish(version, named tensors)`` announces a version with ``WeightsUpdated``, the engine
side ``receive(msg)`` turns that announcement into what the engine loads. Members:

- ``dir`` (:mod:`~asyncrl.weights.files`): safetensors in a folder every actor reads;
- ``object_store`` (:mod:`~asyncrl.weights.files`): the same files in the run's NATS object store;
- ``collective`` (:mod:`~asyncrl.weights.collective`): a torch.distributed broadcast in
  buckets, one two-rank group per engine, each step bounded by ``weights.timeout_s``;
- ``cuda_ipc`` (:mod:`~asyncrl.weights.cuda_ipc`): CUDA IPC handles of the trainer's
  tensors, mapped by an engine on the same GPU.

This package's root imports no torch; :func:`choose` resolves ``weights.transport = "auto"``.
"""

from asyncrl.weights.choose import choose
from asyncrl.weights.config import TransportKind, WeightsConfig

__all__ = ["TransportKind", "WeightsConfig", "choose"]
