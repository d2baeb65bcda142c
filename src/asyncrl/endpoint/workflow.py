"""A workflow whose episodes are agent code written against the ``openai`` client::

    async def agent(client: openai.AsyncOpenAI, data: dict) -> float   # the reward

Each of the ``group_size`` episodes of a prompt runs concurrently with a client of its own
whose ``base_url`` names its episode on an :class:`~asyncrl.endpoint.OpenAIEndpoint`, so
the endpoint records every call token for token; the trajectories are built from those
records (:func:`~asyncrl.endpoint.recording.episode_samples`), never from the text the
agent saw.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.endpoint.recording import Call, EpisodeRecorder, episode_samples
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.engines.base import InferenceEngine
from asyncrl.messages import Prompt, Trajectory
from asyncrl.workflows.base import RolloutWorkflow, split_item
from asyncrl.workflows.loader import load_callable

log = logging.getLogger(__name__)

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float]]


def load_agent(spec: str) -> AgentFn:
    """The agent function named by ``"path/to/file.py:agent"`` or ``"module:agent"``."""
    fn = load_callable(spec)
    if not asyncio.iscoroutinefunction(fn):
        raise TypeError(f"{spec!r} must be an async function (client, data) -> reward")
    return fn  # type: ignore[no-any-return]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs ``agent`` ``group_size`` times per prompt through ``endpoint``.

    One trajectory per episode: an episode whose calls do not all extend one another gives
    several samples (:func:`episode_samples`), which would make GRPO groups uneven, so the
    workflow keeps the LAST sample, which holds the whole conversation when every call
    continued the previous one, and records ``samples`` (how many there were) in
    ``reward_info``. Its reward is the agent's return value (the last sample is never
    discounted). An agent that raises scores 0 with the error in ``reward_info['reason']``;
    an episode that made no call has no tokens and is left out of the group (the group
    shrinks; no trajectory at all returns None). Any call aborted by a stopping engine
    drops the group (None), as in the other workflows: the prompt goes back to the pool.

    The ``engine`` passed to :meth:`arun_episode` is not used: the endpoint holds its own.
    """

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        agent: AgentFn | str,
        *,
        group_size: int = 1,
        turn_discount: float = 1.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.endpoint = endpoint
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        self.group_size = group_size
        self.turn_discount = turn_discount
        self.request_timeout_s = request_timeout_s

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        uid, record = split_item(item)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._run_agent(record)) for _ in range(self.group_size)]
        episodes = [t.result() for t in tasks]
        if any(aborted for *_, aborted in episodes):
            return None
        kept = [e for e in episodes if e[0]]
        trajectories = []
        for index, (calls, reward, reason, metrics, _) in enumerate(kept):
            samples = episode_samples(calls, reward, turn_discount=self.turn_discount)
            last = samples[-1]
            reply = calls[-1].reply or {}
            completion = str(reply.get("content") or "")
            trajectories.append(
                last.trace.to_trajectory(
                    uid,
                    index,
                    len(kept),
                    record,
                    completion,
                    last.finish_reason,
                    reward=last.reward,
                    reward_info={
                        **metrics,
                        "samples": len(samples),
                        "ok": not reason,
                        "reason": reason,
                    },
                )
            )
        return trajectories or None

    async def _run_agent(
        self, record: dict[str, Any]
    ) -> tuple[list[Call], float, str, dict[str, float], bool]:
        """One episode: ``(calls, reward, failure reason or "", metrics, aborted)``."""
        import openai

        async with self.endpoint.episode() as recorder:
            client = openai.AsyncOpenAI(
                base_url=recorder.base_url,
                api_key=self.endpoint.token,
                max_retries=0,
                timeout=self.request_timeout_s,
            )
            try:
                reward, reason = await self._reward(client, record, recorder)
            finally:
                await client.close()
            return recorder.calls, reward, reason, recorder.metrics(), recorder.aborted

    async def _reward(
        self, client: Any, record: dict[str, Any], recorder: EpisodeRecorder
    ) -> tuple[float, str]:
        try:
            value = await self.agent(client, dict(record))
            return float(value), ""
        except Exception as exc:  # agent code is user code: a failure is a scored outcome
            reason = f"agent raised {type(exc).__name__}: {exc}"
            log.warning("episode %s: %s", recorder.episode_id, reason)
            return 0.0, reason
