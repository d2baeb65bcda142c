"""Rollout workflows: the contract, RLVR, multi-turn, agents with tools, and loading a
user's own.

``make_workflow(spec, **options)`` builds the recipe's ``rollout.workflow``:

- ``"rlvr"``, ``"multi_turn"`` or ``"agent"``: the built-in classes;
- ``"path/to/file.py:name"`` or ``"module:name"``: a user's own, where ``name`` is a
  :class:`RolloutWorkflow` subclass, a factory returning one, or an async function. An
  async function is told apart by its first parameter:

  - named ``client`` (or annotated ``openai.AsyncOpenAI``): **agent code**,
    ``async def agent(client, data) -> float``, run by
    :class:`~asyncrl.endpoint.OpenAIAgentWorkflow` against the endpoint in
    ``options["endpoint"]`` (the rollout actor's); its return value is the reward;
  - named ``engine``: a bare ``async def episode(engine, item)`` returning the group's
    trajectories (:class:`FunctionWorkflow`);
  - anything else is refused (:class:`SpecError` naming both forms);
- ``"verifiers:<module, hub id or path/to/file.py>"``: a ``verifiers`` environment (its
  ``load_environment(**env_args)``) whose rollouts run through the endpoint and are scored
  by its rubric (:func:`~asyncrl.endpoint.verifiers_workflow`). It counts as agent code:
  it needs the endpoint and returns its own rewards.

``options`` are offered by keyword (``tokenizer``, ``sampling``, ``group_size``,
``reward``, ``max_turns``, ``endpoint``, ...); each class or factory receives only those
its signature names (all of them if it takes ``**kwargs``), so a user's workflow asks for
what it needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.engines.base import InferenceEngine
from asyncrl.wire.messages import Prompt, Trajectory
from asyncrl.workflows.agent import AgentWorkflow
from asyncrl.workflows.base import (
    RolloutWorkflow,
    Scorer,
    TokenTrace,
    chat_messages,
    encode_chat,
    split_item,
)
from asyncrl.workflows.loader import SpecError, load_callable, split_spec
from asyncrl.workflows.multi_turn import MultiTurnWorkflow
from asyncrl.workflows.rlvr import RLVRWorkflow

WORKFLOWS: dict[str, type[RolloutWorkflow]] = {
    "rlvr": RLVRWorkflow,
    "multi_turn": MultiTurnWorkflow,
    "agent": AgentWorkflow,
}
"""Built-in workflows by the name a recipe uses."""

EpisodeFn = Callable[[InferenceEngine, Any], Awaitable[list[Trajectory] | None]]


class FunctionWorkflow(RolloutWorkflow):
    """A bare ``async def arun_episode(engine, item)`` function as a workflow."""

    def __init__(self, fn: EpisodeFn) -> None:
        self.fn = fn

    async def arun_episode(
        self, engine: InferenceEngine, item: dict[str, Any] | Prompt
    ) -> list[Trajectory] | None:
        return await self.fn(engine, item)


def call_with_accepted(fn: Callable[..., Any], options: dict[str, Any]) -> Any:
    """``fn(**options)`` restricted to the keywords ``fn`` declares."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**options)
    return fn(**{k: v for k, v in options.items() if k in params})


FUNCTION_FORMS = (
    "agent code 'async def agent(client, data) -> float' (first parameter named client, "
    "or annotated openai.AsyncOpenAI) or an episode function "
    "'async def episode(engine, item) -> list[Trajectory]'"
)


def function_kind(fn: Callable[..., Any], spec: str = "") -> str:
    """``"agent"`` or ``"episode"`` for an async workflow function, by its first
    parameter (see the module docstring); :class:`SpecError` for anything else."""
    name = spec or getattr(fn, "__qualname__", repr(fn))
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        first = params[0]
        annotation = first.annotation
        spelled = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if first.name == "client" or spelled.rsplit(".", 1)[-1] == "AsyncOpenAI":
            return "agent"
        if first.name == "engine":
            return "episode"
    raise SpecError(f"{name!r} is an async function of neither form: write {FUNCTION_FORMS}")


VERIFIERS_PREFIX = "verifiers:"
"""``rollout.workflow = "verifiers:<env>"`` names a ``verifiers`` environment."""


def verifiers_env_spec(spec: str) -> str | None:
    """The environment a ``verifiers:<env>`` workflow spec names; None for other specs."""
    if not spec.startswith(VERIFIERS_PREFIX):
        return None
    env = spec[len(VERIFIERS_PREFIX) :].strip()
    if not env:
        raise SpecError(f"{spec!r} names no environment: write 'verifiers:<module or file.py>'")
    return env


def is_agent_code(spec: str) -> bool:
    """Whether the workflow ``spec`` names agent code (which runs through the endpoint):
    an async ``agent(client, data)`` or a ``verifiers:`` environment. Loads a
    ``file.py:name`` spec (not a verifiers environment, whose import is slow); raises
    :class:`SpecError` if it does not load."""
    if verifiers_env_spec(spec) is not None:
        return True
    if spec in WORKFLOWS or ":" not in spec:
        return False
    obj = load_callable(spec)
    return inspect.iscoroutinefunction(obj) and function_kind(obj, spec) == "agent"


def make_workflow(spec: str, **options: Any) -> RolloutWorkflow:
    """The workflow ``spec`` names (see the module docstring), built with ``options``."""
    if spec in WORKFLOWS:
        return call_with_accepted(WORKFLOWS[spec], options)  # type: ignore[no-any-return]
    env = verifiers_env_spec(spec)
    if env is not None:
        from asyncrl.endpoint.verifiers_env import verifiers_workflow

        return verifiers_workflow(
            env,
            endpoint=_endpoint(options, spec),
            env_args=options.get("env_args"),
            group_size=options.get("group_size", 1),
            turn_discount=options.get("turn_discount", 1.0),
        )
    if ":" not in spec:
        raise SpecError(f"workflow {spec!r} is not one of {sorted(WORKFLOWS)} nor a file.py:name")
    split_spec(spec)
    obj = load_callable(spec)
    if inspect.iscoroutinefunction(obj):
        if function_kind(obj, spec) == "episode":
            return FunctionWorkflow(obj)
        from asyncrl.endpoint.workflow import OpenAIAgentWorkflow

        return OpenAIAgentWorkflow(
            _endpoint(options, spec),
            obj,
            group_size=options.get("group_size", 1),
            turn_discount=options.get("turn_discount", 1.0),
        )
    built = call_with_accepted(obj, options)
    if not callable(getattr(built, "arun_episode", None)):
        raise SpecError(f"{spec!r} built a {type(built).__name__}, which has no arun_episode")
    return built  # type: ignore[no-any-return]


def _endpoint(options: dict[str, Any], spec: str) -> Any:
    endpoint = options.get("endpoint")
    if endpoint is None:
        raise SpecError(
            f"{spec!r} is agent code, which runs through the rollout actor's endpoint: "
            "set rollout.endpoint = true (or leave it unset)"
        )
    return endpoint


__all__ = [
    "VERIFIERS_PREFIX",
    "WORKFLOWS",
    "AgentWorkflow",
    "FunctionWorkflow",
    "MultiTurnWorkflow",
    "RLVRWorkflow",
    "RolloutWorkflow",
    "Scorer",
    "SpecError",
    "TokenTrace",
    "chat_messages",
    "encode_chat",
    "function_kind",
    "is_agent_code",
    "load_callable",
    "make_workflow",
    "split_item",
    "verifiers_env_spec",
]
