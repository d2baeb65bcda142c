"""An inference engine whose replies are scripted, for tests that need a given reply (a tool
call, a stop string) and so cannot wait for a random model to write one; and the hf engine
with a record of what it generated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.api.inference import GenerateRequest, GenerateResponse, InferenceEngine, WeightSource
from asyncrl.engines.hf import HFEngine


class ScriptedEngine(InferenceEngine):
    """Replies with ``reply(prompt text)``, or with the next text of a list, tokenized by
    ``tokenizer`` and ended by its EOS, cut at the request's token budget (then
    ``finish_reason`` is ``length``); ``logprob`` for every token. With
    ``advance_version`` the version goes up after every reply, as if new weights had
    arrived between turns. Keeps every request, output and response, in order. Takes
    image requests (the images unread), for tests of what surrounds a vision model."""

    takes_images = True

    def __init__(
        self,
        tokenizer: Any,
        reply: Callable[[str], str] | list[str],
        *,
        version: int = 0,
        logprob: float = -0.5,
        advance_version: bool = False,
    ) -> None:
        super().__init__(version=version)
        self._tokenizer = tokenizer
        self._reply = reply if callable(reply) else None
        self._replies = None if callable(reply) else list(reply)
        self.logprob = logprob
        self.advance_version = advance_version
        self.requests: list[GenerateRequest] = []
        self.outputs: list[list[int]] = []
        self.seen: list[GenerateResponse] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _next_text(self, request: GenerateRequest) -> str:
        if self._reply is None:
            assert self._replies is not None
            return self._replies.pop(0)
        return self._reply(self._tokenizer.decode(request.input_ids, skip_special_tokens=False))

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self._stopping = True

    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        self.requests.append(request)
        tok = self._tokenizer
        ids = [*tok.encode(self._next_text(request), add_special_tokens=False), tok.eos_token_id]
        finish = "stop" if len(ids) <= request.sampling.max_new_tokens else "length"
        ids = ids[: request.sampling.max_new_tokens]
        self.outputs.append(ids)
        response = GenerateResponse(
            rid=request.rid,
            input_ids=list(request.input_ids),
            output_ids=ids,
            output_logprobs=[self.logprob] * len(ids),
            output_versions=[self.version] * len(ids),
            finish_reason=finish,
        )
        self.seen.append(response)
        if self.advance_version:
            self._version += 1
        return response

    async def _interrupt(self) -> None:
        pass

    async def _continue(self) -> None:
        pass

    async def _load_weights(self, source: WeightSource) -> None:
        pass


class SpyHF(HFEngine):
    """The hf engine, keeping every request it is given and every response it returns."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.requests: list[GenerateRequest] = []
        self.seen: list[GenerateResponse] = []

    async def agenerate(self, request: GenerateRequest) -> GenerateResponse:
        self.requests.append(request)
        resp = await super().agenerate(request)
        self.seen.append(resp)
        return resp
