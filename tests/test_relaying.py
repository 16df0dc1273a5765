"""The relay protocol's rules, apart from sockets (dpwa.wire.relaying): framing, checks of every field,
proofs, port ranges, which member holds which port, and the token bucket. Pure: unit tests, no socket, no
thread, no sleep (every time is an argument)."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import zmq
from zmq.utils import z85

from dpwa.wire.errors import ProtocolError
from dpwa.wire.relaying import (
    CHALLENGE_BYTES,
    MAX_MESSAGE,
    PROOF_BYTES,
    TOKEN_BYTES,
    Hello,
    Ports,
    Reader,
    TokenBucket,
    check,
    encode,
    parse_ports,
    proof,
    proof_holds,
)

TOKEN = bytes(range(TOKEN_BYTES))
CHALLENGE = bytes(range(100, 100 + CHALLENGE_BYTES))


def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def packed(msg: Any) -> bytes:
    """A framed msgpack body of any value, bypassing encode's own rules."""
    return frame(msgpack.packb(msg, use_bin_type=True))


def read_all(data: bytes, reader: Reader | None = None) -> list[dict[str, Any]]:
    return list((reader or Reader()).feed(data))


def keypair() -> tuple[bytes, bytes, str]:
    """(raw secret, raw public, Z85 public) of a fresh CURVE key pair (pure computation)."""
    public, secret = zmq.curve_keypair()
    return z85.decode(secret), z85.decode(public), public.decode()


# --------------------------------------------------------------------------- framing


def test_every_kind_round_trips_through_encode_and_reader():
    messages: list[tuple[str, dict[str, Any]]] = [
        ("challenge", {"c": CHALLENGE}),
        ("hello", {"name": "w1", "want": 0}),
        ("hello", {"name": "a.b-c_9", "want": 45101, "key": "k" * 40, "cert": "cert text", "proof": b"p" * 32}),
        ("ok", {"port": 45101}),
        ("no", {"why": "full"}),
        ("open", {"token": TOKEN}),
        ("data", {"token": TOKEN}),
        ("ping", {}),
    ]
    stream = b"".join(encode(kind, **fields) for kind, fields in messages)
    assert read_all(stream) == [{"t": kind, **fields} for kind, fields in messages]


def test_a_message_fed_byte_by_byte_comes_out_once_complete_and_not_before():
    wire = encode("hello", name="w1", want=7) + encode("ping")
    reader = Reader()
    out: list[dict[str, Any]] = []
    first_complete = len(encode("hello", name="w1", want=7))
    for i in range(len(wire)):
        got = list(reader.feed(wire[i : i + 1]))
        if i + 1 == first_complete:
            assert got == [{"t": "hello", "name": "w1", "want": 7}]
        elif i + 1 == len(wire):
            assert got == [{"t": "ping"}]
        else:
            assert got == [], f"a message came out after {i + 1} bytes"
        out += got
    assert len(out) == 2 and reader.leftover() == b""


def test_messages_split_anywhere_across_feeds_come_out_whole_and_in_order():
    wire = encode("open", token=TOKEN) + encode("ping") + encode("no", why="x" * 300) + encode("ok", port=1)
    for cut in range(len(wire) + 1):
        reader = Reader()
        got = list(reader.feed(wire[:cut])) + list(reader.feed(wire[cut:]))
        assert [m["t"] for m in got] == ["open", "ping", "no", "ok"], cut


def test_the_bytes_after_a_message_are_left_over_for_the_stream():
    reader = Reader()
    stream_bytes = b"\x00\x00\xff\xff raw ZMTP bytes, not a relay message"
    # The relay takes the first message only (next): the rest is the stream, never parsed as messages.
    assert next(reader.feed(encode("data", token=TOKEN) + stream_bytes)) == {"t": "data", "token": TOKEN}
    assert reader.leftover() == stream_bytes
    assert reader.leftover() == b""  # taken once


def test_encode_refuses_a_message_over_max_message_and_takes_one_of_exactly_max_message():
    overhead = len(msgpack.packb({"t": "no", "why": ""}, use_bin_type=True))
    # The empty str costs 1 byte; one of 256 <= n < 65536 bytes costs n + 3: 2 more than the empty one and n.
    fits = MAX_MESSAGE - overhead - 2
    exact = encode("no", why="x" * fits)
    assert len(exact) == 4 + MAX_MESSAGE
    assert read_all(exact)[0]["why"] == "x" * fits
    with pytest.raises(ValueError, match="over"):
        encode("no", why="x" * (fits + 1))


def test_a_length_over_max_message_is_refused_at_once_before_its_body_arrives():
    reader = Reader()
    with pytest.raises(ProtocolError) as caught:
        list(reader.feed(struct.pack("!I", MAX_MESSAGE + 1)))
    assert caught.value.reason == "too_large"
    with pytest.raises(ProtocolError, match="too_large"):
        read_all(b"\xff\xff\xff\xff")
    # A length of exactly MAX_MESSAGE is waited for (nothing comes out, nothing raised).
    assert read_all(struct.pack("!I", MAX_MESSAGE) + b"\x80") == []


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (frame(b"\xc1"), "malformed"),  # a byte msgpack never uses
        (frame(b"\x82\xa1t"), "malformed"),  # a map cut short
        (frame(b""), "malformed"),  # an empty body
        (packed({1: "x", "t": "ping"}), "malformed"),  # a key that is not text
        (packed(["t", "ping"]), "bad_kind"),  # not a map
        (packed("ping"), "bad_kind"),
        (packed({"t": "bogus"}), "bad_kind"),
        (packed({"kind": "ping"}), "bad_kind"),  # no t
        (packed({"t": None}), "bad_kind"),
        (packed({"t": "ping", "extra": 1}), "bad_field"),
        (packed({"t": "ok", "port": 1, "why": "x"}), "bad_field"),
        (packed({"t": "ping", "c": CHALLENGE}), "bad_field"),  # a known field on the wrong kind
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_bodies_and_unknown_kinds_or_fields_raise_protocol_errors_with_a_reason(wire, reason):
    with pytest.raises(ProtocolError) as caught:
        read_all(wire)
    assert caught.value.reason == reason
    assert caught.value.detail


@pytest.mark.parametrize(
    "msg",
    [
        {"t": "challenge"},
        {"t": "challenge", "c": b"short"},
        {"t": "challenge", "c": CHALLENGE + b"x"},
        {"t": "challenge", "c": "x" * CHALLENGE_BYTES},  # text, not bytes
        {"t": "open"},
        {"t": "open", "token": TOKEN[:-1]},
        {"t": "open", "token": TOKEN + b"\x00"},
        {"t": "data", "token": b""},
        {"t": "data", "token": 12345},
        {"t": "data", "token": None},
        {"t": "ok"},
        {"t": "ok", "port": -1},
        {"t": "ok", "port": 65536},
        {"t": "ok", "port": "45101"},
        {"t": "ok", "port": 1.5},
        {"t": "ok", "port": None},
        {"t": "no"},
        {"t": "no", "why": b"bytes"},
        {"t": "no", "why": 3},
        {"t": "hello", "want": 0},  # no name
        {"t": "hello", "name": "w1"},  # no want
        {"t": "hello", "name": "w1", "want": -1},
        {"t": "hello", "name": "w1", "want": 70000},
        {"t": "hello", "name": "w1", "want": "0"},
        {"t": "hello", "name": "", "want": 0},
        {"t": "hello", "name": "a" * 65, "want": 0},
        {"t": "hello", "name": "has space", "want": 0},
        {"t": "hello", "name": "a/b", "want": 0},
        {"t": "hello", "name": "w1\n", "want": 0},
        {"t": "hello", "name": "wé", "want": 0},
        {"t": "hello", "name": b"w1", "want": 0},
        {"t": "hello", "name": 1, "want": 0},
        {"t": "hello", "name": "w1", "want": 0, "key": "k" * 39},
        {"t": "hello", "name": "w1", "want": 0, "key": b"k" * 40},
        {"t": "hello", "name": "w1", "want": 0, "cert": 5},
        {"t": "hello", "name": "w1", "want": 0, "proof": b"p" * (PROOF_BYTES - 1)},
        {"t": "hello", "name": "w1", "want": 0, "proof": "p" * PROOF_BYTES},
    ],
)
def test_fields_of_the_wrong_type_or_size_and_bad_names_are_refused(msg):
    with pytest.raises(ProtocolError) as caught:
        read_all(packed(msg))
    assert caught.value.reason == "bad_field", caught.value
    with pytest.raises(ProtocolError):
        check(msgpack.packb(msg, use_bin_type=True))


def test_a_64_character_name_and_the_edge_ports_are_accepted():
    assert check(msgpack.packb({"t": "hello", "name": "a" * 64, "want": 65535}))["want"] == 65535
    assert check(msgpack.packb({"t": "ok", "port": 0}))["port"] == 0
    assert check(msgpack.packb({"t": "hello", "name": "w", "want": 0, "key": None, "cert": None, "proof": None}))


def test_hello_of_gives_the_checked_fields_and_none_for_the_absent_ones():
    bare = Hello.of({"name": "w1", "want": 0})
    assert bare == Hello("w1", 0, None, None, None)
    full = Hello.of({"name": "w1", "want": 5, "key": "k" * 40, "cert": "c", "proof": b"p" * PROOF_BYTES})
    assert (full.key, full.cert, full.proof) == ("k" * 40, "c", b"p" * PROOF_BYTES)
    with pytest.raises(ProtocolError, match="cert"):
        Hello.of({"name": "w1", "want": 0, "cert": "c" * (MAX_MESSAGE + 1)})


# --------------------------------------------------------------------------- proofs


def test_a_proof_holds_only_with_the_right_keys_challenge_and_name():
    relay_secret, relay_public, _ = keypair()
    member_secret, member_public, _ = keypair()
    other_secret, other_public, _ = keypair()
    made = proof(member_secret, relay_public, CHALLENGE, "w1")
    assert len(made) == PROOF_BYTES
    assert made == proof(relay_secret, member_public, CHALLENGE, "w1")  # both ends compute the same HMAC
    assert proof_holds(relay_secret, member_public, CHALLENGE, "w1", made)

    assert not proof_holds(relay_secret, other_public, CHALLENGE, "w1", made)  # another member's key
    assert not proof_holds(other_secret, member_public, CHALLENGE, "w1", made)  # checked by another relay
    assert not proof_holds(relay_secret, member_public, bytes(CHALLENGE_BYTES), "w1", made)  # another challenge
    assert not proof_holds(relay_secret, member_public, CHALLENGE, "w2", made)  # another name
    assert not proof_holds(relay_secret, member_public, CHALLENGE, "w1", None)
    assert not proof_holds(relay_secret, member_public, CHALLENGE, "w1", made[:-1])
    assert not proof_holds(relay_secret, member_public, CHALLENGE, "w1", bytes(PROOF_BYTES))
    forged = proof(other_secret, relay_public, CHALLENGE, "w1")  # a stranger's secret, claiming member's key
    assert not proof_holds(relay_secret, member_public, CHALLENGE, "w1", forged)


def test_a_proof_against_a_key_that_is_not_one_does_not_hold_and_does_not_raise():
    relay_secret, _, _ = keypair()
    assert not proof_holds(relay_secret, bytes(32), CHALLENGE, "w1", bytes(PROOF_BYTES))  # all zeros: no shared key
    assert not proof_holds(relay_secret, b"short", CHALLENGE, "w1", bytes(PROOF_BYTES))


# --------------------------------------------------------------------------- port ranges


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("45101-45108", range(45101, 45109)),
        (" 7 - 7 ", range(7, 8)),
        ("1-1024", range(1, 1025)),
        ("64512-65535", range(64512, 65536)),
        ("65535-65535", range(65535, 65536)),
    ],
)
def test_parse_ports_accepts_first_last(text, expected):
    assert parse_ports(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "45101", "45101-", "-45101", "a-b", "1-2-3", "0-5", "5-4", "1-1025", "65535-65536", "123456-123457", "1,2"],
)
def test_parse_ports_refuses_anything_else(text):
    with pytest.raises(ValueError, match="FIRST-LAST"):
        parse_ports(text)


# --------------------------------------------------------------------------- which member holds which port


def test_a_member_gets_the_port_it_wants_when_free_else_the_lowest_free():
    ports = Ports(range(100, 104))
    assert ports.grant("a", 102) == 102
    assert ports.grant("b", 102) == 100  # taken: the lowest free
    assert ports.grant("c", 0) == 101
    assert ports.grant("d", 99) == 103  # out of the range: ignored
    assert ports.held() == {"a": 102, "b": 100, "c": 101, "d": 103}
    assert ports.holder(101) == "c" and ports.holder(99) is None


def test_a_holder_gets_no_second_port_and_a_full_range_grants_none():
    ports = Ports(range(100, 102))
    assert ports.grant("a", 0) == 100
    assert ports.grant("a", 101) is None  # holds one already
    assert ports.held() == {"a": 100}
    assert ports.grant("b", 0) == 101
    assert ports.grant("c", 100) is None  # full
    assert "c" not in ports.held()
    ports.release("a")
    assert ports.holder(100) is None
    assert ports.grant("c", 0) == 100
    ports.release("nobody")  # a no-op


def test_a_member_that_comes_back_gets_the_port_it_had_even_when_a_lower_one_is_free():
    ports = Ports(range(100, 104))
    assert ports.grant("a", 0) == 100
    assert ports.grant("b", 0) == 101
    ports.release("a")
    ports.release("b")
    assert ports.grant("b", 0) == 101  # sticky, though 100 is free
    assert ports.grant("a", 0) == 100
    ports.release("b")
    assert ports.grant("b", 103) == 103  # what it asks for comes first
    ports.release("b")
    assert ports.grant("b", 0) == 103  # and is what it had from then on


def test_a_port_another_member_took_since_is_not_given_back_and_its_claim_is_forgotten():
    ports = Ports(range(100, 103))
    assert ports.grant("a", 0) == 100
    ports.release("a")
    assert ports.grant("b", 100) == 100  # a's old port, free: b asked for it
    assert ports.grant("a", 0) == 101  # a's old port is taken: the lowest free
    ports.release("b")
    ports.release("a")
    assert ports.grant("a", 0) == 101  # a's claim is now 101, not 100
    assert ports.grant("b", 0) == 100


def test_the_memory_of_who_had_which_port_stays_bounded_by_the_range():
    ports = Ports(range(100, 102))
    for i in range(1000):
        assert ports.grant(f"m{i}", 0) is not None
        ports.release(f"m{i}")
    assert len(ports._had) <= 2


# --------------------------------------------------------------------------- the token bucket


def test_a_bucket_starts_full_spends_and_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=100.0, burst=50.0, now=10.0)
    assert bucket.allowance(10.0) == 50
    assert bucket.wait_s(10.0) == 0.0
    bucket.spend(50, 10.0)
    assert bucket.allowance(10.0) == 0
    assert bucket.wait_s(10.0) == pytest.approx(0.01)  # one byte at 100 bytes a second
    assert bucket.allowance(10.25) == 25
    assert bucket.allowance(1000.0) == 50  # never more than the burst


def test_an_overspent_bucket_waits_until_its_debt_is_paid():
    bucket = TokenBucket(rate=100.0, burst=50.0, now=0.0)
    bucket.spend(80, 0.0)  # 30 bytes in debt
    assert bucket.allowance(0.0) == 0
    assert bucket.wait_s(0.0) == pytest.approx(0.31)
    assert bucket.allowance(0.3) == 0
    assert bucket.wait_s(0.3) == pytest.approx(0.01)
    assert bucket.allowance(0.31) == 1


def test_a_fraction_of_a_byte_is_no_allowance():
    bucket = TokenBucket(rate=100.0, burst=50.0, now=0.0)
    bucket.spend(50, 0.0)
    assert bucket.allowance(0.005) == 0  # half a byte
    assert bucket.wait_s(0.005) == pytest.approx(0.005)


def test_a_bucket_moves_rate_times_time_plus_burst_and_no_more():
    rate, burst = 1000.0, 100.0
    bucket = TokenBucket(rate, burst, now=0.0)
    moved = 0
    now = 0.0
    for _ in range(10_000):  # a greedy spender, asking every millisecond for 2 s
        n = bucket.allowance(now)
        bucket.spend(n, now)
        moved += n
        now += 0.001
        if now > 2.0:
            break
    assert moved <= burst + rate * 2.0
    assert moved >= rate * 2.0 * 0.95


def test_rate_zero_is_no_bound():
    bucket = TokenBucket(rate=0.0, burst=0.0, now=0.0)
    assert bucket.allowance(0.0) >= 1 << 30
    bucket.spend(1 << 40, 0.0)
    assert bucket.allowance(0.0) >= 1 << 30
    assert bucket.wait_s(0.0) == 0.0
