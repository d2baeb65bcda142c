"""The wire schema: every message that crosses NATS (or sits in the run's object store).

Each message is a pydantic model; :mod:`asyncrl.wire.codec` puts it on the wire as one msgpack
map ``{"k": kind, "v": SCHEMA_VERSION, "d": fields}`` and checks kind, schema version and
fields on the way back. Numeric arrays travel as :class:`Array` (raw bytes + dtype +
shape), never as lists. This module imports numpy but no torch, so the schema loads fast
anywhere.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from asyncrl.wire.unchecked import assembled, updated

SCHEMA_VERSION = 1

ALLOWED_DTYPES = frozenset(
    {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"}
)

# Every Array received is checked against this: a dict lookup is far cheaper per message
# than np.dtype(name), which dominated the cost of validating a small array.
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}
_LITTLE = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
"""Each allowed dtype, little-endian: looked up, not built, for every array read."""
_LITTLE_NAMES = {dtype: name for name, dtype in _LITTLE.items()}
"""The name of each allowed little-endian dtype: ``dtype.name`` costs more than making a
small array."""
_LIST_CODES = (
    {"int32": "i", "int64": "q", "float32": "f", "float64": "d"}
    if sys.byteorder == "little" and array("i").itemsize == 4 and array("q").itemsize == 8
    else {}
)
"""The :mod:`array` type code of a dtype whose bytes it writes exactly as numpy does (on
a little-endian machine): a flat list of Python numbers converts several times faster."""


class Array(BaseModel):
    """A dense numeric array as raw little-endian bytes, its dtype and its shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @model_validator(mode="after")
    def _check_size(self) -> Array:
        itemsize = _ITEMSIZE.get(self.dtype)
        shape = self.shape
        if itemsize is not None and len(shape) == 1 and len(self.data) == itemsize * shape[0]:
            # the usual array, 1-d (a length that matches cannot be negative): told in one
            # step; every other case goes through the checks below, which name the fault
            return self
        if itemsize is None:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}")
        expected = itemsize
        for dim in self.shape:
            if dim < 0:
                raise ValueError(f"negative dimension in shape {self.shape}")
            expected *= dim
        if len(self.data) != expected:
            raise ValueError(
                f"{len(self.data)} bytes do not match dtype {self.dtype} and shape {self.shape}"
                f" ({expected} bytes expected)"
            )
        return self

    @classmethod
    def of(cls, values: Any, dtype: str | None = None) -> Array:
        """Wraps anything numpy can turn into an array (a list, a numpy array, a CPU tensor)."""
        if type(values) is list and dtype is not None and cls is Array:
            data = _list_bytes(values, dtype)
            if data is not None:
                return assembled(Array, {"dtype": dtype, "shape": (len(values),), "data": data})
        if hasattr(values, "detach"):  # a torch tensor, without importing torch here
            values = values.detach().cpu().numpy()
        arr = np.asarray(values, dtype=dtype)
        name = _LITTLE_NAMES.get(arr.dtype)
        if name is not None and cls is Array:
            # an allowed little-endian dtype (every one, on a little-endian machine): the
            # bytes, C order, match dtype and shape by construction, which is all that
            # validation checks; assembled, not validated (a rollout makes four a sample)
            return assembled(Array, {"dtype": name, "shape": arr.shape, "data": arr.tobytes()})
        # astype(order="C") keeps a 0-d array 0-d (ascontiguousarray would make it 1-d)
        arr = arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False)
        return cls(dtype=arr.dtype.name, shape=tuple(arr.shape), data=arr.tobytes())

    def numpy(self) -> np.ndarray:
        """A read-only view of the bytes; copy it before writing."""
        return np.frombuffer(self.data, dtype=_LITTLE[self.dtype]).reshape(self.shape)

    def tolist(self) -> list[Any]:
        return self.numpy().tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1


def _list_bytes(values: list[Any], dtype: str) -> bytes | None:
    """The bytes numpy would make of a flat list of numbers as ``dtype``, where the
    :mod:`array` module (or ``bytes``, for a bool list of 0s and 1s) makes the same; None
    for anything else (another dtype, a nested list, a value it would convert otherwise:
    a float in an int list, a number out of range), which numpy converts."""
    try:
        if dtype == "bool":
            data = bytes(values)  # True, False, 0 and 1 only, as checked next
            return None if data.translate(None, b"\x00\x01") else data
        code = _LIST_CODES.get(dtype)
        return None if code is None else array(code, values).tobytes()
    except (TypeError, ValueError, OverflowError):
        return None


class Message(BaseModel):
    """Base of every wire message. ``KIND`` names it on the wire."""

    model_config = ConfigDict(extra="forbid")
    KIND: ClassVar[str] = ""


# --- control plane -----------------------------------------------------------------------


class ActorInfo(Message):
    """Who an actor is; the body of ``started`` and of every heartbeat."""

    KIND: ClassVar[str] = "actor_info"
    role: str
    actor_id: str
    pid: int
    host: str
    version: int = Field(default=-1, description="policy version the actor holds, -1 if none")
    asyncrl_version: str = ""
    status: str = "running"
    time: float = 0.0
    holding: list[str] | None = Field(
        default=None,
        description="prompt uids whose episodes the actor runs now (rollout actors); None: "
        "the actor holds no leases",
    )
    delivered: list[str] = Field(
        default_factory=list,
        description="prompt uids whose trajectories the actor recently put on the stream: "
        "their scores are on the way, so the buffer keeps their leases",
    )
    dropped: dict[str, int] = Field(
        default_factory=dict,
        description="received messages the actor's bus did not handle, since it started, "
        "by ``<subject>/<reason>`` (the subscription's subject without the run prefix)",
    )


class Control(Message):
    """A command to actors: ``stop`` ends them gracefully."""

    KIND: ClassVar[str] = "control"
    command: Literal["stop"]
    target: str = Field(default="*", description="an actor id, a role, or * for all")
    reason: str = ""


class ActorExit(Message):
    """Published by an actor as it stops, so the supervisor can tell a clean end from a crash."""

    KIND: ClassVar[str] = "actor_exit"
    role: str
    actor_id: str
    ok: bool
    reason: str = ""
    fatal: bool = Field(
        default=False, description="failed in a way a restart cannot mend: not started again"
    )


class Metrics(Message):
    """A metrics record; ``values`` are plain numbers so any NATS client can read them."""

    KIND: ClassVar[str] = "metrics"
    role: str
    actor_id: str
    step: int = -1
    time: float = 0.0
    values: dict[str, float | int] = Field(default_factory=dict)


class Ack(Message):
    """A generic reply: ok or an error text."""

    KIND: ClassVar[str] = "ack"
    ok: bool = True
    error: str = ""


# --- data plane ----------------------------------------------------------------------------


class Prompt(Message):
    """One dataset item handed to a rollout actor. ``uid`` is unique within the run."""

    KIND: ClassVar[str] = "prompt"
    uid: str
    data: dict[str, Any]
    # ≥ 1, but unconstrained: a field constraint takes Lease off the codec's fast path
    attempt: int = Field(
        default=1,
        description="the how-many-th lease of this prompt this is (a retry after a failed or "
        "lost episode counts on): with rollout.deterministic a retry draws other samples",
    )


class LeaseRequest(Message):
    """A rollout actor asks the buffer for up to ``max_episodes`` episodes to start."""

    KIND: ClassVar[str] = "lease_request"
    actor_id: str
    max_episodes: int = Field(ge=1)
    request_id: str = Field(
        default="",
        description="the same id on a retry after a timeout gets the same lease, never a "
        "second one",
    )
    wait: float = Field(
        default=0.0,
        ge=0.0,
        le=60.0,
        description="seconds the buffer may hold the request while it has nothing to lease, "
        "answering as soon as capacity frees (a long poll); 0 answers at once",
    )


class Lease(Message):
    """Episodes an actor may start now. Empty ``prompts`` means: no capacity (for the
    request's whole ``wait``), ask again after ``retry_after`` seconds or on the next
    ``WeightsUpdated``."""

    KIND: ClassVar[str] = "lease"
    lease_id: str
    actor_id: str
    version: int
    prompts: list[Prompt] = Field(default_factory=list)
    retry_after: float = 0.0
    done: bool = Field(default=False, description="the run has ended; the actor should stop asking")
    epoch: int = Field(default=0, description="the trainer epoch the buffer knows")


class EpisodeAborted(Message):
    """A leased episode that produced nothing (workflow returned None or failed). A
    request: the buffer answers :class:`Ack`, and the actor repeats it until it does (a
    repeat is harmless: only the lease it names is returned, once)."""

    KIND: ClassVar[str] = "episode_aborted"
    actor_id: str
    prompt_uid: str
    reason: str = ""
    lease_id: str = Field(default="", description="the lease the episode ran under")


class SampledWith(BaseModel):
    """The distribution a sample's generated tokens were drawn from, where a call of agent
    code chose its own (``rollout.endpoint_sampling = "per_call"``): the trainer scores the
    sample's tokens with this temperature and cut instead of ``rollout.sampling``'s."""

    model_config = ConfigDict(frozen=True)
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    @model_validator(mode="after")
    def _valid(self) -> SampledWith:
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} must be > 0 (greedy is not trained)")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"top_k {self.top_k} must be >= 0 and top_p {self.top_p} in (0, 1]")
        return self


class Trajectory(Message):
    """One sample: the full token sequence of one episode member.

    ``loss_mask`` marks the generated tokens; ``logprobs`` are the behaviour policy's
    logprobs of those tokens (0 elsewhere); ``versions`` is the policy version that produced
    each token (-1 for prompt and environment tokens). ``reward`` is None until scored.
    """

    KIND: ClassVar[str] = "trajectory"
    uid: str = Field(
        description="unique sample id: <prompt uid>/<index in group>, and /<episode_sample> "
        "after it for an episode of several samples"
    )
    prompt_uid: str
    group_index: int
    group_size: int
    episode_sample: int = Field(
        default=0,
        description="which sample of its episode (the group_index-th) this is: agent code "
        "whose calls do not all continue one another gives several",
    )
    episode_samples: int = Field(
        default=1, description="how many samples its episode gave; a group is whole with all"
    )
    actor_id: str = ""
    attempt: str = Field(
        default="", description="the lease that produced it: a retried prompt differs here"
    )
    input_ids: Array
    loss_mask: Array
    logprobs: Array
    versions: Array
    reward: float | None = None
    reward_info: dict[str, Any] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict, description="the prompt record, for scoring")
    completion: str = Field(
        default="", description="the generated text, decoded by the rollout actor"
    )
    finish_reason: str = ""
    sampled_with: SampledWith | None = Field(
        default=None,
        description="the sampling its calls chose (rollout.endpoint_sampling = 'per_call'); "
        "None: rollout.sampling",
    )
    epoch: int = Field(
        default=0,
        description="the trainer epoch (restarts of the trainer) of the weights it was "
        "generated with; a sample of an older epoch comes from a lineage that was rolled back",
    )
    images: list[str] = Field(
        default_factory=list,
        description="the prompt's images, by reference (file paths), one per image in "
        "input_ids' placeholder tokens, in order; pixels never travel in a message",
    )

    @model_validator(mode="after")
    def _same_lengths(self) -> Trajectory:
        _check_lengths(self)
        return self

    def past_scoring(self, **update: Any) -> Trajectory:
        """This sample as it goes on once scored: without the prompt record and the
        completion text, which only scoring reads (the buffer keeps the records by prompt
        id, and training reads tokens); ``update`` sets other fields in the same copy (the
        score)."""
        if not update and not self.data and not self.completion:
            return self
        return updated(self, {**update, "data": {}, "completion": ""})

    def msg_id(self, stage: str) -> str:
        """JetStream dedup id at ``stage`` (``raw``, ``scored``): the same publish retried
        is stored once, while a re-run of the prompt under a new lease is new data."""
        return f"{stage}/{self.attempt}/{self.uid}"

    def to_train_sample(self) -> TrainSample:
        """What training reads of this scored sample (raises ``ValueError`` if unscored):
        every field :class:`TrainSample` has, taken from this one."""
        if self.reward is None:
            raise ValueError(f"sample {self.uid} is not scored")
        # every value is one this validated sample holds, of the type TrainSample's field
        # has (its reward a float, checked above), and TrainSample's own check is the
        # lengths check this sample passed: assembled as validation would, not validated
        # again (about a tenth of what admitting a sample cost); its dict copied as
        # validation would copy it
        fields = self.__dict__
        values = {name: fields[name] for name in _TRAIN_FIELDS}
        values["reward_info"] = dict(self.reward_info)
        values["images"] = list(self.images)
        return assembled(TrainSample, values)

    @property
    def versions_spanned(self) -> int:
        """How many policy versions produced the generated tokens: more than one when a
        weight update landed while this sample was being generated."""
        return _versions_spanned(self.versions)

    @property
    def head_version(self) -> int:
        """The oldest policy version that produced a token of this sample (-1 if none)."""
        return _head_version(self.versions)


class TrajectoryGroup(Message):
    """The samples a workflow produced for one prompt in one go (RLVR's ``group_size``
    completions), as one message: one stream write, one delivery and one ack for the
    group instead of one per sample. The prompt record travels once, in ``data``, not in
    each sample (theirs are empty). Workflows that produce samples one at a time, or
    groups too large for one message, publish :class:`Trajectory` messages instead; the
    buffer judges each sample of a group exactly as it judges one that came alone."""

    KIND: ClassVar[str] = "trajectory_group"
    prompt_uid: str
    attempt: str = Field(default="", description="the lease that produced every sample")
    data: dict[str, Any] = Field(
        default_factory=dict, description="the prompt record, for scoring (raw stage only)"
    )
    samples: list[Trajectory]

    @model_validator(mode="after")
    def _one_prompt_one_attempt(self) -> TrajectoryGroup:
        if not self.samples:
            raise ValueError(f"group {self.prompt_uid} has no sample")
        for t in self.samples:
            if t.prompt_uid != self.prompt_uid or t.attempt != self.attempt:
                raise ValueError(
                    f"group {self.prompt_uid} (attempt {self.attempt!r}) holds sample {t.uid} "
                    f"of prompt {t.prompt_uid} (attempt {t.attempt!r})"
                )
        return self

    @classmethod
    def of(cls, samples: list[Trajectory]) -> TrajectoryGroup:
        """The samples of one prompt and attempt as one message, the prompt record (the
        first sample's) kept once."""
        first = samples[0]
        return cls(
            prompt_uid=first.prompt_uid,
            attempt=first.attempt,
            data=first.data,
            samples=[updated(t, {"data": {}}) if t.data else t for t in samples],
        )

    def past_scoring(self) -> TrajectoryGroup:
        """The group as it goes on once scored (see :meth:`Trajectory.past_scoring`)."""
        return updated(self, {"data": {}, "samples": [t.past_scoring() for t in self.samples]})

    def msg_id(self, stage: str) -> str:
        """JetStream dedup id at ``stage``, as :meth:`Trajectory.msg_id` (a sample's uid
        always ends in its index, never in ``group``)."""
        return f"{stage}/{self.attempt}/{self.prompt_uid}/group"


class TrainSample(Message):
    """One scored sample as training and its records read it, in its :class:`Group`: the
    tokens, loss mask, behaviour logprobs, per-token versions and reward of a
    :class:`Trajectory`, with the ids that place it in its group and episode. The prompt
    record, the completion text and the lease it ran under stay behind."""

    KIND: ClassVar[str] = "train_sample"
    uid: str
    prompt_uid: str
    group_index: int
    episode_sample: int = 0
    episode_samples: int = 1
    actor_id: str = ""
    input_ids: Array
    loss_mask: Array
    logprobs: Array
    versions: Array
    reward: float
    reward_info: dict[str, Any] = Field(default_factory=dict)
    finish_reason: str = ""
    sampled_with: SampledWith | None = Field(
        default=None,
        description="the sampling its calls chose (rollout.endpoint_sampling = 'per_call'); "
        "None: rollout.sampling",
    )
    images: list[str] = Field(
        default_factory=list,
        description="the prompt's images, by reference (Trajectory.images)",
    )

    @model_validator(mode="after")
    def _same_lengths(self) -> TrainSample:
        _check_lengths(self)
        return self

    @property
    def versions_spanned(self) -> int:
        """How many policy versions produced the generated tokens (see :class:`Trajectory`)."""
        return _versions_spanned(self.versions)

    @property
    def head_version(self) -> int:
        """The oldest policy version that produced a token of this sample (-1 if none)."""
        return _head_version(self.versions)


def _check_lengths(sample: Trajectory | TrainSample) -> None:
    n = sample.input_ids.shape
    for name in ("loss_mask", "logprobs", "versions"):
        if getattr(sample, name).shape != n:
            raise ValueError(f"{name} shape {getattr(sample, name).shape} != input_ids {n}")


def _versions_spanned(versions: Array) -> int:
    v = versions.numpy()
    generated = v[v >= 0]
    if not generated.size:
        return 0
    if generated.min() == generated.max():
        return 1  # the usual case, told without a set of every token's version
    return len(set(generated.tolist()))


def _head_version(versions: Array) -> int:
    v = versions.numpy()
    gen = v[v >= 0]
    return int(gen.min()) if gen.size else -1


_TRAIN_FIELDS = tuple(TrainSample.model_fields)
"""The fields a :class:`Trajectory` hands on to training: each is one of its own too."""


class Group(Message):
    """One admitted GRPO group, the unit of training data from admission to the loss.

    ``samples`` are every sample of every episode of one prompt, in episode order (by
    ``group_index``, then ``episode_sample``); ``shaped_rewards`` are the rewards the
    advantages use, one per sample, shaped once at admission (``trainer.shaping``, see
    :func:`~asyncrl.algo.shaping.shaped_sample_rewards`; the dynamic filter judged the
    group on them). An episode of several samples (agent code whose calls do not all
    continue one another) has its reward, undiscounted, on every sample; the episode's is
    its final sample's (:attr:`final_positions`), and each sample records in
    ``reward_info['turns_to_go']`` the calls after its last, by which the trainer
    discounts the episode's advantage (:func:`~asyncrl.train.batch.build_samples`).
    """

    KIND: ClassVar[str] = "group"
    prompt_uid: str
    samples: list[TrainSample]
    shaped_rewards: list[float]

    @model_validator(mode="after")
    def _one_reward_per_sample(self) -> Group:
        if len(self.shaped_rewards) != len(self.samples):
            raise ValueError(
                f"{len(self.shaped_rewards)} shaped rewards for {len(self.samples)} samples"
            )
        others = {t.prompt_uid for t in self.samples} - {self.prompt_uid}
        if others:
            raise ValueError(f"group {self.prompt_uid} holds samples of {sorted(others)}")
        return self

    @property
    def final_positions(self) -> list[int]:
        """For each episode, by ``group_index``: the position in ``samples`` of its final
        sample (the one that holds its last call, whose reward is the episode's)."""
        finals: dict[int, int] = {}
        for i, t in enumerate(self.samples):
            finals.setdefault(t.group_index, i)
            if t.episode_sample == t.episode_samples - 1:
                finals[t.group_index] = i
        return [finals[e] for e in sorted(finals)]

    @property
    def head_version(self) -> int:
        """The oldest policy version that produced a token of the group (-1 if none). A
        sample without a generated token (greedy calls only, ``per_call``) has none to
        count: its -1 is not the group's."""
        return min((h for t in self.samples if (h := t.head_version) >= 0), default=-1)

    @property
    def newest_version(self) -> int:
        """The newest policy version of any token of the group (-1 if none)."""
        return max((int(t.versions.numpy().max(initial=-1)) for t in self.samples), default=-1)


class BatchWaiting(BaseModel):
    """What a batch request is waiting for: the buffer's answer when a batch is not ready."""

    model_config = ConfigDict(extra="forbid")

    ready_groups: int
    batch_size: int
    rejected_stale: int = Field(description="groups rejected as stale so far in the run")
    rejected_invalid: int = Field(description="trajectories refused as invalid so far")
    running: int = Field(description="episodes leased and not yet scored")
    version: int = Field(description="the buffer's (published) version")

    def describe(self) -> str:
        return (
            f"{self.ready_groups}/{self.batch_size} groups ready, {self.running} running, "
            f"{self.rejected_stale} rejected as stale, {self.rejected_invalid} invalid "
            f"(buffer version {self.version})"
        )


class TrainBatchRef(Message):
    """A batch of whole groups for one trainer step: the groups inline, or, when they
    would not fit in one message, an object-store key (``blob_key``, in the run's batch
    bucket) holding an encoded :class:`TrainBatchRef` with them inline. With ``waiting``
    set there is no batch yet: it says what the buffer is waiting for."""

    KIND: ClassVar[str] = "train_batch"
    step: int
    version: int
    groups: list[Group] = Field(default_factory=list)
    blob_key: str = ""
    waiting: BatchWaiting | None = None
    counters: dict[str, int] = Field(default_factory=dict, description="buffer counters")


class BatchRequest(Message):
    """The trainer asks for the batch of ``step``; the buffer replies with a TrainBatchRef
    (its ``waiting`` set while the batch is not ready)."""

    KIND: ClassVar[str] = "batch_request"
    step: int
    version: int = Field(description="the trainer's version (steps done)")
    published_version: int = Field(
        default=-1,
        description="the newest version the trainer published (what rollouts can have); "
        "-1: the same as ``version``",
    )
    epoch: int = Field(default=0, description="the trainer's epoch: its restarts in this run")
    checkpoint_step: int = Field(
        default=0, description="the step of the trainer's latest checkpoint (0: none)"
    )


class WeightsQuery(Message):
    """A newly started rollout actor asks the buffer for the latest weights."""

    KIND: ClassVar[str] = "weights_query"
    actor_id: str


class WeightsUpdated(Message):
    """New weights exist (:mod:`asyncrl.weights`). ``location`` is, by ``kind``: a
    directory of safetensors (``dir``); an object-store manifest key (``object_store``);
    the broadcast group's id (``collective``: the weights follow on the group to the
    engines in ``members``, and an engine not among them asks to join); a blob key of
    CUDA IPC handles (``cuda_ipc``)."""

    KIND: ClassVar[str] = "weights_updated"
    version: int
    kind: Literal["dir", "object_store", "collective", "cuda_ipc"]
    location: str
    step: int = 0
    epoch: int = Field(
        default=0,
        description="the trainer's epoch (its restarts in this run): weights of a newer "
        "epoch replace any held version, even a higher one (a trainer that restarted from "
        "its last checkpoint rolled back the versions after it)",
    )
    members: list[str] = Field(
        default_factory=list,
        description="collective: the actors this version is broadcast to, in no order",
    )
    seq: int = Field(
        default=0, description="collective: the publisher's count of broadcasts, this one's"
    )
    skipped: list[str] = Field(
        default_factory=list,
        description="collective: joined actors this version is not sent to because they do "
        "not load it (their join's ``every`` and ``last``); they stay in the group",
    )


class WeightsJoin(Message):
    """An engine asks the trainer's rank 0 for a place in the weight broadcast
    (``collective``); the reply is a :class:`WeightsGrant`."""

    KIND: ClassVar[str] = "weights_join"
    actor_id: str
    group: str = Field(description="the broadcast group the engine saw announced")
    protocol: str = Field(
        default="asyncrl",
        description="what the engine speaks: asyncrl's wire (an in-process engine, or a "
        "server with asyncrl's receiver), or a server's own broadcast protocol",
    )
    every: int = Field(
        default=1,
        ge=0,
        description="the versions the engine loads: 0, the multiples of this and ``last`` "
        "(1: every version; the eval actor: its due ones); the trainer sends it no other",
    )
    last: int = Field(default=-1, description="a version it loads besides: the run's last")


class WeightsGrant(Message):
    """Where and how to form the two-rank group with the trainer's rank 0 (rank 0 the
    trainer, rank 1 the engine). The current weights follow on the group at once."""

    KIND: ClassVar[str] = "weights_grant"
    group: str
    host: str
    port: int
    prefix: str = Field(description="the key prefix of this pair's rendezvous in the store")
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    since_seq: int = Field(
        description="the broadcasts this engine takes part in are those after this count"
    )
    version: int
    epoch: int = 0


class WeightsFallback(Message):
    """An engine that cannot take the broadcast asks for the current weights in the object
    store; the reply is a ``WeightsUpdated`` of kind ``object_store``."""

    KIND: ClassVar[str] = "weights_fallback"
    actor_id: str
    reason: str = ""


class MemoryControl(Message):
    """Colocation (``rollout.colocate``): the trainer asks rollout engines to ``release``
    their accelerator memory before a step, or to ``resume`` it after a step that
    published no weights (new weights bring the memory back by themselves)."""

    KIND: ClassVar[str] = "memory_control"
    action: Literal["release", "resume"]
    step: int


class MemoryReleased(Message):
    """A rollout actor's answer to ``release``: its engine is paused and its memory free."""

    KIND: ClassVar[str] = "memory_released"
    actor_id: str
    step: int
    freed_bytes: int = 0


# --- the buffer's durable state (in the run's object store, not on a subject) -----------------


class LeasedRecord(BaseModel):
    prompt: Prompt
    actor_id: str
    lease_id: str
    delivered: bool = False


class AnswerRecord(BaseModel):
    actor_id: str
    request_id: str
    lease: Lease


class ServedRecord(BaseModel):
    """A batch the buffer served, as its snapshot keeps it: the batch's own fields, and
    its groups by where they are written (``(part, index)``, see :class:`BufferPart`)."""

    step: int
    version: int
    blob_key: str = ""
    counters: dict[str, int] = Field(default_factory=dict)
    groups: list[tuple[int, int]] = Field(default_factory=list)

    @classmethod
    def of(cls, batch: TrainBatchRef, places: list[tuple[int, int]]) -> ServedRecord:
        """``batch``, its groups at ``places``."""
        return cls(
            step=batch.step,
            version=batch.version,
            blob_key=batch.blob_key,
            counters=batch.counters,
            groups=places,
        )

    def batch(self, groups: list[Group]) -> TrainBatchRef:
        """The batch again, with its ``groups`` (read from their places)."""
        return TrainBatchRef(
            step=self.step,
            version=self.version,
            blob_key=self.blob_key,
            counters=self.counters,
            groups=groups,
        )


class CompletedEpoch(BaseModel):
    """The complete prompts of one data epoch in a :class:`BufferSnapshot`: bit ``i`` of
    ``bits`` (little-endian within each byte) set for record ``i``'s prompt
    (``e<epoch>-<i>``)."""

    epoch: int
    bits: bytes


class BufferPart(Message):
    """Admitted groups written once, each as an encoded :class:`Group`: the buffer's
    snapshot names a group by its part's number and its index here, so a group that
    stays in the buffer through many writes of the snapshot is written once."""

    KIND: ClassVar[str] = "buffer_part"
    groups: list[bytes]


class BufferSnapshot(Message):
    """Everything a restarted buffer needs to go on where the dead one stood. The
    admitted groups and the served batches' groups are named, not held: each lives in a
    :class:`BufferPart` written once."""

    KIND: ClassVar[str] = "buffer_snapshot"
    epoch: int = 0
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0
    counters: dict[str, int] = Field(default_factory=dict)
    sampler: dict[str, Any] = Field(default_factory=dict)
    pool: list[Prompt] = Field(default_factory=list)
    leased: list[LeasedRecord] = Field(default_factory=list)
    attempts: dict[str, int] = Field(default_factory=dict)
    issued: int = 0
    answers: list[AnswerRecord] = Field(default_factory=list)
    partial: list[Trajectory] = Field(default_factory=list)
    """Samples of the groups still in the making (past scoring: no prompt records)."""
    completed: list[str] = Field(default_factory=list)
    """Complete prompts whose ids are not ``e<data epoch>-<record index>`` of the dataset
    (an older asyncrl kept every complete prompt here)."""
    completed_epochs: list[int] = Field(default_factory=list)
    """Data epochs whose every prompt is complete."""
    completed_bits: list[CompletedEpoch] = Field(default_factory=list)
    """The complete prompts of the other data epochs that have any."""
    refused: list[tuple[str, str]] = Field(default_factory=list)
    ready: list[tuple[int, int]] = Field(default_factory=list)
    """Each admitted group, in order, by ``(part, index)`` (see :class:`BufferPart`)."""
    served: list[ServedRecord] = Field(default_factory=list)
    """Each served batch still kept (for a repeated request, or a roll-back)."""
    next_part: int = Field(default=0, description="the number the next BufferPart takes")
    since_checkpoint: list[tuple[int, list[str]]] = Field(default_factory=list)
    """(step, the prompt uids of its batch): pairs, as the wire takes only string keys."""
    positions: list[tuple[int, dict[str, Any]]] = Field(default_factory=list)
    """(step, the dataset position when its batch was served), for the steps from the
    trainer's latest checkpoint on: a run resumed from the checkpoint of step s continues
    the dataset from the position of step s - 1."""
    weights: WeightsUpdated | None = None


class TrainedBatch(Message):
    """What one trainer step consumed, kept so that ``asyncrl replay`` can train it again:
    the batch as the buffer served it (its groups, in batch order, with their samples and
    shaped rewards) and what else the step's result depends on. One per step in
    ``<run>/replay/`` (:mod:`asyncrl.train.replay_log`); a step that a restarted trainer
    takes again replaces its record, so the folder holds the run's final lineage.

    ``stats`` are the step's own outcome (its train statistics without timings): the
    first step whose replay gives other numbers is where a replay and the run part."""

    KIND: ClassVar[str] = "trained_batch"
    step: int = Field(description="the step this batch made: the engine's step after it")
    epoch: int = Field(description="the trainer's epoch (its restarts in this run)")
    groups: list[Group]
    world_size: int = Field(description="trainer ranks the step was split over")
    threads: int = Field(description="torch intra-op threads of each trainer rank")
    allocator: str = Field(description="the trainer's malloc: mimalloc or system")
    torch_version: str
    settings_sha256: str = Field(
        description="digest of the recipe's settings the step depends on "
        "(asyncrl.train.replay_log.settings_digest)"
    )
    stats: dict[str, float] = Field(default_factory=dict)


MESSAGE_TYPES: dict[str, type[Message]] = {
    m.KIND: m
    for m in (
        ActorInfo,
        Control,
        ActorExit,
        Metrics,
        Ack,
        Prompt,
        LeaseRequest,
        Lease,
        EpisodeAborted,
        Trajectory,
        TrajectoryGroup,
        TrainSample,
        TrainBatchRef,
        BatchRequest,
        WeightsQuery,
        WeightsUpdated,
        MemoryControl,
        MemoryReleased,
        TrainedBatch,
    )
}
