"""The wire format: headers round-trip, every field is range-checked, and every malformed header
is rejected with a reason before anyone reads it."""

from __future__ import annotations

import msgpack
import pytest

from dpwa.gossip.transfer.protocol import CONFIRM, EXCHANGE, FETCH, MAX_CLOCK, MAX_LOSS, PARAMS, check_payload
from dpwa.mixing.model import WireModel
from dpwa.mixing.params import fingerprint
from dpwa.wire.errors import EncodeError, ProtocolError
from dpwa.wire.schema import (
    KINDS,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Integer,
    ListOf,
    MapOf,
    Number,
    Record,
    Text,
    decode,
    encode,
    message_kind,
)

FP = fingerprint([("layer.weight", (3, 4), "float32"), ("layer.bias", (3,), "float32")])


def params_fields(**overrides):
    fields = {"from": "w1", "fp": FP, "dtype": "float32", "nbytes": 60, "clock": 12.5, "loss": 0.25, "version": 3}
    fields.update(overrides)
    return fields


def raw(**header):
    return msgpack.packb(header, use_bin_type=True)


def test_round_trip():
    header = decode(encode(PARAMS, 42, **params_fields()))
    assert header.kind == "params" and header.id == 42
    assert header["clock"] == 12.5 and header["loss"] == 0.25 and header["fp"] == FP and header["version"] == 3
    assert isinstance(decode(encode(PARAMS, 1, **params_fields(clock=3)))["clock"], float)
    assert decode(encode(PARAMS, 1, **params_fields(loss=None)))["loss"] is None
    assert decode(encode("params", 1, **params_fields(xid=7, f=0.5))).get("xid") == 7  # optional fields


def test_fingerprint_depends_on_names_shapes_and_dtypes():
    base = [("w", (3, 4), "float32")]
    assert fingerprint(base) == fingerprint(list(base))
    assert len(fingerprint(base)) == 16
    for other in (
        [("v", (3, 4), "float32")],
        [("w", (4, 3), "float32")],
        [("w", (3, 4), "float16")],
        base + [("b", (3,), "float32")],
    ):
        assert fingerprint(other) != fingerprint(base)


GOOD = dict(v=PROTOCOL_VERSION, kind="params", id=1, **params_fields())


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "bad_header"),
        (b"\xc1garbage", "bad_header"),
        (raw(**{**GOOD, "v": 1}), "bad_version"),  # the protocol before server-assigned exchange ids
        (msgpack.packb([1, 2, 3]), "bad_header"),
        (raw(**{**GOOD, "kind": "pickle"}), "bad_kind"),
        (raw(**{**GOOD, "id": -1}), "bad_header"),
        (raw(**{**GOOD, "id": True}), "bad_header"),
        (raw(**{**GOOD, "id": "7"}), "bad_header"),
        (raw(**{**GOOD, "nbytes": -4}), "bad_header"),
        (raw(**{**GOOD, "nbytes": 1.5}), "bad_header"),
        (raw(**{**GOOD, "nbytes": 2**41}), "bad_header"),
        (raw(**{**GOOD, "clock": float("nan")}), "bad_header"),
        (raw(**{**GOOD, "clock": -1.0}), "bad_header"),  # clocks are never negative
        (raw(**{**GOOD, "clock": 1.7e308}), "bad_header"),  # ... nor beyond MAX_CLOCK
        (raw(**{**GOOD, "clock": MAX_CLOCK * 2}), "bad_header"),
        (raw(**{**GOOD, "loss": float("inf")}), "bad_header"),
        (raw(**{**GOOD, "loss": MAX_LOSS * 10}), "bad_header"),
        (raw(**{**GOOD, "f": 0.75}), "bad_header"),  # no exchange moves a node past the midpoint
        (raw(**{**GOOD, "f": -0.1}), "bad_header"),
        (raw(**{**GOOD, "xid": 0}), "bad_header"),
        (raw(**{**GOOD, "from": "../../etc"}), "bad_header"),  # names end up in logs and file names
        (raw(**{**GOOD, "from": "w" * 65}), "bad_header"),
        (raw(**{**GOOD, "dtype": "float64"}), "bad_header"),
        (raw(**{**GOOD, "fp": "not bytes"}), "bad_header"),
        (raw(**{**GOOD, "fp": b"short"}), "bad_header"),
        (raw(**{k: v for k, v in GOOD.items() if k != "dtype"}), "bad_header"),
        (raw(**{**GOOD, "extra": 1}), "bad_header"),
        (b"\x81\xa1v" + b"\xdb" + (10**6).to_bytes(4, "big"), "bad_header"),  # claims a 1 MB string
        (b"\x00" * (1 << 17), "header_too_large"),
    ],
)
def test_malformed_headers_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.reason == reason


def test_a_header_longer_than_its_kind_allows_is_refused_before_parsing():
    accept = {CONFIRM.name: CONFIRM}  # a kind with the default limit (fetch may carry a digest: 16 KiB)
    with pytest.raises(ProtocolError) as info:
        decode(b"\x00" * (MAX_HEADER_BYTES + 1), accept)
    assert info.value.reason == "header_too_large"


def test_a_kind_the_caller_does_not_take_is_unexpected():
    data = encode(CONFIRM, 5, **{"from": "w1"}, xid=9)
    assert decode(data, {CONFIRM.name: CONFIRM})["xid"] == 9
    with pytest.raises(ProtocolError) as info:
        decode(data, {FETCH.name: FETCH})
    assert info.value.reason == "unexpected_kind"
    assert decode(encode("error", 5, reason="busy", detail="x"), {FETCH.name: FETCH}).kind == "error"


def test_encoding_checks_too():
    """A header this side was about to send that breaks its schema is an EncodeError: our bug, which a
    server counts as its own (internal), never a ProtocolError it would blame on the requester."""
    with pytest.raises(EncodeError, match="missing field 'loss'"):
        encode(PARAMS, 1, **{k: v for k, v in params_fields().items() if k != "loss"})
    with pytest.raises(EncodeError, match="field 'clock'"):
        encode(EXCHANGE, 1, **{"from": "w1"}, fp=FP, dtype="float32", nbytes=60, clock=-5, loss=None)
    assert not issubclass(EncodeError, ProtocolError)
    with pytest.raises(EncodeError, match="header_too_large|field 'detail'"):
        encode("error", 1, reason="x", detail="y" * MAX_HEADER_BYTES)


def test_kinds_are_declared_once_with_bounded_nested_fields():
    with pytest.raises(ValueError, match="declared twice"):
        message_kind("fetch", {})
    kind = message_kind(
        "test_nested",
        {
            "counters": MapOf(Text(16), Integer(0, 100), max_len=3),
            "peers": ListOf(Record({"name": Text(8)}, {"score": Number(0, 1)}), max_len=2),
        },
    )
    try:
        good = {"counters": {"a": 1}, "peers": [{"name": "w1", "score": 0.5}, {"name": "w2"}]}
        assert decode(encode(kind, 1, **good))["peers"][1] == {"name": "w2"}
        for bad in (
            {"counters": {"a": 101}},
            {"counters": {f"k{i}": 0 for i in range(4)}},
            {"peers": [{"name": "w1"}] * 3},
            {"peers": [{"name": "w1", "score": 2}]},
            {"peers": [{"name": "w1", "other": 1}]},
        ):
            with pytest.raises(ProtocolError):
                decode(raw(v=PROTOCOL_VERSION, kind=kind.name, id=1, **{**good, **bad}))
    finally:
        del KINDS[kind.name]


@pytest.mark.parametrize(
    "override, reason",
    [
        ({"fp": b"\x00" * 16}, "bad_fingerprint"),
        ({"dtype": "float16"}, "bad_dtype"),
        ({"nbytes": 10**12}, "bad_size"),  # an oversized claim
        ({"nbytes": 59}, "bad_size"),
    ],
)
def test_payload_checks(override, reason):
    header = decode(encode(PARAMS, 1, **params_fields(**override)))
    with pytest.raises(ProtocolError) as info:
        check_payload(header, WireModel(FP, "float32", 15))
    assert info.value.reason == reason


def test_payload_check_accepts_the_right_message():
    check_payload(decode(encode(PARAMS, 1, **params_fields())), WireModel(FP, "float32", 15))


@pytest.mark.parametrize("kind", [[1, 2], {"a": 1}, b"fetch", 3, None])
def test_a_kind_of_any_type_is_just_a_bad_header(kind):
    # found by the fuzzer: an unhashable kind once escaped as a TypeError and stopped the Rx thread
    with pytest.raises(ProtocolError) as info:
        decode(raw(**{**GOOD, "kind": kind}))
    assert info.value.reason in ("bad_kind", "bad_header")
