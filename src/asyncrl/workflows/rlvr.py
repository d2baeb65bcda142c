"""RLVR: one prompt, ``group_size`` independent samples, a verifiable reward per sample.

The prompt goes through the tokenizer's chat template once; the samples are generated
concurrently (so the engine batches them). With a ``reward`` scorer each trajectory is
scored inline; without one, ``reward`` stays None for the reward actor to fill in.

A record that names images (under ``image_key``) is asked of a vision model: its
processor (``vision``) places the image tokens in the prompt ids, and the requests and
trajectories carry the images by reference (their paths); the engine and the trainer each
read the pixels themselves.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from asyncrl.api.inference import GenerateRequest, InferenceEngine, SamplingParams
from asyncrl.api.workflow import RolloutWorkflow, Scorer
from asyncrl.models.vision import VisionProcessor, open_image, record_images, with_images
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.wire.unchecked import updated
from asyncrl.workflows.base import (
    TokenTrace,
    chat_messages,
    encode_chat,
    item_attempt,
    split_item,
)


def sample_seed(seed: int | None, prompt_uid: str, index: int, attempt: int = 1) -> int | None:
    """A distinct, reproducible seed per sample of a group and attempt (the how-many-th
    lease of the prompt: a retry draws anew); None stays None."""
    if seed is None:
        return None
    retry = f"/{attempt}" if attempt > 1 else ""
    return zlib.crc32(f"{seed}/{prompt_uid}/{index}{retry}".encode())


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn generation of a group, optionally scored inline."""

    def __init__(
        self,
        tokenizer: Any,
        sampling: SamplingParams,
        group_size: int = 1,
        reward: Scorer | None = None,
        system_prompt: str | None = None,
        vision: VisionProcessor | None = None,
        image_key: str | None = None,
    ) -> None:
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.group_size = group_size
        self.reward = reward
        self.system_prompt = system_prompt
        self.vision = vision
        self.image_key = image_key

    def prompt(self, record: dict[str, Any]) -> tuple[list[int], list[str]]:
        """The prompt ids of ``record`` and the images they hold (paths, in order)."""
        messages = chat_messages(record, self.system_prompt)
        images = record_images(record, self.image_key)
        if not images:
            return encode_chat(self.tokenizer, messages), []
        if self.vision is None:
            raise ValueError(
                f"the prompt record names {len(images)} image(s) under {self.image_key!r}, "
                "but model.path is not a vision model"
            )
        inputs = self.vision(with_images(messages, len(images)), [open_image(p) for p in images])
        return [int(i) for i in inputs["input_ids"][0].tolist()], images

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        uid, record = split_item(item)
        attempt = item_attempt(item)
        if self.vision is not None:  # decoding and processing images: off the event loop
            prompt_ids, images = await asyncio.to_thread(self.prompt, record)
        else:
            prompt_ids, images = self.prompt(record)
        samplings = [
            self.sampling
            if self.sampling.seed is None
            else self.sampling.model_copy(
                update={"seed": sample_seed(self.sampling.seed, uid, i, attempt)}
            )
            for i in range(self.group_size)
        ]
        first = GenerateRequest(
            input_ids=prompt_ids, images=images, sampling=samplings[0], rid=f"{uid}/0"
        )
        # the others copy the first (a request is frozen): the prompt ids validated once
        requests = [first] + [
            updated(first, {"sampling": samplings[i], "rid": f"{uid}/{i}"})
            for i in range(1, self.group_size)
        ]
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(engine.agenerate(r)) for r in requests]
        responses = [t.result() for t in tasks]
        if any(r.finish_reason == "abort" for r in responses):
            return None  # the engine stopped: a partial group is no group
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in responses]

        outcomes: list[Any] = [None] * len(responses)
        if self.reward is not None:
            scorer = self.reward
            async with asyncio.TaskGroup() as tg:
                scored = [tg.create_task(scorer.score(text, record)) for text in texts]
            outcomes = [t.result() for t in scored]

        trajectories = []
        for i, (resp, text, outcome) in enumerate(zip(responses, texts, outcomes, strict=True)):
            trace = TokenTrace()
            trace.add_context(prompt_ids)
            trace.add_generated(resp)
            trajectories.append(
                trace.to_trajectory(
                    uid,
                    i,
                    self.group_size,
                    record,
                    text,
                    resp.finish_reason,
                    reward=None if outcome is None else float(outcome.reward),
                    reward_info=None
                    if outcome is None
                    else {"ok": outcome.ok, "reason": outcome.reason},
                    images=images,
                )
            )
        return trajectories
