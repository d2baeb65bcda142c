"""The inference-engine contract every backend (:mod:`asyncrl.engines`) implements, and its
request/response types.

A backend provides one primitive, :meth:`InferenceEngine._generate_segment`: generate for
one request until it finishes *or until the engine is paused*, in which case the segment
ends with ``finish_reason="abort"`` and carries the tokens made so far. Everything above
that is shared here:

- :meth:`InferenceEngine.agenerate` waits while the engine is paused, runs segments, and
  after a pause resubmits ``prompt + partial tokens`` with the remaining token budget, so
  the continuation is conditioned on the partial tokens (recomputed under the new
  weights: no KV cache survives a weight update). Each token keeps the policy version
  that produced it. The caller sees one response; ``"abort"`` reaches it only when the
  engine stops.
- :meth:`InferenceEngine.update_weights` loads new weights while paused (pausing and
  resuming around the load if the caller did not) and then takes the new version.

This split fits server backends too: an HTTP backend (vLLM, SGLang) maps a segment to one
completion request, ``pause()`` to the server's abort-mode pause (in-flight requests come
back as ``abort`` with their partial tokens), ``resume()`` to its resume, and the weight
load to its reload endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.wire.unchecked import assembled

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]

WeightSource = (
    str | Path | Iterable[tuple[str, "torch.Tensor"]] | AsyncIterable[tuple[str, "torch.Tensor"]]
)
"""A directory of safetensors files, or a stream of ``(parameter name, tensor)`` pairs in
the HF state-dict naming, synchronous or asynchronous (e.g. read from an object store)."""


class SamplingParams(BaseModel):
    """How to sample. ``temperature == 0`` is greedy decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, description="0 disables the top-k cut-off")] = 0
    max_new_tokens: Annotated[int, Field(ge=0)] = 256
    stop_token_ids: Annotated[
        tuple[int, ...] | None,
        Field(description="None: the model's end-of-sequence ids; () stops only on length"),
    ] = None
    seed: Annotated[
        int | None, Field(description="per-request sampling seed; None draws freshly")
    ] = None


SamplingMode = Literal["recipe", "per_call"]
"""Whether a call to the OpenAI-compatible endpoint samples as the endpoint does
(``recipe``: its :class:`SamplingParams`, which the trainer scores with) or as it asks
(``per_call``); the recipe's ``rollout.endpoint_sampling``. Defined here rather than in
:mod:`asyncrl.endpoint.requests`, which explains it, so that the recipe's schema takes it
without loading the endpoint's server."""


class GenerateRequest(BaseModel):
    """One generation: token ids in, token ids out. ``rid`` only labels logs.

    ``images``: for a vision-language model, the prompt's images as file paths (absolute),
    one per image in ``input_ids``, in order; ``input_ids`` hold each image's placeholder
    tokens already expanded, as :class:`asyncrl.models.vision.VisionProcessor` gives them.
    A resumed segment (after a pause) carries the same images."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_ids: Annotated[list[int], Field(min_length=1)]
    sampling: SamplingParams = SamplingParams()
    rid: str = ""
    images: list[str] = []


class GenerateResponse(BaseModel):
    """The generated tokens, one logprob and one policy version per token.

    ``output_ids`` include the stop token when ``finish_reason == "stop"`` (the policy
    sampled it, so the trainer learns it). ``output_logprobs`` follow the engine's
    documented logprob convention (see the backend's docstring).
    """

    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    input_ids: list[int]
    output_ids: list[int] = []
    output_logprobs: list[float] = []
    output_versions: list[int] = []
    finish_reason: FinishReason = "length"

    def extend(self, other: GenerateResponse) -> None:
        """Appends a later segment's tokens and takes its finish reason."""
        self.output_ids.extend(other.output_ids)
        self.output_logprobs.extend(other.output_logprobs)
        self.output_versions.extend(other.output_versions)
        self.finish_reason = other.finish_reason


@dataclass(frozen=True)
class BroadcastJoin:
    """Where a server engine joins the trainer's weight broadcast
    (``weights.transport = "collective"``, :mod:`asyncrl.weights.collective`): the
    rendezvous store, the key prefix of its pair, the backend and the timeout of every
    collective."""

    host: str
    port: int
    prefix: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class BroadcastStaged:
    """A version a server received from the broadcast itself and holds, staged, until
    :meth:`InferenceEngine.update_weights` swaps it in."""

    version: int
    epoch: int


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast version, for a server that must be told what it is about
    to receive (``broadcast_protocol = "sglang"``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class EngineStopped(RuntimeError):
    """The engine is stopped (or failed); no generation can run."""


def segment_seed(seed: int, tokens_done: int) -> int:
    """The seed of a resumed segment: a fixed function of the request seed and its progress,
    so a paused-and-resumed request stays reproducible."""
    return zlib.crc32(f"{seed}/{tokens_done}".encode())


class InferenceEngine(ABC):
    """Asynchronous generation with per-token logprobs and versions, pausable for updates.

    Lifecycle: ``await start()`` … ``await stop()``, or ``async with engine:``.
    """

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._update_lock = asyncio.Lock()
        self._stopping = False
        self._released = False

    # --- the backend's part -----------------------------------------------------------------

    @abstractmethod
    async def start(self) -> None:
        """Loads the model (or connects to the server); returns once generation can run."""

    @abstractmethod
    async def stop(self) -> None:
        """Ends generation; in-flight requests return ``abort``. Idempotent."""

    @abstractmethod
    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        """Generates until done or until paused (then ``finish_reason="abort"``)."""

    @abstractmethod
    async def _interrupt(self) -> None:
        """Makes in-flight segments return at their next safe point; returns once none runs.
        Segments submitted later must not start before :meth:`_continue`."""

    @abstractmethod
    async def _continue(self) -> None:
        """Lets segments run again after :meth:`_interrupt`."""

    @abstractmethod
    async def _load_weights(self, source: WeightSource) -> None:
        """Replaces the weights; only called while interrupted."""

    async def _release_memory(self) -> int:
        """Frees the accelerator memory of the weights and KV cache (only called while
        interrupted); returns the bytes freed where the backend can tell, else 0."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    async def _resume_memory(self) -> None:
        """Takes back what :meth:`_release_memory` freed."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (chat template included)."""
        raise NotImplementedError

    takes_images: ClassVar[bool] = False
    """Whether the backend feeds a request's ``images`` to its model; one that does not
    refuses image requests rather than generate as if the images were not there."""

    broadcast_protocol: ClassVar[str] = ""
    """How the engine takes the ``collective`` weight broadcast: "" for an in-process
    engine (the actor receives the tensors and gives them to :meth:`update_weights`);
    otherwise the engine's server joins the trainer's group itself
    (:meth:`join_broadcast`, :meth:`receive_broadcast`), speaking the named protocol."""

    async def join_broadcast(self, where: BroadcastJoin) -> None:
        """Has the server form its group with the trainer's rank 0 (as rank 1)."""
        raise NotImplementedError(f"{type(self).__name__} takes no broadcast itself")

    async def receive_broadcast(
        self, version: int, epoch: int, tensors: Sequence[TensorSpec] = ()
    ) -> BroadcastStaged:
        """Has the server receive the version announced (``version``, ``epoch``) into a
        staging area while it keeps generating; returns what :meth:`update_weights` then
        takes (the version the server actually received). ``tensors``: what the version
        holds, in sending order, given only to a protocol whose server must know it
        before the bytes arrive (``"sglang"``)."""
        raise NotImplementedError(f"{type(self).__name__} takes no broadcast itself")

    # --- shared behaviour -------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version of the loaded weights; new tokens carry it."""
        return self._version

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        """Generates for ``request``; pauses in between are invisible except in the versions.

        ``finish_reason`` is ``"stop"`` (a stop token was sampled), ``"length"`` (the token
        budget or the model's context is used up) or ``"abort"`` (the engine stopped).
        """
        if request.images and not self.takes_images:
            raise ValueError(
                f"request {request.rid!r} has images, which {type(self).__name__} does not "
                "feed to a model"
            )
        sampling = request.sampling
        # the ids of a validated request, the rest empty: not validated again
        result = assembled(
            GenerateResponse,
            {
                "rid": request.rid,
                "input_ids": list(request.input_ids),
                "output_ids": [],
                "output_logprobs": [],
                "output_versions": [],
                "finish_reason": "length",
            },
        )
        while True:
            await self._resumed.wait()
            if self._stopping:
                result.finish_reason = "abort"
                return result
            done = len(result.output_ids)
            segment = request
            if done:
                segment = request.model_copy(
                    update={
                        "input_ids": request.input_ids + result.output_ids,
                        "sampling": sampling.model_copy(
                            update={
                                "max_new_tokens": sampling.max_new_tokens - done,
                                "seed": None
                                if sampling.seed is None
                                else segment_seed(sampling.seed, done),
                            }
                        ),
                    }
                )
            result.extend(await self._generate_segment(segment))
            if result.finish_reason != "abort":
                return result
            if len(result.output_ids) >= sampling.max_new_tokens:
                result.finish_reason = "length"
                return result
            if self._stopping:
                return result

    async def pause(self) -> None:
        """Stops generation at a safe point (between decode steps); returns once nothing
        runs. Requests made while paused wait for :meth:`resume`."""
        self._resumed.clear()
        await self._interrupt()

    async def resume(self) -> None:
        """Continues paused requests from their partial tokens, under the current weights."""
        await self._continue()
        self._resumed.set()

    def metrics(self) -> dict[str, float]:
        """Counters of the engine's own work, published with its actor's metrics as
        ``engine/<name>`` (totals since the engine started); none by default."""
        return {}

    @property
    def released(self) -> bool:
        """Whether :meth:`release_memory` freed the engine's memory (until it is taken back)."""
        return self._released

    async def release_memory(self) -> int:
        """Pauses generation and frees the accelerator memory of the weights and KV cache,
        so that a trainer on the same device can step (``rollout.colocate``). The memory
        comes back with :meth:`resume_memory`, or with the next :meth:`update_weights`;
        generation stays paused until :meth:`resume`. Returns the bytes freed (0 where the
        backend cannot tell)."""
        async with self._update_lock:
            await self.pause()
            if self._released:
                return 0
            freed = await self._release_memory()
            self._released = True
            return freed

    async def resume_memory(self) -> None:
        """Takes back the memory :meth:`release_memory` freed (the weights as they were)."""
        async with self._update_lock:
            await self._take_memory_back()

    async def _take_memory_back(self) -> None:
        if self._released:
            await self._resume_memory()
            self._released = False

    async def stage_weights(self, source: WeightSource) -> WeightSource:
        """Prepares an update while generation goes on, so that the pause covers only the
        load: returns what :meth:`update_weights` is then given. A backend that reads
        files itself (a server loading a directory) has nothing to prepare."""
        return source

    async def update_weights(self, source: WeightSource, version: int) -> None:
        """Loads new weights and takes ``version``; tokens sampled afterwards carry it.

        Called while paused (the usual pause → update → resume), the engine stays paused;
        otherwise it pauses and resumes around the load. If the load fails, the version
        does not change and the error propagates.
        """
        async with self._paused_for_weights():
            await self._load_weights(source)
            self._version = version

    @contextlib.asynccontextmanager
    async def _paused_for_weights(self) -> AsyncIterator[None]:
        """The region where weights change: one change at a time, generation paused (and
        resumed after, unless the caller had paused it), the released memory taken back."""
        async with self._update_lock:
            was_paused = self.paused
            if not was_paused:
                await self.pause()
            try:
                await self._take_memory_back()
                yield
            finally:
                if not was_paused:
                    await self.resume()
