"""Building a workflow the way the actors do, from ``rollout.workflow`` written as a recipe
writes it (a shorthand string or a table), without an actor."""

from __future__ import annotations

from typing import Any

from asyncrl.api.inference import SamplingParams
from asyncrl.api.workflow import RolloutWorkflow, Scorer
from asyncrl.config.recipe import load_recipe
from asyncrl.config.workflow import WorkflowParts
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.tools.base import Tool


def workflow_from(
    workflow: str,
    *sets: str,
    tokenizer: Any = None,
    sampling: SamplingParams | None = None,
    group_size: int = 1,
    reward: Scorer | None = None,
    endpoint: OpenAIEndpoint | None = None,
    tools: list[Tool] | None = None,
) -> RolloutWorkflow:
    """The workflow ``rollout.workflow = workflow`` (with the ``--set`` overrides ``sets``)
    builds from these parts."""
    recipe = load_recipe(None, [f"rollout.workflow={workflow}", *sets])
    r = recipe.rollout
    parts = WorkflowParts(
        tokenizer=tokenizer,
        sampling=sampling or r.sampling.params(),
        group_size=group_size,
        reward=reward,
        endpoint=endpoint,
        tools=tools,
    )
    return r.workflow.build(r, parts)
