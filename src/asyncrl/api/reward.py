"""The reward contract: the function a recipe names (``reward.fn``), what scoring it gives
back, and the scorer the reward actor (and a workflow that scores its own episodes) calls.

A reward function takes the completion's text and its prompt record (the dataset row,
reference answer included) and returns a finite number, or an awaitable of one. It may
raise, hang or return anything: the scorer that runs it (:class:`asyncrl.rewards.RewardPool`,
in worker processes under a hard timeout) turns every such failure into a
:class:`RewardResult` with ``ok=False``, so scoring never raises for a reward's own fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol


class RewardFunction(Protocol):
    """``fn(completion, data) -> float`` (or an ``async def``): the reward of
    ``completion`` for the prompt record ``data``."""

    def __call__(self, completion: str, data: dict[str, Any], /) -> float | Awaitable[float]: ...


@dataclass(frozen=True)
class RewardResult:
    """One scored completion. ``reason`` is empty when ``ok``; otherwise the reward is 0
    and ``reason`` starts with the failure's kind (``raised``, ``bad_value``, ``died``,
    ``timeout``)."""

    reward: float
    ok: bool = True
    reason: str = ""


class RewardScorer(Protocol):
    """Scores completions with one reward function; :class:`asyncrl.rewards.RewardPool`.

    Lifecycle: ``await start()`` (idempotent; raises if the function cannot be loaded)
    … ``await aclose()``."""

    @property
    def failures(self) -> Counter[str]:
        """Failed calls so far, by kind."""
        ...

    async def start(self) -> None:
        """Loads the reward function; returns once scoring can run."""
        ...

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        """The reward of ``completion`` for the prompt record ``data``; never raises for
        the reward function's own failure (that is a result with ``ok=False``)."""
        ...

    async def aclose(self) -> None:
        """Ends scoring and releases what :meth:`start` took."""
        ...


__all__ = ["RewardFunction", "RewardResult", "RewardScorer"]
