"""Wire format: headers round-trip, and every malformed header is rejected with a reason."""

from __future__ import annotations

import msgpack
import pytest

from dpwa.protocol import (MAX_HEADER_BYTES, PROTOCOL_VERSION, ProtocolError, check_payload, decode_header,
                           encode_header, fingerprint)

FP = fingerprint([("layer.weight", (3, 4), "float32"), ("layer.bias", (3,), "float32")])


def params_header(**overrides):
    fields = {"from": "w1", "fp": FP, "dtype": "float32", "nbytes": 60, "clock": 12.5, "loss": 0.25}
    fields.update(overrides)
    return fields


def raw(**header):
    return msgpack.packb(header, use_bin_type=True)


def test_round_trip():
    data = encode_header("params", 42, **params_header())
    header = decode_header(data)
    assert header.kind == "params" and header.id == 42
    assert header["clock"] == 12.5 and header["loss"] == 0.25 and header["fp"] == FP
    assert isinstance(decode_header(encode_header("params", 1, **params_header(clock=3)))["clock"], float)
    assert decode_header(encode_header("params", 1, **params_header(loss=None)))["loss"] is None


def test_fingerprint_depends_on_names_shapes_and_dtypes():
    base = [("w", (3, 4), "float32")]
    assert fingerprint(base) == fingerprint(list(base))
    assert len(fingerprint(base)) == 16
    for other in ([("v", (3, 4), "float32")], [("w", (4, 3), "float32")], [("w", (3, 4), "float16")],
                  base + [("b", (3,), "float32")]):
        assert fingerprint(other) != fingerprint(base)


GOOD = dict(v=PROTOCOL_VERSION, kind="params", id=1, **params_header())


@pytest.mark.parametrize("data, reason", [
    (b"", "bad_header"),
    (b"\xc1garbage", "bad_header"),
    (raw(**{**GOOD, "v": 99}), "bad_version"),
    (msgpack.packb([1, 2, 3]), "bad_header"),
    (raw(**{**GOOD, "kind": "pickle"}), "bad_kind"),
    (raw(**{**GOOD, "id": -1}), "bad_header"),
    (raw(**{**GOOD, "id": True}), "bad_header"),
    (raw(**{**GOOD, "id": "7"}), "bad_header"),
    (raw(**{**GOOD, "nbytes": -4}), "bad_header"),
    (raw(**{**GOOD, "nbytes": 1.5}), "bad_header"),
    (raw(**{**GOOD, "clock": float("nan")}), "bad_header"),
    (raw(**{**GOOD, "loss": float("inf")}), "bad_header"),
    (raw(**{**GOOD, "fp": "not bytes"}), "bad_header"),
    (raw(**{k: v for k, v in GOOD.items() if k != "dtype"}), "bad_header"),
    (raw(**{**GOOD, "extra": 1}), "bad_header"),
    (b"\x81\xa1v" + b"\xdb" + (10**6).to_bytes(4, "big"), "bad_header"),  # claims a 1 MB string
    (b"\x00" * (MAX_HEADER_BYTES + 1), "header_too_large"),
])
def test_malformed_headers_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ProtocolError) as info:
        decode_header(data)
    assert info.value.reason == reason


def test_encoding_checks_too():
    with pytest.raises(ProtocolError, match="missing field 'loss'"):
        encode_header("params", 1, **{k: v for k, v in params_header().items() if k != "loss"})
    with pytest.raises(ProtocolError, match="header_too_large"):
        encode_header("error", 1, reason="x", detail="y" * MAX_HEADER_BYTES)


@pytest.mark.parametrize("override, payload_len, reason", [
    ({"fp": b"\x00" * 16}, 60, "bad_fingerprint"),
    ({"dtype": "float16"}, 60, "bad_dtype"),
    ({"nbytes": 10**12}, 60, "bad_size"),      # an oversized claim
    ({}, 59, "bad_size"),                      # a truncated payload
    ({}, 61, "bad_size"),
])
def test_payload_checks(override, payload_len, reason):
    header = decode_header(encode_header("params", 1, **params_header(**override)))
    with pytest.raises(ProtocolError) as info:
        check_payload(header, b"\x00" * payload_len, fp=FP, dtype="float32", nbytes=60)
    assert info.value.reason == reason


def test_payload_check_accepts_the_right_message():
    header = decode_header(encode_header("params", 1, **params_header()))
    check_payload(header, memoryview(b"\x00" * 60), fp=FP, dtype="float32", nbytes=60)


@pytest.mark.parametrize("kind", [[1, 2], {"a": 1}, b"fetch", 3, None])
def test_a_kind_of_any_type_is_just_a_bad_header(kind):
    # found by the fuzzer: an unhashable kind once escaped as a TypeError and stopped the Rx thread
    with pytest.raises(ProtocolError) as info:
        decode_header(raw(**{**GOOD, "kind": kind}))
    assert info.value.reason in ("bad_kind", "bad_header")
