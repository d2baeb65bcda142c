"""The request bodies the endpoint accepts, validated; OpenAI fields it does not use are
ignored, fields it cannot honour are refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.api.inference import SamplingParams


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

    def sampling(self, defaults: SamplingParams, max_new_tokens_cap: int) -> SamplingParams:
        """The engine's sampling for this request: the endpoint's defaults, overridden by
        the request's temperature, top_p, token budget (at most ``max_new_tokens_cap``) and
        seed."""
        update: dict[str, Any] = {}
        if self.temperature is not None:
            update["temperature"] = self.temperature
        if self.top_p is not None:
            update["top_p"] = self.top_p
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
