"""The recipe schema: one pydantic tree, loaded from TOML plus ``--set a.b=c`` overrides.

Every model forbids unknown keys, so a typo fails before anything starts with the key's
full path. The ``model``, ``trainer`` and ``rollout.engine`` sections are the configs of
the components built from them and live beside those (:mod:`asyncrl.models.resolve`,
:mod:`asyncrl.train.config`, :mod:`asyncrl.engines.config`), and the ``run`` section,
which the runtime reads without the rest, is :mod:`asyncrl.config.run`; values one section
derives from others are computed in :meth:`Recipe._derive` only. This module imports no
torch, nor what the workflows it configures run on: ``asyncrl check`` and ``--help`` stay
instant.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncrl.api.inference import SamplingMode, SamplingParams
from asyncrl.config.agent import AgentConfig
from asyncrl.config.placement import NodeSpec, Placement
from asyncrl.config.run import RunConfig
from asyncrl.config.schema import CpuList, RecipeError, Section
from asyncrl.config.workflow import (
    VERIFIERS_PREFIX,
    RLVRWorkflowConfig,
    WorkflowConfig,
    workflow_shorthand,
)
from asyncrl.data.gsm8k import BOXED_INSTRUCTION
from asyncrl.data.shapes import COLORS, KINDS, QUESTIONS, SHAPES_INSTRUCTION, names_among

# The sections of other components are theirs: each class is the config its component
# is built from, so that what this schema accepts, the component accepts.
from asyncrl.engines.config import EngineConfig, HFEngineConfig
from asyncrl.models.resolve import ModelConfig
from asyncrl.train.config import DERIVED_KEYS, TrainerConfig
from asyncrl.weights.config import WeightsConfig


class ArithmeticData(Section):
    type: Literal["arithmetic"] = "arithmetic"
    """Synthetic offline arithmetic questions with \\boxed{} answers."""
    size: int = Field(2000, ge=1)
    """Number of generated questions."""
    max_operand: int = Field(20, ge=1)
    """Largest operand."""
    ops: str = "+-"
    """Operators to draw from."""
    instruction: str = BOXED_INSTRUCTION
    """Appended to each question."""


class ProductsData(Section):
    type: Literal["products"] = "products"
    """Synthetic offline products ``What is a * b?`` for tool use (the ``calculator``)."""
    size: int = Field(2000, ge=1)
    """Number of generated questions."""
    digits: tuple[Annotated[int, Field(ge=1, le=9)], Annotated[int, Field(ge=1, le=9)]] = (3, 4)
    """Digits of the two factors."""
    instruction: str = "Use the calculator, then give the final answer in \\boxed{}."
    """Appended to each question."""
    example: bool = False
    """Start each chat with one solved exchange (question, calculator call, result, boxed
    answer); needs a chat template that renders the ``tool`` role."""


class ShapesData(Section):
    type: Literal["shapes"] = "shapes"
    """Synthetic offline images of coloured circles, squares and triangles, each with a
    counting question (``How many red shapes are there?``) whose answer is an integer.
    Records carry the image as a file path (``image``), rendered once into ``cache_dir``."""
    size: int = Field(2000, ge=1)
    """Number of generated questions."""
    image_size: int = Field(128, ge=32, le=1024)
    """Side of the square images, in pixels."""
    min_shapes: int = Field(1, ge=1)
    """Fewest shapes in an image."""
    max_shapes: int = Field(6, ge=1)
    """Most shapes in an image (they must fit without overlap: about 10 at 128 pixels)."""
    colors: list[str] = Field(default_factory=lambda: ["red", "green", "blue", "yellow"])
    """Colours to draw from, among red, green, blue, yellow, purple, orange, gray, cyan."""
    kinds: list[str] = Field(default_factory=lambda: list(KINDS))
    """Shapes to draw from, among circle, square, triangle."""
    questions: list[str] = Field(default_factory=lambda: list(QUESTIONS))
    """What questions count: ``color`` (red shapes), ``kind`` (triangles), ``color_kind``
    (red triangles), ``total`` (all shapes)."""
    questions_per_image: int = Field(1, ge=1)
    """Consecutive records that ask about the same image."""
    instruction: str = SHAPES_INSTRUCTION
    """Appended to each question."""
    cache_dir: str | None = None
    """Folder the images are written to (one sub-folder per seed and drawing settings);
    None: ``$ASYNCRL_CACHE/shapes``, else ``~/.cache/asyncrl/shapes``."""

    @field_validator("colors")
    @classmethod
    def _known_colors(cls, v: list[str]) -> list[str]:
        return names_among(v, tuple(COLORS))

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, v: list[str]) -> list[str]:
        return names_among(v, KINDS)

    @field_validator("questions")
    @classmethod
    def _known_questions(cls, v: list[str]) -> list[str]:
        return names_among(v, QUESTIONS)

    @model_validator(mode="after")
    def _shape_counts(self) -> ShapesData:
        if self.min_shapes > self.max_shapes:
            raise ValueError(
                f"min_shapes ({self.min_shapes}) is above max_shapes ({self.max_shapes})"
            )
        return self


class JsonlData(Section):
    type: Literal["jsonl"] = "jsonl"
    """Records from a local JSONL file (GSM8K format: question/answer)."""
    path: str
    """The JSONL file."""
    prompt_key: str = "question"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference answer."""
    image_key: str | None = None
    """Field naming a record's image file (a path relative to the JSONL file's folder, or
    absolute), e.g. ``"image"``; every file named must exist, checked as the records load.
    Records without the field are text-only. None (the default) reads no images, so that a
    text dataset with a field of that name is read as before."""


class HFData(Section):
    type: Literal["hf"] = "hf"
    """A dataset from the HF hub (needs network or a local cache)."""
    name: str
    """Dataset id, e.g. ``openai/gsm8k``."""
    subset: str | None = None
    """Configuration name, e.g. ``main``."""
    split: str = "train"
    """Split to train on."""
    prompt_key: str = "question"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference answer."""
    image_key: str | None = None
    """Field naming a record's image file (absolute, or relative to the directory the run
    starts in), as ``data.jsonl``'s; every file named must exist. None (the default):
    records are text."""


DataConfig = Annotated[
    ArithmeticData | ProductsData | ShapesData | JsonlData | HFData,
    Field(discriminator="type"),
]


def image_field(data: DataConfig | None) -> str | None:
    """The record field that names a prompt's image files in ``data``'s records: ``image``
    for the shapes task, ``image_key`` for a JSONL file or a hub dataset; None where
    records hold text only."""
    if isinstance(data, ShapesData):
        return "image"
    if isinstance(data, JsonlData | HFData):
        return data.image_key
    return None


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scores logprobs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k cut-off; 0 disables it."""
    max_new_tokens: int = Field(256, ge=1)
    """Most tokens generated per turn."""

    def params(self, **changes: Any) -> SamplingParams:
        """These settings as the engines take them, with ``changes`` (an eval's
        temperature and budget) applied."""
        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        return SamplingParams(**{**fields, **changes})


class RolloutConfig(Placement):
    actors: int = Field(1, ge=0)
    """Rollout actor processes ``up`` starts (more can be attached later)."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """The inference backend."""
    workflow: Annotated[WorkflowConfig, BeforeValidator(workflow_shorthand)] = Field(
        default_factory=RLVRWorkflowConfig
    )
    """The workflow, a table on ``type`` (:mod:`asyncrl.config.workflow`): ``rlvr``,
    ``multi_turn``, ``agent`` (tool calls; its tools in ``rollout.agent``), ``agent_code``
    (``fn``: ``async def agent(client, data) -> float``, run against this actor's
    endpoint), ``verifiers`` (``env``) or ``episode`` (``fn``: ``async def
    episode(engine, item)``, or a workflow class or factory). One string says the same:
    ``"rlvr"``, ``"multi_turn"``, ``"agent"``, ``"verifiers:<env>"``, or
    ``"path/to/file.py:name"`` / ``"module:name"`` (agent code or an episode function by
    its first parameter)."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Tools, parser and limits of the ``agent`` workflow."""
    endpoint: bool | None = None
    """Serve an OpenAI-compatible endpoint (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``) from each rollout actor's engine, on 127.0.0.1, requiring the run's
    NATS token (or, in a run without one, a token of the actor's own) as the API key; its
    URL is in ``<run>/endpoints/<actor>.json`` and the actor's log. None: on exactly when
    the workflow is agent code, which needs it."""
    endpoint_port: int = Field(0, ge=0, le=65535)
    """The endpoint's port; 0 takes a free one (a fixed port suits one rollout actor per
    machine)."""
    endpoint_record: bool = False
    """Append every call agent code makes through the endpoint (prompt and completion token
    ids, versions) to ``<run>/endpoint_calls.jsonl``, per episode with its sample's uid:
    to check what was trained against what was sampled. About a prompt of JSON per call."""
    endpoint_sampling: SamplingMode = "recipe"
    """How the endpoint's calls sample. ``recipe``: every call with ``rollout.sampling``,
    which the trainer scores every token with (a call that sends another temperature,
    top_p or top_k gets a 400 naming the key). ``per_call``: each call with the
    temperature, top_p and top_k it sends (what it leaves out is ``rollout.sampling``'s):
    greedy calls (temperature 0) are served but never trained, a change of sampling
    within an episode starts a new sample, and the trainer scores each sample with its
    own temperature and cut. Only for a workflow whose episodes call the endpoint (agent
    code, a verifiers environment, an episode workflow handed the endpoint); the eval's
    endpoints serve calls the same way."""
    group_size: int = Field(4, ge=1)
    """Samples per prompt (one GRPO group)."""
    max_concurrent: int = Field(16, ge=1)
    """Episodes one rollout actor runs at once."""
    max_turns: int = Field(2, ge=1)
    """Turns of the ``multi_turn`` workflow; replies per sample of the ``agent`` workflow
    (the last one is scored as it is). Agent code decides its own turns."""
    turn_discount: float = Field(0.9, gt=0, le=1)
    """``γ``. In ``multi_turn``, what a success is worth per feedback turn it needed (the
    reward is ``r_t · γ^t``). For agent code, an episode of several samples (calls that do
    not all continue one another) discounts a sample's advantage, not its reward, per call
    between its last call and the episode's last: ``A_j = γ^k · A_episode``."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    lease_ttl: float = Field(30.0, gt=0)
    """Seconds without a heartbeat after which an actor's leased prompts return to the pool."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in each rollout process; 0 leaves torch's default. On a small
    CPU, give generation and training their own cores: oversubscribed threads spin."""
    cpus: CpuList = Field(default_factory=list)
    """CPU ids each rollout process (and its vLLM servers) may run on, e.g. ``[0]``; empty:
    any. With ``threads`` and ``trainer.cpus`` this keeps generation and training apart."""
    actors_per_node: int = Field(0, ge=0)
    """Rollout actors on each node of ``rollout.node`` (``up --ray``); 0: ``actors``
    spread over them in turn. Set, ``actors`` must be ``actors_per_node`` × the nodes."""
    colocate: bool = False
    """Rollout engines and the trainer take turns on one accelerator: before each trainer
    step the engines pause and release their weights and KV cache, and take them back
    with the new weights (synchronous, like η = 0, but in half the GPUs)."""
    deterministic: bool = False
    """Generation that depends only on (``run.seed``, prompt id, sample index, attempt):
    every sample draws from a generator of its own, seeded from those, and the engine
    computes each sequence alone, so no float depends on what else was in flight (the hf
    engine decodes one sequence at a time, without its prefix cache: slower). The buffer
    orders each batch by prompt id. With ``buffer.max_head_offpolicyness = 0`` two runs of
    one seed train the same weights; vllm, sglang and the endpoint's workflows refuse it
    (``asyncrl check`` says why)."""

    @property
    def serves_endpoint(self) -> bool:
        """Whether each rollout actor serves the endpoint: ``endpoint``, or when it is
        unset, whether the workflow runs through it (agent code)."""
        return self.endpoint if self.endpoint is not None else self.workflow.needs_endpoint


class RewardConfig(Placement):
    fn: str = "math"
    """``math`` (math-verify, for GSM8K and \\boxed{} answers; an unboxed answer falls back
    to the last number), ``math_boxed`` (the same, but only a \\boxed{} answer counts), or
    ``path/to/file.py:fn``."""
    actors: int = Field(1, ge=0)
    """Reward actor processes (a queue group: more means more throughput)."""
    workers: int = Field(2, ge=1)
    """Worker processes per reward actor."""
    timeout: float = Field(10.0, gt=0)
    """Seconds one reward call may take; past it the sample scores 0."""
    cpus: CpuList = Field(default_factory=list)
    """CPU ids each reward actor and its worker processes may run on; empty: any."""


class BufferConfig(Placement):
    batch_size: int = Field(8, ge=1)
    """B: episodes (prompt groups) per training batch."""
    max_head_offpolicyness: int = Field(2, ge=0)
    """η: the oldest token of a trained episode may come from at most η *published*
    versions before the newest published one. With ``trainer.update_every = k`` the
    trainer runs up to k − 1 unpublished steps ahead, so a trained episode is at most
    η + k − 1 trainer versions old (``asyncrl check`` prints that bound). 0 with k = 1 is
    synchronous RL."""
    max_concurrent: int = Field(64, ge=1)
    """C: episodes in flight across all rollout actors."""
    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal (they carry no GRPO signal)."""
    durable: bool = True
    """Keep the buffer's state (leases, groups, served batches, dataset position) in the
    run's JetStream object store, written before a lease, an admission or a batch is
    acknowledged, so a buffer killed in mid-run restarts where it stood, and ``up --resume``
    continues the dataset from where the checkpoint's batches stood. False: neither (a
    resumed run starts the dataset from its beginning, with a warning)."""


class EvalConfig(Placement):
    every: int = Field(0, ge=0)
    """Evaluate every k policy versions (trainer steps), at version 0 and at the last one;
    0 turns evaluation off."""
    data: DataConfig | None = None
    """Where the held-out prompts come from (any ``data`` source). None: ``max_prompts``
    records carved out of the run's own data, which the buffer then never leases."""
    max_prompts: int = Field(64, ge=1)
    """Prompts per evaluation (and the size of the carved-out split when ``data`` is None)."""
    greedy: bool = True
    """Score one greedy completion per prompt (``eval/accuracy``)."""
    k: int = Field(0, ge=0)
    """Samples per prompt at ``temperature`` for ``eval/pass@k`` and ``eval/mean@k``; 0: none."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the k samples."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Token budget per completion; None: ``rollout.sampling.max_new_tokens``."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in the eval process; 0 leaves torch's default."""
    cpus: CpuList = Field(default_factory=list)
    """CPU ids the eval process may run on; empty: any."""

    @model_validator(mode="after")
    def _something_to_score(self) -> EvalConfig:
        if self.every and not self.greedy and not self.k:
            raise ValueError("eval: greedy is false and k is 0, so nothing would be scored")
        return self


class Recipe(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and infrastructure."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=ArithmeticData)
    """The prompt dataset."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout actors."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward actors."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The buffer and the staleness rule."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Periodic evaluation on held-out prompts (its own actor, role ``eval``)."""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    """How new weights travel from the trainer to the engines (:mod:`asyncrl.weights`)."""
    nodes: dict[str, NodeSpec] = Field(default_factory=dict)
    """The cluster's nodes by name (``[nodes.gpu-a] gpus = 8``), for ``asyncrl check``
    to refuse a placement (``<role>.node``, ``<role>.gpus``) that cannot fit; empty: not
    checked. See :mod:`asyncrl.config.placement`."""

    @model_validator(mode="before")
    @classmethod
    def _no_derived_keys(cls, data: Any) -> Any:
        trainer = data.get("trainer") if isinstance(data, dict) else None
        if isinstance(trainer, dict) and "weights_transport" in trainer:
            raise ValueError(
                "trainer.weights_transport is now weights.transport (a [weights] section: "
                f'transport = {trainer["weights_transport"]!r}, or "auto")'
            )
        if isinstance(trainer, dict):
            given = [k for k in DERIVED_KEYS if k in trainer]
            if given:
                raise ValueError(
                    "; ".join(
                        f"trainer.{k} is no recipe key: the trainer scores the distribution "
                        f"that sampled, so it is {DERIVED_KEYS[k]}; set that instead"
                        for k in given
                    )
                )
        return data

    @model_validator(mode="after")
    def _derive(self) -> Recipe:
        """The values one section takes from others, computed here and nowhere else: the
        trainer's sampling parameters (its logprobs must be of the sampler's
        distribution) and Dr.GRPO's divisor ``trainer.loss.norm_len``, when unset, the
        generation budget (a batch-dependent divisor would bring back the length bias the
        variant removes). The cosine schedule ends at ``trainer.max_steps`` itself."""
        t, s = self.trainer, self.rollout.sampling
        t.temperature, t.top_k, t.top_p = s.temperature, s.top_k, s.top_p
        if t.loss.loss_agg == "seq-mean-token-sum-norm" and t.loss.norm_len is None:
            t.loss.norm_len = float(generation_budget(self))
        return self


def generation_budget(recipe: Recipe) -> int:
    """Most tokens a sample can generate: ``max_new_tokens``, per turn for ``multi_turn``
    and ``agent`` (there at most ``rollout.agent.max_total_tokens``). Agent code decides
    its own turns: its budget is counted per call."""
    return recipe.rollout.workflow.generation_budget(recipe.rollout)


def sample_budget(recipe: Recipe, replies: int) -> int:
    """Most tokens a sample of ``replies`` replies can generate: :func:`generation_budget`
    per call for agent code (a sample may hold several calls that continue one another),
    the whole budget for the turn-based workflows."""
    return recipe.rollout.workflow.sample_budget(recipe.rollout, replies)


def _format_validation(exc: ValidationError) -> str:
    return format_validation_error(exc, Recipe)


def format_validation_error(exc: ValidationError, root: type[BaseModel]) -> str:
    """Every error of ``exc`` on one line naming its key (``root``'s dotted path); an
    unknown key lists the allowed ones."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _model_at(err["loc"][:-1], root)
            if parent is not None:
                msg += f" (allowed: {', '.join(sorted(parent.model_fields))})"
        if not err["loc"]:  # a check across sections: its message names its keys
            lines.append(f"  {msg.removeprefix('Value error, ')}")
            continue
        got = _URL_CREDENTIALS.sub("://***@", repr(err.get("input")))
        lines.append(f"  {key}: {msg} (got {got})")
    return "invalid recipe:\n" + "\n".join(lines)


_URL_CREDENTIALS = re.compile(r"://[^/@\s'\"]+@")
"""The ``user:password@`` of a URL, kept out of error messages (a terminal, a CI log)."""


def _model_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            # a discriminated union member name (pydantic puts the tag in the path)
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML/JSON literal if it parses (numbers, booleans, lists,
    quoted strings), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies ``a.b.c=value`` overrides in place and returns ``data``."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise RecipeError(f"--set {item!r}: empty key")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: {p} is not a section")
            node = child
        node[parts[-1]] = parse_value(value.strip())
    return data


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The TOML recipe at ``path`` as a dict (nothing validated). Raises
    :class:`RecipeError` when the file is missing or is not TOML."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"recipe {str(p)!r} is not valid TOML: {exc}") from None


def load_recipe(
    path: str | Path | None, overrides: list[str] | None = None, *, here: bool = True
) -> Recipe:
    """Reads a TOML recipe (or the defaults when ``path`` is None), applies overrides,
    validates. Raises :class:`RecipeError` naming every bad key.

    A ``file.py:name`` spec written in the recipe file (``reward.fn``,
    ``rollout.workflow``) is found beside the recipe, so a recipe and its reward can
    travel together; specs given with ``--set`` are relative to the working directory.

    ``here``: the run starts on this machine, so what only this machine can tell is
    checked too (:func:`path_problems`: local model folder, data files, sink packages).
    False for a run that starts elsewhere (``asyncrl slurm``, ``check --nodes``), whose
    caller reports those lines as not verified instead."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_recipe_file(path)
        _anchor_code_specs(data, Path(path).parent)
    _switch_types(data, overrides or [])
    apply_overrides(data, overrides or [])
    for section, (_, default) in TYPED_SECTIONS.items():
        node = _section(data, section)
        if isinstance(node, dict):
            node.setdefault("type", default.model_fields["type"].default)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_validation(exc)) from None
    _check_paths(recipe)
    if here and (problems := path_problems(recipe)):
        raise RecipeError("invalid recipe:\n" + "\n".join(f"  {p}" for p in problems))
    _check_cpus(recipe)
    return recipe


TYPED_SECTIONS: dict[str, tuple[Any, type[BaseModel]]] = {
    "data": (DataConfig, ArithmeticData),
    "eval.data": (DataConfig, ArithmeticData),
    "rollout.engine": (EngineConfig, HFEngineConfig),
    "rollout.workflow": (WorkflowConfig, RLVRWorkflowConfig),
}
"""The sections that are a choice of types (a discriminated union on ``type``), each with
the type a table without ``type`` has."""


def _section(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _switch_types(data: dict[str, Any], overrides: list[str]) -> None:
    """A ``--set <section>.type=...`` that switches a typed section (:data:`TYPED_SECTIONS`)
    to another type drops the keys the recipe file gave it that the new type lacks, so
    ``--set data.type=jsonl --set data.path=...`` turns a hub dataset (``name``,
    ``subset``, ``split``) into a local file. Keys given with ``--set`` are all kept, and
    checked as always."""
    for item in overrides:
        key, sep, value = item.partition("=")
        section = key.strip().removesuffix(".type")
        if not sep or section == key.strip() or section not in TYPED_SECTIONS:
            continue
        node = _section(data, section)
        new_type = parse_value(value.strip())
        if not isinstance(node, dict) or node.get("type", new_type) == new_type:
            continue
        union = get_args(get_args(TYPED_SECTIONS[section][0])[0])
        fields = next(
            (m.model_fields for m in union if m.model_fields["type"].default == new_type), None
        )
        for name in [k for k in node if fields is not None and k not in fields]:
            del node[name]


def _anchor_code_specs(data: dict[str, Any], base: Path) -> None:
    rollout = data.get("rollout")
    agent = rollout.get("agent") if isinstance(rollout, dict) else None
    workflow = rollout.get("workflow") if isinstance(rollout, dict) else None
    for node, key in (
        (data.get("reward"), "fn"),
        (rollout, "workflow"),
        (agent, "env"),
        (workflow, "fn"),
    ):
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = _anchored(node[key], base)
    if isinstance(workflow, dict) and isinstance(workflow.get("env"), str):
        workflow["env"] = _anchored(VERIFIERS_PREFIX + workflow["env"], base).removeprefix(
            VERIFIERS_PREFIX
        )
    if isinstance(agent, dict) and isinstance(agent.get("tools"), list):
        agent["tools"] = [_anchored(t, base) if isinstance(t, str) else t for t in agent["tools"]]


def _anchored(spec: str, base: Path) -> str:
    """``file.py:name`` with the file found beside the recipe made absolute; any other
    spec as it is."""
    if spec.startswith(VERIFIERS_PREFIX):
        env = spec.removeprefix(VERIFIERS_PREFIX)
        beside = base / env
        if env.endswith(".py") and not Path(env).is_absolute() and beside.is_file():
            return f"{VERIFIERS_PREFIX}{beside.resolve()}"
        return spec
    if ":" not in spec:
        return spec
    file_part, name = spec.split(":", 1)
    beside = base / file_part
    if file_part.endswith(".py") and not Path(file_part).is_absolute() and beside.is_file():
        return f"{beside.resolve()}:{name}"
    return spec


def code_files(recipe: Recipe) -> list[tuple[str, str]]:
    """``(key, file)`` of every ``path/to/file.py`` the recipe's code specs name."""
    agent = recipe.rollout.agent
    specs = [
        ("rollout.workflow", recipe.rollout.workflow.code()),
        ("reward.fn", recipe.reward.fn if ":" in recipe.reward.fn else ""),
        ("rollout.agent.env", agent.env),
    ]
    specs += [(f"rollout.agent.tools[{i}]", t) for i, t in enumerate(agent.tools) if ":" in t]
    files = [(key, spec.split(":", 1)[0]) for key, spec in specs]
    return [(key, file) for key, file in files if file.endswith(".py")]


def path_problems(recipe: Recipe) -> list[str]:
    """What only the machine where the run starts can tell, each line naming its key: a
    local model folder or data file that does not exist, a metrics sink whose package is
    missing. ``asyncrl up`` refuses these; ``asyncrl slurm`` and ``check --nodes`` (the
    run starts on the cluster) report them as not verified."""
    problems = []
    model_path = recipe.model.path
    looks_local = model_path.startswith((".", "/", "~")) or Path(model_path).exists()
    if looks_local and not Path(model_path).expanduser().is_dir():
        problems.append(f"model.path: directory {model_path!r} does not exist")
    for key, source in (("data", recipe.data), ("eval.data", recipe.eval.data)):
        if isinstance(source, JsonlData) and not Path(source.path).expanduser().is_file():
            problems.append(f"{key}.path: file {source.path!r} does not exist")
    # checked where a run starts, not where an actor reads the run's recipe: a rollout
    # actor on another machine needs neither package
    return problems + recipe.run.missing_packages()


def _check_paths(recipe: Recipe) -> None:
    """What must hold wherever the run starts: held-out prompts that leave data to train
    on, and the recipe's own code files (they travel beside it)."""
    problems = []
    if (
        recipe.eval.every
        and recipe.eval.data is None
        and isinstance(recipe.data, ArithmeticData | ProductsData | ShapesData)
        and recipe.data.size <= recipe.eval.max_prompts
    ):
        problems.append(
            f"  eval.max_prompts: {recipe.eval.max_prompts} held-out prompts would leave none "
            f"of data.size={recipe.data.size} to train on"
        )
    for key, file in code_files(recipe):
        if not Path(file).is_file():
            problems.append(f"  {key}: file {file!r} does not exist")
    if problems:
        raise RecipeError("invalid recipe:\n" + "\n".join(problems))


def role_cpus(recipe: Recipe) -> dict[str, list[int]]:
    """The CPU ids each role is pinned to (``<role>.cpus``), for the roles that have the key."""
    return {
        "rollout": recipe.rollout.cpus,
        "reward": recipe.reward.cpus,
        "trainer": recipe.trainer.cpus,
        "eval": recipe.eval.cpus,
    }


def _check_cpus(recipe: Recipe) -> None:
    """Every pinned CPU id exists on this machine. Checked where a run starts: an actor
    attached from another machine applies only its own role's key, at its own start."""
    count = os.cpu_count() or 1
    problems = [
        f"  {role}.cpus: {bad} not on this machine (CPU ids 0-{count - 1})"
        for role, ids in role_cpus(recipe).items()
        if (bad := sorted(i for i in set(ids) if i >= count))
    ]
    if problems:
        raise RecipeError("invalid recipe:\n" + "\n".join(problems))


def dump_recipe(recipe: BaseModel) -> str:
    """The resolved recipe as TOML-ish text (what the run folder keeps)."""
    return _to_toml(recipe.model_dump(mode="json"))


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = []
    tables = []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append(_to_toml(v, f"{prefix}{k}."))
        elif v is not None:
            scalars.append(f"{k} = {json.dumps(v)}")
    out = ""
    if scalars:
        header = f"[{prefix[:-1]}]\n" if prefix else ""
        out += header + "\n".join(scalars) + "\n\n"
    return out + "".join(tables)
