"""What the rollout and eval actors share: asking for the latest weights, the order in
which weights supersede one another, and the recipe's workflow built from its config with
the tools and the endpoint it needs (:mod:`asyncrl.config.workflow`)."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Mapping

from asyncrl.api.inference import InferenceEngine, SamplingParams
from asyncrl.api.workflow import RolloutWorkflow, Scorer
from asyncrl.config.recipe import DataConfig, image_field
from asyncrl.config.workflow import ENDPOINT_CALLS, WorkflowParts
from asyncrl.endpoint.requests import SAMPLING_KEYS
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.models.resolve import resolve_model_path
from asyncrl.models.vision import VisionProcessor, vision_family_offline
from asyncrl.runtime.actor import Actor
from asyncrl.runtime.bus import BusTimeout, RemoteError
from asyncrl.tools.base import Tool
from asyncrl.wire.messages import WeightsQuery, WeightsUpdated

WEIGHTS_QUERY_TIMEOUT = 5.0
"""Seconds to wait for the buffer's answer to "which weights are the latest?"."""


async def latest_weights(actor: Actor) -> WeightsUpdated | None:
    """The latest weights the buffer knows of (for an actor that joins a live run, or one
    that missed a broadcast); None when nothing is published yet, or no buffer answers."""
    try:
        return await actor.bus.request(
            actor.subjects.weights_query,
            WeightsQuery(actor_id=actor.actor_id),
            WeightsUpdated,
            timeout=WEIGHTS_QUERY_TIMEOUT,
        )
    except (BusTimeout, RemoteError):
        return None


def supersedes(epoch: int, version: int, than: tuple[int, int]) -> bool:
    """Whether weights ``(epoch, version)`` supersede ``than``'s: a newer trainer epoch (a
    trainer restarted from its checkpoint) wins over a higher version of the lineage it
    rolled back."""
    return (epoch, version) > than


async def serve_endpoint(
    actor: Actor,
    engine: InferenceEngine,
    sampling: SamplingParams,
    resources: contextlib.AsyncExitStack,
    *,
    port: int = 0,
    sampling_keys: Mapping[str, str] = SAMPLING_KEYS,
) -> OpenAIEndpoint:
    """The actor's OpenAI-compatible endpoint on ``engine`` and ``port`` (0: a free one),
    started, sampling every call with ``sampling`` (with ``rollout.endpoint_sampling =
    "recipe"`` a call may change only its budget and seed, and a refusal names the recipe
    key in ``sampling_keys``; with ``"per_call"`` a call's own temperature, top_p and top_k
    are served), stopped when ``resources`` closes. Its API key is the run's NATS token,
    or in a run without one a fresh token."""
    recipe = actor.recipe
    endpoint = OpenAIEndpoint(
        engine,
        model_name=recipe.model.path,
        token=actor.ctx.nats.token or secrets.token_urlsafe(24),
        port=port,
        parser=recipe.rollout.agent.parser,
        sampling=sampling,
        sampling_keys=sampling_keys,
        sampling_mode=recipe.rollout.endpoint_sampling,
    )
    await endpoint.start()
    # the openai client's HTTP library (httpx, or its httpx2 fork) logs every request at
    # INFO: a line per call of every episode
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    resources.push_async_callback(endpoint.stop)
    return endpoint


def build_workflow(
    actor: Actor,
    engine: InferenceEngine,
    sampling: SamplingParams,
    group_size: int,
    *,
    reward: Scorer | None,
    endpoint: OpenAIEndpoint | None,
    tools: list[Tool] | None,
    data: DataConfig | None = None,
) -> RolloutWorkflow:
    """The recipe's workflow as both actors build it, from ``rollout.workflow``'s config,
    with ``sampling`` and ``group_size`` (the rollout's, or an eval job's). Agent code
    appends its endpoint calls to ``<run>/endpoint_calls.jsonl`` with
    ``rollout.endpoint_record``. ``data`` is where the prompts come from (default the
    recipe's ``data``): where its records name images, a vision model's processor places
    them in the prompts."""
    r = actor.recipe.rollout
    image_key = image_field(data or actor.recipe.data)
    vision = None
    if image_key and vision_family_offline(actor.recipe.model.path):
        vision = VisionProcessor(resolve_model_path(actor.recipe.model.path))
    parts = WorkflowParts(
        tokenizer=engine.tokenizer,
        sampling=sampling,
        group_size=group_size,
        reward=reward,
        endpoint=endpoint,
        tools=tools,
        record_path=actor.ctx.run_dir / ENDPOINT_CALLS if r.endpoint_record else None,
        vision=vision,
        image_key=image_key,
    )
    return r.workflow.build(r, parts)
