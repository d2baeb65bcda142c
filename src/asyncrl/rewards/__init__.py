"""Rewards: answer extraction, the math-verify reward, and the process pool that runs any
reward function under a hard timeout."""

from __future__ import annotations

from asyncrl.rewards.extract import extract_answer, last_boxed, to_number
from asyncrl.rewards.math_reward import boxed_math_reward, math_reward
from asyncrl.rewards.pool import (
    REWARDS,
    RewardLoadError,
    RewardPool,
    build_reward_pool,
    resolve_reward_spec,
)

__all__ = [
    "REWARDS",
    "RewardLoadError",
    "RewardPool",
    "boxed_math_reward",
    "build_reward_pool",
    "extract_answer",
    "last_boxed",
    "math_reward",
    "resolve_reward_spec",
    "to_number",
]
