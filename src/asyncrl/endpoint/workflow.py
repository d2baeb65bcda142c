"""A workflow whose episodes are agent code written against the ``openai`` client::

    async def agent(client: openai.AsyncOpenAI, data: dict) -> float   # the reward

Each of the ``group_size`` episodes of a prompt runs concurrently with a client of its own
whose ``base_url`` names its episode on an :class:`~asyncrl.endpoint.OpenAIEndpoint`, so
the endpoint records every call token for token; the trajectories are built from those
records (:func:`~asyncrl.endpoint.recording.episode_samples`), never from the text the
agent saw.

The agent may return a dict instead of a float: ``{"reward": r, ...}``, the other keys
joining the sample's ``reward_info``. That is how agent code reports what only it knows,
the outcome of the tools it ran: ``tool_success`` (calls that worked), ``tool_errors``
(``{reason: count}``) and ``tool_latency_s`` (their total time) feed the same
``agent/...`` metrics as the built-in agent workflow.

``reward_info`` of every sample: ``turns`` (the episode's calls to the model),
``tool_calls`` (tool calls the endpoint parsed and returned), ``tool_errors`` (at least
``malformed``: calls the endpoint could not parse, returned as text),
``endpoint_added_latency_s`` (the endpoint's own time per call, mean), the recorder's
counts (:meth:`~asyncrl.endpoint.recording.EpisodeRecorder.metrics`), ``samples``, and
``ok``/``reason`` (whether the agent raised). ``tool_success`` and ``tool_latency_s``
appear only when the agent reports them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from asyncrl.api.inference import InferenceEngine
from asyncrl.api.workflow import RolloutWorkflow
from asyncrl.endpoint.recording import Call, EpisodeRecorder, episode_samples
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.workflows.base import split_item
from asyncrl.workflows.loader import load_callable

log = logging.getLogger(__name__)

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[float | dict[str, Any]]]

Episode = tuple[list[Call], float, str, dict[str, Any], bool]
"""``(calls, reward, failure reason or "", reward_info, aborted)`` of one episode."""


def load_agent(spec: str) -> AgentFn:
    """The agent function named by ``"path/to/file.py:agent"`` or ``"module:agent"``."""
    fn = load_callable(spec)
    if not asyncio.iscoroutinefunction(fn):
        raise TypeError(f"{spec!r} must be an async function (client, data) -> reward")
    return fn  # type: ignore[no-any-return]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs ``agent`` ``group_size`` times per prompt through ``endpoint``.

    Every sample of every episode is trained. An episode whose calls all continue one
    another is one sample (trajectory ``<prompt>/<i>``); one whose calls do not gives
    several (:func:`episode_samples`; trajectories ``<prompt>/<i>/<k>`` with
    ``episode_sample = k`` of ``episode_samples``), each with the episode's reward
    undiscounted and ``reward_info['turns_to_go']``, the calls between the sample's last
    call and the episode's last, by which the trainer discounts the episode's advantage
    (``γ^turns_to_go``, ``γ = rollout.turn_discount``). The trainer takes the baseline of
    a group from its episodes' rewards
    (:func:`~asyncrl.algo.advantages.episode_advantages`), so an episode of many samples
    weighs no more in it than one of a single sample. Where the endpoint serves each call
    its own sampling (``per_call``), a sample's trajectory carries it in ``sampled_with``
    (None: the endpoint's), greedy calls are context, and a change of sampling starts a new
    sample (:func:`episode_samples`). An agent that raises scores 0 with
    the error in ``reward_info['reason']``. An episode that made no call has no tokens to
    train on, and a group is trained only whole: the episode raises ``RuntimeError``
    naming why (the prompt goes back to the pool). Any call aborted by a stopping engine
    drops the group (None), as in the other workflows: the prompt goes back to the pool.

    ``record_path``: a JSON-lines file to which every finished episode appends its
    samples' uids and its calls' token ids, versions, finish reasons and sampling.

    The ``engine`` passed to :meth:`arun_episode` is not used: the endpoint holds its own.
    """

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        agent: AgentFn | str,
        *,
        group_size: int = 1,
        request_timeout_s: float = 600.0,
        record_path: Path | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.endpoint = endpoint
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        self.group_size = group_size
        self.request_timeout_s = request_timeout_s
        self.record_path = record_path

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        uid, record = split_item(item)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._run_agent(record)) for _ in range(self.group_size)]
        episodes = [t.result() for t in tasks]
        if any(aborted for *_, aborted in episodes):
            return None
        empty = [(i, reason) for i, (calls, _, reason, *_) in enumerate(episodes) if not calls]
        if empty:
            index, reason = empty[0]
            raise RuntimeError(
                f"episode {index} of {uid} made no call to the endpoint "
                f"({reason or 'the agent returned without calling the model'}); "
                "a group is trained only with every episode's tokens"
            )
        trajectories: list[Trajectory] = []
        for index, (calls, reward, reason, info, _) in enumerate(episodes):
            samples = episode_samples(calls, reward, self.endpoint.sampling)
            for k, sample in enumerate(samples):
                reply = calls[sample.calls[-1]].reply or {}
                traj = sample.trace.to_trajectory(
                    uid,
                    index,
                    self.group_size,
                    record,
                    str(reply.get("content") or ""),
                    sample.finish_reason,
                    reward=sample.reward,
                    reward_info={
                        **info,
                        "samples": len(samples),
                        "sample_calls": sample.calls,
                        "turns_to_go": sample.calls_to_go,
                        "ok": not reason,
                        "reason": reason,
                    },
                    sampled_with=sample.sampled_with,
                )
                if len(samples) > 1:
                    traj = traj.model_copy(
                        update={
                            "uid": f"{uid}/{index}/{k}",
                            "episode_sample": k,
                            "episode_samples": len(samples),
                        }
                    )
                trajectories.append(traj)
        if self.record_path is not None:
            self._record(trajectories, [calls for calls, *_ in episodes])
        return trajectories

    def _record(self, trajectories: list[Trajectory], episodes: list[list[Call]]) -> None:
        with open(self.record_path, "a") as f:  # type: ignore[arg-type]
            for index, calls in enumerate(episodes):
                entry = {
                    "uids": [t.uid for t in trajectories if t.group_index == index],
                    "calls": [
                        {
                            "prompt_ids": c.prompt_ids,
                            "completion_ids": c.completion_ids,
                            "versions": c.versions,
                            "finish_reason": c.finish_reason,
                            "continued_from": c.continued_from,
                            "sampling": {
                                "temperature": c.temperature,
                                "top_k": c.top_k,
                                "top_p": c.top_p,
                            },
                        }
                        for c in calls
                    ],
                }
                f.write(json.dumps(entry) + "\n")

    async def _run_agent(self, record: dict[str, Any]) -> Episode:
        import openai  # noqa: PLC0415 - optional: openai (the agents extra)

        async with self.endpoint.episode() as recorder:
            client = openai.AsyncOpenAI(
                base_url=recorder.base_url,
                api_key=self.endpoint.token,
                max_retries=0,
                timeout=self.request_timeout_s,
            )
            try:
                reward, reason, reported = await self._reward(client, record, recorder)
            finally:
                await client.close()
            info = episode_info(recorder, reported)
            return recorder.calls, reward, reason, info, recorder.aborted

    async def _reward(
        self, client: Any, record: dict[str, Any], recorder: EpisodeRecorder
    ) -> tuple[float, str, dict[str, Any]]:
        """``(reward, failure reason or "", what the agent reported beside its reward)``."""
        try:
            value = await self.agent(client, dict(record))
            if isinstance(value, dict):
                if "reward" not in value:
                    raise ValueError(f"the agent returned a dict without 'reward': {value}")
                reported = {k: v for k, v in value.items() if k != "reward"}
                return float(value["reward"]), "", reported
            return float(value), "", {}
        except Exception as exc:  # agent code is user code: a failure is a scored outcome
            reason = f"agent raised {type(exc).__name__}: {exc}"
            log.warning("episode %s: %s", recorder.episode_id, reason)
            return 0.0, reason, {}


def episode_info(recorder: EpisodeRecorder, reported: dict[str, Any]) -> dict[str, Any]:
    """An episode's ``reward_info`` in the names of the agent workflow's (see the module
    docstring): the endpoint's counts, then what the agent reported, its ``tool_errors``
    added to the endpoint's ``malformed``."""
    counts = recorder.metrics()
    info: dict[str, Any] = {
        **counts,
        "turns": int(counts["calls"]),
        "tool_calls": int(counts["tool_calls"]),
        "endpoint_added_latency_s": counts["endpoint_added_latency_s_mean"],
    }
    errors: dict[str, int] = {}
    if counts["malformed_tool_calls"]:
        errors["malformed"] = int(counts["malformed_tool_calls"])
    for reason, n in dict(reported.get("tool_errors") or {}).items():
        errors[str(reason)] = errors.get(str(reason), 0) + int(n)
    info.update({k: v for k, v in reported.items() if k != "tool_errors"})
    info["tool_errors"] = errors
    return info
