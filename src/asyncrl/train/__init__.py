"""The train engine: FSDP2 causal LM, packed micro-batches, DCP checkpoints, HF export.

Use (every rank of a torchrun job, or one plain process with no process group)::

    engine = build_train_engine(recipe)     # or TrainEngine(recipe.trainer, recipe.model, seed=...)
    batch = [Sample(input_ids, loss_mask, behav_logprobs, advantage), ...]  # same on all ranks
    stats = engine.train_step(batch)            # ppo_minibatches optimizer steps, version + 1
    for bucket in engine.iter_weights(256 << 20):   # rank 0: [(hf_name, tensor), ...]
        ...
    engine.export_hf(dir)                       # or: safetensors + config + tokenizer
    engine.save_checkpoint(dir, {"dataset_pos": 123}); engine.load_checkpoint(dir)

See :mod:`asyncrl.train.batch` for the alignment of per-token arrays.
The engine's configuration is the recipe's ``trainer`` section (``TrainerConfig``, with
``OptimConfig``, ``LossConfig``, ``ShapingConfig``), which imports no torch
(``asyncrl.train.config``); everything else is loaded on first use, so that a config
tree can reference this package cheaply.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, TypeVar, overload

from asyncrl.config.schema import resolve_device
from asyncrl.launch.cores import placed_threads
from asyncrl.train.config import LossConfig, OptimConfig, ShapingConfig, TrainerConfig

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.sft.config import SftRecipe
    from asyncrl.train.batch import Batch, Sample
    from asyncrl.train.engine import TrainEngine
    from asyncrl.train.models import apply_fsdp

_LAZY = {
    "Batch": "asyncrl.train.batch",
    "Sample": "asyncrl.train.batch",
    "TrainEngine": "asyncrl.train.engine",
    "apply_fsdp": "asyncrl.train.models",
}

__all__ = [
    "Batch",
    "LossConfig",
    "OptimConfig",
    "Sample",
    "ShapingConfig",
    "TrainEngine",
    "TrainerConfig",
    "apply_fsdp",
    "build_train_engine",
    "trainer_threads",
]


def trainer_threads(threads: int = 0) -> int:
    """Torch intra-op threads for one trainer process: ``threads`` (``trainer.threads``)
    when set, else the share ``up``'s automatic placement chose
    (:func:`asyncrl.launch.cores.placed_threads`), else the CPUs this process may run on (its
    affinity, ``trainer.cpus`` when pinned) shared among the trainer processes on this
    machine (``LOCAL_WORLD_SIZE``), at least 1. Never more threads than those cores:
    OpenMP workers beyond them spin and wait on each other."""
    if threads > 0:
        return threads
    if placed_threads() > 0:
        return placed_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, (cpus or 1) // local)


Engine = TypeVar("Engine", bound="TrainEngine")


@overload
def build_train_engine(recipe: Recipe | SftRecipe) -> TrainEngine: ...
@overload
def build_train_engine(recipe: Recipe | SftRecipe, engine: type[Engine]) -> Engine: ...
def build_train_engine(recipe: Recipe | SftRecipe, engine: type[TrainEngine] | None = None) -> Any:
    """The recipe's train engine, an ``engine`` (default :class:`TrainEngine`; the SFT run
    gives :class:`asyncrl.sft.engine.SFTEngine`) built from its ``trainer`` and ``model``
    sections and ``run.seed``; joins the torchrun process group first when there is one
    (NCCL when the trainer's device is CUDA, else gloo). Sets torch's intra-op threads to
    :func:`trainer_threads`."""
    import torch
    import torch.distributed as dist

    from asyncrl.train.engine import TrainEngine

    torch.set_num_threads(trainer_threads(recipe.trainer.threads))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        cuda = resolve_device(recipe.trainer.device).startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo")
    return (engine or TrainEngine)(recipe.trainer, recipe.model, seed=recipe.run.seed)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
