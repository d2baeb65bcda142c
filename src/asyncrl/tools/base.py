"""Tools: an OpenAI function schema plus an async callable, and the box that runs calls.

A :class:`Tool` is what a model may call. :func:`function_tool` builds one from a plain
Python function: the parameter schema comes from the signature (``int``, ``float``,
``str``, ``bool``, ``list[...]``, ``dict``, ``Literal``, ``X | None``; a default makes a
parameter optional) and the description from the docstring (its first paragraph; an
``Args:`` section describes the parameters). Arguments are validated against the same
pydantic model before the call.

A :class:`ToolBox` runs a :class:`~asyncrl.tools.calls.ToolCall` and always answers with
a :class:`ToolResult`, never an exception: a bad call is an observation the model reads
(a short message) plus a reason the workflow counts. The reasons:

- ``unknown_tool``: no tool has that name;
- ``bad_arguments``: the arguments do not fit the schema;
- ``malformed``: the parser could not read the call at all;
- ``raised``: the tool raised;
- ``timeout``: the tool ran past its ``timeout_s``;
- any reason a tool gives itself by raising :class:`ToolError` (the ``python`` tool says
  ``exit_status``, ``killed`` or ``timeout``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from asyncrl.tools.calls import ParsedReply, ToolCall

DEFAULT_TIMEOUT_S = 30.0
MAX_OUTPUT_CHARS = 4000
"""The longest tool output a model is shown: more fills the context without helping."""


class ToolError(Exception):
    """Raised by a tool to report a failure with its own ``reason`` and a message for the
    model (``str(exc)``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BadArguments(ToolError):
    """The arguments of a call do not fit the tool's schema."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_arguments", message)


@dataclass(frozen=True)
class Tool:
    """A callable tool. ``call(arguments)`` receives the call's JSON arguments, validates
    them (raising :class:`BadArguments`), and returns the output text the model reads."""

    name: str
    description: str
    parameters: dict[str, Any]
    call: Callable[[dict[str, Any]], Awaitable[str]]
    timeout_s: float = DEFAULT_TIMEOUT_S

    def schema(self) -> dict[str, Any]:
        """The tool in OpenAI's ``tools`` shape."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolResult:
    """The answer to one call. ``content`` is what the model reads; ``reason`` is empty
    when ``ok``."""

    call_id: str
    name: str
    content: str
    ok: bool
    reason: str = ""
    latency_s: float = 0.0

    def message(self) -> dict[str, str]:
        """The result as a chat message in the ``tool`` role."""
        return {
            "role": "tool",
            "tool_call_id": self.call_id,
            "name": self.name,
            "content": self.content,
        }


# --- tools from Python functions --------------------------------------------------------


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` of a Google-style docstring: the first
    paragraph, and the ``name: text`` (or ``name (type): text``) lines of ``Args:``."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    description = " ".join(doc.split("\n\n", 1)[0].split())
    params: dict[str, str] = {}
    section = re.search(
        r"^(?:Args|Arguments|Parameters):[ \t]*\n((?:[ \t]+\S.*\n?|[ \t]*\n)*)", doc, re.M
    )
    if section is None:
        return description, params
    lines = [line for line in section.group(1).splitlines() if line.strip()]
    if not lines:
        return description, params
    entry_indent = _indent(lines[0])
    current = None
    for line in lines:
        entry = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if entry and _indent(line) == entry_indent:
            current = entry.group(1)
            params[current] = entry.group(2).strip()
        elif current is not None:  # a continuation line of the current parameter
            params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _arguments_model(fn: Callable[..., Any], name: str, docs: dict[str, str]) -> type[BaseModel]:
    hints = get_type_hints(fn)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name!r}: *args and **kwargs have no schema")
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, Field(default, description=docs.get(param.name)))
    return create_model(  # type: ignore[call-overload, no-any-return]
        f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
    )


def _strip_titles(schema: Any) -> Any:
    """The JSON schema without pydantic's ``title`` keys (noise in a model's prompt)."""
    if isinstance(schema, dict):
        return {
            k: _strip_titles(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))
        }
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def function_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Tool:
    """A :class:`Tool` calling ``fn`` (sync or async); see the module docstring.

    A sync ``fn`` runs in a worker thread; a timeout abandons the thread (Python cannot
    stop it), so a sync tool that may hang should bound itself. A non-string return value
    is shown to the model as JSON."""
    tool_name = name or fn.__name__
    doc_description, docs = parse_docstring(fn.__doc__)
    model = _arguments_model(fn, tool_name, docs)
    parameters = _strip_titles(model.model_json_schema())
    parameters.setdefault("properties", {})

    async def call(arguments: dict[str, Any]) -> str:
        try:
            parsed = model.model_validate(arguments)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
                for e in exc.errors()
            )
            raise BadArguments(f"bad arguments for {tool_name}: {problems}") from None
        kwargs = {field: getattr(parsed, field) for field in type(parsed).model_fields}
        if inspect.iscoroutinefunction(fn):
            result = await fn(**kwargs)
        else:
            result = await asyncio.to_thread(fn, **kwargs)
        return _as_text(result)

    return Tool(tool_name, description or doc_description, parameters, call, timeout_s)


# --- running calls ------------------------------------------------------------------------


def truncate(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """``text`` cut to its first ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[output truncated: {len(text) - limit} more characters]"


class ToolBox:
    """The tools of an episode by name; runs calls and never raises for a bad one."""

    def __init__(self, tools: Sequence[Tool] = (), max_output_chars: int = MAX_OUTPUT_CHARS):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.max_output_chars = max_output_chars

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def run(self, call: ToolCall) -> ToolResult:
        """Runs one call under its tool's timeout."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                call.id,
                call.name,
                f"Error: there is no tool named {call.name!r} (tools: {known}).",
                ok=False,
                reason="unknown_tool",
            )
        start = time.perf_counter()
        try:
            async with asyncio.timeout(tool.timeout_s):
                output = await tool.call(dict(call.arguments))
        except ToolError as exc:
            content, ok, reason = f"Error: {exc}", False, exc.reason
        except TimeoutError:
            content = f"Error: {tool.name} did not finish within {tool.timeout_s:g} s."
            ok, reason = False, "timeout"
        except Exception as exc:  # a tool's bug is an observation, never the actor's death
            content = f"Error: {tool.name} raised {type(exc).__name__}: {exc}"
            ok, reason = False, "raised"
        else:
            content, ok, reason = output, True, ""
        return ToolResult(
            call.id,
            call.name,
            truncate(content, self.max_output_chars),
            ok,
            reason,
            time.perf_counter() - start,
        )

    async def run_reply(self, reply: ParsedReply) -> list[ToolResult]:
        """Results for every call of ``reply``, run concurrently, in the reply's order,
        followed by one ``malformed`` result per call the parser could not read."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self.run(call)) for call in reply.tool_calls]
        results = [t.result() for t in tasks]
        for i, error in enumerate(reply.errors):
            results.append(
                ToolResult(
                    f"call_malformed_{i}",
                    "",
                    f"Error: a tool call could not be read ({error}). Write "
                    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
                    ok=False,
                    reason="malformed",
                )
            )
        return results
