"""The recipe's ``rollout.agent`` section: the tools, MCP servers, limits and prompt of an
``agent`` workflow (and a ``verifiers`` environment's arguments). Its tools are built
here once, for the workflow's check and for its build alike."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from asyncrl.config.schema import Section
from asyncrl.tools.base import Tool, function_tool
from asyncrl.tools.builtin import BUILTIN_TOOLS, calculator_tool, python_tool
from asyncrl.tools.mcp import MCPServerSpec
from asyncrl.tools.sandbox import Limits
from asyncrl.workflows.loader import load_callable


class McpServer(Section):
    """An MCP server started over stdio by each rollout actor of an agent workflow."""

    command: str
    """The program, e.g. ``python`` or ``npx``."""
    args: list[str] = Field(default_factory=list)
    """Its arguments, e.g. ``["my_server.py"]``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables added to the small default environment the server gets (never the
    actor's NATS credentials or the run's token)."""


class AgentConfig(Section):
    """The tools, limits and prompt of ``rollout.workflow = "agent"``."""

    tools: list[str] = Field(default_factory=lambda: ["calculator", "python"])
    """Tools the model may call: built-in names (``calculator``, ``python``) or Python
    functions, ``path/to/file.py:fn`` / ``module:fn`` (schema from the signature and the
    docstring)."""
    mcp: list[McpServer] = Field(default_factory=list)
    """MCP servers over stdio whose tools join ``tools``: each ``{command = "...", args =
    [...], env = {...}}``, started once per rollout actor and closed when it ends."""
    parser: str = "hermes"
    """How tool calls are read from the generated text (``hermes``:
    ``<tool_call>{json}</tool_call>``)."""
    max_total_tokens: int = Field(2048, ge=1)
    """Most tokens of one sample, prompt, replies and tool results together; the episode
    ends when the next reply would not fit."""
    tool_timeout: float = Field(10.0, gt=0)
    """Seconds one tool call may take; past it the model reads a ``timeout`` error (the
    ``python`` tool's wall clock, and each MCP call's read timeout)."""
    system_prompt: str = ""
    """A system message before each record's chat (the tools are listed after it); a
    worked example of a tool call here helps a small model find the format. Empty: none."""
    tool_listing: Literal["template", "compact"] = "template"
    """How the tools are shown to the model. ``template``: as the chat template renders
    ``tools=`` (the schemas in full, in the template's own words; SmolLM2's listing of the
    calculator is 175 tokens), or in the system message where the template renders
    none. ``compact``: a line a tool in the system message, ``name(arg: type): what it
    does``, and one example call (37 tokens for the calculator). Every prompt token is
    computed in every sample; but on the tools recipe the base model called the calculator
    in 25% of episodes with ``compact`` against 44% with ``template`` (bench/README.md),
    so the template's listing is the default."""
    env: str = ""
    """``path/to/file.py:factory`` / ``module:factory``: a function of no arguments that
    returns a fresh :class:`asyncrl.workflows.tool_env.Environment` per sample. It replaces
    ``tools``, ``mcp`` and ``reward.fn``: the environment gives the tools and the reward."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a ``verifiers`` environment's ``load_environment`` (with
    ``rollout.workflow = "verifiers:<env>"``), e.g. ``{num_train_examples = 500}``."""

    def function_tools(self) -> tuple[list[Tool], list[str]]:
        """The tools ``tools`` names (MCP servers' tools come apart, from
        :meth:`mcp_specs`), each under ``tool_timeout``, and one line per entry that is no
        built-in tool, or a spec that does not load or cannot become a tool (an argument
        type without a JSON schema), or a name two tools share. The check reports the
        lines; building refuses them."""
        tools: list[Tool] = []
        problems: list[str] = []
        for i, name in enumerate(self.tools):
            key = f"rollout.agent.tools[{i}] = {name!r}"
            if name == "calculator":
                tools.append(calculator_tool(timeout_s=self.tool_timeout))
            elif name == "python":
                tools.append(python_tool(Limits(wall_s=self.tool_timeout)))
            elif ":" in name:
                try:
                    tools.append(function_tool(load_callable(name), timeout_s=self.tool_timeout))
                except Exception as exc:  # user code: whatever its import raises
                    problems.append(f"{key}: {type(exc).__name__}: {exc}")
            else:
                problems.append(
                    f"{key} is no built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor a "
                    "path/to/file.py:fn or module:fn"
                )
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            problems.append(f"rollout.agent.tools: two tools share a name: {names}")
        return tools, problems

    def mcp_specs(self) -> list[MCPServerSpec]:
        """``mcp`` as :class:`~asyncrl.tools.mcp.MCPServerSpec`, each call under
        ``tool_timeout``."""
        return [
            MCPServerSpec(s.command, list(s.args), dict(s.env), timeout_s=self.tool_timeout)
            for s in self.mcp
        ]
