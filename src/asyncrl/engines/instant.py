"""The instant engine (``rollout.engine.type = "instant"``): a null engine, no model,
instant fixed-length responses.

For benchmarks and protocol tests of everything around generation (leases, the stream,
the buffer, weight broadcasts) at rates no model reaches: ``bench/scale.py`` runs 64
rollout actors on it. Every request gets ``response_tokens`` tokens at once (fewer when
its ``max_new_tokens`` is smaller), all the token ``RESPONSE_TOKEN``, each with logprob
``-1.0`` and the engine's version; the finish reason is ``length``. Its tokenizer maps
text to UTF-8 byte values and back, so the real workflows run on it unchanged. A weight
update loads nothing: only the version changes, as it would after a real load.
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.inference import GenerateRequest, GenerateResponse, InferenceEngine, WeightSource
from asyncrl.engines.config import InstantEngineConfig
from asyncrl.models.resolve import ModelConfig
from asyncrl.wire.unchecked import assembled

RESPONSE_TOKEN = ord("7")
"""What every response is made of: a digit, so a math reward parses it (and scores 0)."""


class ByteTokenizer:
    """Token ids are UTF-8 byte values; the chat template is ``role: content`` lines."""

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
    ) -> Any:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        try:
            raw = bytes(ids)  # the usual case, every id a byte value: no Python loop
        except ValueError:
            raw = bytes(i % 256 for i in ids)
        return raw.decode(errors="replace")


class InstantEngine(InferenceEngine):
    """See the module docstring. ``model`` is accepted (and ignored) like every backend's;
    ``config`` is the recipe's ``rollout.engine`` section. Image requests are taken (and
    their images ignored, as their prompts are)."""

    takes_images = True

    def __init__(
        self, model: ModelConfig | str = "", config: InstantEngineConfig | None = None
    ) -> None:
        super().__init__()
        self.config = config or InstantEngineConfig()
        self.response_tokens = self.config.response_tokens
        self._tokenizer = ByteTokenizer()

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self._stopping = True

    async def _generate_segment(self, request: GenerateRequest) -> GenerateResponse:
        n = min(self.response_tokens, request.sampling.max_new_tokens)
        # every field given, of its type by construction (the ids of a validated request):
        # not validated again, so the bench measures the protocol, not this null model
        return assembled(
            GenerateResponse,
            {
                "rid": request.rid,
                "input_ids": list(request.input_ids),
                "output_ids": [RESPONSE_TOKEN] * n,
                "output_logprobs": [-1.0] * n,
                "output_versions": [self.version] * n,
                "finish_reason": "length",
            },
        )

    async def _interrupt(self) -> None:
        pass  # a segment never yields mid-way: nothing is ever in flight to stop

    async def _continue(self) -> None:
        pass

    async def _load_weights(self, source: WeightSource) -> None:
        pass
