"""The wire format. No pickle, ever.

A message is one or two ZeroMQ frames:

1. a msgpack map, the header, of at most :data:`MAX_HEADER_BYTES`. Every header
   carries ``v`` (protocol version), ``kind`` and ``id`` (the request id,
   echoed in the reply); the other fields depend on the kind and are listed in
   :data:`SCHEMAS`;
2. for kinds that carry tensors, the raw bytes of one flat buffer, sent from
   and received into numpy memory without copies. The header states their
   dtype and byte count, and a message whose payload disagrees is rejected.

Kinds are registered in :data:`SCHEMAS` (required fields) and :data:`OPTIONAL`
(fields that may be absent), so the same transport can carry other requests
than parameter fetches. :func:`decode_header` checks a header against
its schema before anyone reads it and raises :class:`ProtocolError` with a short
machine-readable ``reason`` (for counters) and a human-readable detail.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import msgpack

__all__ = [
    "MAX_HEADER_BYTES",
    "OPTIONAL",
    "PROTOCOL_VERSION",
    "SCHEMAS",
    "WIRE_DTYPES",
    "Header",
    "ProtocolError",
    "decode_header",
    "encode_header",
    "fingerprint",
    "check_payload",
]

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 4096
MAX_REQUEST_ID = 2**64 - 1

# Wire dtype names a payload may have (see dpwa.kernels for their storage).
WIRE_DTYPES = ("float32", "float16", "bfloat16")


class ProtocolError(ValueError):
    """A message that does not follow the protocol. `reason` is a short code for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Float:
    """Schema marker: a finite number (int or float); stored as float."""


class _OptionalFloat:
    """Schema marker: a finite number, or nil for 'unknown'."""


class _Count:
    """Schema marker: a non-negative integer."""


class _ShmId:
    """Schema marker: 16 lowercase hex digits (it becomes part of a file name)."""


# kind -> {field: type}: fields every message of that kind carries.
SCHEMAS: dict[str, dict[str, Any]] = {
    # requester -> server: "send me your latest snapshot"
    "fetch": {"from": str, "fp": bytes, "dtype": str},
    # server -> requester, followed by a payload frame of `nbytes` bytes, or,
    # with shm_slot, nothing: the snapshot is in that same-host shared-memory slot
    "params": {"from": str, "fp": bytes, "dtype": str, "nbytes": _Count,
               "clock": _Float, "loss": _OptionalFloat},
    # server -> requester: the request was refused; nothing follows
    "error": {"reason": str, "detail": str},
    # requester -> server (mode symmetric): "here is my snapshot, send me yours"; a payload
    # frame of `nbytes` follows. The reply is a "params" message, as for "fetch".
    "exchange": {"from": str, "fp": bytes, "dtype": str, "nbytes": _Count, "clock": _Float, "loss": _OptionalFloat},
    # requester -> server: "I applied my half of exchange `xid` with factor f: apply yours"
    "confirm": {"from": str, "xid": _Count, "f": _Float},
    # server -> requester: the confirm was recorded
    "ack": {},
}
# kind -> {field: type}: fields that may be absent. Any field in neither table is refused.
OPTIONAL: dict[str, dict[str, Any]] = {
    "fetch": {"shm": bool},  # the requester runs on the same host and can read shared memory
    "exchange": {"shm": bool},
    "params": {"version": _Count, "shm_slot": _Count, "shm_id": _ShmId},
}
_COMMON = ("v", "kind", "id")


@dataclass(frozen=True)
class Header:
    """A decoded, validated header."""

    kind: str
    id: int
    fields: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


def encode_header(kind: str, request_id: int, **fields: Any) -> bytes:
    """Encode a header, checking it against the schema of its kind first."""
    header = {"v": PROTOCOL_VERSION, "kind": kind, "id": request_id, **fields}
    _validate(header)
    data = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"{kind} header is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    return data


def decode_header(data: bytes | memoryview) -> Header:
    """Decode and validate one header frame; raise ProtocolError if anything is off."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"header frame is {len(data)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=64,
            max_map_len=32,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise ProtocolError("bad_header", f"not a msgpack map: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header must be a map, got {type(header).__name__}")
    try:
        _validate(header)
    except ProtocolError:
        raise
    except Exception as exc:  # any other surprise in hostile input is still just a bad header
        raise ProtocolError("bad_header", f"unusable header: {type(exc).__name__}: {exc}") from None
    fields = {k: v for k, v in header.items() if k not in _COMMON}
    for key, kind in SCHEMAS[header["kind"]].items():
        if kind is _Float:
            fields[key] = float(fields[key])
        elif kind is _OptionalFloat and fields[key] is not None:
            fields[key] = float(fields[key])
    return Header(kind=header["kind"], id=header["id"], fields=fields)


def _validate(header: Mapping[str, Any]) -> None:
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {version!r}, this node speaks {PROTOCOL_VERSION}")
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in SCHEMAS:
        raise ProtocolError("bad_kind", f"unknown message kind {kind!r}")
    request_id = header.get("id")
    if not _is_int(request_id) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ProtocolError("bad_header", f"{kind}: id must be an integer in [0, 2**64), got {request_id!r}")
    schema, optional = SCHEMAS[kind], OPTIONAL.get(kind, {})
    extra = set(header) - set(schema) - set(optional) - set(_COMMON)
    if extra:
        raise ProtocolError("bad_header", f"{kind}: unexpected fields {sorted(map(str, extra))}")
    for key, expected in list(schema.items()) + list(optional.items()):
        if key not in header:
            if key in schema:
                raise ProtocolError("bad_header", f"{kind}: missing field {key!r}")
            continue
        value = header[key]
        if not _matches(value, expected):
            raise ProtocolError("bad_header", f"{kind}: field {key!r} has a bad value {value!r:.80}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: Any, expected: Any) -> bool:
    if expected is _Float:
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if expected is _OptionalFloat:
        return value is None or ((_is_int(value) or isinstance(value, float)) and math.isfinite(value))
    if expected is _Count:
        return _is_int(value) and value >= 0
    if expected is _ShmId:
        return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)
    if expected is bool:
        return isinstance(value, bool)
    return isinstance(value, expected) and not isinstance(value, bool)


def check_payload(header: Header, payload: memoryview | bytes | None, *, fp: bytes, dtype: str, nbytes: int) -> None:
    """Check that a tensor-carrying message is the one we can use.

    The fingerprint, dtype and byte count in the header must be ours, and the
    payload frame must hold exactly the number of bytes the header announces
    (pass ``payload=None`` when the bytes come another way, e.g. shared memory).
    """
    if header["fp"] != fp:
        raise ProtocolError(
            "bad_fingerprint",
            f"model fingerprint {header['fp'].hex()} differs from ours {fp.hex()} "
            "(different layer names, shapes or dtypes)",
        )
    if header["dtype"] != dtype:
        raise ProtocolError("bad_dtype", f"payload dtype {header['dtype']!r}, expected {dtype!r}")
    if header["nbytes"] != nbytes:
        raise ProtocolError("bad_size", f"header announces {header['nbytes']} bytes, expected {nbytes}")
    if payload is not None and len(payload) != nbytes:
        raise ProtocolError("bad_size", f"payload frame holds {len(payload)} bytes, header announces {nbytes}")


def fingerprint(entries: Iterable[tuple[str, tuple[int, ...], str]]) -> bytes:
    """A 16-byte digest of a model's layout: each tensor's name, shape and dtype, in order."""
    canonical = [[name, [int(d) for d in shape], str(dtype)] for name, shape, dtype in entries]
    return hashlib.blake2b(msgpack.packb(canonical, use_bin_type=True), digest_size=16).digest()
