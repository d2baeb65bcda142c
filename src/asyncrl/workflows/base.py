"""The pieces every workflow shares: the item's uid and record, the chat to generate
from, its tokens, and the growing token sequence of a sample. The contract itself is
:mod:`asyncrl.api.workflow`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api.inference import GenerateResponse
from asyncrl.wire.messages import Array, Prompt, SampledWith, Trajectory

ITEM_KEYS = ("uid", "attempt")
"""The keys of a workflow item that are not the prompt record's: the prompt's id, and the
how-many-th lease of it the episode runs under (1 when absent)."""


def split_item(item: dict[str, Any] | Prompt) -> tuple[str, dict[str, Any]]:
    """``(uid, record)`` of a workflow item; the record is the item without its uid and
    attempt."""
    if isinstance(item, Prompt):
        return item.uid, dict(item.data)
    if "uid" not in item:
        raise KeyError("a workflow item needs a 'uid' (the prompt's id)")
    return str(item["uid"]), {k: v for k, v in item.items() if k not in ITEM_KEYS}


def item_attempt(item: dict[str, Any] | Prompt) -> int:
    """The how-many-th lease of its prompt a workflow item runs under: 1, 2 … (a retry
    after a failed or lost episode); 1 for an item that does not say (an eval's)."""
    if isinstance(item, Prompt):
        return item.attempt
    return int(item.get("attempt", 1))


def chat_messages(
    record: Mapping[str, Any],
    system_prompt: str | None = None,
    few_shot: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The chat to generate from: ``messages`` if the record has them, else one user turn
    from ``prompt`` (or ``question``) after the ``few_shot`` turns; either way after
    ``system_prompt`` if given, unless the chat opens with a system message."""
    if "messages" in record:
        messages = [dict(m) for m in record["messages"]]
    else:
        text = record.get("prompt", record.get("question"))
        if text is None:
            raise KeyError(
                f"the prompt record has no messages, prompt or question: {sorted(record)}"
            )
        messages = [dict(m) for m in few_shot]
        messages.append({"role": "user", "content": str(text)})
    if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as it stands inside a chat (no special tokens added)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def rest_of_turn_end(tokenizer: Any, end_text: str, output_ids: Sequence[int]) -> str:
    """What of the chat template's end-of-assistant-turn text ``end_text`` still follows a
    reply that ended with ``output_ids``: all of it, less the part the model's last token
    already wrote (its stop token, or a newline). Appending those tokens, never a
    re-encoding of the reply, keeps the sequence the engine's own."""
    if output_ids:
        last = tokenizer.decode(list(output_ids[-1:]), skip_special_tokens=False)
        if last and end_text.startswith(last):
            return end_text[len(last) :]
    return end_text


@dataclass
class TokenTrace:
    """A growing token sequence: which tokens the policy generated, with what logprob and
    version, and which came from the prompt or the environment."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        self.input_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def add_generated(self, resp: GenerateResponse) -> None:
        self.input_ids.extend(resp.output_ids)
        self.loss_mask.extend([1] * len(resp.output_ids))
        self.logprobs.extend(resp.output_logprobs)
        self.versions.extend(resp.output_versions)

    def to_trajectory(
        self,
        prompt_uid: str,
        index: int,
        group_size: int,
        data: dict[str, Any],
        completion: str,
        finish_reason: str,
        reward: float | None = None,
        reward_info: dict[str, Any] | None = None,
        sampled_with: SampledWith | None = None,
        images: list[str] | None = None,
    ) -> Trajectory:
        return Trajectory(
            uid=f"{prompt_uid}/{index}",
            prompt_uid=prompt_uid,
            group_index=index,
            group_size=group_size,
            input_ids=Array.of(self.input_ids, "int32"),
            loss_mask=Array.of(self.loss_mask, "bool"),
            logprobs=Array.of(self.logprobs, "float32"),
            versions=Array.of(self.versions, "int32"),
            reward=reward,
            reward_info=reward_info or {},
            data=data,
            completion=completion,
            finish_reason=finish_reason,
            sampled_with=sampled_with,
            images=images or [],
        )
