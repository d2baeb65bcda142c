"""The Hermes tool-call parser: well-formed calls, several per turn, and every kind of
malformed call named, never dropped."""

from __future__ import annotations

import json

import pytest

from asyncrl.tools.calls import ToolCall, get_parser, parse_hermes, tools_system_text


def test_one_call_and_the_text_around_it() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    reply = parse_hermes(text)
    assert reply.content == "Let me compute."
    assert reply.tool_calls == [ToolCall("calculator", {"expression": "2*3"}, "call_0")]
    assert reply.errors == []
    assert reply.tool_calls[0].openai() == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "2*3"})},
    }


def test_several_calls_string_arguments_and_an_unclosed_last_call() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {}, "id": "mine"}</tool_call>'
        '<tool_call>{"name": "c", "arguments": {"y": 2}}'
    )
    reply = parse_hermes(text)
    assert [(c.name, c.arguments, c.id) for c in reply.tool_calls] == [
        ("a", {"x": 1}, "call_0"),
        ("b", {}, "mine"),
        ("c", {"y": 2}, "call_2"),
    ]
    assert reply.content == "and"


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', "no tool name"),
        ('{"name": "f", "arguments": "{oops"}', "are not JSON"),
        ('{"name": "f", "arguments": [1]}', "must be an object"),
    ],
)
def test_a_malformed_call_is_an_error_not_a_silence(block: str, reason: str) -> None:
    reply = parse_hermes(f"x <tool_call>{block}</tool_call>")
    assert reply.tool_calls == []
    assert len(reply.errors) == 1 and reason in reply.errors[0]
    assert reply.errors[0].startswith("malformed")


def test_no_call_is_plain_text_and_parsers_are_named() -> None:
    assert parse_hermes("The answer is \\boxed{4}.").tool_calls == []
    assert get_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        get_parser("xml")


def test_the_system_text_lists_every_schema() -> None:
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {}}}
    text = tools_system_text([schema])
    assert json.dumps(schema) in text and "<tool_call>" in text
