"""``verifiers`` environments trained through the endpoint.

A ``verifiers`` environment (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``, ...)
is a dataset, a rollout loop that talks to a model through an OpenAI client, and a rubric
that scores the finished rollouts. Here each rollout of a GRPO group runs with a client of
its own whose ``base_url`` is an episode of an :class:`~asyncrl.endpoint.OpenAIEndpoint`,
so every model call is recorded token for token and the trajectories are the engine's
tokens (:class:`~asyncrl.endpoint.OpenAIAgentWorkflow` builds them), never a
re-tokenization of the messages the environment kept. The group is scored by the
environment's rubric in one ``rubric.score_group`` call, as ``verifiers`` itself does, so
group reward functions see the whole group.

The environment comes from a module or a file that defines ``load_environment(**args)``,
as the environments of the ``verifiers`` hub are laid out: :func:`load_verifiers_env`.

Where prompts come from: the environment's own dataset is the natural source (its rows
hold the chat the environment built: its system prompt, few-shot turns, ``answer``,
``info``); :func:`verifiers_records` turns them into asyncrl prompt records. Records from
any other source are mapped by :func:`rollout_input` (``messages``, else ``prompt`` or
``question`` as the user turn; ``answer``; ``info``), so asyncrl's ``jsonl``/``hf`` data
also works, with the loader's own instruction in the prompt.

API used (``verifiers`` 0.3.x; 0.4 removed this environment API): ``Environment.rollout``,
``Environment.get_dataset``/``get_eval_dataset``, ``Environment.rubric.score_group`` and
``.cleanup``, and the ``OpenAIChatCompletionsClient``/``OpenAICompletionsClient`` adapters
around an ``openai.AsyncOpenAI``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from asyncrl.endpoint.requests import CompletionRequest
from asyncrl.endpoint.server import OpenAIEndpoint
from asyncrl.endpoint.workflow import OpenAIAgentWorkflow
from asyncrl.workflows.base import chat_messages
from asyncrl.workflows.loader import SpecError, load_callable

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install 'asyncrl[agents]' && pip install --no-deps 'verifiers==0.3.1' "
    "(verifiers pins mcp<2, which the MCP tools cannot use; its other dependencies are "
    "in the agents extra)"
)
"""How to get the supported ``verifiers`` (the Makefile does this)."""

RECORD_FIELDS = ("messages", "prompt", "answer", "info", "example_id")
"""The fields of an asyncrl prompt record that :func:`rollout_input` maps itself."""


def import_verifiers() -> Any:
    """The ``verifiers`` package, if it is installed and has the environment API used here;
    otherwise ``ImportError`` saying how to install it."""
    try:
        import verifiers  # noqa: PLC0415 - optional: verifiers
    except ImportError as exc:
        raise ImportError(
            f"verifiers environments need the verifiers package: {INSTALL_HINT}"
        ) from exc
    try:
        has_api = hasattr(verifiers, "Environment")  # the 0.3 package root loads it lazily
    except ImportError as exc:
        raise ImportError(f"verifiers cannot load ({exc}): {INSTALL_HINT}") from exc
    if not has_api:
        version = getattr(verifiers, "__version__", "unknown")
        raise ImportError(
            f"verifiers {version} lacks the Environment API (SingleTurnEnv, ToolEnv, Rubric) "
            f"that asyncrl runs, which verifiers 0.4 removed: {INSTALL_HINT}"
        )
    return verifiers


def _loader_spec(spec: str) -> str:
    """``load_environment``'s ``file.py:name``/``module:name`` for an environment spec. A
    hub id (``owner/name``, ``name-with-dashes``) names the module its package installs,
    as ``verifiers`` imports it."""
    if spec.endswith(".py"):
        return f"{spec}:load_environment"
    module = spec.rsplit("/", 1)[-1].replace("-", "_")
    return f"{module}:load_environment"


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Restores the SIGINT and SIGTERM handlers on the way out: a ``verifiers``
    Environment installs its own, process-wide, when it is built (its teardown, then exit),
    which would take a graceful stop away from the process that loads it (an asyncio
    loop's ``add_signal_handler`` included)."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def load_verifiers_env(spec: str, args: Mapping[str, Any] | None = None) -> Any:
    """The ``verifiers`` Environment that ``load_environment(**args)`` returns in ``spec``:
    a module name (or hub id) or a ``path/to/file.py``.

    Raises ``ImportError`` when ``verifiers`` is missing, :class:`SpecError` when the module
    or file does not load or has no ``load_environment``, ``TypeError`` when ``args`` do not
    fit its signature or it returns something other than an Environment. Call it from the
    main thread: an Environment sets signal handlers when it is built (this function puts
    the caller's back)."""
    vf = import_verifiers()
    args = dict(args or {})
    try:
        load = load_callable(_loader_spec(spec))
    except SpecError as exc:
        if "has no attribute 'load_environment'" in str(exc):
            raise SpecError(
                f"verifiers environment {spec!r} has no load_environment(); an environment "
                "module defines `def load_environment(**kwargs) -> vf.Environment`"
            ) from None
        raise SpecError(f"verifiers environment {spec!r}: {exc}") from exc
    try:
        with _signal_handlers_kept():
            env = load(**args)
    except TypeError as exc:
        raise TypeError(f"load_environment of {spec!r} with args {args}: {exc}") from exc
    if not isinstance(env, vf.Environment):
        raise TypeError(
            f"load_environment of {spec!r} returned a {type(env).__name__}, "
            "not a verifiers Environment"
        )
    if not env.env_id:
        env.env_id = Path(spec).stem if spec.endswith(".py") else spec
    env.env_args = env.env_args or args
    return env


def verifiers_records(env: Any, split: str = "train", limit: int | None = None) -> list[dict]:
    """The environment's dataset rows as asyncrl prompt records: ``messages`` (the chat the
    environment built), ``prompt`` (the text of its last user turn, for display),
    ``answer``, ``info``, ``example_id`` and every other column. ``split`` is ``train``
    (``get_dataset``) or ``eval`` (``get_eval_dataset``, which falls back to the train set
    when the environment has none)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    records = []
    for row in dataset:
        messages = [dict(m) for m in row["prompt"]]
        user = [m for m in messages if m.get("role") == "user"]
        record = {k: v for k, v in row.items() if k != "prompt"}
        record.update(
            messages=messages,
            prompt=str(user[-1].get("content", "")) if user else "",
            answer=row.get("answer", ""),
            info=row.get("info") or {},
        )
        records.append(record)
    return records


def rollout_input(env: Any, record: Mapping[str, Any]) -> dict[str, Any]:
    """The ``verifiers`` rollout input for an asyncrl prompt record.

    ``prompt`` (the chat): the record's ``messages``, else one user turn from its ``prompt``
    (or ``question``) text after the environment's few-shot turns; either way after the
    environment's system prompt unless the chat opens with one (as ``verifiers`` formats
    its datasets). ``answer`` and ``info`` are the record's (``""`` and ``{}`` if absent),
    ``example_id`` its own or 0; its other fields are kept, since reward functions may ask
    for dataset columns by name."""
    messages = chat_messages(record, env.system_prompt or None, env.few_shot or ())
    extra = {k: v for k, v in record.items() if k not in RECORD_FIELDS}
    return {
        **extra,
        "prompt": messages,
        "answer": record.get("answer", ""),
        "info": record.get("info") or {},
        "example_id": record.get("example_id", 0),
    }


class RolloutFailed(Exception):
    """A rollout that ends without a reward: the reason is the message."""


class _GroupScoring:
    """The rubric's scoring of one prompt's group, which needs every rollout's state at
    once (a rubric's group reward functions compare the rollouts).

    Each of the ``size`` rollouts calls :meth:`score` exactly once, with its state or None
    (a rollout that raised); the last to arrive scores the states with
    ``rubric.score_group``, runs ``rubric.cleanup`` on each, and wakes the others. Every
    rollout reaches :meth:`score` unless the whole group is cancelled, so no one waits on a
    rollout that will not come."""

    def __init__(self, rubric: Any, size: int) -> None:
        self.rubric = rubric
        self.size = size
        self.states: list[Any] = []
        self.failure = ""
        self._scored = asyncio.Event()

    async def score(self, state: Any) -> str:
        """Waits until the group is scored; returns why scoring failed, or ``""``."""
        self.states.append(state)
        if len(self.states) == self.size:
            scored = [s for s in self.states if s is not None]
            try:
                if scored:
                    await self.rubric.score_group(scored)
                    for s in scored:
                        await self.rubric.cleanup(s)
            except Exception as exc:  # a rubric is user code: its failure scores 0
                self.failure = f"the rubric raised {type(exc).__name__}: {exc}"
                log.warning("%s", self.failure)
            finally:
                self._scored.set()
        await self._scored.wait()
        return self.failure


_GROUP: contextvars.ContextVar[_GroupScoring] = contextvars.ContextVar("verifiers_group")
"""The scoring of the group being run: set by :meth:`VerifiersWorkflow.arun_episode`, seen
by each rollout's task (tasks copy the context they are created in)."""


def _error_text(error: BaseException) -> str:
    """``verifiers`` wraps a failed model call in an error without a message; the cause says
    what happened."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    cause = error.__cause__
    if cause is not None:
        text += f" (from {type(cause).__name__}: {cause})"
    return text


def check_sampling_args(sampling_args: Mapping[str, Any], endpoint: OpenAIEndpoint) -> None:
    """Raises ValueError, with the endpoint's reason, where ``sampling_args`` (``extra_body``
    included, as the client sends it) hold a value the endpoint refuses on every call: an
    environment that sets its own temperature would otherwise score 0 on every rollout
    (unless the endpoint serves each call its own sampling, ``per_call``)."""
    body = {k: v for k, v in sampling_args.items() if k not in ("n", "extra_body")}
    body.update(sampling_args.get("extra_body") or {})
    try:
        CompletionRequest.model_validate({**body, "prompt": ""}).sampling(
            endpoint.sampling,
            endpoint.max_new_tokens_cap,
            endpoint.sampling_keys,
            endpoint.sampling_mode,
        )
    except ValueError as exc:  # RequestError, or pydantic's ValidationError
        raise ValueError(f"the verifiers environment's sampling_args: {exc}") from None


class VerifiersWorkflow(OpenAIAgentWorkflow):
    """Runs ``group_size`` rollouts of a ``verifiers`` environment per prompt through
    ``endpoint`` and scores the group with the environment's rubric.

    ``env`` is an Environment or a spec for :func:`load_verifiers_env` (with ``env_args``).
    Each rollout's input is :func:`rollout_input` of the prompt record. Sampling: the
    environment's own ``sampling_args`` updated by ``sampling_args`` (as ``verifiers``
    merges its caller's), sent with every call; what neither sets is the endpoint's default
    (the recipe's sampling). Sampling args the endpoint would refuse on every call (a
    temperature, top_p or top_k other than the recipe's, unless ``rollout.endpoint_sampling
    = "per_call"``; a non-neutral penalty) are refused here, naming the key. A chat
    environment talks to ``/v1/chat/completions``, a ``message_type="completion"`` one to
    ``/v1/completions``.

    Rewards: the rubric's ``state["reward"]``; its functions' scores (metrics included)
    are in ``reward_info["rubric_metrics"]``. A rollout that raises, that stops on an
    error it recorded (``state["error"]``: a refused or failed model call, an empty reply,
    a tool the environment lets stop the rollout), or whose group's rubric raises scores 0
    with the reason in ``reward_info['reason']``; the actor goes on. Trajectories, the
    keeping of an episode's last sample, and a group whose engine stopped (dropped, the
    prompt goes back) are :class:`OpenAIAgentWorkflow`'s.
    """

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        env: Any,
        *,
        env_args: Mapping[str, Any] | None = None,
        group_size: int = 1,
        sampling_args: Mapping[str, Any] | None = None,
        request_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(
            endpoint,
            self._rollout,
            group_size=group_size,
            request_timeout_s=request_timeout_s,
        )
        self.vf = import_verifiers()
        self.env = load_verifiers_env(env, env_args) if isinstance(env, str) else env
        merged = {k: v for k, v in self.env.sampling_args.items() if k not in ("n", "extra_body")}
        if self.env.sampling_args.get("extra_body"):
            merged["extra_body"] = dict(self.env.sampling_args["extra_body"])
        merged.update(sampling_args or {})
        check_sampling_args(merged, endpoint)
        self.sampling_args = merged

    async def arun_episode(self, engine: Any, item: Any) -> Any:
        token = _GROUP.set(_GroupScoring(self.env.rubric, self.group_size))
        try:
            return await super().arun_episode(engine, item)
        finally:
            _GROUP.reset(token)

    def _client(self, client: Any) -> Any:
        if self.env.message_type == "completion":
            return self.vf.OpenAICompletionsClient(client)
        return self.vf.OpenAIChatCompletionsClient(client)

    async def _rollout(self, client: Any, data: dict[str, Any]) -> dict[str, Any]:
        """One rollout through ``client`` (an episode's) and its group's scoring: its reward
        and the rubric's per-function scores (``rubric_metrics`` in ``reward_info``), or
        :class:`RolloutFailed` with the reason when it has no reward."""
        group = _GROUP.get()
        state = None
        failure = ""
        try:
            state = await self.env.rollout(
                rollout_input(self.env, data),
                self._client(client),
                self.endpoint.model_name,
                dict(self.sampling_args),
            )
        except Exception as exc:  # an environment is user code: its failure scores 0
            failure = f"the rollout raised {_error_text(exc)}"
        if state is not None and state.get("error") is not None:
            failure = f"the rollout stopped on {_error_text(state['error'])}"
        rubric_failure = await group.score(state)
        if state is None or failure or rubric_failure:  # no state: the rollout raised
            raise RolloutFailed(failure or rubric_failure)
        metrics = {str(k): float(v) for k, v in (state.get("metrics") or {}).items()}
        return {"reward": float(state["reward"]), "rubric_metrics": metrics}


def verifiers_workflow(
    spec: str,
    *,
    endpoint: OpenAIEndpoint,
    env_args: Mapping[str, Any] | None = None,
    group_size: int = 1,
    sampling_args: Mapping[str, Any] | None = None,
) -> VerifiersWorkflow:
    """The workflow of ``rollout.workflow = "verifiers:<spec>"``: ``spec`` is what follows
    ``verifiers:`` (a module, hub id or ``path/to/file.py``; see :func:`load_verifiers_env`)."""
    return VerifiersWorkflow(
        endpoint,
        spec,
        env_args=env_args,
        group_size=group_size,
        sampling_args=sampling_args,
    )
