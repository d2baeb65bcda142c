"""The image inputs of the hf engine's requests: decoded, processed and checked off the
event loop and off the model thread.

A request's ``images`` (file paths) become the pixel inputs of its prefill
(:meth:`asyncrl.models.vision.VisionProcessor.pixel_inputs`), which also checks that the
processor expands those images into the runs of image tokens the request's ``input_ids``
hold. Requests with the same prompt and images that arrive while one of them is being
processed (the n requests of a GRPO group, sent together) wait for that one's result
instead of processing their own: all of them are then queued in the same turn of the
event loop, join the decode batch together and share one prefill.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.api.inference import GenerateRequest
from asyncrl.models.vision import VisionProcessor, open_image

_LEADER_GONE = object()
"""Handed to the requests waiting for another's processing when that one was cancelled:
one of them processes the images itself."""

Pixels = dict[str, torch.Tensor]


class RequestPixels:
    """The pixel inputs of requests to the model named ``model`` (for messages), whose
    processor is ``processor`` (None: a text model, which takes no image)."""

    def __init__(self, processor: VisionProcessor | None, model: str) -> None:
        self.processor = processor
        self.model = model
        # one entry per prompt and images being processed: the futures of the requests
        # that wait for it; bounded by the engine's callers, each waiting on one request
        self._processing: dict[tuple[tuple[int, ...], tuple[str, ...]], list[asyncio.Future[Any]]]
        self._processing = {}

    def needed(self, request: GenerateRequest) -> bool:
        """Whether ``request`` goes through :meth:`get`: it has images, or the model is a
        vision model, whose text-only prompts must hold no image tokens."""
        return bool(request.images) or self.processor is not None

    async def get(self, request: GenerateRequest) -> Pixels | None:
        """The pixel inputs of ``request`` (None without images); ``ValueError`` naming the
        request when its images cannot be read or do not match its image tokens."""
        try:
            return await self._shared(request)
        except ValueError as exc:
            raise ValueError(f"request {request.rid!r}: {exc}") from exc

    async def _shared(self, request: GenerateRequest) -> Pixels | None:
        key = (tuple(request.input_ids), tuple(request.images))
        while (followers := self._processing.get(key)) is not None:
            mine: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            followers.append(mine)
            result = await mine
            if result is not _LEADER_GONE:
                return result  # type: ignore[no-any-return]
        followers = self._processing[key] = []
        try:
            pixels = await asyncio.to_thread(self._process, request)
        except Exception as exc:
            for f in followers:
                if not f.done():
                    f.set_exception(exc)
            raise
        except BaseException:  # cancelled: a follower takes over
            for f in followers:
                if not f.done():
                    f.set_result(_LEADER_GONE)
            raise
        finally:
            del self._processing[key]
        for f in followers:
            if not f.done():
                f.set_result(pixels)
        if followers:
            # the followers resume on the loop's next pass and join the engine's queue
            # there; the leader joins it on that pass too, after them, so that the engine's
            # scheduler (which may wake in between) takes the group together or not at all,
            # and prefills its shared prompt once
            await asyncio.sleep(0)
        return pixels

    def _process(self, request: GenerateRequest) -> Pixels | None:
        if self.processor is None:
            if request.images:
                raise ValueError(
                    f"{len(request.images)} images given, but {self.model!r} is not a vision model"
                )
            return None
        try:
            images = [open_image(path) for path in request.images]
        except OSError as exc:
            raise ValueError(f"an image cannot be read: {exc}") from exc
        return self.processor.pixel_inputs(request.input_ids, images) or None
