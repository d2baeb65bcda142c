"""The train engine: FSDP2 causal LM, packed micro-batches, DCP checkpoints, HF export.

Use (every rank of a torchrun job, or one plain process with no process group)::

    engine = build_train_engine(recipe)     # asyncrl.train.engine; or TrainEngine(recipe.trainer, recipe.model, seed=...)
    batch = [Sample(input_ids, loss_mask, behav_logprobs, advantage), ...]  # same on all ranks
    stats = engine.train_step(batch)            # ppo_minibatches optimizer steps, version + 1
    for bucket in engine.iter_weights(256 << 20):   # rank 0: [(hf_name, tensor), ...]
        ...
    engine.export_hf(dir)                       # or: safetensors + config + tokenizer
    engine.save_checkpoint(dir, {"dataset_pos": 123}); engine.load_checkpoint(dir)

See :mod:`asyncrl.train.batch` for the alignment of per-token arrays.
The engine's configuration is the recipe's ``trainer`` section (``TrainerConfig``, with
``OptimConfig``, ``LossConfig``, ``ShapingConfig``), which imports no torch
(``asyncrl.train.config``); this package's top level holds only those and
:func:`trainer_threads`, so a config tree references it cheaply. The engine and its
builder are :mod:`asyncrl.train.engine`, the batch :mod:`asyncrl.train.batch`.
"""

from __future__ import annotations

import os

from asyncrl.runtime.cores import placed_threads
from asyncrl.train.config import LossConfig, OptimConfig, ShapingConfig, TrainerConfig

__all__ = [
    "LossConfig",
    "OptimConfig",
    "ShapingConfig",
    "TrainerConfig",
    "trainer_threads",
]


def trainer_threads(threads: int = 0) -> int:
    """Torch intra-op threads for one trainer process: ``threads`` (``trainer.threads``)
    when set, else the share ``up``'s automatic placement chose
    (:func:`asyncrl.runtime.cores.placed_threads`), else the CPUs this process may run on (its
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
