"""The actors, one per module. ``ACTORS`` maps a role to ``module:class``; modules are
imported only when that role starts, so a reward process never loads the trainer."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.runtime.actor import Actor

ACTORS: dict[str, str] = {
    "buffer": "asyncrl.actors.buffer:BufferActor",
    "eval": "asyncrl.actors.eval:EvalActor",
    "reward": "asyncrl.actors.reward:RewardActor",
    "rollout": "asyncrl.actors.rollout:RolloutActor",
    "trainer": "asyncrl.actors.trainer:TrainerActor",
}


def actor_class(role: str) -> type[Actor]:
    if role not in ACTORS:
        raise ValueError(f"unknown role {role!r}; known roles: {', '.join(ACTORS)}")
    module, name = ACTORS[role].split(":")
    cls: type[Actor] = getattr(importlib.import_module(module), name)
    return cls
