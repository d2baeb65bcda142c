"""The run's records split in two: the prompts the buffer leases and the held-out ones
the eval actor scores."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from asyncrl.data.sources import load_records

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe


def load_prompt_records(recipe: Recipe) -> list[dict[str, Any]]:
    """The records the buffer leases: the run's data minus the held-out split."""
    records = load_records(recipe.data, seed=recipe.run.seed)
    held_out = set(held_out_indices(recipe, len(records)))
    return [r for i, r in enumerate(records) if i not in held_out]


def held_out_indices(recipe: Recipe, n_records: int) -> list[int]:
    """Indices of the run's records set aside for evaluation: ``eval.max_prompts`` of them,
    drawn by a seeded permutation (the same on every process and on resume), or none when
    evaluation is off or reads its own ``eval.data``."""
    cfg = recipe.eval
    if not cfg.every or cfg.data is not None:
        return []
    if n_records <= cfg.max_prompts:
        raise ValueError(
            f"eval.max_prompts={cfg.max_prompts} would hold out all {n_records} records: "
            f"set eval.max_prompts lower or give eval.data"
        )
    order = list(range(n_records))
    random.Random(f"heldout/{recipe.run.seed}").shuffle(order)
    return sorted(order[: cfg.max_prompts])


def load_eval_records(recipe: Recipe) -> list[dict[str, Any]]:
    """The held-out prompts: ``eval.data`` (its first ``max_prompts``), or the split that
    :func:`load_prompt_records` leaves out."""
    cfg = recipe.eval
    if cfg.data is not None:
        return load_records(cfg.data, seed=recipe.run.seed)[: cfg.max_prompts]
    records = load_records(recipe.data, seed=recipe.run.seed)
    return [records[i] for i in held_out_indices(recipe, len(records))]
