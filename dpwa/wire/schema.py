"""The wire format of every dpwa service. No pickle, ever.

A message is a list of ZeroMQ frames:

1. the header, a msgpack map of at most its kind's ``max_header_bytes``. Every
   header carries ``v`` (the protocol version), ``kind`` and ``id`` (the
   request id, echoed in the reply); its other fields are declared by its
   :class:`MessageKind`;
2. exactly ``payload`` more frames of raw bytes (tensors, sent from and
   received into numpy memory without copies), for the kinds that carry them.

A service declares its kinds with :func:`message_kind` in its own module
(``dpwa.gossip.transfer.protocol``, the lab's ``dpwa_lab.systems.sync.protocol``, ...), so every
kind has one schema, checked on both ends: :func:`encode` refuses to send a
header that breaks it and :func:`decode` refuses to hand one to anyone. Each
field says what it accepts (a number within bounds, a short string, a blob of
a given length, a bounded list or map), so numbers from a peer are range-checked
before any handler sees them. A violation is a :class:`ProtocolError` with a
short machine-readable ``reason`` (for counters) and a readable detail.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import EncodeError, ProtocolError

__all__ = [
    "ERROR",
    "KINDS",
    "MAX_HEADER_BYTES",
    "MAX_ID",
    "NAME_PATTERN",
    "PROTOCOL_VERSION",
    "Blob",
    "Choice",
    "Field",
    "Flag",
    "Header",
    "Integer",
    "ListOf",
    "MapOf",
    "MessageKind",
    "Number",
    "Record",
    "Text",
    "decode",
    "encode",
    "clamp",
    "error_header",
    "message_kind",
]

PROTOCOL_VERSION = 2  # 2: kinds declared per service, bounded fields, server-assigned exchange ids
MAX_HEADER_BYTES = 4096  # the default limit of one header frame
LARGEST_HEADER_BYTES = 1 << 16  # no kind may declare more (status replies are the largest)
MAX_ID = 2**64 - 1
NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"  # node names, reasons: what may appear in logs and file names


# --------------------------------------------------------------------------- fields


class Field(ABC):
    """What one header field accepts. `check` returns the value to use, or raises ValueError."""

    @abstractmethod
    def check(self, value: Any) -> Any: ...


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Number(Field):
    """A finite number in [lo, hi] (ints are accepted and become floats); None too when optional."""

    lo: float = -math.inf
    hi: float = math.inf
    optional: bool = False

    def check(self, value: Any) -> float | None:
        if value is None and self.optional:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        number = float(value)
        if not math.isfinite(number) or not self.lo <= number <= self.hi:
            raise ValueError(f"expected a finite number in [{self.lo:g}, {self.hi:g}], got {number!r}")
        return number


@dataclass(frozen=True)
class Integer(Field):
    """An integer in [lo, hi]."""

    lo: int = 0
    hi: int = MAX_ID

    def check(self, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not self.lo <= value <= self.hi:
            raise ValueError(f"expected an integer in [{self.lo}, {self.hi}], got {value!r:.40}")
        return int(value)


@dataclass(frozen=True)
class Text(Field):
    """A string of at most `max_len` characters, matching `pattern` when given."""

    max_len: int = 256
    pattern: str | None = None
    _regex: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.pattern is not None:  # compiled once: every header of a kind checks it
            object.__setattr__(self, "_regex", re.compile(self.pattern))

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or len(value) > self.max_len:
            raise ValueError(f"expected a string of at most {self.max_len} characters")
        if self._regex is not None and not self._regex.fullmatch(value):
            raise ValueError(f"{value[:40]!r} does not match {self.pattern}")
        return value


@dataclass(frozen=True)
class Blob(Field):
    """Bytes: exactly `length` of them, or at most `max_len`."""

    length: int | None = None
    max_len: int = MAX_HEADER_BYTES

    def check(self, value: Any) -> bytes:
        if not isinstance(value, bytes):
            raise ValueError(f"expected bytes, got {type(value).__name__}")
        if (self.length is not None and len(value) != self.length) or len(value) > self.max_len:
            raise ValueError(f"expected {self.length or f'at most {self.max_len}'} bytes, got {len(value)}")
        return value


@dataclass(frozen=True)
class Flag(Field):
    """True or False."""

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r:.40}")
        return value


@dataclass(frozen=True)
class Choice(Field):
    """One of a few strings."""

    choices: tuple[str, ...]

    def check(self, value: Any) -> str:
        if value not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {value!r:.40}")
        return str(value)


@dataclass(frozen=True)
class ListOf(Field):
    """A list of at most `max_len` items, each checked by `item`."""

    item: Field
    max_len: int = 64

    def check(self, value: Any) -> list[Any]:
        if not isinstance(value, list) or len(value) > self.max_len:
            raise ValueError(f"expected a list of at most {self.max_len} items")
        return [self.item.check(v) for v in value]


@dataclass(frozen=True)
class MapOf(Field):
    """A map of at most `max_len` entries; keys and values checked by `key` and `value`."""

    key: Field
    value: Field
    max_len: int = 64

    def check(self, value: Any) -> dict[Any, Any]:
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise ValueError(f"expected a map of at most {self.max_len} entries")
        return {self.key.check(k): self.value.check(v) for k, v in value.items()}


@dataclass(frozen=True)
class Record(Field):
    """A map with named fields, like a header's: `fields` required, `optional` may be absent."""

    fields: Mapping[str, Field]
    optional: Mapping[str, Field] = field(default_factory=dict)

    def check(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError("expected a map")
        return _check_fields(value, self.fields, self.optional, "")


def _check_fields(
    data: Mapping[Any, Any],
    required: Mapping[str, Field],
    optional: Mapping[str, Field],
    where: str,
    skip: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The checked values of `data`'s fields (those in `skip` are checked elsewhere and left out)."""
    for key in data:  # one pass of lookups: the common case has nothing unexpected
        if key not in required and key not in optional and key not in skip:
            extra = sorted(str(k) for k in data if k not in required and k not in optional and k not in skip)
            raise ValueError(f"{where}unexpected fields {extra[:5]}")
    out: dict[str, Any] = {}
    for key, spec in required.items():
        if key not in data:
            raise ValueError(f"{where}missing field {key!r}")
        try:
            out[key] = spec.check(data[key])
        except ValueError as exc:
            raise ValueError(f"{where}field {key!r}: {exc}") from None
    for key, spec in optional.items():
        if key in data:
            try:
                out[key] = spec.check(data[key])
            except ValueError as exc:
                raise ValueError(f"{where}field {key!r}: {exc}") from None
    return out


# --------------------------------------------------------------------------- kinds


@dataclass(frozen=True)
class MessageKind:
    """The schema of one kind of message."""

    name: str
    fields: Mapping[str, Field]  # fields every message of this kind carries
    optional: Mapping[str, Field] = field(default_factory=dict)  # fields it may carry
    payload: int = 0  # raw frames after the header, exactly
    max_header_bytes: int = MAX_HEADER_BYTES


KINDS: dict[str, MessageKind] = {}  # every kind any service declared, by name


def message_kind(
    name: str,
    fields: Mapping[str, Field],
    optional: Mapping[str, Field] | None = None,
    *,
    payload: int = 0,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> MessageKind:
    """Declare a kind of message; its name must be new."""
    if name in KINDS:
        raise ValueError(f"message kind {name!r} is declared twice")
    if not 0 < max_header_bytes <= LARGEST_HEADER_BYTES:
        raise ValueError(f"{name}: max_header_bytes must be in (0, {LARGEST_HEADER_BYTES}]")
    kind = MessageKind(name, dict(fields), dict(optional or {}), payload, max_header_bytes)
    KINDS[name] = kind
    return kind


# server -> client: the request was refused or rejected; nothing follows
ERROR = message_kind("error", {"reason": Text(64, NAME_PATTERN), "detail": Text(1024)})


@dataclass(frozen=True)
class Header:
    """A decoded, validated header."""

    kind: str
    id: int
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def encode(kind: MessageKind | str, request_id: int, **fields: Any) -> bytes:
    """A header frame, checked against the schema of its kind first.

    Raises :class:`EncodeError` (a bug here, not a peer's) when it breaks the schema; fields a node
    reports about itself are made to fit first (:func:`clamp`), so that its own numbers cannot stop it.
    """
    spec = KINDS[kind] if isinstance(kind, str) else kind
    header = {"v": PROTOCOL_VERSION, "kind": spec.name, "id": request_id, **fields}
    try:
        data: bytes = msgpack.packb(header, use_bin_type=True)
        _validate(header, spec, len(data))
    except ProtocolError as exc:
        raise EncodeError(f"cannot send a {spec.name}: {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot send a {spec.name}: {type(exc).__name__}: {exc}") from None
    return data


def clamp(field: Field, value: Any) -> Any:
    """`value` made to fit `field` where a number can be: clamped into its bounds, a non-finite one
    dropped (None if optional, else the bound nearest 0); maps and records field by field. Anything
    else is returned as it is (encode still checks it)."""
    if isinstance(field, Number) and (_is_int(value) or isinstance(value, float)):
        number = float(value)
        if not math.isfinite(number):
            return None if field.optional else min(max(0.0, field.lo), field.hi)
        return min(max(number, field.lo), field.hi)
    if isinstance(field, Integer) and _is_int(value):
        return min(max(value, field.lo), field.hi)
    if isinstance(field, MapOf) and isinstance(value, dict):
        return {k: clamp(field.value, v) for k, v in value.items()}
    if isinstance(field, Record) and isinstance(value, dict):
        specs = {**field.fields, **field.optional}
        return {k: clamp(specs[k], v) if k in specs else v for k, v in value.items()}
    return value


def error_header(request_id: int, reason: str, detail: str) -> bytes:
    """An ``error`` reply (detail cut to the field's limit)."""
    return encode(ERROR, request_id, reason=reason, detail=detail[:1024])


def decode(data: bytes | memoryview, accept: Mapping[str, MessageKind] | None = None) -> Header:
    """Decode and validate one header frame; raise ProtocolError if anything is off.

    `accept` limits the kinds this caller takes (a server's routes, a client's
    expected replies); ``error`` is always accepted. Size is checked before parsing.
    """
    limit = MAX_HEADER_BYTES  # every kind allows this much; larger frames only if an accepted kind does
    if len(data) > limit:
        if accept:
            limit = max(limit, max((k.max_header_bytes for k in accept.values()), default=0))
        else:
            limit = LARGEST_HEADER_BYTES
        if len(data) > limit:
            raise ProtocolError("header_too_large", f"header frame is {len(data)} bytes, limit {limit}")
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError("bad_header", f"not a msgpack map: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {version!r:.20}, this node speaks {PROTOCOL_VERSION}")
    name = header.get("kind")
    spec = KINDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ProtocolError("bad_kind", f"unknown message kind {name!r:.40}")
    if accept is not None and name not in accept and name != ERROR.name:
        raise ProtocolError("unexpected_kind", f"{name!r} is not expected here")
    fields = _validate(header, spec, len(data))
    return Header(kind=spec.name, id=header["id"], fields=fields)


_ENVELOPE = frozenset(("v", "kind", "id"))  # every header's own keys, checked apart from its kind's fields


def _validate(header: Mapping[str, Any], spec: MessageKind, size: int) -> dict[str, Any]:
    if size > spec.max_header_bytes:
        raise ProtocolError("header_too_large", f"{spec.name} header is {size} bytes, limit {spec.max_header_bytes}")
    request_id = header.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id <= MAX_ID:
        raise ProtocolError("bad_header", f"{spec.name}: id must be an integer in [0, 2**64), got {request_id!r:.40}")
    try:
        return _check_fields(header, spec.fields, spec.optional, f"{spec.name}: ", _ENVELOPE)
    except ValueError as exc:
        raise ProtocolError("bad_header", str(exc)) from None
    except Exception as exc:  # any other surprise in hostile input is still just a bad header
        raise ProtocolError("bad_header", f"{spec.name}: unusable header: {type(exc).__name__}") from None
