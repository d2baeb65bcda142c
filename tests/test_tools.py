"""Tools from Python functions (schema, validation), the box that runs calls and turns every
failure into a reasoned observation, and the calculator."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import pytest

from asyncrl.tools.base import Tool, ToolBox, ToolError, function_tool, parse_docstring, truncate
from asyncrl.tools.builtin import MAX_INT_BITS, calculator_tool, evaluate
from asyncrl.tools.calls import ParsedReply, ToolCall


def search(
    query: str,
    limit: int = 5,
    tags: list[str] | None = None,
    mode: Literal["fast", "exact"] = "fast",
    weights: dict[str, float] | None = None,
    strict: bool = False,
    scale: float = 1.0,
) -> str:
    """Searches the notes.

    Longer text that is not part of the description.

    Args:
        query: what to look for,
            over two lines.
        limit (int): how many hits.
        mode: how to match.
    """
    return f"{query}|{limit}|{tags}|{mode}|{weights}|{strict}|{scale}"


def test_schema_from_signature_and_docstring() -> None:
    tool = function_tool(search, timeout_s=3.0)
    assert tool.timeout_s == 3.0
    fn = tool.schema()
    assert fn["type"] == "function"
    assert fn["function"]["name"] == "search"
    assert fn["function"]["description"] == "Searches the notes."
    params = fn["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["query"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for, over two lines."}
    assert props["limit"] == {"type": "integer", "default": 5, "description": "how many hits."}
    assert props["tags"]["anyOf"] == [
        {"type": "array", "items": {"type": "string"}},
        {"type": "null"},
    ]
    assert (
        props["mode"]["enum"] == ["fast", "exact"]
        and props["mode"]["description"] == "how to match."
    )
    assert props["weights"]["anyOf"][0] == {
        "type": "object",
        "additionalProperties": {"type": "number"},
    }
    assert props["strict"]["type"] == "boolean" and props["scale"]["type"] == "number"
    assert "title" not in str(params)


def test_docstring_without_args_and_without_doc() -> None:
    assert parse_docstring(None) == ("", {})
    assert parse_docstring("One line.\n\nMore.") == ("One line.", {})


async def test_arguments_are_validated_before_the_call() -> None:
    box = ToolBox([function_tool(search, name="find")])
    ok = await box.run(ToolCall("find", {"query": "x", "limit": "3", "mode": "exact"}, "c1"))
    assert ok.ok and ok.content == "x|3|None|exact|None|False|1.0" and ok.call_id == "c1"
    for bad in (
        {},
        {"query": "x", "mode": "slow"},
        {"query": "x", "limit": "many"},
        {"query": "x", "other": 1},
    ):
        result = await box.run(ToolCall("find", bad, "c2"))
        assert (result.ok, result.reason) == (False, "bad_arguments")
        assert result.content.startswith("Error: bad arguments for find:")


async def test_every_failure_is_a_result_with_a_reason() -> None:
    def broken(x: int) -> int:
        """Raises."""
        raise RuntimeError("kaput")

    async def hangs() -> str:
        """Never answers."""
        await asyncio.Event().wait()
        return ""

    async def refuses() -> str:
        """Reports its own failure."""
        raise ToolError("quota", "no more calls today")

    box = ToolBox(
        [function_tool(broken), function_tool(hangs, timeout_s=0.05), function_tool(refuses)]
    )
    reply = ParsedReply(
        "",
        [
            ToolCall("broken", {"x": 1}, "a"),
            ToolCall("hangs", {}, "b"),
            ToolCall("missing", {}, "c"),
            ToolCall("refuses", {}, "d"),
        ],
        errors=["malformed: not JSON (Expecting value at 0)"],
    )
    results = await box.run_reply(reply)
    assert [(r.call_id, r.ok, r.reason) for r in results] == [
        ("a", False, "raised"),
        ("b", False, "timeout"),
        ("c", False, "unknown_tool"),
        ("d", False, "quota"),
        ("call_malformed_0", False, "malformed"),
    ]
    assert results[0].content == "Error: broken raised RuntimeError: kaput"
    assert results[1].content == "Error: hangs did not finish within 0.05 s."
    assert "tools: broken, hangs, refuses" in results[2].content
    assert results[3].content == "Error: no more calls today"
    assert "not JSON" in results[4].content and "<tool_call>" in results[4].content
    assert results[1].latency_s >= 0.05
    assert results[0].message() == {
        "role": "tool",
        "tool_call_id": "a",
        "name": "broken",
        "content": results[0].content,
    }


async def test_sync_tools_run_off_the_event_loop_and_outputs_are_bounded() -> None:
    loop_thread = threading.get_ident()

    def where() -> list[int]:
        """Says which thread it ran in."""
        return [threading.get_ident() != loop_thread, 7]

    def chatty() -> str:
        """Talks a lot."""
        return "x" * 50

    box = ToolBox([function_tool(where), function_tool(chatty)], max_output_chars=20)
    assert (await box.run(ToolCall("where", {}, "w"))).content == "[true, 7]"
    long = await box.run(ToolCall("chatty", {}, "c"))
    assert long.ok and long.content == "x" * 20 + "\n[output truncated: 30 more characters]"
    assert truncate("short", 20) == "short"


def test_duplicate_tool_names_are_refused() -> None:
    tool = function_tool(search)
    with pytest.raises(ValueError, match="two tools are named 'search'"):
        ToolBox([tool, tool])
    assert isinstance(tool, Tool)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("10 / 4", 2.5),
        ("-(3 - 5)", 2),
        ("1234 * 5678", 7006652),
        ("+1.5e3", 1500.0),
    ],
)
def test_calculator_values(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("2 ** 100000", "exponent is larger"),
        ("99 ** 4000", "too large"),
        ("2 ** 4000 * 2 ** 4000", "too large"),
        ("1 +", "not an arithmetic expression"),
        ("'a' * 3", "Constant is not allowed"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" * 1001, "longer than"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


async def test_calculator_tool_answers_and_errors() -> None:
    box = ToolBox([calculator_tool()])
    run = box.run
    assert (await run(ToolCall("calculator", {"expression": "12*7"}, "a"))).content == "84"
    assert (
        await run(ToolCall("calculator", {"expression": "1/3"}, "a"))
    ).content == "0.333333333333"
    zero = await run(ToolCall("calculator", {"expression": "1/0"}, "a"))
    assert (zero.ok, zero.reason, zero.content) == (
        False,
        "raised",
        "Error: ZeroDivisionError: division by zero",
    )
    names = await run(ToolCall("calculator", {"expression": "open('x')"}, "a"))
    assert (names.ok, names.reason) == (False, "bad_arguments")
    assert MAX_INT_BITS >= 64
