"""Inference engines: the :class:`InferenceEngine` API and its backends.

Importing this package loads no torch; a backend is imported when it is built.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.engines.base import (
    EngineStopped,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    SamplingParams,
    WeightSource,
)

BACKENDS = {
    "hf": "asyncrl.engines.hf:HFEngine",
    "vllm": "asyncrl.engines.vllm:VLLMEngine",
    "sglang": "asyncrl.engines.sglang:SGLangEngine",
    "instant": "asyncrl.engines.instant:InstantEngine",
}
"""Engine kinds (the recipe's ``rollout.engine.type``) and the class that implements each."""


def make_engine(kind: str, model: str, **options: Any) -> InferenceEngine:
    """An unstarted engine of ``kind`` for ``model``; ``options`` go to its constructor."""
    if kind not in BACKENDS:
        raise ValueError(f"engine type {kind!r} is not one of {sorted(BACKENDS)}")
    module, _, name = BACKENDS[kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(model, **options)  # type: ignore[no-any-return]


__all__ = [
    "BACKENDS",
    "EngineStopped",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "InferenceEngine",
    "SamplingParams",
    "WeightSource",
    "make_engine",
]
