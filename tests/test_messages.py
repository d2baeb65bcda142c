"""The wire codec: every message type round-trips; bad payloads give a counted reason.

Strategies are derived from each model's fields, so a new message type or field is
covered without touching this file (an unknown field type fails loudly instead).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

import annotated_types
import msgpack
import numpy as np
import pytest
from hypothesis import example, given, reject, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, ValidationError

from asyncrl.wire.codec import (
    DecodeError,
    _decode_checked,
    _encodes_directly,
    _fast_decoder,
    decode,
    decode_any,
    encode,
    encode_fields,
    enveloped,
)
from asyncrl.wire.messages import (
    ALLOWED_DTYPES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Ack,
    ActorInfo,
    Array,
    Group,
    Lease,
    Message,
    Metrics,
    TrainBatchRef,
    TrainSample,
    Trajectory,
    TrajectoryGroup,
)
from asyncrl.wire.unchecked import updated

# Deterministic: a fixed seed and no example database, so every run tests the same inputs.
CODEC = settings(derandomize=True, database=None, max_examples=60, deadline=None)

INT64 = (-(2**63), 2**63 - 1)
ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# The strategy builders below are cached: each call of one defines a composite strategy,
# which hypothesis compiles and inspects, and values() asks for them at every draw (over a
# third of this module's time before they were cached: 42 -> 27 s on 2 cores).


@functools.cache
def arrays(shape: tuple[int, ...]) -> st.SearchStrategy[Array]:
    """Arrays of any allowed dtype; the bytes are arbitrary (NaN payloads included)."""

    @st.composite
    def build(draw: st.DrawFn) -> Array:
        dtype = draw(st.sampled_from(sorted(ALLOWED_DTYPES)))
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return Array(dtype=dtype, shape=shape, data=draw(st.binary(min_size=size, max_size=size)))

    return build()


def _int_bounds(metadata: list[Any]) -> tuple[int, int]:
    lo, hi = INT64
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            lo = max(lo, int(m.ge))  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Gt):
            lo = max(lo, int(m.gt) + 1)  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Le):
            hi = min(hi, int(m.le))  # type: ignore[call-overload]
        elif isinstance(m, annotated_types.Lt):
            hi = min(hi, int(m.lt) - 1)  # type: ignore[call-overload]
    return lo, hi


def values(annotation: Any, metadata: list[Any], length: int) -> st.SearchStrategy[Any]:
    """A strategy for one field. 1-D arrays of one model share ``length``, the way the
    arrays of a Trajectory must."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return ANY_VALUE
    if inspect.isclass(annotation) and issubclass(annotation, Array):
        return arrays((length,))
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return instances(annotation)
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (Union, types.UnionType):
        return st.one_of([values(a, metadata, length) for a in args])
    if origin is list:
        return st.lists(values(args[0], [], length), max_size=3)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(values(args[0], [], length), max_size=3).map(tuple)
        return st.tuples(*(values(a, [], length) for a in args))
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), values(args[1], [], length), max_size=3)
    simple: dict[Any, st.SearchStrategy[Any]] = {
        bool: st.booleans(),
        float: st.floats(allow_nan=False),
        str: st.text(max_size=16),
        bytes: st.binary(max_size=32),
        type(None): st.none(),
    }
    if annotation is int:
        return st.integers(*_int_bounds(metadata))
    if annotation in simple:
        return simple[annotation]
    raise TypeError(f"no strategy for field type {annotation!r}: extend values()")


@functools.cache
def instances(cls: type[BaseModel]) -> st.SearchStrategy[Any]:
    if cls is TrajectoryGroup:
        return trajectory_groups()

    @st.composite
    def build(draw: st.DrawFn) -> BaseModel:
        length = draw(st.integers(0, 6))
        fields = {
            name: draw(values(f.annotation, f.metadata, length))
            for name, f in cls.model_fields.items()
        }
        try:
            return cls(**fields)
        except ValidationError:
            reject()  # a cross-field rule the generic strategy does not know

    return build()


@functools.cache
def trajectory_groups() -> st.SearchStrategy[TrajectoryGroup]:
    """Groups of random samples made one prompt's and one attempt's, the rule a group
    keeps (the generic strategy would almost never draw samples that share them)."""

    @st.composite
    def build(draw: st.DrawFn) -> TrajectoryGroup:
        prompt_uid, attempt = draw(st.text(max_size=16)), draw(st.text(max_size=16))
        samples = draw(st.lists(instances(Trajectory), min_size=1, max_size=3))
        return TrajectoryGroup(
            prompt_uid=prompt_uid,
            attempt=attempt,
            data=draw(values(dict[str, Any], [], 0)),
            samples=[
                t.model_copy(update={"prompt_uid": prompt_uid, "attempt": attempt}) for t in samples
            ],
        )

    return build()


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=list(MESSAGE_TYPES))
@CODEC
@given(data=st.data())
def test_every_message_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(instances(cls))
    payload = encode(msg)
    assert decode(payload, cls) == msg
    back = decode_any(payload)
    assert type(back) is cls and back == msg
    other = Ack if cls is not Ack else Metrics
    with pytest.raises(DecodeError) as err:
        decode(payload, other)
    assert err.value.reason == "kind"


@CODEC
@given(data=st.data())
def test_fields_encoded_once_write_the_bytes_of_encoding_them_again(data: st.DataObject) -> None:
    """The buffer encodes a group's fields once, for its state, and puts those bytes into
    every batch that holds the group: the bytes are the ones encoding the batch makes."""
    # a group made of drawn samples (a drawn Group rarely holds samples of one prompt)
    samples = data.draw(st.lists(instances(TrainSample), min_size=1, max_size=3))
    uid = samples[0].prompt_uid
    group = Group(
        prompt_uid=uid,
        samples=[t.model_copy(update={"prompt_uid": uid}) for t in samples],
        shaped_rewards=data.draw(
            st.lists(st.floats(allow_nan=False), min_size=len(samples), max_size=len(samples))
        ),
    )
    fields = encode_fields(group)
    assert fields is not None and enveloped(group, fields) == encode(group)
    # the group, another object of the same, then the group again: one encoded apart
    batch = TrainBatchRef(step=3, version=2, groups=[group, group.model_copy(), group])
    assert encode(batch, {id(group): fields}) == encode(batch)
    assert decode(encode(batch, {id(group): fields}), TrainBatchRef) == batch


def test_fields_that_do_not_encode_directly_are_not_encoded_apart() -> None:
    msg = _Open.model_construct(data={"s": {1, 2}}, extra=None, inner=[], pairs=[])
    assert encode_fields(msg) is None
    fine = _Open(data={"s": [1, 2]})
    assert enveloped(fine, encode_fields(fine) or b"") == encode(fine)


def test_registry_names_each_type_by_its_kind() -> None:
    assert all(kind == cls.KIND and kind for kind, cls in MESSAGE_TYPES.items())


@CODEC
@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(sorted(ALLOWED_DTYPES)),
    data=st.data(),
)
def test_arrays_of_any_shape_and_dtype_round_trip(
    shape: tuple[int, ...], dtype: str, data: st.DataObject
) -> None:
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = data.draw(st.binary(min_size=size, max_size=size))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    wrapped = Array.of(arr)
    assert (wrapped.shape, wrapped.dtype, wrapped.data) == (shape, dtype, raw)
    # The same path the codec takes for a field: dump, msgpack, validate.
    back = Array.model_validate(msgpack.unpackb(_pack(wrapped.model_dump())))
    assert back == wrapped
    assert back.numpy().tobytes() == raw and back.numpy().shape == shape


_NUMBERS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0, 1, 2, 255, 256, -1, 2**31, -(2**31) - 1, 2**63, -0.0, 1e39, 1e-46]),
)


def _numpy_made(values: Any, dtype: str) -> Any:
    """What numpy makes of ``values``: the array's fields, or the error's type."""
    try:
        with np.errstate(all="ignore"):
            arr = np.asarray(values, dtype=dtype)
    except Exception as exc:
        return type(exc)
    return (arr.dtype.name, arr.shape, arr.tobytes())


@settings(max_examples=300, deadline=None)
@given(
    values=st.one_of(
        st.lists(_NUMBERS, max_size=6),
        st.lists(st.sampled_from([0, 1, True, False]), max_size=6),  # the bool fast path
        st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), max_size=3),  # 2-d
    ),
    dtype=st.sampled_from(sorted(ALLOWED_DTYPES)),
)
@example(values=[0, 1, 2], dtype="bool")  # 2 is True to numpy, not the byte 2
@example(values=[True, 256], dtype="bool")
@example(values=[1, 1.5], dtype="int32")  # numpy truncates
@example(values=[2**31], dtype="int32")
@example(values=[-(2**63) - 1], dtype="int64")
@example(values=[1e39, -0.0, float("nan")], dtype="float32")
@example(values=[[1, 2], [3, 4]], dtype="int32")
@example(values=[], dtype="float64")
def test_an_array_of_a_list_holds_what_numpy_makes_of_it(values: list[Any], dtype: str) -> None:
    """Lists take a faster conversion for some dtypes (the rollout makes four arrays a
    sample from lists): the same bytes, or the same error, as numpy's."""
    want = _numpy_made(values, dtype)
    with np.errstate(all="ignore"):
        try:
            arr = Array.of(values, dtype)
        except Exception as exc:
            assert want is type(exc)
            return
    assert (arr.dtype, arr.shape, arr.data) == want
    assert Array.model_validate(arr.model_dump()) == arr


def test_zero_dimensional_array_keeps_its_shape() -> None:
    assert Array.of(np.float32(1.5)).shape == ()


def test_trajectory_keeps_numpy_values() -> None:
    n = 9
    t = Trajectory(
        uid="p/1",
        prompt_uid="p",
        group_index=1,
        group_size=2,
        input_ids=Array.of(np.arange(n, dtype=np.int64)),
        loss_mask=Array.of(np.arange(n) % 2 == 0),
        logprobs=Array.of(np.linspace(-1, 0, n, dtype=np.float32)),
        versions=Array.of(np.full(n, 3, dtype=np.int32)),
        reward=1.0,
    )
    back = decode(encode(t), Trajectory)
    for name in ("input_ids", "loss_mask", "logprobs", "versions"):
        np.testing.assert_array_equal(getattr(back, name).numpy(), getattr(t, name).numpy())
    assert back.head_version == 3


def test_a_train_sample_holds_what_training_reads_and_nothing_else() -> None:
    assert set(TrainSample.model_fields) == {
        *("uid", "prompt_uid", "group_index", "episode_sample", "episode_samples"),
        *("actor_id", "input_ids", "loss_mask", "logprobs", "versions"),
        *("reward", "reward_info", "finish_reason", "sampled_with", "images"),
    }
    assert "data_state" not in TrainBatchRef.model_fields
    t = Trajectory(
        uid="e0-4/1",
        prompt_uid="e0-4",
        group_index=1,
        group_size=2,
        actor_id="r0",
        attempt="lease-1",
        input_ids=Array.of([1, 2, 3], "int32"),
        loss_mask=Array.of([False, True, True]),
        logprobs=Array.of([0.0, -0.5, -0.25], "float32"),
        versions=Array.of([-1, 2, 3], "int32"),
        reward=1.0,
        reward_info={"ok": True},
        data={"question": "q" * 500, "answer": "4"},
        completion="c" * 500,
        finish_reason="stop",
        images=["/cache/shapes/0.png"],
    )
    s = t.to_train_sample()
    assert s.images == ["/cache/shapes/0.png"] and s.images is not t.images
    for name in set(TrainSample.model_fields):
        assert getattr(s, name) == getattr(t, name), name
    assert (s.head_version, s.versions_spanned) == (2, 2)
    group = Group(prompt_uid="e0-4", samples=[s, s], shaped_rewards=[0.5, 0.5])
    batch = TrainBatchRef(step=0, version=3, groups=[group, group])
    back = decode(encode(batch), TrainBatchRef)
    assert back == batch and back.groups[0].samples[0].reward == 1.0
    assert back.groups[0].shaped_rewards == [0.5, 0.5] and back.groups[0].head_version == 2
    assert len(encode(s)) < len(encode(t)) - 1000  # the record and the text stay behind
    with pytest.raises(ValueError, match="not scored"):
        t.model_copy(update={"reward": None}).to_train_sample()


def test_a_group_has_one_shaped_reward_per_sample_of_its_own_prompt() -> None:
    def sample(prompt: str, index: int, versions: list[int]) -> TrainSample:
        return TrainSample(
            uid=f"{prompt}/{index}",
            prompt_uid=prompt,
            group_index=index,
            input_ids=Array.of([1, 2, 3], "int32"),
            loss_mask=Array.of([False, True, True]),
            logprobs=Array.of([0.0, -0.5, -0.25], "float32"),
            versions=Array.of(versions, "int32"),
            reward=1.0,
        )

    a, b = sample("p", 0, [-1, 4, 5]), sample("p", 1, [-1, 3, 3])
    group = Group(prompt_uid="p", samples=[a, b], shaped_rewards=[1.0, 0.0])
    assert (group.head_version, group.newest_version, group.final_positions) == (3, 5, [0, 1])
    with pytest.raises(ValueError, match="1 shaped rewards for 2 samples"):
        Group(prompt_uid="p", samples=[a, b], shaped_rewards=[1.0])
    with pytest.raises(ValueError, match="holds samples of"):
        Group(prompt_uid="p", samples=[a, sample("q", 1, [-1, 3, 3])], shaped_rewards=[1.0, 0.0])
    # a group travels in a batch on the fast path
    assert _fast_decoder(Group) is not None
    back = decode(encode(group), Group)
    assert back == group


# -- malformed payloads -------------------------------------------------------------------------


GOOD = encode(Metrics(role="trainer", actor_id="t0", step=3, values={"loss": 0.25}))


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "garbage"),
        (b"\xc1", "garbage"),  # a byte msgpack never uses
        (b"GET / HTTP/1.1\r\n", "garbage"),
        (GOOD[:-1], "garbage"),  # truncated
        (GOOD + b"\x00", "garbage"),  # trailing bytes
        (_pack([1, 2, 3]), "garbage"),
        (_pack({"k": "metrics", "d": {}}), "garbage"),  # no version
        (_pack({"k": "metrics", "v": SCHEMA_VERSION}), "garbage"),  # no body
        (_pack({1: "x"}), "garbage"),  # non-string map key
        (_pack({"k": "metrics", "v": SCHEMA_VERSION + 1, "d": {}}), "schema_version"),
        (_pack({"k": "metrics", "v": 0, "d": {}}), "schema_version"),
        (_pack({"k": "metrics", "v": str(SCHEMA_VERSION), "d": {}}), "schema_version"),
        (_pack({"k": "no_such_kind", "v": SCHEMA_VERSION, "d": {}}), "kind"),
        (_pack({"k": 7, "v": SCHEMA_VERSION, "d": {}}), "kind"),
        (encode(Ack()), "kind"),  # a valid message, of another kind
        (_pack({"k": "metrics", "v": SCHEMA_VERSION, "d": {}}), "invalid"),  # fields missing
        (_pack({"k": "metrics", "v": SCHEMA_VERSION, "d": [1]}), "invalid"),
        (
            _pack({"k": "metrics", "v": SCHEMA_VERSION, "d": {"role": "r", "actor_id": 5}}),
            "invalid",
        ),
        (
            _pack(
                {"k": "metrics", "v": SCHEMA_VERSION, "d": {"role": "r", "actor_id": "a", "x": 1}}
            ),
            "invalid",  # unknown field: extra="forbid"
        ),
    ],
)
def test_bad_payloads_give_decode_error_with_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode(payload, Metrics)
    assert err.value.reason == reason
    assert str(err.value).startswith(reason)


@pytest.mark.parametrize(
    ("array", "fragment"),
    [
        ({"dtype": "float32", "shape": [3], "data": b"\x00" * 11}, "bytes do not match"),
        ({"dtype": "complex64", "shape": [1], "data": b"\x00" * 8}, "dtype"),
        ({"dtype": "uint8", "shape": [-1], "data": b""}, "negative"),
        ({"dtype": "uint8", "shape": [2], "data": 5}, "bytes"),
    ],
)
def test_inconsistent_arrays_are_invalid(array: dict[str, Any], fragment: str) -> None:
    arr = Array.of(np.zeros(3, dtype=np.int32))
    body = {
        "uid": "p/0",
        "prompt_uid": "p",
        "group_index": 0,
        "group_size": 1,
        "input_ids": array,
        "loss_mask": arr.model_dump(),
        "logprobs": arr.model_dump(),
        "versions": arr.model_dump(),
    }
    with pytest.raises(DecodeError) as err:
        decode(_pack({"k": "trajectory", "v": SCHEMA_VERSION, "d": body}), Trajectory)
    assert err.value.reason == "invalid"
    assert fragment in err.value.detail


def test_mismatched_trajectory_lengths_are_invalid() -> None:
    a3, a4 = Array.of(np.zeros(3, np.int32)), Array.of(np.zeros(4, np.int32))
    body = {
        "uid": "p/0",
        "prompt_uid": "p",
        "group_index": 0,
        "group_size": 1,
        "input_ids": a3.model_dump(),
        "loss_mask": a4.model_dump(),
        "logprobs": a3.model_dump(),
        "versions": a3.model_dump(),
    }
    with pytest.raises(DecodeError) as err:
        decode(_pack({"k": "trajectory", "v": SCHEMA_VERSION, "d": body}), Trajectory)
    assert err.value.reason == "invalid"


REASONS = {"garbage", "schema_version", "kind", "invalid"}

# Envelope parts that are mostly right: decode takes a shortcut for a well-formed envelope
# of the expected kind, and every near miss must still get the reason decode_any gives.
# Kinds of other registered types are left out: for those decode says "kind" before
# decode_any looks at the body.
NEAR_ENVELOPES = st.fixed_dictionaries(
    {},
    optional={
        "k": st.sampled_from(["metrics", "no_such_kind"])
        | ANY_VALUE.filter(lambda v: not (isinstance(v, str) and v in MESSAGE_TYPES)),
        "v": st.sampled_from([SCHEMA_VERSION, SCHEMA_VERSION + 1, True, float(SCHEMA_VERSION)])
        | ANY_VALUE,
        "d": st.just(msgpack.unpackb(GOOD)["d"]) | ANY_VALUE,
        "x": ANY_VALUE,
    },
)


@CODEC
@given(NEAR_ENVELOPES)
def test_decode_gives_the_same_reason_as_decode_any(envelope: dict[str, Any]) -> None:
    def outcome(decoder: Any) -> str:
        try:
            msg = decoder(_pack(envelope))
        except DecodeError as exc:
            return exc.reason
        assert isinstance(msg, Metrics)
        return "ok"

    assert outcome(lambda p: decode(p, Metrics)) == outcome(decode_any)


@CODEC
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash_the_decoder(payload: bytes) -> None:
    try:
        decode_any(payload)
    except DecodeError as exc:
        assert exc.reason in REASONS


@CODEC
@given(ANY_VALUE)
def test_arbitrary_msgpack_values_never_crash_the_decoder(value: Any) -> None:
    with pytest.raises(DecodeError) as err:
        decode(_pack(value), Metrics)
    assert err.value.reason in REASONS


@CODEC
@given(position=st.integers(0, len(GOOD) - 1), flip=st.integers(1, 255))
def test_corrupted_messages_decode_or_fail_cleanly(position: int, flip: int) -> None:
    corrupted = bytearray(GOOD)
    corrupted[position] ^= flip
    try:
        msg = decode(bytes(corrupted), Metrics)
    except DecodeError as exc:
        assert exc.reason in REASONS
    else:
        assert isinstance(msg, Metrics)  # a flip inside a string or number can stay valid


# -- the fast path ------------------------------------------------------------------------------
#
# decode tries msgspec first and falls back to the careful path (msgpack + pydantic) on any
# refusal, so a refused payload always gets the careful verdict. What must hold is the other
# half: whatever the fast path accepts, the careful path accepts too, as the same model, with
# the same types inside (1 and 1.0 are equal but not the same) and the same fields set.


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, BaseModel):
        return a.model_fields_set == b.model_fields_set and all(
            _same(getattr(a, name), getattr(b, name)) for name in type(a).model_fields
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b or (a != a and b != b))  # NaN is NaN


def _outcome(decoder: Any, payload: bytes) -> Any:
    try:
        return decoder(payload)
    except DecodeError as exc:
        return (exc.reason, exc.detail)


def _paths_agree(payload: bytes, cls: type[Message]) -> None:
    fast, careful = (
        _outcome(lambda p: decode(p, cls), payload),
        _outcome(lambda p: _decode_checked(p, cls), payload),
    )
    assert _same(fast, careful), (fast, careful)


def test_the_hot_message_types_take_the_fast_path() -> None:
    for cls in (Trajectory, TrainSample, Group, Metrics, Ack, TrainBatchRef, ActorInfo, Lease):
        assert _fast_decoder(cls) is not None, cls


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=list(MESSAGE_TYPES))
@CODEC
@given(data=st.data())
def test_fast_and_careful_paths_build_the_same_message(
    cls: type[Message], data: st.DataObject
) -> None:
    msg = data.draw(instances(cls))
    payload = encode(msg)
    # the bytes are those msgpack writes, whichever encoder wrote them
    assert payload == msgpack.Packer().pack(
        {"k": cls.KIND, "v": SCHEMA_VERSION, "d": msg.model_dump()}
    )
    _paths_agree(payload, cls)
    fast = _fast_decoder(cls)
    if fast is not None:  # it takes a valid message itself, not through the fallback
        assert _same(fast(payload), msg)
    # the same body with its optional fields left out: the defaults, and fields_set without them
    body = msgpack.unpackb(payload)["d"]
    required = {k: v for k, v in body.items() if cls.model_fields[k].is_required()}
    _paths_agree(_pack({"k": cls.KIND, "v": SCHEMA_VERSION, "d": required}), cls)


TRAJECTORY = encode(
    Trajectory(
        uid="p/1",
        prompt_uid="p",
        group_index=1,
        group_size=2,
        input_ids=Array.of(np.arange(3, dtype=np.int32)),
        loss_mask=Array.of(np.ones(3, dtype=bool)),
        logprobs=Array.of(np.zeros(3, dtype=np.float32)),
        versions=Array.of(np.zeros(3, dtype=np.int32)),
        reward=1.0,
        reward_info={"f": 0.5, "n": [1, None, b"x"]},
        data={"question": "q", "answer": 4},
    )
)


@CODEC
@given(position=st.integers(0, len(TRAJECTORY) - 1), flip=st.integers(1, 255))
def test_fast_and_careful_paths_agree_on_corrupted_trajectories(position: int, flip: int) -> None:
    corrupted = bytearray(TRAJECTORY)
    corrupted[position] ^= flip
    _paths_agree(bytes(corrupted), Trajectory)


@CODEC
@given(position=st.integers(0, len(GOOD) - 1), flip=st.integers(1, 255))
def test_fast_and_careful_paths_agree_on_corrupted_metrics(position: int, flip: int) -> None:
    corrupted = bytearray(GOOD)
    corrupted[position] ^= flip
    _paths_agree(bytes(corrupted), Metrics)


@pytest.mark.parametrize(
    "body",
    [
        {"role": "r", "actor_id": "a", "step": 1.0},  # pydantic takes a whole float as an int
        {"role": "r", "actor_id": "a", "step": True},
        {"role": "r", "actor_id": "a", "time": 3},  # an int for a float: 3.0 in both
        {"role": "r", "actor_id": b"a"},  # bytes for str
        {"role": "r", "actor_id": "a", "values": {"x": 1, "y": 2.5}},  # int stays int
        {"role": "r", "actor_id": "a", "values": {b"x": 1}},
        {"role": "r", "actor_id": "a", "x": 1},
    ],
)
def test_fast_and_careful_paths_agree_on_conversions(body: dict[str, Any]) -> None:
    _paths_agree(_pack({"k": "metrics", "v": SCHEMA_VERSION, "d": body}), Metrics)


@pytest.mark.parametrize(
    "fields",
    [
        {"reward": 3},  # an int for float | None: 3.0 in both
        {"reward_info": {1: "x"}},  # a non-string key in a field typed dict[str, Any]
        {"data": [1]},
        {"versions": {"dtype": "int32", "shape": [2], "data": b"\0" * 4}},  # too few bytes
        {"versions": {"dtype": "int32", "shape": [-1, -1], "data": b"\0" * 4}},
        {"versions": {"dtype": "object", "shape": [1], "data": b"\0" * 8}},
        {"versions": {"dtype": "int8", "shape": ["1"], "data": b"\0"}},  # pydantic: "1" is 1
        {"versions": {"dtype": "int8", "shape": [1], "data": "x"}},  # pydantic: str as bytes
    ],
)
def test_fast_and_careful_paths_agree_on_trajectory_fields(fields: dict[str, Any]) -> None:
    body = msgpack.unpackb(TRAJECTORY)["d"] | fields
    _paths_agree(_pack({"k": "trajectory", "v": SCHEMA_VERSION, "d": body}), Trajectory)


class _Holder(Message):
    """A type that encodes directly and holds a model (no registered type does yet)."""

    KIND: ClassVar[str] = "test_holder"
    arr: Array
    n: int = 0


class _WiderArray(Array):
    note: str = "x"


@pytest.mark.parametrize(
    "msg",
    [
        _Holder(arr=Array.of([1, 2])),
        _Holder(arr=_WiderArray(dtype="uint8", shape=(1,), data=b"\1")),  # Array's fields only
        _Holder(arr=Array.of([1]), n=2**64),  # too large for msgpack
        _Holder(arr=Array.of([1]), n=-(2**63)),
    ],
)
def test_direct_encoding_writes_what_pydantic_and_msgpack_write(msg: _Holder) -> None:
    def careful() -> Any:
        body = msg.__pydantic_serializer__.to_python(msg)
        return msgpack.Packer().pack({"k": msg.KIND, "v": SCHEMA_VERSION, "d": body})

    assert _encodes_directly(_Holder)
    try:
        expected = careful()
    except Exception as exc:
        with pytest.raises(type(exc)):
            encode(msg)
    else:
        assert encode(msg) == expected
        _paths_agree(expected, _Holder)


class _Open(Message):
    """A type that encodes directly with open fields (``Any``, ``dict[str, Any]``, Any
    inside a container), one in a nested model, as a trajectory's record, its reward info
    and the buffer snapshot's dataset positions are."""

    KIND: ClassVar[str] = "test_open"
    data: dict[str, Any] = Field(default_factory=dict)
    extra: Any = None
    inner: list[_Holder] = Field(default_factory=list)
    pairs: list[tuple[int, dict[str, Any]]] = Field(default_factory=list)


class _Text(str):
    pass


class _Number(float):
    pass


@pytest.mark.parametrize(
    "fields",
    [
        {"data": {"question": "2+2?", "answer": "4", "n": 3, "ok": True, "none": None}},
        {"data": {"nested": {"a": [1, 2.5, "x", b"\0", None, (3, 4)]}}, "extra": (1, [2])},
        {"extra": {"k": {"deeper": [{"x": -(2**63)}]}}},
        {"extra": 2**64},  # too large for msgpack: refused as the careful path refuses it
        {"data": {"s": {1, 2}}},  # a set: msgpack refuses it (msgspec would write an array)
        {"extra": frozenset({1})},
        {"data": {"t": _Text("x")}},  # subclasses of plain types: the careful path decides
        {"data": {"f": _Number(0.5)}},
        {"data": {"f": np.float64(0.5), "i": np.int64(3)}},
        {"extra": {1: "a non-string key"}},
        {"inner": [_Holder(arr=Array.of([1]))]},
        {"pairs": [(1, {"epoch": 0, "order": [3, 1]}), (2, {})]},
        {"pairs": [(1, {"seen": {3}})]},
    ],
)
def test_open_fields_encode_directly_only_when_that_writes_the_same_bytes(
    fields: dict[str, Any],
) -> None:
    """Fields typed ``Any`` or ``dict[str, Any]`` take the direct encoding when they hold
    only plain values; anything else goes the careful way, with its result or its error."""
    msg = _Open.model_construct(**{"data": {}, "extra": None, "inner": [], "pairs": []} | fields)
    assert _encodes_directly(_Open)
    try:
        body = msg.__pydantic_serializer__.to_python(msg)
        expected = msgpack.Packer().pack({"k": msg.KIND, "v": SCHEMA_VERSION, "d": body})
    except Exception as exc:
        with pytest.raises(type(exc)):
            encode(msg)
    else:
        assert encode(msg) == expected


# -- copies without pydantic -------------------------------------------------------------------


@settings(CODEC, max_examples=30)
@given(
    st.sampled_from([Trajectory, TrajectoryGroup, Lease, TrainSample]).flatmap(
        lambda cls: st.tuples(instances(cls), instances(cls), st.data())
    )
)
def test_updated_makes_what_model_copy_makes(case: tuple[BaseModel, BaseModel, Any]) -> None:
    """``unchecked.updated`` (the rollout actor's stamps, a group's copies) against pydantic's
    own ``model_copy``: the same fields, the same fields counted as set, the same bytes on the
    wire, and the original left as it was; the update's values drawn from another instance."""
    full, other, data = case
    cls = type(full)
    # made with some of its defaults left out, so that what counts as set differs
    given_ = {
        name: getattr(full, name)
        for name, f in cls.model_fields.items()
        if f.is_required() or data.draw(st.booleans())
    }
    try:
        original = cls(**given_)
    except ValidationError:
        reject()  # a default left out that a cross-field rule needs (a group's attempt)
    names = data.draw(st.sets(st.sampled_from(sorted(cls.model_fields)), max_size=4))
    update = {name: getattr(other, name) for name in names}
    before = encode(original)
    got, want = updated(original, update), original.model_copy(update=update)
    assert type(got) is type(want)
    assert got.__dict__ == want.__dict__
    assert got.model_fields_set == want.model_fields_set
    assert encode(got) == encode(want)
    assert encode(original) == before and got is not original
