"""``weights.transport = "auto"`` resolved, with the reason ``asyncrl check`` prints, and
the combinations a recipe cannot run with. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.config.schema import engine_device
from asyncrl.runtime.cores import gpu_visible, is_cpu_device

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.weights.config import TransportKind

TENSOR_ENGINES = ("hf", "instant")
"""Engine types that take weights as tensors in their own process, so a broadcast or an
IPC handle reaches them; a server engine loads files, or joins the broadcast itself
(:data:`BROADCAST_SERVERS`)."""

BROADCAST_SERVERS = ("vllm", "sglang")
"""Server engines whose server joins the broadcast itself (one server of one worker per
rollout actor: :func:`broadcast_server_problem`)."""

PARALLEL_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
    "--tp-size",
    "--pp-size",
    "--dp-size",
)
"""vLLM and SGLang flags that give a server more than one worker (each would need a group;
SGLang's own would be ``world_size = 1 + tp``, one rank per tensor-parallel worker)."""


def _parallel_args(args: list[str]) -> list[str]:
    """The flags of ``args`` that ask for more than one worker, as written."""
    found = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in PARALLEL_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value.strip() not in ("", "1"):
            found.append(f"{flag} {value}")
    return found


def broadcast_server_problem(recipe: Recipe) -> str | None:
    """Why the server engine cannot take the broadcast itself, naming the keys, or None.

    Each server, and each worker in one, would be a member of the broadcast of its own;
    one server of one worker per rollout actor is what is supported."""
    engine = recipe.rollout.engine
    if engine.type not in BROADCAST_SERVERS:
        return f"the {engine.type} engine's servers do not join the broadcast"
    urls, servers = getattr(engine, "urls", []), getattr(engine, "servers", 1)
    if urls and engine.type == "vllm":
        return "rollout.engine.urls: servers started elsewhere lack asyncrl's worker extension"
    if len(urls) > 1:
        return f"rollout.engine.urls has {len(urls)}: the broadcast reaches one server per actor"
    if servers != 1:
        return f"rollout.engine.servers = {servers}: the broadcast reaches one server per actor"
    parallel = _parallel_args(list(getattr(engine, "args", [])))
    if parallel:
        return (
            f"rollout.engine.args has {', '.join(parallel)}: the broadcast reaches a server "
            "of one worker"
        )
    if shared_gpu(recipe) is not None:
        return "trainer.device and the server share one GPU, where NCCL cannot pair two ranks"
    return None


def _cuda_index(device: str) -> int | None:
    """The CUDA device a :data:`~asyncrl.config.schema.Device` choice names (``auto`` and
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
    if recipe.trainer.lora.publishes_adapter:
        return "object_store", (
            "LoRA publishes adapters (trainer.lora.publish = 'adapter'), a few MiB that "
            "travel as files through NATS"
        )
    in_process = engine.type in TENSOR_ENGINES
    if not in_process and (problem := broadcast_server_problem(recipe)) is not None:
        return "object_store", f"the {engine.type} engine loads files here ({problem})"
    if in_process and (gpu := shared_gpu(recipe)) is not None:
        return "cuda_ipc", f"trainer and engine share cuda:{gpu}: IPC handles, no copy"
    backend = "gloo" if _cuda_index(engine_device(engine)) is None else "nccl"
    who = f"the {engine.type} engines" if in_process else f"the {engine.type} server"
    return "collective", (
        f"{who} join{'' if in_process else 's'} a {backend} group with the trainer's "
        "rank 0 (the object store stays the fallback)"
    )


def transport_problems(recipe: Recipe) -> list[str]:
    """A transport set by hand that the recipe cannot run with, each naming its keys."""
    w, engine = recipe.weights, recipe.rollout.engine
    problems: list[str] = []
    if w.transport == "cuda_ipc" and engine.type not in TENSOR_ENGINES:
        problems.append(
            f'weights.transport = "cuda_ipc" with rollout.engine.type = "{engine.type}": '
            f"only in-process engines ({', '.join(TENSOR_ENGINES)}) map IPC handles; use "
            '"collective", "object_store" or "dir" (or "auto")'
        )
    if w.transport == "collective" and engine.type not in TENSOR_ENGINES:
        problem = broadcast_server_problem(recipe)
        if problem is not None:
            problems.append(
                f'weights.transport = "collective" with rollout.engine.type = '
                f'"{engine.type}": {problem}; use "object_store" or "dir" (or "auto")'
            )
    if w.transport == "cuda_ipc" and shared_gpu(recipe) is None:
        problems.append(
            'weights.transport = "cuda_ipc" needs trainer.device and rollout.engine.device '
            "on the same CUDA device of this machine (IPC handles map memory of one GPU); "
            'use "collective" (or "auto")'
        )
    if w.transport in ("collective", "cuda_ipc") and recipe.trainer.lora.publishes_adapter:
        problems.append(
            f'weights.transport = "{w.transport}" with trainer.lora.publish = "adapter": '
            'adapters travel as files; set trainer.lora.publish = "merged" or use '
            '"object_store"'
        )
    return problems


__all__ = [
    "BROADCAST_SERVERS",
    "TENSOR_ENGINES",
    "broadcast_server_problem",
    "choose",
    "shared_gpu",
    "transport_problems",
]
