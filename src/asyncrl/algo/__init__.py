"""RL math: advantages, the policy loss, reward shaping, the sampler's cut. Pure functions;
no transport, no engine.

Names are imported on first use: :mod:`asyncrl.algo.shaping` imports no torch, so the
buffer (which shapes the rewards of the groups it admits) loads without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.algo.advantages import episode_advantages, group_advantages
    from asyncrl.algo.loss import (
        IMPORTANCE_LEVELS,
        KL_PLACEMENTS,
        KL_TYPES,
        LOSS_AGGS,
        agg_count,
        aggregate,
        kl_penalty,
        policy_loss,
    )
    from asyncrl.algo.shaping import (
        overlong_penalty,
        recipe_shaped_rewards,
        shape_reward,
        shaped_rewards,
    )
    from asyncrl.algo.truncation import cut_logprobs, kept_mask

_EXPORTS = {
    "IMPORTANCE_LEVELS": "loss",
    "KL_PLACEMENTS": "loss",
    "KL_TYPES": "loss",
    "LOSS_AGGS": "loss",
    "agg_count": "loss",
    "aggregate": "loss",
    "kl_penalty": "loss",
    "policy_loss": "loss",
    "episode_advantages": "advantages",
    "group_advantages": "advantages",
    "overlong_penalty": "shaping",
    "shape_reward": "shaping",
    "shaped_rewards": "shaping",
    "recipe_shaped_rewards": "shaping",
    "cut_logprobs": "truncation",
    "kept_mask": "truncation",
}

__all__ = [
    "IMPORTANCE_LEVELS",
    "KL_PLACEMENTS",
    "KL_TYPES",
    "LOSS_AGGS",
    "agg_count",
    "aggregate",
    "cut_logprobs",
    "episode_advantages",
    "group_advantages",
    "kept_mask",
    "kl_penalty",
    "overlong_penalty",
    "policy_loss",
    "recipe_shaped_rewards",
    "shape_reward",
    "shaped_rewards",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl.algo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncrl.algo.{module}"), name)
