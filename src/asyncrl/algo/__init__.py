"""RL math: advantages, the policy loss, reward shaping. Pure functions on tensors; no
transport, no engine."""

from asyncrl.algo.advantages import group_advantages
from asyncrl.algo.loss import (
    IMPORTANCE_LEVELS,
    KL_TYPES,
    LOSS_AGGS,
    agg_count,
    aggregate,
    kl_penalty,
    policy_loss,
)
from asyncrl.algo.shaping import overlong_penalty, shape_rewards

__all__ = [
    "IMPORTANCE_LEVELS",
    "KL_TYPES",
    "LOSS_AGGS",
    "agg_count",
    "aggregate",
    "group_advantages",
    "kl_penalty",
    "overlong_penalty",
    "policy_loss",
    "shape_rewards",
]
