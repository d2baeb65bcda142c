"""Tool calls as a model writes them, and the parsers that read them from generated text.

A parser takes the decoded text of one assistant turn and returns a :class:`ParsedReply`:
the text outside the calls, the calls, and one error string per call it could not read.
A malformed call is never dropped silently: the agent workflow shows the model an error
observation for it and counts the reason.

Parsers are looked up by name in :data:`PARSERS` (a recipe names one); ``hermes`` is the
default, the format of Hermes/Qwen-style templates::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Calls get ids ``call_<turn-local index>`` unless the text carries its own ``id``; the
OpenAI-compatible endpoint and the environments use the same :class:`ToolCall`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
"""One Hermes call: from its opening tag to its closing tag, or to the end of the text
(a generation cut by the token budget leaves the last call unclosed)."""


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool: its name and JSON arguments, as the model wrote them."""

    name: str
    arguments: dict[str, Any]
    id: str = ""

    def openai(self) -> dict[str, Any]:
        """The call in OpenAI's ``tool_calls`` shape (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass
class ParsedReply:
    """An assistant turn read by a parser: the text outside the calls, the calls that
    could be read, and one reason per call that could not (``malformed: ...``)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_hermes(text: str) -> ParsedReply:
    """Reads every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of ``text``.

    ``arguments`` may be an object or a JSON string holding one (some models write it
    that way). Anything else in a block is an error, named with what was wrong."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for block in TOOL_CALL_RE.findall(text):
        call, error = _read_call(block.strip(), f"call_{len(calls) + len(errors)}")
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    content = TOOL_CALL_RE.sub("", text).strip()
    return ParsedReply(content=content, tool_calls=calls, errors=errors)


def _read_call(raw: str, default_id: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return None, f"malformed: not JSON ({exc.msg} at {exc.pos})"
    if not isinstance(obj, dict):
        return None, "malformed: a call must be a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "malformed: no tool name"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"malformed: the arguments of {name!r} are not JSON"
    if not isinstance(args, dict):
        return None, f"malformed: the arguments of {name!r} must be an object"
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) and call_id else default_id), ""


Parser = Callable[[str], ParsedReply]

PARSERS: dict[str, Parser] = {"hermes": parse_hermes}
"""Tool-call parsers by the name a recipe gives them."""


def get_parser(name: str) -> Parser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}: known {sorted(PARSERS)}") from None


def compact_tools_text(schemas: Sequence[dict[str, Any]]) -> str:
    """The tools in a few tokens (``rollout.agent.tool_listing = "compact"``): a line a
    tool, ``- name(arg: type, ...): description`` (its arguments' own descriptions left
    out), then one call of the first tool in the Hermes format, its first argument as
    ``...``::

        Tools:
        - calculator(expression: string): Evaluates an arithmetic expression and returns its value.
        Call a tool like this: <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>
    """
    lines = ["Tools:"]
    for schema in schemas:
        fn = schema["function"]
        props = fn.get("parameters", {}).get("properties", {})
        args = ", ".join(f"{name}: {p.get('type', 'any')}" for name, p in props.items())
        about = f": {fn['description']}" if fn.get("description") else ""
        lines.append(f"- {fn['name']}({args}){about}")
    first = schemas[0]["function"]
    names = list(first.get("parameters", {}).get("properties", {}))
    example = {"name": first["name"], "arguments": {names[0]: "..."} if names else {}}
    lines.append(f"Call a tool like this: <tool_call>{json.dumps(example)}</tool_call>")
    return "\n".join(lines)


def tools_system_text(schemas: Sequence[dict[str, Any]]) -> str:
    """How to call the tools, for a chat template that does not render ``tools`` itself:
    the OpenAI function schemas inside ``<tools>`` and the Hermes call format."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You may call one or more functions to help with the task. The functions are:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, write a JSON object with its name and arguments between "
        "<tool_call> and </tool_call> tags, for example:\n"
        '<tool_call>\n{"name": "<function-name>", "arguments": {"<arg>": <value>}}\n</tool_call>'
    )
