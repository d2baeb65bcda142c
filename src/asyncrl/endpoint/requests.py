"""The request bodies the endpoint accepts, validated; OpenAI fields it does not use are
ignored, fields it cannot honour are refused by name.

How a call may sample depends on the endpoint's
:data:`~asyncrl.api.inference.SamplingMode` (``rollout.endpoint_sampling``):

- ``"recipe"``: a call may not change the distribution it samples from. The trainer then
  scores every token with the recipe's sampling (``rollout.sampling``), so a token drawn
  at another temperature or cut would carry a behaviour logprob of another distribution,
  and a greedy token none at all. ``temperature``, ``top_p`` and ``top_k`` are accepted
  only when absent or equal to the endpoint's own (:data:`SAMPLING_KEYS` names the recipe
  key the refusal points to).
- ``"per_call"``: a call's ``temperature``, ``top_p`` and ``top_k`` (``-1``: vLLM's "no
  cut", 0 here) replace the endpoint's for that call, ``temperature = 0`` (greedy)
  included; what a call leaves out stays the endpoint's. The endpoint records the sampling
  each call was served with, greedy calls are never trained, and each sample is trained
  with the temperature and cut its calls chose
  (:func:`~asyncrl.endpoint.recording.episode_samples`).

In both, ``min_p``, the penalties and ``logit_bias``, which the engines do not implement,
are accepted only at their neutral values. ``seed`` and the token budget leave the
distribution alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.api.inference import SamplingMode, SamplingParams

SAMPLING_KEYS: Mapping[str, str] = {
    "temperature": "rollout.sampling.temperature",
    "top_p": "rollout.sampling.top_p",
    "top_k": "rollout.sampling.top_k",
}
"""The recipe key each setting of an endpoint's sampling comes from, as a refusal names it
(an eval endpoint's come partly from ``eval``)."""

NEUTRAL: Mapping[str, float] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
"""Settings (OpenAI's and vLLM's) the engines do not implement, at the value that leaves
the distribution as it is: the only value a call may send."""


class RequestError(ValueError):
    """A request the endpoint refuses (400), with the offending parameter if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=-1, description="-1 or 0: no cut (vLLM's)")] = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    stop: str | list[str] | None = None
    n: int | None = 1
    seed: int | None = None
    stream: bool | None = False

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        if self.n not in (None, 1):
            raise ValueError("n must be 1: each choice is its own call of the episode")
        if self.stream:
            raise ValueError("stream is not supported; call without streaming")
        return self

    def sampling(
        self,
        defaults: SamplingParams,
        max_new_tokens_cap: int,
        keys: Mapping[str, str] = SAMPLING_KEYS,
        mode: SamplingMode = "recipe",
    ) -> SamplingParams:
        """The engine's sampling for this request: the endpoint's ``defaults`` with the
        request's token budget (at most ``max_new_tokens_cap``, refused above it) and seed,
        and in ``per_call`` ``mode`` its temperature, top_p and top_k.

        Raises :class:`RequestError` naming the setting and its recipe key (``keys``) for a
        temperature, top_p or top_k that differs from ``defaults`` in ``recipe`` mode (see
        the module docstring), and for a non-neutral min_p, penalty or logit_bias."""
        update: dict[str, Any] = {}
        for name, key in keys.items():
            asked = getattr(self, name)
            if name == "top_k" and asked == -1:
                asked = 0  # vLLM's "no cut"
            own = getattr(defaults, name)
            if asked is None or asked == own:
                continue
            if mode == "per_call":
                update[name] = asked
                continue
            greedy = " (greedy decoding is not a sample of the policy)" if asked == 0 else ""
            raise RequestError(
                f"{name} {asked}{greedy} differs from {own}, which this endpoint samples "
                f"with ({key}): leave {name} out of the call or send {own}, or set "
                'rollout.endpoint_sampling = "per_call" to train each sample with its '
                "calls' own sampling. Every token is trained with the logprobs of the "
                "endpoint's sampling, so a token drawn otherwise would be trained as a "
                "sample of another distribution",
                name,
            )
        for name, neutral in NEUTRAL.items():
            asked = getattr(self, name)
            if asked is not None and asked != neutral:
                raise RequestError(
                    f"{name} {asked} is not supported: the engine samples without it "
                    f"(leave it out or send {neutral})",
                    name,
                )
        if self.logit_bias:
            raise RequestError(
                "logit_bias is not supported: the engine samples without it", "logit_bias"
            )
        budget = self.max_completion_tokens or self.max_tokens
        if budget is not None:
            if budget > max_new_tokens_cap:
                raise RequestError(
                    f"max_tokens {budget} is above this endpoint's cap of {max_new_tokens_cap}",
                    "max_tokens",
                )
            update["max_new_tokens"] = budget
        if self.seed is not None:
            update["seed"] = self.seed
        return defaults.model_copy(update=update)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise RequestError("stop strings must not be empty", "stop")
        return stops


class ChatRequest(_Common):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_choice(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("tool_choice") not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice {data['tool_choice']!r} is not supported: use 'auto' or 'none'"
            )
        return data


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_ids_or_text(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
            return p  # type: ignore[return-value]
        if isinstance(p, list) and len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise RequestError("prompt must be one text or one list of token ids", "prompt")
