"""The transport a run uses, built for the trainer's rank 0 (:func:`build_publisher`) and
for an engine (:func:`build_receiver`)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.api.weights import WeightPublisher
from asyncrl.config.schema import engine_device, resolve_device
from asyncrl.models.resolve import resolve_dtype
from asyncrl.runtime.bus import Bus
from asyncrl.weights.collective import CollectivePublisher, rendezvous_host
from asyncrl.weights.config import TransportKind
from asyncrl.weights.cuda_ipc import CudaIpcPublisher
from asyncrl.weights.files import DirPublisher, ObjectStorePublisher, delete_weights, put_weights
from asyncrl.weights.receiver import EngineWeights
from asyncrl.weights.version import Wanted
from asyncrl.weights.wire import Packed, unpack
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from asyncrl.api.inference import InferenceEngine
    from asyncrl.config.recipe import Recipe


def engine_side(recipe: Recipe) -> tuple[str, str, str]:
    """``(backend, the engine's device, its dtype)``: NCCL when trainer and engine both
    compute on CUDA, else gloo (tensors then travel through host memory)."""
    engine = resolve_device(engine_device(recipe.rollout.engine))
    trainer = resolve_device(recipe.trainer.device)
    dtype = resolve_dtype(recipe.model.dtype, engine)
    if engine.startswith("cuda") and trainer.startswith("cuda"):
        return "nccl", engine, dtype
    return "gloo", "cpu", dtype


def build_publisher(
    recipe: Recipe,
    kind: TransportKind,
    bus: Bus,
    subjects: Subjects,
    weights_dir: Path,
    nats_url: str,
) -> WeightPublisher:
    """Rank 0's publisher of ``kind``, the run's transport (:func:`~asyncrl.weights.choose` resolves
    ``weights.transport``)."""
    if kind == "dir":
        return DirPublisher(weights_dir, bus, subjects)
    if kind == "object_store":
        return ObjectStorePublisher(weights_dir, bus, subjects)
    backend, _, dtype = engine_side(recipe)
    trainer_dev = resolve_device(recipe.trainer.device, local_rank=0)
    if kind == "cuda_ipc":
        return CudaIpcPublisher(bus, subjects, dtype=dtype, device=trainer_dev)
    return CollectivePublisher(
        bus,
        subjects,
        recipe.weights,
        host=rendezvous_host(recipe.weights, nats_url),
        dtype=dtype,
        backend=backend,
        device=trainer_dev if backend == "nccl" else "cpu",
        fallback=object_store_copy(bus, subjects),
    )


def object_store_copy(
    bus: Bus, subjects: Subjects
) -> Callable[[Packed, int], Awaitable[WeightsUpdated]]:
    """The fallback of the broadcast: the version being broadcast (its packed copy, not
    the trainer's live weights) written once to the object store; the copy of the
    version before is deleted."""
    uploaded: list[Path] = []

    async def upload(packed: Packed, step: int) -> WeightsUpdated:
        from safetensors.torch import save_file  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

        folder = Path(tempfile.mkdtemp(prefix="asyncrl-fallback-")) / (
            f"fallback-e{packed.epoch}-v{packed.version:06d}"
        )

        def write() -> None:
            folder.mkdir(parents=True)
            tensors = {n: t.contiguous() for n, t in unpack(packed.manifest, packed.buckets)}
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

        await asyncio.to_thread(write)
        key = await put_weights(bus, subjects.weights_bucket, folder)
        for old in uploaded:
            await delete_weights(bus, subjects.weights_bucket, old)
            shutil.rmtree(old.parent, ignore_errors=True)
        uploaded[:] = [folder]
        return WeightsUpdated(
            version=packed.version,
            kind="object_store",
            location=key,
            step=step,
            epoch=packed.epoch,
        )

    return upload


def build_receiver(
    recipe: Recipe,
    engine: InferenceEngine,
    bus: Bus,
    subjects: Subjects,
    actor_id: str,
    want: Wanted | None = None,
    in_order: bool = False,
) -> EngineWeights:
    """An engine's receiver; it takes whatever transport each announcement names."""
    _, device, _ = engine_side(recipe)
    return EngineWeights(
        engine, bus, subjects, actor_id, device=device, want=want, in_order=in_order
    )


__all__ = ["build_publisher", "build_receiver", "engine_side"]
