"""The recipe's ``rollout.workflow``: one config per kind of workflow, a discriminated union
on ``type``, and each builds its workflow and knows its own checks.

=================  ==========================================================================
``type``           the workflow
=================  ==========================================================================
``rlvr``           one reply per sample (:mod:`asyncrl.workflows.rlvr`)
``multi_turn``     feedback turns up to ``rollout.max_turns`` (:mod:`~.multi_turn`)
``agent``          tool calls, with ``rollout.agent``'s tools (:mod:`~.agent`)
``agent_code``     ``fn``: ``async def agent(client, data) -> float`` through the endpoint
``verifiers``      ``env``: a ``verifiers`` environment through the endpoint
``episode``        ``fn``: ``async def episode(engine, item)``, or a workflow class/factory
=================  ==========================================================================

A recipe may write the workflow as one string (:func:`workflow_shorthand`): ``"rlvr"``,
``"multi_turn"``, ``"agent"``, ``"verifiers:<env>"``, or ``"path/to/file.py:name"`` /
``"module:name"``, which is agent code or an episode function by its first parameter
(:mod:`asyncrl.workflows.code`; the spec is loaded to tell). The rest of a workflow's
settings stay where they were: ``rollout.max_turns``, ``rollout.turn_discount``,
``rollout.agent`` (tools, limits, and a verifiers environment's ``env_args``).

Each config builds its workflow from the rollout section and the :class:`WorkflowParts`
an actor hands it; the rollout and eval actors build the same way. Imports no torch, and
a workflow's implementation (on the wire messages and numpy, or the endpoint's aiohttp
server) only when it is built: the recipe's schema is on the path of every command.
"""

from __future__ import annotations

import contextlib
import shutil
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from asyncrl.config.agent import AgentConfig
from asyncrl.config.schema import Section
from asyncrl.tools.calls import PARSERS
from asyncrl.tools.mcp import MCPTools
from asyncrl.workflows.code import is_agent_code, user_workflow
from asyncrl.workflows.loader import SpecError, load_callable, split_spec

if TYPE_CHECKING:
    from asyncrl.api.inference import SamplingParams
    from asyncrl.api.workflow import RolloutWorkflow, Scorer
    from asyncrl.config.recipe import RolloutConfig
    from asyncrl.endpoint.server import OpenAIEndpoint
    from asyncrl.models.vision import VisionProcessor
    from asyncrl.tools.base import Tool

ENDPOINT_CALLS = "endpoint_calls.jsonl"
"""Where ``rollout.endpoint_record`` appends the calls of agent code's episodes."""


@dataclass
class WorkflowParts:
    """What an actor hands the recipe's workflow config to build the workflow: the
    engine's tokenizer, the sampling and samples per prompt (the rollout's, or an eval
    job's), and the started parts a kind may use: a reward pool (:meth:`scores_inline`
    says whether the rollout actor starts one), the endpoint (:attr:`needs_endpoint`), the
    opened tools (:meth:`open_tools`), the file recording the endpoint's calls, and for a
    vision model its processor and the record field naming a prompt's images."""

    tokenizer: Any
    sampling: SamplingParams
    group_size: int
    reward: Scorer | None = None
    endpoint: OpenAIEndpoint | None = None
    tools: list[Tool] | None = None
    record_path: Path | None = None
    vision: VisionProcessor | None = None
    image_key: str | None = None

    def need_endpoint(self, key: str) -> OpenAIEndpoint:
        if self.endpoint is None:
            raise SpecError(
                f"{key} runs through the rollout actor's endpoint: set rollout.endpoint = "
                "true (or leave it unset)"
            )
        return self.endpoint

    def need_reward(self, key: str) -> Scorer:
        if self.reward is None:
            raise ValueError(f"{key} scores its samples inline: it needs a reward pool")
        return self.reward


class WorkflowConfigBase(Section):
    """What every kind of workflow config answers; see the module docstring."""

    needs_endpoint: ClassVar[bool] = False
    """Whether its episodes run through the actor's endpoint (agent code)."""
    turns: ClassVar[bool] = False
    """Whether a sample has up to ``rollout.max_turns`` replies (the generation budget is
    per turn)."""
    whole_groups: ClassVar[bool] = False
    """Whether an episode returns its prompt's whole group of one-sample episodes at once
    (RLVR's ``group_size`` completions): the rollout actor then publishes it as one
    :class:`~asyncrl.wire.messages.TrajectoryGroup`, not one message per sample. Agent code,
    whose episodes may give several samples each and long ones, keeps one per sample."""

    @abstractmethod
    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        """The workflow, built from the rollout section and the actor's ``parts``."""

    def problems(self, rollout: RolloutConfig) -> list[str]:
        """Why the workflow could not be built, one line per reason naming its key."""
        if self.needs_endpoint and rollout.endpoint is False:
            return [
                f"rollout.workflow = {self.spec()!r} runs through the rollout actor's "
                "endpoint, but rollout.endpoint = false: leave it unset"
            ]
        return []

    def scores_inline(self, rollout: RolloutConfig) -> bool:
        """Whether the rollout actor needs a reward pool of its own for the workflow: a
        workflow that scores its samples itself with the recipe's ``reward.fn``."""
        return False

    def calls_endpoint(self, rollout: RolloutConfig) -> bool:
        """Whether its episodes may sample through the actor's endpoint, whose calls
        ``rollout.endpoint_sampling`` governs: agent code and verifiers environments do;
        the built-in workflows sample with ``rollout.sampling`` on the engine itself."""
        return self.needs_endpoint

    def generation_budget(self, rollout: RolloutConfig) -> int:
        """Most tokens one sample can generate. Agent code decides its own turns: its
        budget is counted per call."""
        per_turn = rollout.sampling.max_new_tokens
        return per_turn * rollout.max_turns if self.turns else per_turn

    def sample_budget(self, rollout: RolloutConfig, replies: int) -> int:
        """Most tokens a sample of ``replies`` replies can generate: the turn-based
        workflows' :meth:`generation_budget` (their turns are bounded), else ``replies``
        calls' budgets (agent code whose consecutive calls continue one another makes one
        sample of several calls)."""
        if self.turns:
            return self.generation_budget(rollout)
        return replies * self.generation_budget(rollout)

    def budget_keys(self) -> str:
        """The keys that set :meth:`generation_budget`, for messages."""
        return "rollout.sampling.max_new_tokens" + (" × rollout.max_turns" if self.turns else "")

    def spec(self) -> str:
        """The workflow as its shorthand string (messages)."""
        return str(getattr(self, "type", ""))

    def code(self) -> str:
        """The ``file.py:name`` / ``module:name`` / environment the workflow names; empty
        for a built-in."""
        return ""

    async def open_tools(
        self, rollout: RolloutConfig, resources: contextlib.AsyncExitStack
    ) -> list[Tool] | None:
        """The tools the workflow calls, MCP servers started into ``resources``; None for
        a workflow without tools."""
        return None


class RLVRWorkflowConfig(WorkflowConfigBase):
    type: Literal["rlvr"] = "rlvr"
    """One reply per sample; the reward actors score it (an eval scores it inline)."""

    whole_groups: ClassVar[bool] = True

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        from asyncrl.workflows.rlvr import RLVRWorkflow  # noqa: PLC0415 - heavy: the wire messages, numpy

        return RLVRWorkflow(
            parts.tokenizer,
            parts.sampling,
            parts.group_size,
            parts.reward,
            vision=parts.vision,
            image_key=parts.image_key,
        )


class MultiTurnWorkflowConfig(WorkflowConfigBase):
    type: Literal["multi_turn"] = "multi_turn"
    """Feedback turns until the reward is positive or ``rollout.max_turns`` is reached,
    discounted by ``rollout.turn_discount`` per extra turn; scored inline."""

    turns: ClassVar[bool] = True

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        from asyncrl.workflows.multi_turn import MultiTurnWorkflow  # noqa: PLC0415 - heavy: the wire messages, numpy

        return MultiTurnWorkflow(
            parts.tokenizer,
            parts.sampling,
            parts.need_reward("rollout.workflow = 'multi_turn'"),
            group_size=parts.group_size,
            max_turns=rollout.max_turns,
            turn_discount=rollout.turn_discount,
        )

    def scores_inline(self, rollout: RolloutConfig) -> bool:
        return True


class AgentWorkflowConfig(WorkflowConfigBase):
    type: Literal["agent"] = "agent"
    """Tool calls, with the tools, parser and limits of ``rollout.agent``; scored inline
    (or by ``rollout.agent.env``'s environment)."""

    turns: ClassVar[bool] = True

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        from asyncrl.workflows.agent import AgentWorkflow  # noqa: PLC0415 - heavy: the wire messages, numpy

        a = rollout.agent
        options: dict[str, Any] = {}
        if a.env:
            options["env_factory"] = load_callable(a.env)
        else:
            options["tools"] = parts.tools if parts.tools is not None else self.tools(a)
        return AgentWorkflow(
            parts.tokenizer,
            parts.sampling,
            reward=parts.reward,
            group_size=parts.group_size,
            max_turns=rollout.max_turns,
            max_total_tokens=a.max_total_tokens,
            tool_parser=a.parser,
            system_prompt=a.system_prompt or None,
            tool_listing=a.tool_listing,
            **options,
        )

    @staticmethod
    def tools(agent: AgentConfig) -> list[Tool]:
        """``rollout.agent.tools`` built; ``ValueError`` naming the key for each that is not."""
        tools, problems = agent.function_tools()
        if problems:
            raise ValueError("; ".join(problems))
        return tools

    async def open_tools(
        self, rollout: RolloutConfig, resources: contextlib.AsyncExitStack
    ) -> list[Tool] | None:
        """``rollout.agent.tools`` and the tools of its MCP servers (started into
        ``resources``); None when an environment brings its own."""
        a = rollout.agent
        if a.env:
            return None
        tools = self.tools(a)
        for spec in a.mcp_specs():
            server = await resources.enter_async_context(MCPTools(spec))
            tools += server.tools
        return tools

    def scores_inline(self, rollout: RolloutConfig) -> bool:
        return not rollout.agent.env

    def generation_budget(self, rollout: RolloutConfig) -> int:
        return min(super().generation_budget(rollout), rollout.agent.max_total_tokens)

    def problems(self, rollout: RolloutConfig) -> list[str]:
        """An unknown parser, a token budget without room for a prompt, an environment
        factory that does not load, a tool that is not one
        (:meth:`AgentConfig.function_tools`), an MCP command that is not installed."""
        a, errors = rollout.agent, []
        if a.parser not in PARSERS:
            errors.append(
                f"rollout.agent.parser = {a.parser!r} is unknown: known "
                f"{', '.join(sorted(PARSERS))}"
            )
        if a.max_total_tokens <= rollout.sampling.max_new_tokens:
            errors.append(
                f"rollout.agent.max_total_tokens = {a.max_total_tokens} leaves no room for a "
                f"prompt before a reply of rollout.sampling.max_new_tokens = "
                f"{rollout.sampling.max_new_tokens} tokens; raise it above the prompt plus a "
                "reply"
            )
        if a.env:
            try:
                load_callable(a.env)
            except Exception as exc:  # user code: whatever its import raises
                errors.append(f"rollout.agent.env = {a.env!r}: {type(exc).__name__}: {exc}")
            return errors
        errors.extend(a.function_tools()[1])
        for i, server in enumerate(a.mcp):
            if shutil.which(server.command) is None:
                errors.append(
                    f"rollout.agent.mcp[{i}].command = {server.command!r} is not an installed "
                    "program (not on PATH)"
                )
        return errors


def _spec(value: str) -> str:
    split_spec(value)
    return value


class AgentCodeWorkflowConfig(WorkflowConfigBase):
    type: Literal["agent_code"] = "agent_code"
    """``async def agent(client, data) -> float`` run against the actor's endpoint; its
    return value is the reward."""
    fn: str
    """``path/to/file.py:agent`` or ``module:agent``."""

    needs_endpoint: ClassVar[bool] = True

    _fn_spec = field_validator("fn")(_spec)

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        from asyncrl.endpoint.workflow import (  # noqa: PLC0415 - heavy: the endpoint's aiohttp server
            OpenAIAgentWorkflow,
            load_agent,
        )

        return OpenAIAgentWorkflow(
            parts.need_endpoint(repr(self.fn)),
            load_agent(self.fn),
            group_size=parts.group_size,
            record_path=parts.record_path,
        )

    def problems(self, rollout: RolloutConfig) -> list[str]:
        """A spec that does not load or is no agent code, or the endpoint turned off."""
        try:
            agent_code = is_agent_code(self.fn)
        except Exception as exc:  # user code: whatever its import raises
            return [f"rollout.workflow = {self.fn!r}: {type(exc).__name__}: {exc}"]
        if not agent_code:
            return [
                f"rollout.workflow = {self.fn!r} is no agent code "
                "'async def agent(client, data) -> float'"
            ]
        return super().problems(rollout)

    def spec(self) -> str:
        return self.fn

    def code(self) -> str:
        return self.fn


VERIFIERS_PREFIX = "verifiers:"
"""The shorthand ``rollout.workflow = "verifiers:<env>"`` names a ``verifiers`` environment."""


class VerifiersWorkflowConfig(WorkflowConfigBase):
    type: Literal["verifiers"] = "verifiers"
    """A ``verifiers`` environment (its ``load_environment(**rollout.agent.env_args)``)
    whose rollouts run through the endpoint and are scored by its rubric."""
    env: str = Field(min_length=1)
    """A module, hub id or ``path/to/file.py``."""

    needs_endpoint: ClassVar[bool] = True

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        from asyncrl.endpoint.verifiers_env import verifiers_workflow  # noqa: PLC0415 - heavy: the endpoint's aiohttp server

        workflow = verifiers_workflow(
            self.env,
            endpoint=parts.need_endpoint(repr(self.spec())),
            env_args=dict(rollout.agent.env_args),
            group_size=parts.group_size,
        )
        workflow.record_path = parts.record_path
        return workflow

    def problems(self, rollout: RolloutConfig) -> list[str]:
        """The endpoint turned off, or an environment that does not load (``verifiers``
        missing, no ``load_environment``, arguments that do not fit, not an Environment).
        Builds the environment once, as each actor will."""
        from asyncrl.endpoint.verifiers_env import load_verifiers_env  # noqa: PLC0415 - heavy: the endpoint's aiohttp server

        errors = super().problems(rollout)
        try:
            load_verifiers_env(self.env, rollout.agent.env_args)
        except ImportError as exc:
            errors.append(f"rollout.workflow = {self.spec()!r}: {exc}")
        except Exception as exc:  # user code: whatever building the environment raises
            errors.append(
                f"rollout.workflow = {self.spec()!r} (rollout.agent.env_args = "
                f"{dict(rollout.agent.env_args)}): {type(exc).__name__}: {exc}"
            )
        return errors

    def spec(self) -> str:
        return f"{VERIFIERS_PREFIX}{self.env}"

    def code(self) -> str:
        return self.env


class EpisodeWorkflowConfig(WorkflowConfigBase):
    type: Literal["episode"] = "episode"
    """A user's own workflow: ``async def episode(engine, item)`` returning the group's
    trajectories, or a workflow class or factory, called with the options it names
    (``tokenizer``, ``sampling``, ``group_size``, ``max_turns``, ``turn_discount``,
    ``reward``, ``endpoint``)."""
    fn: str
    """``path/to/file.py:name`` or ``module:name``."""

    _fn_spec = field_validator("fn")(_spec)

    def build(self, rollout: RolloutConfig, parts: WorkflowParts) -> RolloutWorkflow:
        options: dict[str, Any] = {
            "tokenizer": parts.tokenizer,
            "sampling": parts.sampling,
            "group_size": parts.group_size,
            "max_turns": rollout.max_turns,
            "turn_discount": rollout.turn_discount,
        }
        if parts.reward is not None:
            options["reward"] = parts.reward
        if parts.endpoint is not None:
            options["endpoint"] = parts.endpoint
        return user_workflow(self.fn, options)

    def problems(self, rollout: RolloutConfig) -> list[str]:
        """A spec that does not load, or an async function of neither form."""
        try:
            if is_agent_code(self.fn):
                return [
                    f"rollout.workflow = {self.fn!r} is agent code: write it as "
                    '{type = "agent_code", fn = ...}'
                ]
        except Exception as exc:  # user code: whatever its import raises
            return [f"rollout.workflow = {self.fn!r}: {type(exc).__name__}: {exc}"]
        return []

    def scores_inline(self, rollout: RolloutConfig) -> bool:
        return True

    def calls_endpoint(self, rollout: RolloutConfig) -> bool:
        """Whether it is handed the endpoint (``rollout.endpoint = true``), which it may
        run agent code through."""
        return rollout.serves_endpoint

    def spec(self) -> str:
        return self.fn

    def code(self) -> str:
        return self.fn


WorkflowConfig = Annotated[
    RLVRWorkflowConfig
    | MultiTurnWorkflowConfig
    | AgentWorkflowConfig
    | AgentCodeWorkflowConfig
    | VerifiersWorkflowConfig
    | EpisodeWorkflowConfig,
    Field(discriminator="type"),
]

BUILT_IN: dict[str, type[WorkflowConfigBase]] = {
    "rlvr": RLVRWorkflowConfig,
    "multi_turn": MultiTurnWorkflowConfig,
    "agent": AgentWorkflowConfig,
}
"""The built-in workflows by the shorthand a recipe uses."""


def workflow_shorthand(value: Any) -> Any:
    """``rollout.workflow`` written as one string, as its table: ``"rlvr"`` →
    ``{type = "rlvr"}``, ``"verifiers:<env>"`` → ``{type = "verifiers", env = ...}``,
    ``"file.py:name"`` → ``agent_code`` or ``episode`` by what it names (loaded to tell).
    Raises ``ValueError`` for a string that is none of them; anything else is returned as
    it is."""
    if not isinstance(value, str):
        return value
    if value in BUILT_IN:
        return {"type": value}
    if value.startswith(VERIFIERS_PREFIX):
        return {"type": "verifiers", "env": value.removeprefix(VERIFIERS_PREFIX).strip()}
    if ":" not in value:
        raise ValueError(
            f"{value!r} is not one of {', '.join(BUILT_IN)} nor verifiers:<env> or "
            "path/to/file.py:name"
        )
    try:
        kind = "agent_code" if is_agent_code(value) else "episode"
    except Exception as exc:  # user code: whatever its import raises
        raise ValueError(f"{value!r}: {type(exc).__name__}: {exc}") from None
    return {"type": kind, "fn": value}
