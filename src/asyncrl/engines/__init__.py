"""Inference engines: the backends of the :class:`~asyncrl.api.inference.InferenceEngine`
contract, and the builder that picks one for a recipe.

Importing this package loads no torch; a backend is imported when it is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncrl.api.inference import InferenceEngine

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe

BACKENDS = {
    "hf": "asyncrl.engines.hf:HFEngine",
    "vllm": "asyncrl.engines.vllm:VLLMEngine",
    "sglang": "asyncrl.engines.sglang:SGLangEngine",
    "instant": "asyncrl.engines.instant:InstantEngine",
}
"""Engine kinds (the recipe's ``rollout.engine.type``) and the class that implements each."""


def build_engine(recipe: Recipe) -> InferenceEngine:
    """The recipe's rollout engine, not started: the ``rollout.engine.type`` backend built
    from the ``model`` and ``rollout.engine`` sections themselves. Server engines log
    under ``<run>/logs``; ``rollout.colocate`` asks for engines that can release their
    memory (hf, sglang; the recipe checks refuse vllm). Server engines of a run that
    publishes LoRA adapters start their servers with LoRA on. ``rollout.deterministic``
    makes the hf engine run one sequence at a time (the recipe checks refuse it for the
    server engines; the instant engine is deterministic as it is)."""
    cfg = recipe.rollout.engine
    module, _, name = BACKENDS[cfg.type].partition(":")
    cls = getattr(importlib.import_module(module), name)
    options: dict[str, Any] = {}
    if cfg.type in ("vllm", "sglang"):
        options["log_dir"] = recipe.run.path / "logs"
    if cfg.type in ("hf", "sglang"):
        options["memory_saver"] = recipe.rollout.colocate
    if cfg.type == "hf":
        options["deterministic"] = recipe.rollout.deterministic
    lora = recipe.trainer.lora
    if cfg.type in ("vllm", "sglang") and lora.publishes_adapter:
        options["lora_rank"] = lora.rank  # the servers start with LoRA on
    return cls(recipe.model, cfg, **options)  # type: ignore[no-any-return]


__all__ = ["BACKENDS", "build_engine"]
