"""An OpenAI-compatible HTTP endpoint in front of an :class:`InferenceEngine`.

Agent code written against the ``openai`` client talks to the engine through it, and every
call made under an episode URL is recorded token for token (see
:mod:`asyncrl.endpoint.recording`), so training sees the engine's own ids, logprobs and
versions, never a re-tokenization of the text the client saw.

Routes (non-streaming), each under ``/v1`` and under ``/episodes/<episode_id>/v1``:
``GET models``, ``POST chat/completions``, ``POST completions``. Calls under plain ``/v1``
are served and recorded nowhere; calls under an episode that is not open get 404.

Safety: the server binds 127.0.0.1 only (the constructor refuses any other host), on a free
port unless one is given, and refuses any request without ``Authorization: Bearer <token>``
(401). A body that is not JSON or has bad fields gets 400 with an OpenAI-style error body.

Tool calls are read from the generated text by the named parser (``hermes`` by default).
A reply with a call the parser cannot read is returned whole as plain ``content`` with no
``tool_calls`` (the agent then sees what the model wrote) and counted in
:attr:`Call.malformed_tool_calls`. ``tool_choice="none"`` keeps the tools in the prompt (so
the prompt is the one an ``auto`` call would get) and returns the text unparsed; other
choices (``required``, a named function) are refused, since sampling cannot be forced.
The request's ``model`` is not checked: there is one model, the engine's.

Sampling is the endpoint's: a call may set its token budget and seed, but a temperature,
top_p or top_k other than the endpoint's is refused (400, naming the recipe key), since the
trainer scores every token with that sampling; in ``per_call`` mode
(``rollout.endpoint_sampling``) a call's own temperature, top_p and top_k are served and
recorded with it instead (see :mod:`asyncrl.endpoint.requests`).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Self

from aiohttp import web
from pydantic import ValidationError

from asyncrl.api.inference import (
    EngineStopped,
    GenerateRequest,
    GenerateResponse,
    InferenceEngine,
    SamplingParams,
)
from asyncrl.endpoint.chat import ChatError, ChatRenderer, normalize_message
from asyncrl.endpoint.recording import Call, EpisodeRecorder
from asyncrl.endpoint.requests import (
    SAMPLING_KEYS,
    ChatRequest,
    CompletionRequest,
    RequestError,
    SamplingMode,
)
from asyncrl.tools.calls import ToolCall, get_parser

log = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
EPISODE_ID_RE = re.compile(r"^[A-Za-z0-9._~-]{1,128}$")
MAX_BODY_BYTES = 16 * 2**20
"""A chat of a long agent episode stays far below this; a larger body is refused (413)."""

SHUTDOWN_TIMEOUT_S = 5.0
"""Seconds :meth:`OpenAIEndpoint.stop` waits for requests in flight before it cuts them."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """An error in OpenAI's shape, which the ``openai`` client turns into its exceptions."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


class OpenAIEndpoint:
    """See the module docstring. Lifecycle: ``await start()`` … ``await stop()``, or
    ``async with endpoint:``; :attr:`base_url` is valid once started.

    ``sampling`` is how every call samples: a request may change its token budget (at most
    ``max_new_tokens_cap``, default: ``sampling``'s budget) and seed, and may send its
    temperature, top_p and top_k only at ``sampling``'s values; a refusal names the recipe
    key in ``sampling_keys`` (default: ``rollout.sampling``'s) that sets each. With
    ``sampling_mode = "per_call"`` a request's temperature, top_p and top_k replace
    ``sampling``'s, which then is only the default of calls that send none; each
    :class:`Call` records what it was served with."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any = None,
        *,
        model_name: str,
        token: str,
        host: str = LOCALHOST,
        port: int = 0,
        parser: str = "hermes",
        sampling: SamplingParams | None = None,
        max_new_tokens_cap: int | None = None,
        sampling_keys: Mapping[str, str] = SAMPLING_KEYS,
        sampling_mode: SamplingMode = "recipe",
    ) -> None:
        if host != LOCALHOST:
            raise ValueError(f"the endpoint listens on {LOCALHOST} only, not {host!r}")
        if not token:
            raise ValueError("the endpoint needs a non-empty token")
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.model_name = model_name
        self.token = token
        self.host = host
        self.port = port
        self.parse = get_parser(parser)
        self.sampling = sampling or SamplingParams()
        self.max_new_tokens_cap = max_new_tokens_cap or self.sampling.max_new_tokens
        self.sampling_keys = dict(sampling_keys)
        self.sampling_mode: SamplingMode = sampling_mode
        self.renderer = ChatRenderer(self.tokenizer)
        self._episodes: dict[str, EpisodeRecorder] = {}
        self._runner: web.AppRunner | None = None

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_get(f"{prefix}/models", self._models)
            app.router.add_post(f"{prefix}/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/completions", self._completions)
        # a request still in the engine at shutdown holds it at most this long
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        """The ``/v1`` URL of calls outside any episode."""
        return f"http://{self.host}:{self.port}/v1"

    # --- episodes ---------------------------------------------------------------------------

    def open_episode(self, episode_id: str | None = None) -> EpisodeRecorder:
        """Starts recording calls made under ``recorder.base_url``. ``episode_id`` (URL-safe
        characters only) defaults to a fresh random id."""
        episode_id = episode_id or uuid.uuid4().hex
        if not EPISODE_ID_RE.match(episode_id):
            raise ValueError(f"episode id {episode_id!r} must match {EPISODE_ID_RE.pattern}")
        if episode_id in self._episodes:
            raise ValueError(f"episode {episode_id!r} is already open")
        url = f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"
        recorder = EpisodeRecorder(episode_id, url)
        self._episodes[episode_id] = recorder
        return recorder

    def close_episode(self, episode_id: str) -> list[Call]:
        """Stops recording the episode and returns its calls; later calls to its URL get 404."""
        return self._episodes.pop(episode_id).calls

    @asynccontextmanager
    async def episode(self, episode_id: str | None = None) -> AsyncIterator[EpisodeRecorder]:
        """:meth:`open_episode` for the duration of the block, closed however it ends."""
        recorder = self.open_episode(episode_id)
        try:
            yield recorder
        finally:
            self._episodes.pop(recorder.episode_id, None)

    # --- HTTP -------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Authentication first, then OpenAI-style errors for everything that goes wrong."""
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        ):
            return error_response(
                401, "missing or wrong API key in the Authorization header", "authentication_error"
            )
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return error_response(exc.status, exc.reason, "invalid_request_error")
        except RequestError as exc:
            return error_response(400, str(exc), "invalid_request_error", exc.param)
        except (ChatError, ValidationError) as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except EngineStopped as exc:
            return error_response(503, f"the engine is stopped: {exc}", "server_error")
        except Exception as exc:  # one request's failure is its own 500, never the server's
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")

    def _recorder(self, request: web.Request) -> EpisodeRecorder | None:
        episode_id = request.match_info.get("episode")
        if episode_id is None:
            return None
        recorder = self._episodes.get(episode_id)
        if recorder is None:
            raise web.HTTPNotFound(reason=f"episode {episode_id!r} is not open")
        return recorder

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def _models(self, request: web.Request) -> web.Response:
        self._recorder(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _generate(
        self,
        recorder: EpisodeRecorder | None,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stops: list[str],
    ) -> tuple[GenerateResponse, str, float]:
        """The engine's response (cut after a stop string, if one appears), its text, and
        the engine's time. A generation the stopping engine aborts marks the episode
        aborted (its samples are incomplete) and answers 503."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        t0 = time.perf_counter()
        try:
            resp = await self.engine.agenerate(
                GenerateRequest(input_ids=prompt_ids, sampling=sampling)
            )
        except ValueError as exc:  # engines refuse requests they cannot serve this way
            raise RequestError(f"the engine refused the request: {exc}") from exc
        except EngineStopped:
            if recorder is not None:
                recorder.aborted = True
            raise
        engine_s = time.perf_counter() - t0
        if resp.finish_reason == "abort":
            if recorder is not None:
                recorder.aborted = True
            raise EngineStopped("generation aborted")
        text = self.tokenizer.decode(resp.output_ids, skip_special_tokens=True)
        if stops:
            resp, text = self._cut_at_stop(resp, text, stops)
        return resp, text, engine_s

    def _cut_at_stop(
        self, resp: GenerateResponse, text: str, stops: list[str]
    ) -> tuple[GenerateResponse, str]:
        """Keeps the tokens up to the one that completes the first stop string, and the text
        before it. The kept tokens are an exact prefix of what was sampled, so they remain a
        valid sample of the policy."""
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return resp, text
        cut = min(hits)
        end = cut + next(len(s) for s in stops if text.find(s) == cut)
        for n in range(1, len(resp.output_ids) + 1):
            decoded = self.tokenizer.decode(resp.output_ids[:n], skip_special_tokens=True)
            if len(decoded) >= end:
                break
        kept = GenerateResponse(
            rid=resp.rid,
            input_ids=resp.input_ids,
            output_ids=resp.output_ids[:n],
            output_logprobs=resp.output_logprobs[:n],
            output_versions=resp.output_versions[:n],
            finish_reason="stop",
        )
        return kept, text[:cut]

    def _sampling(self, req: ChatRequest | CompletionRequest) -> SamplingParams:
        return req.sampling(
            self.sampling, self.max_new_tokens_cap, self.sampling_keys, self.sampling_mode
        )

    def _chat_prompt(
        self,
        recorder: EpisodeRecorder | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[list[int], int | None]:
        """The prompt ids and the index of the call they continue (see
        :mod:`asyncrl.endpoint.chat` for why continuing beats rendering again)."""
        if recorder is not None:
            for index in range(len(recorder.calls) - 1, -1, -1):
                prev = recorder.calls[index]
                if prev.messages is None or prev.reply is None or prev.tools != tools:
                    continue
                n = len(prev.messages)
                if not (
                    len(messages) > n + 1
                    and messages[:n] == prev.messages
                    and messages[n] == prev.reply
                ):
                    continue
                delta = self.renderer.continuation_ids(
                    prev.messages,
                    messages[n + 1 :],
                    tools,
                    prev.completion_ids,
                    stopped=prev.finish_reason in ("stop", "tool_calls"),
                )
                if delta is not None:
                    return prev.prompt_ids + prev.completion_ids + delta, index
        return self.renderer.fresh_ids(messages, tools), None

    async def _chat(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        recorder = self._recorder(request)
        req = ChatRequest.model_validate(await self._body(request))
        messages = [normalize_message(m) for m in req.messages]
        tools = _check_tools(req.tools)
        sampling = self._sampling(req)
        prompt_ids, continued = self._chat_prompt(recorder, messages, tools)
        resp, text, engine_s = await self._generate(
            recorder, prompt_ids, sampling, req.stop_strings()
        )

        calls: list[ToolCall] = []
        malformed = 0
        content = text
        if tools and req.tool_choice != "none":
            parsed = self.parse(text)
            malformed = len(parsed.errors)
            if not malformed and parsed.tool_calls:
                content = parsed.content
                calls = [_unique_id(c) for c in parsed.tool_calls]
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        finish = "tool_calls" if calls else resp.finish_reason
        if recorder is not None:
            recorder.add(
                Call(
                    prompt_ids=prompt_ids,
                    completion_ids=list(resp.output_ids),
                    logprobs=list(resp.output_logprobs),
                    versions=list(resp.output_versions),
                    finish_reason=resp.finish_reason,
                    messages=messages,
                    tools=tools,
                    reply=normalize_message(message),
                    continued_from=continued,
                    tool_calls=len(calls),
                    malformed_tool_calls=malformed,
                    handling_s=time.perf_counter() - started,
                    engine_s=engine_s,
                    **_drawn(sampling),
                )
            )
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": _usage(prompt_ids, resp),
        }
        return web.json_response(body)

    async def _completions(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        recorder = self._recorder(request)
        req = CompletionRequest.model_validate(await self._body(request))
        prompt = req.prompt_ids_or_text()
        if isinstance(prompt, str):
            prompt_ids = self.renderer.encode(prompt)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= i < vocab for i in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        sampling = self._sampling(req)
        resp, text, engine_s = await self._generate(
            recorder, prompt_ids, sampling, req.stop_strings()
        )
        if recorder is not None:
            recorder.add(
                Call(
                    prompt_ids=prompt_ids,
                    completion_ids=list(resp.output_ids),
                    logprobs=list(resp.output_logprobs),
                    versions=list(resp.output_versions),
                    finish_reason=resp.finish_reason,
                    handling_s=time.perf_counter() - started,
                    engine_s=engine_s,
                    **_drawn(sampling),
                )
            )
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": 0, "text": text, "finish_reason": resp.finish_reason, "logprobs": None}
            ],
            "usage": _usage(prompt_ids, resp),
        }
        return web.json_response(body)


def _usage(prompt_ids: list[int], resp: GenerateResponse) -> dict[str, int]:
    n_out = len(resp.output_ids)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": n_out,
        "total_tokens": len(prompt_ids) + n_out,
    }


def _drawn(sampling: SamplingParams) -> dict[str, Any]:
    """The settings of ``sampling`` that shape the distribution, as a :class:`Call` records
    them."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def _check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for tool in tools:
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise RequestError("each tool must be {'type': 'function', 'function': {...}}", "tools")
    return tools


def _unique_id(call: ToolCall) -> ToolCall:
    """Gives a call the parser numbered per turn (``call_0``) an id unique in the episode,
    since agent frameworks match tool results to calls by id across turns."""
    if re.fullmatch(r"call_\d+", call.id):
        return ToolCall(call.name, call.arguments, f"call_{uuid.uuid4().hex[:12]}")
    return call
