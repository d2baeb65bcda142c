"""Tools from an MCP server started over stdio (the ``mcp`` package).

    async with MCPTools(MCPServerSpec("python", ["server.py"])) as server:
        box = ToolBox(server.tools)

starts the server command, lists its tools and exposes each as a
:class:`~asyncrl.tools.base.Tool` whose call goes through the session under the tool's
timeout. The server process is ended on exit. Enter and exit in the same task (the
transport's task group requires it); calls may come from any task while it is open.

The server gets the ``mcp`` package's default environment (``HOME``, ``PATH``, ``USER``
and a few more, never the actor's NATS credentials or run token) plus ``env``. An error
the server reports (``isError``) is a tool error with reason ``raised``; no answer in time
is ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from asyncrl.tools.base import DEFAULT_TIMEOUT_S, Tool, ToolError


@dataclass(frozen=True)
class MCPServerSpec:
    """How to start one MCP server: ``command args...`` with ``env`` added to the default
    environment. ``timeout_s`` applies to each of its tools' calls."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 30.0


class MCPTools:
    """An open MCP server and its tools (``.tools``); see the module docstring."""

    def __init__(self, spec: MCPServerSpec, errlog: TextIO = sys.stderr) -> None:
        self.spec = spec
        self.errlog = errlog
        self.tools: list[Tool] = []
        self._stack = contextlib.AsyncExitStack()
        self._session: Any = None

    async def __aenter__(self) -> MCPTools:
        from mcp import ClientSession, StdioServerParameters  # noqa: PLC0415 - optional: mcp
        from mcp.client.stdio import stdio_client  # noqa: PLC0415 - optional: mcp

        params = StdioServerParameters(
            command=self.spec.command,
            args=list(self.spec.args),
            env=dict(self.spec.env),
            cwd=self.spec.cwd,
        )
        command = " ".join([self.spec.command, *self.spec.args])
        try:
            read, write = await self._stack.enter_async_context(
                stdio_client(params, errlog=self.errlog)
            )
            self._session = await self._stack.enter_async_context(ClientSession(read, write))
            # A server that dies or hangs before answering would leave this waiting forever.
            async with asyncio.timeout(self.spec.start_timeout_s):
                await self._session.initialize()
                listed = await self._session.list_tools()
        except (Exception, TimeoutError) as exc:
            await self._stack.aclose()
            raise RuntimeError(
                f"MCP server {command!r} did not start: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            await self._stack.aclose()
            raise
        self.tools = [self._tool(t) for t in listed.tools]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.tools = []
        await self._stack.aclose()

    def _tool(self, listed: Any) -> Tool:
        name: str = listed.name
        timeout_s = self.spec.timeout_s

        async def call(arguments: dict[str, Any]) -> str:
            from mcp.shared.exceptions import MCPError  # noqa: PLC0415 - optional: mcp

            try:
                result = await self._session.call_tool(
                    name, arguments, read_timeout_seconds=timeout_s
                )
            except MCPError as exc:
                reason = "timeout" if "timed out" in str(exc) else "raised"
                raise ToolError(reason, f"{name}: {exc}") from None
            text = _text_of(result)
            if result.is_error:
                raise ToolError("raised", text or f"{name} failed")
            return text

        schema = dict(listed.input_schema or {"type": "object", "properties": {}})
        schema.pop("title", None)
        return Tool(name, listed.description or "", schema, call, timeout_s)


def _text_of(result: Any) -> str:
    """The text parts of a call's result; other parts are named, structured content is
    the fallback."""
    parts = []
    for item in result.content:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{item.type} content]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)
