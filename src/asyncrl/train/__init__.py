"""The train engine: FSDP2 causal LM, packed micro-batches, DCP checkpoints, HF export.

Use (every rank of a torchrun job, or one plain process with no process group)::

    engine = TrainEngine(TrainConfig(model="path/or/hub-id", lr=1e-6, param_dtype="bfloat16"))
    batch = [Sample(input_ids, loss_mask, behav_logprobs, advantage), ...]  # same on all ranks
    stats = engine.train_step(batch)            # ppo_minibatches optimizer steps, version + 1
    for bucket in engine.iter_weights(256 << 20):   # rank 0: [(hf_name, tensor), ...]
        ...
    engine.export_hf(dir)                       # or: safetensors + config + tokenizer
    engine.save_checkpoint(dir, {"dataset_pos": 123}); engine.load_checkpoint(dir)

See :mod:`asyncrl.train.batch` for the alignment of per-token arrays.
``TrainConfig``/``LossConfig`` import no torch (``asyncrl.train.config``); everything
else is loaded on first use, so that a config tree can reference this package cheaply.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncrl.train.config import LossConfig, TrainConfig

if TYPE_CHECKING:
    from asyncrl.train.batch import Batch, Sample
    from asyncrl.train.engine import TrainEngine
    from asyncrl.train.models import apply_fsdp

_LAZY = {
    "Batch": "asyncrl.train.batch",
    "Sample": "asyncrl.train.batch",
    "TrainEngine": "asyncrl.train.engine",
    "apply_fsdp": "asyncrl.train.models",
}

__all__ = ["Batch", "LossConfig", "Sample", "TrainConfig", "TrainEngine", "apply_fsdp"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
