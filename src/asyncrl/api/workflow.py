"""The workflow contract: what turns one prompt record into the trajectories of one episode
(a GRPO group), and what scores a completion inline.

    trajectories = await workflow.arun_episode(engine, item)

``item`` is the prompt record with its ``uid`` (a dict with a ``"uid"`` key, or a
:class:`~asyncrl.wire.messages.Prompt`), and from the rollout actor its ``"attempt"`` (the
how-many-th lease of the prompt: :func:`asyncrl.workflows.base.item_attempt`), which a
sample's seed takes in (:func:`asyncrl.workflows.rlvr.sample_seed`). It returns the
group's trajectories, or None when the episode produced nothing usable (the engine stopped
mid-way): the prompt then goes back to the pool. Every trajectory carries the record in
``data`` (so a reward actor can score it), its uid ``f"{prompt_uid}/{i}"``, generated
tokens with ``loss_mask`` 1 and their behaviour logprobs and versions, and
prompt/environment tokens with mask 0, logprob 0, version -1. A trajectory whose
``reward`` is None is scored by the reward actors; one with a reward skips them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.api.inference import InferenceEngine
    from asyncrl.wire.messages import Prompt, Trajectory


class RewardOutcome(Protocol):
    """A scored completion: its reward, and whether the reward function ran (``reason``
    says why not)."""

    @property
    def reward(self) -> float: ...

    @property
    def ok(self) -> bool: ...

    @property
    def reason(self) -> str: ...


class Scorer(Protocol):
    """What scores a completion: :class:`asyncrl.rewards.pool.RewardPool` or any look-alike."""

    async def score(self, completion: str, data: dict[str, Any]) -> RewardOutcome: ...


class RolloutWorkflow(ABC):
    """Produces one episode's trajectories; see the module docstring for the contract."""

    @abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None: ...
