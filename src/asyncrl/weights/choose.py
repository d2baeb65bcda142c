"""``weights.transport = "auto"`` resolved, with the reason ``asyncrl check`` prints, and
the combinations a recipe cannot run with. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.cores import engine_device, gpu_visible, is_cpu_device

if TYPE_CHECKING:
    from asyncrl.config import Recipe
    from asyncrl.weights.config import TransportKind

TENSOR_ENGINES = ("hf", "instant")
"""Engine types that take weights as tensors in their own process, so a broadcast or an
IPC handle reaches them; the server engines (vLLM, SGLang) load files."""


def _cuda_index(device: str) -> int | None:
    """The CUDA device a :data:`~asyncrl.schema.Device` choice names (``auto`` and
    ``cuda`` the first one), or None for the CPU; decided without importing torch."""
    if is_cpu_device(device) or not gpu_visible():
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def shared_gpu(recipe: Recipe) -> int | None:
    """The CUDA device index trainer and rollout engine both compute on, or None: both
    resolve to the same CUDA device and neither role has GPUs of its own (``<role>.gpus``
    gives each process its own ``CUDA_VISIBLE_DEVICES``, so equal indices are then
    different GPUs), or the rollout is colocated (``rollout.colocate``)."""
    t = _cuda_index(recipe.trainer.device)
    e = _cuda_index(engine_device(recipe.rollout.engine))
    if t is None or e is None or t != e:
        return None
    if recipe.rollout.colocate or not (recipe.trainer.gpus or recipe.rollout.gpus):
        return t
    return None


def choose(recipe: Recipe) -> tuple[TransportKind, str]:
    """The transport the run uses and why (``weights.transport``, ``auto`` resolved)."""
    w, engine = recipe.weights, recipe.rollout.engine
    if w.transport != "auto":
        return w.transport, "set by weights.transport"
    adapter = recipe.trainer.lora.rank > 0 and recipe.trainer.lora.publish == "adapter"
    if adapter:
        return "object_store", (
            "LoRA publishes adapters (trainer.lora.publish = 'adapter'), a few MiB that "
            "travel as files through NATS"
        )
    if engine.type not in TENSOR_ENGINES:
        return "object_store", (
            f"the {engine.type} engine loads weights from files here; the broadcast reaches "
            f"in-process engines ({', '.join(TENSOR_ENGINES)})"
        )
    gpu = shared_gpu(recipe)
    if gpu is not None:
        return "cuda_ipc", f"trainer and engine share cuda:{gpu}: IPC handles, no copy"
    backend = "gloo" if _cuda_index(engine_device(engine)) is None else "nccl"
    return "collective", (
        f"the {engine.type} engines join a {backend} group with the trainer's rank 0 "
        "(the object store stays the fallback)"
    )


def transport_problems(recipe: Recipe) -> list[str]:
    """A transport set by hand that the recipe cannot run with, each naming its keys."""
    w, engine = recipe.weights, recipe.rollout.engine
    problems: list[str] = []
    if w.transport in ("collective", "cuda_ipc") and engine.type not in TENSOR_ENGINES:
        problems.append(
            f'weights.transport = "{w.transport}" with rollout.engine.type = '
            f'"{engine.type}": only in-process engines ({", ".join(TENSOR_ENGINES)}) receive '
            'tensors; use "object_store" or "dir" (or "auto")'
        )
    if w.transport == "cuda_ipc" and shared_gpu(recipe) is None:
        problems.append(
            'weights.transport = "cuda_ipc" needs trainer.device and rollout.engine.device '
            "on the same CUDA device of this machine (IPC handles map memory of one GPU); "
            'use "collective" (or "auto")'
        )
    if w.transport in ("collective", "cuda_ipc"):
        t = recipe.trainer.lora
        if t.rank > 0 and t.publish == "adapter":
            problems.append(
                f'weights.transport = "{w.transport}" with trainer.lora.publish = "adapter": '
                'adapters travel as files; set trainer.lora.publish = "merged" or use '
                '"object_store"'
            )
    return problems


__all__ = ["TENSOR_ENGINES", "choose", "shared_gpu", "transport_problems"]
