"""A user's own workflow code, named ``path/to/file.py:name`` or ``module:name``: a
:class:`~asyncrl.api.workflow.RolloutWorkflow` subclass, a factory returning one, or an
async function. An async function is told apart by its first parameter:

- named ``client`` (or annotated ``openai.AsyncOpenAI``): **agent code**,
  ``async def agent(client, data) -> float``, run by
  :class:`~asyncrl.endpoint.workflow.OpenAIAgentWorkflow` through an endpoint; its return
  value is the reward;
- named ``engine``: a bare ``async def episode(engine, item)`` returning the group's
  trajectories (:class:`FunctionWorkflow`);
- anything else is refused (:class:`SpecError` naming both forms).

A class or factory receives, by keyword, only the options its signature names (all of them
if it takes ``**kwargs``), so a user's workflow asks for what it needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.api.workflow import RolloutWorkflow
from asyncrl.workflows.loader import SpecError, load_callable

if TYPE_CHECKING:
    from asyncrl.api.inference import InferenceEngine
    from asyncrl.wire.messages import Prompt, Trajectory

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


def takes_client(fn: Callable[..., Any], spec: str = "") -> bool:
    """Whether an async workflow function is agent code (True) or an episode function
    (False), by its first parameter (see the module docstring); :class:`SpecError` for
    anything else."""
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
            return True
        if first.name == "engine":
            return False
    raise SpecError(f"{name!r} is an async function of neither form: write {FUNCTION_FORMS}")


def is_agent_code(spec: str) -> bool:
    """Whether ``spec`` (``file.py:name`` / ``module:name``) names agent code: an async
    function whose first parameter is the client. Loads it; raises :class:`SpecError` if
    it does not load, or is an async function of neither form."""
    obj = load_callable(spec)
    return inspect.iscoroutinefunction(obj) and takes_client(obj, spec)


def user_workflow(spec: str, options: dict[str, Any]) -> RolloutWorkflow:
    """The workflow ``spec`` names when it is no agent code: an episode function, or a
    class or factory called with the ``options`` it accepts."""
    obj = load_callable(spec)
    if inspect.iscoroutinefunction(obj):
        if takes_client(obj, spec):
            raise SpecError(f"{spec!r} is agent code, which runs through the endpoint")
        return FunctionWorkflow(obj)
    built = call_with_accepted(obj, options)
    if not callable(getattr(built, "arun_episode", None)):
        raise SpecError(f"{spec!r} built a {type(built).__name__}, which has no arun_episode")
    return built  # type: ignore[no-any-return]
