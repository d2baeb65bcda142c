"""The codec of the wire schema (:mod:`asyncrl.wire.messages`): encode and decode, with a
generated msgspec fast path.

On the wire a message is one msgpack map ``{"k": kind, "v": schema_version, "d": fields}``;
:func:`decode` checks the kind and the schema version before pydantic validates the
fields, so a receiver can tell "garbage", "a message from a newer/older asyncrl" and "a
field of the wrong type" apart. Most types also decode through a faster path (msgspec,
with a schema derived from the model) that accepts only what that careful path accepts;
see the notes above :func:`encode`.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import msgpack
import msgspec
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from asyncrl.wire.messages import MESSAGE_TYPES, SCHEMA_VERSION, Message


class DecodeError(ValueError):
    """A payload that is not a valid message of the expected kind and schema version.

    ``reason`` is a short, countable tag: ``garbage``, ``schema_version``, ``kind`` or
    ``invalid``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


M = TypeVar("M", bound=Message)


# The codec runs once per message on every subject. Decoding has two paths:
#
# - the careful path: msgpack, then the envelope checks, then pydantic. It alone decides
#   why a payload is refused (DecodeError reasons and details come from it only);
# - a fast path, for the message types it can express (see _fast_decoder): msgspec decodes
#   and type-checks the whole payload in C against a schema derived from the pydantic
#   model, and the model is assembled from that without validating it a second time.
#
# The fast path accepts a payload only if the careful path would accept it and build the
# same model; anything it refuses, for whatever reason, goes down the careful path, so a
# refused payload costs both and gets the careful path's verdict. Junk is no cheaper to
# send than before, and no message skips validation.


def encode(msg: Message, encoded: Mapping[int, bytes] | None = None) -> bytes:
    """msgpack bytes of ``{"k": kind, "v": schema version, "d": fields}``.

    ``encoded``: models nested in ``msg`` whose fields are encoded already, by ``id`` of the
    model, each the bytes :func:`encode_fields` made of it (a model that has not changed
    since): they are written as they are (the buffer's groups, encoded once when they are
    first written, go into a batch that way)."""
    direct = _DIRECT.get(type(msg))
    if direct is None:
        direct = _DIRECT[type(msg)] = _encodes_directly(type(msg))
    if direct:
        # The fields as they are, nested models through _fields_of: the same bytes that
        # pydantic's serializer and msgpack make from these plain types, three to four
        # times faster. msgspec's encode function keeps its state on the stack, so any
        # thread may call it (an Encoder object shares one buffer, and _fields_of runs
        # Python code in the middle of an encoding).
        envelope = {"k": msg.KIND, "v": SCHEMA_VERSION, "d": msg.__dict__}
        hook = _fields_of if not encoded else functools.partial(_fields_or_known, encoded)
        try:
            _check_open_fields(msg)
            return _msgspec_encode(envelope, enc_hook=hook)
        except Exception:  # e.g. an int too large for msgpack: the error comes from below
            pass
    body = msg.__pydantic_serializer__.to_python(msg)
    # A fresh Packer per call (packb makes one too, through a Python frame and keyword
    # arguments): a shared one is not promised to be safe from two threads.
    return msgpack.Packer().pack({"k": msg.KIND, "v": SCHEMA_VERSION, "d": body})


def encode_fields(msg: Message) -> bytes | None:
    """The msgpack of ``msg``'s fields alone (what :func:`encode` writes under ``"d"``, and
    where ``msg`` is nested in another message), or None where its type does not encode
    directly. :func:`enveloped` makes the message of them."""
    if not _encodes_directly(type(msg)):
        return None
    try:
        _check_open_fields(msg)
        return _msgspec_encode(msg.__dict__, enc_hook=_fields_of)
    except Exception:
        return None


def enveloped(msg: Message, fields: bytes) -> bytes:
    """What :func:`encode` makes of ``msg``, given :func:`encode_fields`' bytes of it."""
    return _msgspec_encode({"k": msg.KIND, "v": SCHEMA_VERSION, "d": msgspec.Raw(fields)})


def decode(payload: bytes, expected: type[M]) -> M:
    """Decodes and validates ``payload`` as an ``expected``; raises :class:`DecodeError`."""
    try:
        fast = _FAST[expected]
    except KeyError:
        fast = _FAST[expected] = _fast_decoder(expected)
    if fast is not None:
        try:
            return fast(payload)  # type: ignore[no-any-return]
        except Exception:  # the careful path below gives the verdict
            pass
    return _decode_checked(payload, expected)


def decode_any(payload: bytes) -> Message:
    """Decodes a message of any registered kind; raises :class:`DecodeError`."""
    kind, body = _open_envelope(_unpack(payload))
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise DecodeError("kind", f"unknown message kind {kind!r}")
    return _validate(cls, body)


def _decode_checked(payload: bytes, expected: type[M]) -> M:
    """The careful path of :func:`decode`, the one that names the reason of a refusal."""
    envelope = _unpack(payload)
    # The common case, recognised in one step; anything else goes to _open_envelope, the
    # one place that tells garbage, schema version and kind apart.
    if not (
        type(envelope) is dict
        and envelope.get("v") == SCHEMA_VERSION
        and envelope.get("k") == expected.KIND
        and "d" in envelope
    ):
        kind, _ = _open_envelope(envelope)
        raise DecodeError("kind", f"expected {expected.KIND!r}, got {kind!r}")
    return _validate(expected, envelope["d"])


def _unpack(payload: bytes) -> Any:
    try:
        # No keyword arguments: msgpack's extension parses them again on every call, and
        # the msgpack >= 1.0 defaults are the ones wanted (bin type for bytes, str for str,
        # only str and bytes map keys).
        return msgpack.unpackb(payload)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError("garbage", f"not msgpack ({type(exc).__name__}: {exc})") from None


def _open_envelope(envelope: Any) -> tuple[str, Any]:
    if not isinstance(envelope, dict) or not {"k", "v", "d"} <= envelope.keys():
        raise DecodeError("garbage", "not an asyncrl envelope")
    if envelope["v"] != SCHEMA_VERSION:
        raise DecodeError(
            "schema_version",
            f"schema version {envelope['v']!r}, this asyncrl speaks {SCHEMA_VERSION}",
        )
    if not isinstance(envelope["k"], str):
        raise DecodeError("kind", f"message kind {envelope['k']!r} is not a string")
    return envelope["k"], envelope["d"]


def _validate(cls: type[M], body: Any) -> M:
    try:
        # The validator itself: model_validate only forwards to it through a Python frame
        # and six keyword arguments, which added 30-50% to a small message.
        return cls.__pydantic_validator__.validate_python(body)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise DecodeError("invalid", f"{cls.KIND}: {exc}") from None


# --- the fast path ---------------------------------------------------------------------------

_DIRECT: dict[type[BaseModel], bool] = {}
_OPEN_FIELDS: dict[type[BaseModel], tuple[str, ...]] = {}
"""The open fields (see :func:`_open`) of each type that encodes directly."""
_FAST: dict[type[Message], Callable[[bytes], Any] | None] = {}

# What a pydantic model instance holds besides its __dict__; set the way pydantic-core sets
# them when it validates (the model types here have no extra fields and no private ones).
_new = object.__new__
_set_attr = object.__setattr__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__

# Types whose fields msgspec decodes exactly as msgpack + pydantic (lax) would, given what
# msgspec accepts: an int for a float becomes a float in both, and msgspec refuses
# everything pydantic would have had to convert (a float for an int, a str for bytes).
_SAME_LEAVES = (str, int, float, bool, bytes, type(None))
_MODEL_CONFIG_KEYS = {"extra", "frozen"}  # settings that the fast path honours (or not need)


# One field of a model for a builder: its name, the conversion of what msgspec gives (None:
# as is), and its default as a function (None: the field is required).
_Field = tuple[str, Callable[[Any], Any] | None, Callable[[], Any] | None]


class _Unsupported(Exception):
    """A model the fast path cannot express exactly: it decodes on the careful path only."""


def _fast_decoder(expected: type[Message]) -> Callable[[bytes], Any] | None:
    """The fast path's decoder of one message type, or None if it cannot express the type.

    The schema is derived from the pydantic model once, when the type is first decoded.
    Each model type (the message and those nested in it) gets a msgspec Struct with the
    same fields, unknown fields forbidden (an unknown key must reach the careful path,
    which unpacks and judges it); a field with a default is optional. A field typed Any
    stays raw msgpack and is unpacked by msgpack itself, so it holds exactly what the
    careful path would give. Builders make the pydantic instances from the Structs and
    run the models' ``after`` validators; a type with anything else (field constraints,
    other validators, aliases, other model settings) is not supported.
    """
    schema = _Schema()
    try:
        struct, _ = schema.model(expected)
        envelope = msgspec.defstruct(
            f"_Envelope_{expected.__name__}",
            [("k", Literal[expected.KIND]), ("v", Literal[SCHEMA_VERSION]), ("d", struct)],  # type: ignore[valid-type]
            forbid_unknown_fields=True,
        )
        entry = msgspec.msgpack.Decoder(envelope).decode
    except (_Unsupported, TypeError):  # TypeError: a type msgspec cannot decode
        return None
    # The message's own builder again, taking the payload: one call less per message.
    return _builder(expected, *schema.plans[expected], entry=entry)


class _Schema:
    """Derives msgspec types and builders from pydantic models; raises _Unsupported."""

    def __init__(self) -> None:
        self._models: dict[type[BaseModel], tuple[Any, Callable[[Any], Any]]] = {}
        self.plans: dict[type[BaseModel], tuple[list[_Field], list[Callable[[Any], Any]]]] = {}

    def model(self, model: type[BaseModel]) -> tuple[Any, Callable[[Any], Any]]:
        if model in self._models:
            return self._models[model]
        if (
            not set(model.model_config) <= _MODEL_CONFIG_KEYS
            or model.model_config.get("extra", "ignore") == "allow"
            or model.__private_attributes__
            or model.__pydantic_post_init__
            or model.__pydantic_decorators__.field_validators
            or model.__pydantic_decorators__.validators
            or model.__pydantic_decorators__.root_validators
        ):
            raise _Unsupported(model.__name__)
        after = []
        for dec in model.__pydantic_decorators__.model_validators.values():
            if dec.info.mode != "after" or len(inspect.signature(dec.func).parameters) != 1:
                raise _Unsupported(f"{model.__name__}: a {dec.info.mode} model validator")
            after.append(dec.func)
        fields: list[tuple[str, Any, Any]] = []
        plan: list[_Field] = []
        for name, info in model.model_fields.items():
            if info.metadata or info.alias or info.validation_alias or info.validate_default:
                raise _Unsupported(f"{model.__name__}.{name}")
            spec, convert = self.value(info.annotation)
            if info.default_factory is not None:
                if getattr(info, "default_factory_takes_data", False):
                    raise _Unsupported(f"{model.__name__}.{name}: factory takes data")
                default: Any = info.default_factory
                fields.append((name, spec | msgspec.UnsetType, msgspec.UNSET))
            elif info.default is not PydanticUndefined:
                if not isinstance(info.default, _SAME_LEAVES):
                    raise _Unsupported(f"{model.__name__}.{name}: default {info.default!r}")
                value = info.default
                default = lambda value=value: value  # noqa: E731
                fields.append((name, spec | msgspec.UnsetType, msgspec.UNSET))
            else:
                default = None
                fields.append((name, spec, msgspec.NODEFAULT))
            plan.append((name, convert, default))
        struct = msgspec.defstruct(
            f"_Fast_{model.__name__}",
            [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields],
            forbid_unknown_fields=True,
            kw_only=True,
        )
        build = _builder(model, plan, after)
        self._models[model] = struct, build
        self.plans[model] = plan, after
        return struct, build

    def value(self, annotation: Any) -> tuple[Any, Callable[[Any], Any] | None]:
        """The msgspec type of a field and the conversion of what msgspec gives (None: as is)."""
        origin, args = get_origin(annotation), get_args(annotation)
        if annotation is Any:
            return msgspec.Raw, _unpack_raw
        if annotation in _SAME_LEAVES:
            return annotation, None
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            return self.model(annotation)
        if origin is Literal and all(type(a) is str for a in args):
            return annotation, None
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            spec, convert = self.value(args[0])
            if convert is None:
                return tuple[spec, ...], None  # type: ignore[valid-type]
        elif origin is list:
            spec, convert = self.value(args[0])
            if convert is None:
                return list[spec], None  # type: ignore[valid-type]
            return list[spec], lambda v: [convert(x) for x in v]  # type: ignore[valid-type]
        elif origin is dict and args[0] is str:
            if args[1] is Any:  # kept raw whole: msgpack checks its keys as it would
                return msgspec.Raw, _unpack_raw_dict
            spec, convert = self.value(args[1])
            if convert is None:
                return dict[str, spec], None  # type: ignore[valid-type]
        elif origin in (Union, types.UnionType):
            parts = [self.value(a) for a in args]
            if all(c is None for _, c in parts) and all(a in _SAME_LEAVES for a in args):
                return annotation, None
            if len(args) == 2 and type(None) in args:  # X | None, X a model or a container
                spec, convert = parts[0] if args[1] is type(None) else parts[1]
                if convert is None:
                    return spec | None, None
                return spec | None, lambda v: None if v is None else convert(v)
        raise _Unsupported(repr(annotation))


def _encodes_directly(model: type[BaseModel]) -> bool:
    """Whether msgspec, given ``model.__dict__``, writes what pydantic's serializer and
    msgpack would: fields of plain types only (msgspec would quietly encode what msgpack
    refuses, such as a set or an enum in a field typed Any), nothing that changes the
    serialized form (serializers, computed or excluded fields, aliases), and nothing else
    kept in ``__dict__`` (a cached_property)."""
    if model in _DIRECT:
        return _DIRECT[model]
    _DIRECT[model] = False  # a model that contains itself is not direct
    decorators = model.__pydantic_decorators__
    fields = model.model_fields
    open_fields = tuple(name for name, f in fields.items() if _open(f.annotation))
    direct = not (
        decorators.field_serializers
        or decorators.model_serializers
        or model.__pydantic_computed_fields__
        or model.model_config.get("extra") == "allow"
        or any(
            isinstance(attr, functools.cached_property)
            for klass in model.__mro__
            for attr in vars(klass).values()
        )
        or any(
            f.exclude
            or f.alias
            or f.serialization_alias
            or not (name in open_fields or _plain(f.annotation))
            for name, f in fields.items()
        )
    )
    if direct and open_fields:
        _OPEN_FIELDS[model] = open_fields
    _DIRECT[model] = direct
    return direct


def _open(annotation: Any) -> bool:
    """Whether a field's type holds ``Any`` (``dict[str, Any]``, say) and, besides it, only
    plain types, no model: its value encodes directly when it holds only plain values
    (:func:`_plain_value`), checked as it is encoded."""
    return _plain(annotation, open_=True) and not _plain(annotation)


_PLAIN_VALUES = frozenset(_SAME_LEAVES)


def _plain_value(value: Any) -> bool:
    """Whether msgspec writes ``value`` as msgpack writes what pydantic's serializer makes
    of it: exactly str, int, float, bool, bytes or None, or a list, tuple or dict with str
    keys of those. Anything else (a set, which msgpack refuses and msgspec writes as an
    array; a numpy number; a subclass of a plain type) is left to the careful path."""
    kind = type(value)
    if kind in _PLAIN_VALUES:
        return True
    # loops, not all() over a generator, and a leaf told without a call: a sample's
    # reward info is checked each time it is encoded
    if kind is dict:
        for k, v in value.items():
            if type(k) is not str or (type(v) not in _PLAIN_VALUES and not _plain_value(v)):
                return False
        return True
    if kind is list or kind is tuple:
        for v in value:
            if type(v) not in _PLAIN_VALUES and not _plain_value(v):
                return False
        return True
    return False


def _check_open_fields(obj: BaseModel) -> None:
    """Raises TypeError unless every open field of ``obj`` (see :func:`_open`) holds plain
    values: the direct encoding is then exact, else the careful path writes (or refuses)
    it."""
    values = obj.__dict__
    for name in _OPEN_FIELDS.get(type(obj), ()):
        if not _plain_value(values[name]):
            raise TypeError(f"{type(obj).__name__}.{name} holds a value that is not plain")


def _plain(annotation: Any, *, open_: bool = False) -> bool:
    """Whether a field of this type encodes directly as it is. With ``open_``, ``Any``
    counts as plain and a model does not (the type of an open field, see :func:`_open`)."""
    if annotation in _SAME_LEAVES or (open_ and annotation is Any):
        return True
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return not open_ and _encodes_directly(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return all(type(a) is str for a in args)
    if origin in (tuple, list, dict, Union, types.UnionType):
        return all(a is Ellipsis or _plain(a, open_=open_) for a in args)
    return False


def _fields_of(obj: Any) -> dict[str, Any]:
    """msgspec's hook for a nested model: its fields, if its type encodes directly (and
    its open fields hold plain values)."""
    kind = type(obj)
    if _DIRECT.get(kind):
        if kind in _OPEN_FIELDS:  # most nested models (arrays) have none to check
            _check_open_fields(obj)
        return obj.__dict__  # type: ignore[no-any-return]
    raise TypeError(f"{kind.__name__} is not encoded directly")


def _fields_or_known(known: Mapping[int, bytes], obj: Any) -> Any:
    """:func:`_fields_of`, or the bytes ``known`` holds for ``obj``."""
    fields = known.get(id(obj))
    return _fields_of(obj) if fields is None else msgspec.Raw(fields)


_msgspec_encode = msgspec.msgpack.encode


def _unpack_raw(raw: msgspec.Raw) -> Any:
    return msgpack.unpackb(raw)


_EMPTY_MAP = msgspec.Raw(b"\x80")


def _unpack_raw_dict(raw: msgspec.Raw) -> dict[str, Any]:
    if raw == _EMPTY_MAP:  # the common case (a scored sample's record), without msgpack
        return {}
    value = msgpack.unpackb(raw)
    if type(value) is not dict or not all(type(k) is str for k in value):
        raise ValueError("not a dict with str keys")  # the careful path says what pydantic says
    return value


def _builder(
    model: type[BaseModel],
    plan: list[_Field],
    after: list[Callable[[Any], Any]],
    entry: Callable[[bytes], Any] | None = None,
) -> Callable[[Any], Any]:
    """The function that makes a ``model`` from its Struct, as pydantic-core would; with
    ``entry``, from a payload that ``entry`` decodes into an envelope Struct.

    Its source is written out for this model, the way dataclasses writes ``__init__``: a
    loop over the fields cost more than pydantic's own validation of a small message.
    """
    scope: dict[str, Any] = {
        "entry": entry,
        "model": model,
        "UNSET": msgspec.UNSET,
        "new": _new,
        "set_attr": _set_attr,
        "set_fields_set": _set_fields_set,
        "set_extra": _set_extra,
        "set_private": _set_private,
    }
    required = [name for name, _, default in plan if default is None]
    lines = [
        f"    fields_set = {{{', '.join(map(repr, required))}}}"
        if required
        else "    fields_set = set()"
    ]
    items = []
    for i, (name, convert, default) in enumerate(plan):
        value = f"s.{name}"
        if convert is not None:
            scope[f"convert_{i}"] = convert
            value = f"convert_{i}({value})"
        if default is None:
            items.append(f"{name!r}: {value}")
            continue
        scope[f"default_{i}"] = default
        lines += [
            f"    v_{i} = s.{name}",
            f"    if v_{i} is UNSET:",
            f"        v_{i} = default_{i}()",
            "    else:",
            f"        fields_set.add({name!r})",
            f"        v_{i} = {value.replace(f's.{name}', f'v_{i}')}",
        ]
        items.append(f"{name!r}: v_{i}")
    lines += [
        "    obj = new(model)",
        f"    set_attr(obj, '__dict__', {{{', '.join(items)}}})",
        "    set_fields_set(obj, fields_set)",
        "    set_extra(obj, None)",
        "    set_private(obj, None)",
    ]
    for i, check in enumerate(after):
        scope[f"after_{i}"] = check
        lines.append(f"    obj = after_{i}(obj)")
    head = (
        ["def build(s):"] if entry is None else ["def build(payload):", "    s = entry(payload).d"]
    )
    source = "\n".join([*head, *lines, "    return obj"]) + "\n"
    exec(source, scope)  # our own source, made of the model's field names
    return scope["build"]  # type: ignore[no-any-return]
