"""Multi-turn RLVR: answer, get told it is wrong, try again, up to ``max_turns`` turns.

Each sample is one growing token sequence, token-in/token-out: the engine's output tokens
are appended as they are and never re-tokenized; only the new text between turns (the end
of the assistant turn and the user's feedback, in the chat template's format) is
tokenized. The episode stops at the first turn whose reward is > 0, or after the last turn;
its reward is

    reward = r_t · γ^t        (t = index of the final turn, γ = ``turn_discount``)

so an answer that needed feedback is worth less than one right away. That is the
reward's definition (the one sample holds every turn of its episode), not a discount of
credit across samples: those discount the advantage instead (``reward_info['turns_to_go']``,
:func:`~asyncrl.algo.advantages.episode_advantages`), and this sample's is 0.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.api.inference import GenerateRequest, InferenceEngine, SamplingParams
from asyncrl.api.workflow import RolloutWorkflow, Scorer
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.workflows.base import (
    TokenTrace,
    chat_messages,
    encode_chat,
    encode_text,
    item_attempt,
    rest_of_turn_end,
    split_item,
)
from asyncrl.workflows.rlvr import sample_seed

DEFAULT_FEEDBACK = "Your answer is incorrect. Please think again and give a corrected answer."


def turn_texts(tokenizer: Any, feedback: str) -> tuple[str, str]:
    """What the chat template puts after an assistant reply (``end``), and the text of a
    user feedback turn up to the next reply (``turn``), found by rendering a probe chat.

    Raises ``ValueError`` for a template that rewrites earlier turns when more follow (then
    no token-level continuation exists)."""
    user = {"role": "user", "content": "PROBE_Q"}
    reply = {"role": "assistant", "content": "PROBE_A"}
    render = tokenizer.apply_chat_template
    before = render([user], tokenize=False, add_generation_prompt=True)
    closed = render([user, reply], tokenize=False)
    after = render(
        [user, reply, {"role": "user", "content": feedback}],
        tokenize=False,
        add_generation_prompt=True,
    )
    if not (closed.startswith(before + "PROBE_A") and after.startswith(closed)):
        raise ValueError(
            "this chat template rewrites earlier turns; multi-turn needs one that appends"
        )
    return closed[len(before + "PROBE_A") :], after[len(closed) :]


class MultiTurnWorkflow(RolloutWorkflow):
    """Feedback turns until the reward is positive or ``max_turns`` is reached."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: SamplingParams,
        reward: Scorer,
        group_size: int = 1,
        max_turns: int = 2,
        turn_discount: float = 0.9,
        feedback: str = DEFAULT_FEEDBACK,
        system_prompt: str | None = None,
    ) -> None:
        if max_turns < 1 or group_size < 1:
            raise ValueError("max_turns and group_size must be >= 1")
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.reward = reward
        self.group_size = group_size
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.system_prompt = system_prompt
        self._end_text, turn = turn_texts(tokenizer, feedback)
        self._feedback_ids = self._encode(turn)

    def _encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def _close_turn_ids(self, output_ids: list[int]) -> list[int]:
        """Tokens that end the assistant turn after ``output_ids``."""
        return self._encode(rest_of_turn_end(self.tokenizer, self._end_text, output_ids))

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        uid, record = split_item(item)
        attempt = item_attempt(item)
        prompt_ids = encode_chat(self.tokenizer, chat_messages(record, self.system_prompt))
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(self._sample(engine, uid, record, prompt_ids, i, attempt))
                for i in range(self.group_size)
            ]
        results = [t.result() for t in tasks]
        if any(r is None for r in results):
            return None
        return [r for r in results if r is not None]

    async def _sample(
        self,
        engine: InferenceEngine,
        uid: str,
        record: dict[str, Any],
        prompt_ids: list[int],
        index: int,
        attempt: int = 1,
    ) -> Trajectory | None:
        trace = TokenTrace()
        trace.add_context(prompt_ids)
        seed = sample_seed(self.sampling.seed, uid, index, attempt)
        texts: list[str] = []
        rewards: list[float] = []
        reasons: list[str] = []
        finish = "length"
        for turn in range(self.max_turns):
            if turn:
                trace.add_context(self._feedback_ids)
            sampling = self.sampling.model_copy(
                update={"seed": None if seed is None else seed + turn}
            )
            resp = await engine.agenerate(
                GenerateRequest(
                    input_ids=list(trace.input_ids), sampling=sampling, rid=f"{uid}/{index}/{turn}"
                )
            )
            if resp.finish_reason == "abort":
                return None
            trace.add_generated(resp)
            finish = resp.finish_reason
            text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
            texts.append(text)
            outcome = await self.reward.score(text, record)
            rewards.append(float(outcome.reward))
            reasons.append(outcome.reason)
            if outcome.reward > 0 or turn == self.max_turns - 1:
                break
            trace.add_context(self._close_turn_ids(resp.output_ids))
        final_turn = len(rewards) - 1
        return trace.to_trajectory(
            uid,
            index,
            self.group_size,
            record,
            texts[-1],
            finish,
            reward=rewards[-1] * self.turn_discount**final_turn,
            reward_info={
                "turns": len(rewards),
                "turn_rewards": rewards,
                "ok": all(not r for r in reasons),
                "reason": "; ".join(r for r in reasons if r),
            },
        )
