"""The recipe's workflow as the rollout and eval actors build it: sampling, tools, the
endpoint choice and whether the workflow scores inline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe


def sampling_params(recipe: Recipe) -> Any:
    """The rollout's sampling settings (``rollout.sampling``) as the engines take them."""
    from asyncrl.engines.base import SamplingParams

    s = recipe.rollout.sampling
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens
    )


def build_workflow(
    recipe: Recipe,
    engine: Any,
    reward: Any = None,
    *,
    endpoint: Any = None,
    tools: Sequence[Any] | None = None,
) -> Any:
    """The recipe's workflow. ``reward`` (a started reward pool) is offered to workflows
    that score inline; the built-in ``rlvr`` never gets it, because in a run its samples
    are scored by the reward actors. ``endpoint`` (the actor's started
    :class:`~asyncrl.endpoint.OpenAIEndpoint`, or None) is what agent code runs through,
    and is offered to a user's workflow factory too. ``tools`` (the ``agent`` workflow's,
    MCP tools included) default to :func:`build_agent_tools`."""
    from asyncrl.endpoint import OpenAIAgentWorkflow
    from asyncrl.workflows import make_workflow
    from asyncrl.workflows.loader import load_callable

    r = recipe.rollout
    options: dict[str, Any] = {
        "tokenizer": engine.tokenizer,
        "sampling": sampling_params(recipe),
        "group_size": r.group_size,
        "max_turns": r.max_turns,
        "turn_discount": r.turn_discount,
    }
    if endpoint is not None:
        options["endpoint"] = endpoint
    if r.workflow.startswith("verifiers:"):
        options["env_args"] = dict(r.agent.env_args)
    if r.workflow != "rlvr" and reward is not None:
        options["reward"] = reward
    if r.workflow == "agent":
        agent = r.agent
        options.update(
            max_total_tokens=agent.max_total_tokens,
            tool_parser=agent.parser,
            system_prompt=agent.system_prompt or None,
        )
        if agent.env:
            options["env_factory"] = load_callable(agent.env)
        else:
            options["tools"] = list(tools) if tools is not None else build_agent_tools(recipe)
    workflow = make_workflow(r.workflow, **options)
    if isinstance(workflow, OpenAIAgentWorkflow) and r.endpoint_record:
        workflow.record_path = recipe.run.path / ENDPOINT_CALLS
    return workflow


ENDPOINT_CALLS = "endpoint_calls.jsonl"
"""Where ``rollout.endpoint_record`` appends the calls of agent code's episodes."""


def build_agent_tools(recipe: Recipe) -> list[Any]:
    """The tools ``rollout.agent.tools`` names (MCP servers' tools come apart, from
    :func:`mcp_server_specs`), each under ``rollout.agent.tool_timeout``. Raises
    ``ValueError`` naming the key for a name that is no built-in tool and a spec that does
    not load or cannot be a tool."""
    from asyncrl.tools.base import function_tool
    from asyncrl.tools.builtin import BUILTIN_TOOLS, calculator_tool, python_tool
    from asyncrl.tools.sandbox import Limits
    from asyncrl.workflows.loader import SpecError, load_callable

    cfg = recipe.rollout.agent
    tools = []
    for i, name in enumerate(cfg.tools):
        key = f"rollout.agent.tools[{i}] = {name!r}"
        if name == "calculator":
            tools.append(calculator_tool(timeout_s=cfg.tool_timeout))
        elif name == "python":
            tools.append(python_tool(Limits(wall_s=cfg.tool_timeout)))
        elif ":" in name:
            try:
                fn = load_callable(name)
                tools.append(function_tool(fn, timeout_s=cfg.tool_timeout))
            except (SpecError, TypeError, ValueError) as exc:
                raise ValueError(f"{key}: {exc}") from exc
        else:
            raise ValueError(
                f"{key} is no built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor a "
                "path/to/file.py:fn or module:fn"
            )
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise ValueError(f"rollout.agent.tools: two tools share a name: {names}")
    return tools


def mcp_server_specs(recipe: Recipe) -> list[Any]:
    """``rollout.agent.mcp`` as :class:`~asyncrl.tools.mcp.MCPServerSpec`, each call
    under ``rollout.agent.tool_timeout``."""
    from asyncrl.tools.mcp import MCPServerSpec

    cfg = recipe.rollout.agent
    return [
        MCPServerSpec(s.command, list(s.args), dict(s.env), timeout_s=cfg.tool_timeout)
        for s in cfg.mcp
    ]


def _agent_code(recipe: Recipe) -> bool:
    """Whether the workflow is agent code; a spec that does not load is not (building the
    workflow then says why)."""
    from asyncrl.workflows import is_agent_code

    try:
        return is_agent_code(recipe.rollout.workflow)
    except Exception:
        return False


def endpoint_wanted(recipe: Recipe) -> bool:
    """Whether each rollout actor serves the endpoint: ``rollout.endpoint``, or when it is
    unset, whether the workflow is agent code."""
    if recipe.rollout.endpoint is not None:
        return recipe.rollout.endpoint
    return _agent_code(recipe)


def workflow_scores_inline(recipe: Recipe) -> bool:
    """Whether the rollout actor needs its own reward pool for the workflow: not for
    ``rlvr`` (the reward actors score it), agent code (it returns its reward) or an
    ``agent`` workflow whose environment scores."""
    r = recipe.rollout
    if r.workflow == "rlvr" or (r.workflow == "agent" and r.agent.env):
        return False
    return not _agent_code(recipe)
