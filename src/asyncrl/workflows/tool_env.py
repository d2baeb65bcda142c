"""Environments: the per-episode state an agent acts in.

    first = await env.reset(record)          # the first messages and the tools
    step = await env.step(reply)             # after each assistant turn

``reset`` gives the chat to start from and the tools the model may call; ``step`` takes
the parsed assistant turn and gives the observation (messages to append: tool results in
the ``tool`` role), whether the episode ended, its reward when it did, and ``info`` (the
turn's tool counts). One environment object serves one episode; a workflow makes a fresh
one per sample from a factory.

- :class:`RewardEnv`: a plain reward (any :class:`~asyncrl.api.workflow.Scorer`) is an
  environment without tools; the first reply ends the episode and is scored.
- :class:`ToolEnv`: a reply with tool calls runs them (concurrently, each under its
  timeout, errors as observations) and the episode goes on; a reply without calls ends it
  and is scored.

``step(reply, last=True)`` tells the environment that no further turn will follow (the
workflow ran out of turns or tokens): it must end the episode and give the reward without
running the reply's calls. It may come for a reply that was just stepped without
``last`` (its results did not fit the token budget): then it scores that reply again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.workflow import Scorer
from asyncrl.tools.base import Tool, ToolBox, ToolResult
from asyncrl.tools.calls import ParsedReply
from asyncrl.workflows.base import chat_messages


@dataclass
class Reset:
    """The start of an episode: the chat so far and the tools offered."""

    messages: list[dict[str, Any]]
    tools: list[Tool] = field(default_factory=list)


@dataclass
class Step:
    """What follows one assistant turn. ``reward`` is set when ``done``."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    results: list[ToolResult] = field(default_factory=list)


class Environment(ABC):
    """One episode's state; see the module docstring for the contract."""

    @abstractmethod
    async def reset(self, record: dict[str, Any]) -> Reset: ...

    @abstractmethod
    async def step(self, reply: ParsedReply, *, last: bool = False) -> Step: ...


EnvFactory = Callable[[], Environment]


def first_messages(record: dict[str, Any], system_prompt: str | None) -> list[dict[str, Any]]:
    """The record's chat (``messages``, or one user turn from ``prompt``/``question``),
    after ``system_prompt`` if given."""
    return list(chat_messages(record, system_prompt))


def tool_counts(results: Sequence[ToolResult]) -> dict[str, Any]:
    """Counts of one turn's tool results: calls, successes, errors by reason, latency."""
    errors = Counter(r.reason for r in results if not r.ok)
    return {
        "tool_calls": len(results),
        "tool_success": sum(r.ok for r in results),
        "tool_errors": dict(errors),
        "tool_latency_s": sum(r.latency_s for r in results),
    }


class RewardEnv(Environment):
    """A reward as an environment: no tools, the first reply is scored and ends it."""

    def __init__(self, scorer: Scorer, system_prompt: str | None = None) -> None:
        self.scorer = scorer
        self.system_prompt = system_prompt
        self.record: dict[str, Any] = {}

    async def reset(self, record: dict[str, Any]) -> Reset:
        self.record = record
        return Reset(first_messages(record, self.system_prompt))

    async def step(self, reply: ParsedReply, *, last: bool = False) -> Step:
        return await self._score(reply)

    async def _score(self, reply: ParsedReply) -> Step:
        outcome = await self.scorer.score(reply.content, self.record)
        return Step(
            done=True,
            reward=float(outcome.reward),
            info={"ok": outcome.ok, "reason": outcome.reason},
        )


class ToolEnv(RewardEnv):
    """Tools until the model answers without a call; that answer is scored."""

    def __init__(
        self, tools: Sequence[Tool], scorer: Scorer, system_prompt: str | None = None
    ) -> None:
        super().__init__(scorer, system_prompt)
        self.box = ToolBox(tools)

    async def reset(self, record: dict[str, Any]) -> Reset:
        self.record = record
        return Reset(first_messages(record, self.system_prompt), list(self.box.tools.values()))

    async def step(self, reply: ParsedReply, *, last: bool = False) -> Step:
        if last or not (reply.tool_calls or reply.errors):
            return await self._score(reply)
        results = await self.box.run_reply(reply)
        return Step(
            messages=[r.message() for r in results],
            info=tool_counts(results),
            results=results,
        )
