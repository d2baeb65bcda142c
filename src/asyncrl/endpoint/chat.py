"""Chat requests to prompt token ids: the chat template, tools, and exact continuation.

Two ways to build a prompt:

- **Fresh**: render the request's messages with the chat template and encode the text.
- **Continued**: when the messages are an earlier call's messages, then the assistant
  message that call returned, then new messages (tool results, a user turn), the prompt is
  the earlier call's prompt ids + its completion ids + the end of the assistant turn + the
  new messages' tokens. The returned assistant text is never re-encoded: decoding and
  encoding again need not give the sampled ids back (merges differ, special tokens are
  skipped, tool-call text is reformatted), and a trainer that scores tokens other than the
  sampled ones learns from logprobs of a sequence the policy never produced.

The new messages' tokens come from a template diff: render the earlier messages + a probe
assistant turn, render them again with the new messages after it, and encode what the
second rendering adds. A template that rewrites earlier turns when more follow (one that
drops past reasoning, say) has no such diff; such a chat is rendered fresh.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.tools.calls import tools_system_text
from asyncrl.workflows.base import encode_text, rest_of_turn_end

PROBE_TEXT = "PROBE_ASSISTANT_TEXT"
PROBE_TOOL = "probe_tool_name"


class ChatError(ValueError):
    """A chat request whose messages cannot be rendered; the endpoint answers 400."""


def _text(content: Any) -> str:
    """An OpenAI message content (None, a string, or a list of text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatError("only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatError(f"message content must be a string or a list of parts, not {content!r}")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw


def normalize_message(message: Any) -> dict[str, Any]:
    """The parts of an OpenAI chat message that reach the template, in one canonical form,
    so that two spellings of the same message compare equal (content None or "", tool-call
    arguments as a JSON string or an object, extra client-side fields)."""
    if not isinstance(message, dict):
        raise ChatError(f"a message must be an object, not {message!r}")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ChatError(f"unknown message role {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _text(message.get("content"))
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ChatError("an assistant tool call needs function.name")
            calls.append(
                {
                    "id": str(call.get("id", "")),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))},
                }
            )
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id", ""))
    return out


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template renders on its own, found by rendering probes."""

    renders_tools: bool
    renders_tool_calls: bool
    has_tool_role: bool


def probe_template(tokenizer: Any) -> TemplateTraits:
    user = {"role": "user", "content": "PROBE_USER"}
    schema = {"type": "function", "function": {"name": PROBE_TOOL, "parameters": {}}}
    render = tokenizer.apply_chat_template
    try:
        renders_tools = render([user], tools=[schema], tokenize=False) != render(
            [user], tokenize=False
        )
    except Exception:
        renders_tools = False
    call = {"id": "c0", "type": "function", "function": {"name": PROBE_TOOL, "arguments": {}}}
    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
    try:
        renders_calls = PROBE_TOOL in render([user, reply], tokenize=False)
    except Exception:
        renders_calls = False
    tool = {"role": "tool", "content": "PROBE_RESULT", "tool_call_id": "c0"}
    try:
        has_tool_role = "PROBE_RESULT" in render([user, reply, tool], tokenize=False)
    except Exception:
        has_tool_role = False
    return TemplateTraits(renders_tools, renders_calls, has_tool_role)


def hermes_calls_text(tool_calls: Sequence[dict[str, Any]]) -> str:
    """Tool calls written the way the Hermes parser reads them."""
    return "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in tool_calls
    )


class ChatRenderer:
    """Renders normalized messages (see :func:`normalize_message`) with a tokenizer's chat
    template, showing the tools the way the template can: through its ``tools=`` argument
    when it renders them, else as :func:`~asyncrl.tools.calls.tools_system_text` at the
    head of the system message. Assistant tool calls and tool results that the template
    cannot render become Hermes text and user turns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.traits = probe_template(tokenizer)

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def _template_messages(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls") and not self.traits.renders_tool_calls:
                calls = hermes_calls_text(m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
            if m["role"] == "tool" and not self.traits.has_tool_role:
                m = {
                    "role": "user",
                    "content": f"<tool_response>\n{m['content']}\n</tool_response>",
                }
            out.append(m)
        if tools and not self.traits.renders_tools:
            text = tools_system_text([t.get("function", t) for t in tools])
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{text}\n\n{out[0]['content']}"}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        *,
        generation_prompt: bool,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if tools and self.traits.renders_tools:
            kwargs["tools"] = list(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                self._template_messages(messages, tools),
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # a template's own refusal (e.g. roles out of order)
            raise ChatError(f"the chat template cannot render these messages: {exc}") from exc
        return str(text)

    def fresh_ids(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> list[int]:
        """The prompt ids of ``messages`` rendered from scratch."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def continuation_ids(
        self,
        previous: Sequence[dict[str, Any]],
        new: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        completion_ids: Sequence[int],
        stopped: bool,
    ) -> list[int] | None:
        """The ids that follow ``completion_ids`` (an assistant reply to ``previous``) when
        ``new`` messages come after it: the rest of the template's end-of-turn text (minus
        the stop token the model already generated) and ``new`` up to the next reply.
        None when the template rewrites earlier turns (no continuation exists)."""
        probe = {"role": "assistant", "content": PROBE_TEXT}
        before = self.render(previous, tools, generation_prompt=True)
        closed = self.render([*previous, probe], tools, generation_prompt=False)
        after = self.render([*previous, probe, *new], tools, generation_prompt=True)
        if not (closed.startswith(before + PROBE_TEXT) and after.startswith(closed)):
            return None
        end = closed[len(before + PROBE_TEXT) :]
        if stopped:
            end = rest_of_turn_end(self.tokenizer, end, completion_ids)
        return self.encode(end + after[len(closed) :])
