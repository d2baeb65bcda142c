"""The agent workflow: multi-turn generation in which the model calls tools.

Per sample, token-in/token-out like :mod:`asyncrl.workflows.multi_turn`::

    prompt -> generate -> parse calls -> run them in the environment -> observation -> ...

until a reply without calls (the environment scores it), ``max_turns`` replies, or the
sequence reaches ``max_total_tokens``. The engine's output tokens are appended as they are
and never re-tokenized; only the text between replies (the end of the assistant turn, the
tool results in the chat template's format, the start of the next reply) is tokenized,
with loss mask 0. Every generated token keeps the version that produced it, across turns
and weight updates.

How the chat template is used (probed once, see :class:`ChatFormat`):

- tools are shown through the template's ``tools=`` when it renders them, else as
  :func:`~asyncrl.tools.calls.tools_system_text` in the system message; with
  ``tool_listing="compact"``, as :func:`~asyncrl.tools.calls.compact_tools_text` there;
- tool results are messages in the ``tool`` role when the template renders that role,
  else one user turn of ``<tool_response>`` blocks.

``reward_info`` carries the episode's counts: ``turns``, ``tool_calls``, ``tool_success``,
``tool_errors`` (by reason), ``tool_latency_s``; :func:`~asyncrl.observe.records.agent_metrics` sums a batch of them
into ``agent/...`` metrics.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

from asyncrl.api.inference import GenerateRequest, InferenceEngine, SamplingParams
from asyncrl.api.workflow import RolloutWorkflow, Scorer
from asyncrl.tools.base import Tool
from asyncrl.tools.builtin import BUILTIN_TOOLS
from asyncrl.tools.calls import compact_tools_text, get_parser, tools_system_text
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.workflows.base import (
    TokenTrace,
    encode_text,
    item_attempt,
    rest_of_turn_end,
    split_item,
)
from asyncrl.workflows.multi_turn import turn_texts
from asyncrl.workflows.rlvr import sample_seed
from asyncrl.workflows.tool_env import EnvFactory, Environment, RewardEnv, ToolEnv

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_3141",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
PROBE_RESULT = "PROBE_RESULT_2718"

TOOL_LISTINGS = ("template", "compact")
"""How the tools are shown (``rollout.agent.tool_listing``; see :meth:`ChatFormat.prompt_ids`)."""


class ChatFormat:
    """How a tokenizer's chat template shows tools and tool results, found by rendering
    probe chats. Raises ``ValueError`` for a template that rewrites earlier turns (then no
    token-level continuation exists)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_text, _ = turn_texts(tokenizer, "PROBE_FEEDBACK")
        self.renders_tools = self._renders_tools()
        self.tool_role = self._renders_tool_role()
        self.observation_text([{"role": "tool", "tool_call_id": "p", "name": "p", "content": ""}])

    def _render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))

    def _renders_tools(self) -> bool:
        try:
            text = self._render([{"role": "user", "content": "q"}], tools=[PROBE_TOOL])
        except Exception:  # a template (or tokenizer) without tools support
            return False
        return "probe_tool_3141" in text

    def _renders_tool_role(self) -> bool:
        chat = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "tool_call_id": "p", "name": "p", "content": PROBE_RESULT},
        ]
        try:
            return PROBE_RESULT in self._render(chat, add_generation_prompt=True)
        except Exception:  # a template that refuses the role
            return False

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: Sequence[Tool], listing: str = "template"
    ) -> list[int]:
        """The first messages with the tools shown, ready for the first reply: through the
        template's ``tools=`` where it renders them and ``listing`` is ``"template"``,
        else in the system message (:func:`~asyncrl.tools.calls.compact_tools_text` for
        ``"compact"``, the schemas in full otherwise)."""
        schemas = [t.schema() for t in tools]
        if schemas and self.renders_tools and listing == "template":
            text = self._render(messages, tools=schemas, add_generation_prompt=True)
            return self.encode(text)
        messages = [dict(m) for m in messages]
        if schemas:
            listing = (
                compact_tools_text(schemas) if listing == "compact" else tools_system_text(schemas)
            )
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{listing}"
            else:
                messages.insert(0, {"role": "system", "content": listing})
        return self.encode(self._render(messages, add_generation_prompt=True))

    def observation_text(self, observation: list[dict[str, Any]]) -> str:
        """The text of ``observation`` after a closed assistant turn, up to the next reply."""
        if not self.tool_role:
            blocks = "\n".join(
                f"<tool_response>\n{m['content']}\n</tool_response>" for m in observation
            )
            observation = [{"role": "user", "content": blocks}]
        head = [{"role": "user", "content": "PROBE_Q"}, {"role": "assistant", "content": "A"}]
        closed = self._render(head)
        after = self._render(head + observation, add_generation_prompt=True)
        if not after.startswith(closed):
            raise ValueError(
                "this chat template rewrites earlier turns; agents need one that appends"
            )
        return after[len(closed) :]

    def close_ids(self, output_ids: list[int]) -> list[int]:
        """Tokens that end the assistant turn after ``output_ids``."""
        return self.encode(rest_of_turn_end(self.tokenizer, self.end_text, output_ids))


class AgentWorkflow(RolloutWorkflow):
    """Tool-calling episodes; see the module docstring.

    The environment of each sample comes from ``env_factory``; without one, a
    :class:`~asyncrl.workflows.tool_env.ToolEnv` over ``tools`` scored by ``reward`` (a
    :class:`~asyncrl.workflows.tool_env.RewardEnv` when there are no tools). ``tools`` are
    :class:`~asyncrl.tools.base.Tool` objects or names of built-in tools
    (:data:`~asyncrl.tools.builtin.BUILTIN_TOOLS`); ``rollout.workflow = "agent"`` gets the
    built-ins ``calculator`` and ``python``."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: SamplingParams,
        reward: Scorer | None = None,
        tools: Sequence[Tool | str] = ("calculator", "python"),
        env_factory: EnvFactory | None = None,
        group_size: int = 1,
        max_turns: int = 4,
        max_total_tokens: int = 4096,
        tool_parser: str = "hermes",
        system_prompt: str | None = None,
        tool_listing: str = "template",
    ) -> None:
        if tool_listing not in TOOL_LISTINGS:
            raise ValueError(f"tool_listing {tool_listing!r}: one of {TOOL_LISTINGS}")
        if max_turns < 1 or group_size < 1 or max_total_tokens < 1:
            raise ValueError("max_turns, group_size and max_total_tokens must be >= 1")
        if env_factory is None:
            if reward is None:
                raise ValueError("the agent workflow needs a reward or an env_factory")
            scorer, tool_list = (
                reward,
                [builtin_tool(t) if isinstance(t, str) else t for t in tools],
            )
            env_factory = (
                (lambda: ToolEnv(tool_list, scorer, system_prompt))
                if tool_list
                else (lambda: RewardEnv(scorer, system_prompt))
            )
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.group_size = group_size
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.parse = get_parser(tool_parser)
        self.chat = ChatFormat(tokenizer)
        self.tool_listing = tool_listing

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        uid, record = split_item(item)
        attempt = item_attempt(item)
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self._sample(engine, uid, record, i, attempt))
                for i in range(self.group_size)
            ]
        results = [t.result() for t in tasks]
        if any(r is None for r in results):
            return None  # the engine stopped: a partial group is no group
        return [r for r in results if r is not None]

    async def _sample(
        self,
        engine: InferenceEngine,
        uid: str,
        record: dict[str, Any],
        index: int,
        attempt: int = 1,
    ) -> Trajectory | None:
        env: Environment = self.env_factory()
        start = await env.reset(record)
        trace = TokenTrace()
        trace.add_context(self.chat.prompt_ids(start.messages, start.tools, self.tool_listing))
        seed = sample_seed(self.sampling.seed, uid, index, attempt)
        counts: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        latency = 0.0
        text, finish, turns = "", "length", 0
        reward: float | None = None
        info: dict[str, Any] = {}
        for turn in range(self.max_turns):
            room = self.max_total_tokens - len(trace.input_ids)
            if room <= 0:
                raise ValueError(
                    f"the prompt of {len(trace.input_ids)} tokens leaves no room for a reply "
                    f"under max_total_tokens={self.max_total_tokens}"
                )
            sampling = self.sampling.model_copy(
                update={
                    "seed": None if seed is None else seed + turn,
                    "max_new_tokens": min(self.sampling.max_new_tokens, room),
                }
            )
            resp = await engine.agenerate(
                GenerateRequest(
                    input_ids=list(trace.input_ids), sampling=sampling, rid=f"{uid}/{index}/{turn}"
                )
            )
            if resp.finish_reason == "abort":
                return None
            trace.add_generated(resp)
            finish, turns = resp.finish_reason, turn + 1
            text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            reply = self.parse(text)
            last = turn == self.max_turns - 1 or len(trace.input_ids) >= self.max_total_tokens
            step = await env.step(reply, last=last)
            for result in step.results:
                counts["tool_calls"] += 1
                counts["tool_success"] += result.ok
                latency += result.latency_s
                if not result.ok:
                    errors[result.reason] += 1
            if step.done:
                reward, info = step.reward, step.info
                break
            observation = self.chat.close_ids(resp.output_ids) + self.chat.encode(
                self.chat.observation_text(step.messages)
            )
            if len(trace.input_ids) + len(observation) >= self.max_total_tokens:
                break  # no room for another reply after the results
            trace.add_context(observation)
        if reward is None:
            # Out of turns or tokens with calls pending: the last reply is scored as it is.
            final = await env.step(self.parse(text), last=True)
            reward, info = final.reward, final.info
        return trace.to_trajectory(
            uid,
            index,
            self.group_size,
            record,
            text,
            finish,
            reward=reward,
            reward_info={
                **info,
                "turns": turns,
                "tool_calls": counts["tool_calls"],
                "tool_success": counts["tool_success"],
                "tool_errors": dict(errors),
                "tool_latency_s": latency,
            },
        )


def builtin_tool(name: str) -> Tool:
    try:
        return BUILTIN_TOOLS[name]()
    except KeyError:
        raise ValueError(f"unknown built-in tool {name!r}: known {sorted(BUILTIN_TOOLS)}") from None
