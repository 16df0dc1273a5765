"""Fuzzing live nodes: 10,000 requests per mode and transport against the serving side, 1,000 bad
replies and 400 bad exchange replies or decisions against the requesting side, each checked against
what the protocol says must happen.

The generators are seeded, so a failure replays (up to the timing of dropped
replies, below). Every request is sent in lock-step (one reply awaited before
the next request), so each reply can be held against its request: an oracle
(:class:`RequestFuzzer`) knows, for every targeted mutation, the exact
``error`` reason the node must answer, and for random mutations at least that
the reply is well-formed and any error reason is one the protocol defines. The node's own counters must agree with the
replies, reason by reason, and every request must be counted exactly once.

Throughout, the node's parameters must stay bit-identical: a bad message is
never applied. (The fuzzer's well-formed exchanges carry the node's own
snapshot and are confirmed, so their commit moves nothing; that exercises the
commit path while keeping "unchanged" exact.) Afterwards the node must still
be alive and average with an honest peer to values known in advance.

The node may drop a reply although this client reads every one (libzmq
updates the send credit of its pipe lazily; ``Server._send`` tries once more
after reading ``ZMQ_EVENTS``, and rarely still finds the queue full: timing-
dependent, so no test can pin it down). Such a drop is never guessed at: the node counts it
(``replies_dropped``), and the oracle then applies what the node did all the
same (a commit decided, an exchange left to expire), so every other check
stays exact.

Counts: run with ``-s`` to print the tables docs/reliability.md quotes.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import zmq

from conftest import ORIGINAL, make_config, step_until_averaged, wait_until
from dpwa import NumpyParams
from dpwa.gossip.exchange import driver as exchange_rules
from dpwa.gossip.transfer.protocol import ACK, MAX_CLOCK, MAX_LOSS, MAX_VALUE
from dpwa.mixing import kernels
from dpwa.wire.schema import KINDS, MAX_ID, PROTOCOL_VERSION, decode, encode
from helpers.raw_peer import FakePeer

pytestmark = pytest.mark.slow

SIZE = 2048  # elements: 8 KB snapshots
REQUESTS = 10_000  # per mode
REPLIES = 1_000  # bad replies to a pulling node
EXCHANGE_REPLIES = 400  # bad exchange replies and decisions to a symmetric node
NAMES = ("w0", "w1", "w2")  # without CURVE, "from" must be one of the config's node names
DECODE_REASONS = {"header_too_large", "bad_header", "bad_version", "bad_kind", "unexpected_kind"}
# Reasons decided before a bulk route's unsent-reply budget is looked at; the others
# (checked by the handler) may instead be a "busy" refusal if a reply's tracker lags.
EARLY_REASONS = DECODE_REASONS | {"bad_envelope", "bad_frames", "too_large", "bad_identity"}
ALL_REASONS = EARLY_REASONS | {
    "bad_fingerprint",
    "bad_dtype",
    "bad_size",
    "bad_rule",
    "not_finite",
    "busy",
    "not_ready",
}


def table(title: str, counts: dict, total_label: str = "total") -> str:
    """A small text table of counts (what docs/reliability.md quotes)."""
    width = max([len(str(k)) for k in counts] + [len(total_label)])
    lines = [title] + [f"  {str(k):<{width}}  {v:>6}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]
    lines.append(f"  {total_label:<{width}}  {sum(counts.values()):>6}")
    return "\n".join(lines)


def packed(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return b"\xc1"  # never valid msgpack


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2, 2**63, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, 0.5, 0.6, rng.random()])
    if kind == 4:
        return "".join(rng.choice("abcfetchparams\x00é w0") for _ in range(rng.randrange(0, 20)))
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 6:
        return rng.choice(["fetch", "params", "exchange", "confirm", "decision", "error", "float32", "float16", "w1"])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(random_value(rng, depth + 1))[:10]: random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


# --------------------------------------------------------------------------- the request oracle


@dataclass
class Expect:
    """What the node must answer: ``error`` (reason in `reasons`), ``snapshot``, ``exchange``,
    ``decision`` (outcome), ``silent`` (no reply; counted as `reasons`), or ``any`` well-formed reply."""

    what: str
    reasons: frozenset = frozenset()
    outcome: str = ""
    may_be_busy: bool = False  # a bulk request past the early checks: "busy" is a legal answer too


@dataclass
class Case:
    family: str
    frames: list[bytes]  # as sent by a DEALER: the REQ envelope (empty delimiter) included when present
    expect: Expect
    request_id: int | None = None  # the id the reply must echo (None: the header does not decode)
    sender: str | None = None
    xid: int | None = None
    shm: bool = False


def error(*reasons: str, busy: bool = False) -> Expect:
    return Expect("error", frozenset(reasons), may_be_busy=busy)


class RequestFuzzer:
    """Makes one request at a time, with what the node must answer; tracks exchange ids like the server."""

    def __init__(self, seed: int, fp: bytes, nbytes: int, snapshot: bytes, symmetric: bool, rule: bytes) -> None:
        self.rng = random.Random(seed)
        self.fp, self.nbytes, self.snapshot, self.symmetric = fp, nbytes, snapshot, symmetric
        self.rule = rule  # the node's mixing rule's fingerprint: an exchange that names none is refused bad_rule
        self.given: dict[int, str] = {}  # xid -> the sender the server gave it to
        # sender -> xid -> outcome, as the server remembers them
        self.decided: dict[str, OrderedDict[Hashable, str]] = {}
        self.followups: list[Case] = []
        self.families: Counter[str] = Counter()
        families = [
            (self.valid_fetch, 6),
            (self.wrong_version, 3),
            (self.unknown_kind, 3),
            (self.reply_kind, 3),
            (self.oversized_header, 2),
            (self.schema_violation, 8),
            (self.wrong_model, 4),
            (self.unknown_sender, 3),
            (self.extra_frames, 3),
            (self.no_envelope, 2),
            (self.random_bytes, 4),
            (self.random_msgpack, 4),
            (self.truncated, 4),
            (self.extended, 3),
            (self.bit_flips, 8),
            (self.field_replaced, 6),
            (self.field_missing_or_extra, 4),
        ]
        if symmetric:
            families += [
                (self.valid_exchange, 4),
                (self.exchange_out_of_range, 6),
                (self.exchange_size_lies, 3),
                (self.exchange_payload_frames, 3),
                (self.exchange_payload_too_large, 2),
                (self.exchange_payload_short, 2),
                (self.exchange_not_finite, 3),
                (self.exchange_wrong_model, 3),
                (self.confirm_random_xid, 3),
                (self.confirm_bad_xid, 3),
                (self.confirm_foreign_xid, 3),
                (self.confirm_again, 3),
                (self.confirm_extra_frame, 2),
            ]
        self._makers = [m for m, _ in families]
        self._weights = [w for _, w in families]

    # ----------------------------------------------------------------- plumbing

    def make(self) -> Case:
        if self.followups:
            case = self.followups.pop(0)
        else:
            case = self.rng.choices(self._makers, self._weights)[0]()
        self.families[case.family] += 1
        return case

    def header(self, kind: str, request_id: int, **fields) -> bytes:
        return packed({"v": PROTOCOL_VERSION, "kind": kind, "id": request_id, **fields})

    def rid(self) -> int:
        return self.rng.randrange(0, 2**64)

    def sender(self) -> str:
        return self.rng.choice(NAMES)

    def fetch_fields(self, sender: str, shm: bool = False) -> dict:
        fields: dict[str, object] = {"from": sender, "fp": self.fp, "dtype": "float32"}
        if shm:
            fields["shm"] = True
        return fields

    def exchange_fields(self, sender: str) -> dict:
        loss = self.rng.choice([None, 0.0, 1.5, -3.0, MAX_LOSS])
        clock = self.rng.choice([0.0, 1.0, 12345.5, MAX_CLOCK])
        fields = {
            "from": sender,
            "fp": self.fp,
            "dtype": "float32",
            "nbytes": self.nbytes,
            "clock": clock,
            "loss": loss,
            "rule": self.rule,
        }
        if self.rng.random() < 0.3:
            fields["shm"] = True  # answered through shared memory by a same-host node
        return fields

    def base(self) -> tuple[str, dict, list[bytes]]:
        """A valid request of a random kind this node serves: (kind, fields, payload)."""
        kinds = ["fetch", "exchange", "confirm"] if self.symmetric else ["fetch"]
        kind = self.rng.choice(kinds)
        sender = self.sender()
        if kind == "fetch":
            return kind, self.fetch_fields(sender, self.rng.random() < 0.3), []
        if kind == "exchange":
            return kind, self.exchange_fields(sender), [self.snapshot]
        return kind, {"from": sender, "xid": self.rng.randrange(1, MAX_ID)}, []

    def req(self, family, header, payload=(), expect=None, **kw) -> Case:
        return Case(family, [b"", header, *payload], expect, **kw)

    # ----------------------------------------------------------------- fetch (every mode)

    def valid_fetch(self) -> Case:
        rid, sender, shm = self.rid(), self.sender(), self.rng.random() < 0.5
        header = self.header("fetch", rid, **self.fetch_fields(sender, shm))
        return self.req("valid fetch", header, (), Expect("snapshot", may_be_busy=True), request_id=rid, shm=shm)

    def wrong_version(self) -> Case:
        kind, fields, payload = self.base()
        version = self.rng.choice([0, 1, 3, 99, -1, 2.5, "2", b"\x02", None, [2], {"v": 2}])
        header = packed({"v": version, "kind": kind, "id": 1, **fields})
        if self.rng.random() < 0.2:
            header = packed({"kind": kind, "id": 1, **fields})  # no version at all
        return self.req("wrong protocol version", header, payload, error("bad_version"))

    def unknown_kind(self) -> Case:
        _, fields, payload = self.base()
        kind = self.rng.choice(["push", "Fetch", "", "fetch\x00", "exec", 7, None, b"fetch", ["fetch"]])
        return self.req(
            "unknown kind", packed({"v": PROTOCOL_VERSION, "kind": kind, "id": 1, **fields}), payload, error("bad_kind")
        )

    def reply_kind(self) -> Case:
        """A kind that exists but is not a request this node serves (replies; the symmetric kinds on a pull node)."""
        choices = ["params", "shm_params", "decision", "error"] + ([] if self.symmetric else ["exchange", "confirm"])
        kind = self.rng.choice(choices)
        rid = self.rid()
        if kind == "error":  # a well-formed error decodes, and is refused as a request: the reply echoes its id
            header = encode("error", rid, reason="busy", detail="not a request")
            return self.req("reply kind as a request", header, (), error("unexpected_kind"), request_id=rid)
        _, fields, payload = self.base()
        return self.req("reply kind as a request", self.header(kind, rid, **fields), payload, error("unexpected_kind"))

    def oversized_header(self) -> Case:
        kind, fields, payload = self.base()
        limit = KINDS[kind].max_header_bytes  # the kind's own (16 KiB for those that may carry a members digest)
        target = self.rng.randrange(limit + 1, limit + 250)  # under ZMQ_MAXMSGSIZE
        header = self.header(kind, 1, **fields, pad="")
        header = self.header(kind, 1, **fields, pad="x" * (target - len(header)))
        assert limit < len(header) <= limit + 255
        return self.req("oversized header", header, payload, error("header_too_large"))

    def schema_violation(self) -> Case:
        """One field of a fetch or a confirm out of its schema: wrong type, out of range, bad pattern."""
        rid, sender = self.rid(), self.sender()
        if self.symmetric and self.rng.random() < 0.4:
            kind, fields = "confirm", {"from": sender, "xid": self.rng.randrange(1, MAX_ID)}
            bad = {"from": ["", "w 1", "x" * 65, 5, None, b"w1"], "xid": [0, -1, 1.0, "1", None, [1], True]}
        else:
            kind, fields = "fetch", self.fetch_fields(sender)
            bad = {
                "from": ["", "w 1", "w1/..", "x" * 65, 5, None, b"w1"],
                "fp": [b"\x00" * 15, b"\x00" * 17, "x" * 16, None],
                "dtype": ["int16", "float64", "", None, 32],
                "shm": [1, 0, "yes", None],
            }
        key = self.rng.choice(list(bad))
        fields[key] = self.rng.choice(bad[key])
        if self.rng.random() < 0.25:  # the id instead
            return self.req(
                "field out of its schema",
                packed({"v": PROTOCOL_VERSION, "kind": kind, "id": self.rng.choice([-1, 1.5, "7", None]), **fields}),
                (),
                error("bad_header"),
            )
        return self.req("field out of its schema", self.header(kind, rid, **fields), (), error("bad_header"))

    def wrong_model(self) -> Case:
        rid, sender = self.rid(), self.sender()
        fields = self.fetch_fields(sender)
        if self.rng.random() < 0.5:
            fields["fp"] = bytes(b ^ 0xFF for b in self.fp) if self.rng.random() < 0.5 else self.rng.randbytes(16)
            reason = "bad_fingerprint"
        else:
            fields["dtype"] = self.rng.choice(["float16", "bfloat16", "int8"])
            reason = "bad_dtype"
        return self.req(
            "wrong fingerprint or dtype",
            self.header("fetch", rid, **fields),
            (),
            error(reason, busy=True),
            request_id=rid,
        )

    def unknown_sender(self) -> Case:
        kind, fields, payload = self.base()
        fields["from"] = self.rng.choice(["intruder", "w3", "W1", "w01", "node-1"])
        rid = self.rid()
        return self.req(
            "sender not in the config", self.header(kind, rid, **fields), payload, error("bad_identity"), request_id=rid
        )

    def extra_frames(self) -> Case:
        rid, sender = self.rid(), self.sender()
        if self.symmetric and self.rng.random() < 0.3:
            header = self.header("confirm", rid, **{"from": sender}, xid=self.rng.randrange(1, MAX_ID))
        else:
            header = self.header("fetch", rid, **self.fetch_fields(sender))
        extra = [self.rng.randbytes(self.rng.randrange(0, 300)) for _ in range(self.rng.randrange(1, 4))]
        return self.req("extra payload frames", header, extra, error("bad_frames"), request_id=rid)

    def no_envelope(self) -> Case:
        kind, fields, payload = self.base()
        header = self.header(kind, self.rid(), **fields)
        frames = self.rng.choice([[header, *payload], [b"x", header, *payload], [b""], [header, b"", *payload]])
        return Case("no REQ envelope", frames, Expect("silent", frozenset({"bad_envelope"})))

    # ----------------------------------------------------------------- blind mutations (every mode)

    def random_bytes(self) -> Case:
        return self.req("random bytes", self.rng.randbytes(self.rng.randrange(0, 300)), (), error(*DECODE_REASONS))

    def random_msgpack(self) -> Case:
        return self.req("random msgpack", packed(random_value(self.rng)), (), error(*DECODE_REASONS))

    def truncated(self) -> Case:
        kind, fields, payload = self.base()
        header = self.header(kind, self.rid(), **fields)
        return self.req("truncated header", header[: self.rng.randrange(0, len(header))], payload, error("bad_header"))

    def extended(self) -> Case:
        kind, fields, payload = self.base()
        header = self.header(kind, self.rid(), **fields) + self.rng.randbytes(self.rng.randrange(1, 64))
        return self.req("bytes after the header", header, payload, error("bad_header"))

    def bit_flips(self) -> Case:
        kind, fields, payload = self.base()
        data = bytearray(self.header(kind, self.rid(), **fields))
        for _ in range(self.rng.randrange(1, 9)):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return self.req("header bit flips", bytes(data), payload, Expect("any"))

    def field_replaced(self) -> Case:
        kind, fields, payload = self.base()
        header = {"v": PROTOCOL_VERSION, "kind": kind, "id": self.rid(), **fields}
        header[self.rng.choice(list(header))] = random_value(self.rng)
        return self.req("field replaced by a random value", packed(header), payload, Expect("any"))

    def field_missing_or_extra(self) -> Case:
        kind, fields, payload = self.base()
        header = {"v": PROTOCOL_VERSION, "kind": kind, "id": self.rid(), **fields}
        key = self.rng.choice(list(header))
        if self.rng.random() < 0.5 and key != "shm":
            del header[key]  # every field but shm is required (rule by the node, not the schema)
            reason = {"v": "bad_version", "kind": "bad_kind", "rule": "bad_rule"}.get(key, "bad_header")
        else:
            header[self.rng.choice(["x", "extra", "payload", "xid" if kind == "fetch" else "shm2", ""])] = 1
            reason = "bad_header"
        return self.req("field missing or unexpected", packed(header), payload, error(reason))

    # ----------------------------------------------------------------- exchange and confirm (symmetric)

    def exchange(self, family, fields, payload, expect, **kw) -> Case:
        rid = self.rid()
        return self.req(
            family,
            self.header("exchange", rid, **fields),
            payload,
            expect,
            request_id=rid,
            shm=fields.get("shm") is True,
            **kw,
        )

    def valid_exchange(self) -> Case:
        sender = self.sender()
        fields = self.exchange_fields(sender)
        return self.exchange(
            "valid exchange (own snapshot)",
            fields,
            [self.snapshot],
            Expect("exchange", may_be_busy=True),
            sender=sender,
        )

    def exchange_out_of_range(self) -> Case:
        fields = self.exchange_fields(self.sender())
        key, value = self.rng.choice(
            [
                ("clock", -1.0),
                ("clock", -1e-300),
                ("clock", MAX_CLOCK * 1.0001),
                ("clock", 1e300),
                ("clock", math.nan),
                ("clock", math.inf),
                ("clock", -math.inf),
                ("clock", "1"),
                ("clock", None),
                ("loss", math.nan),
                ("loss", math.inf),
                ("loss", -math.inf),
                ("loss", MAX_LOSS * 10),
                ("loss", "low"),
                ("nbytes", -1),
                ("nbytes", (1 << 40) + 1),
                ("nbytes", 8192.0),
                ("nbytes", None),
                ("from", "x" * 65),
                ("dtype", "float64"),
            ]
        )
        fields[key] = value
        return self.exchange("exchange field out of range", fields, [self.snapshot], error("bad_header"))

    def exchange_size_lies(self) -> Case:
        fields = self.exchange_fields(self.sender())
        fields["nbytes"] = self.rng.choice([0, 4, self.nbytes - 4, self.nbytes + 4, 1 << 40])
        return self.exchange("exchange nbytes lies", fields, [self.snapshot], error("bad_size", busy=True))

    def exchange_payload_frames(self) -> Case:
        fields = self.exchange_fields(self.sender())
        payload = self.rng.choice([[], [self.snapshot, b""], [self.snapshot[:4096], self.snapshot[4096:]]])
        return self.exchange("exchange with 0 or 2 payload frames", fields, payload, error("bad_frames"))

    def exchange_payload_too_large(self) -> Case:
        fields = self.exchange_fields(self.sender())
        payload = self.snapshot + self.rng.randbytes(self.rng.randrange(1, 200))  # under ZMQ_MAXMSGSIZE
        return self.exchange("exchange payload too large", fields, [payload], error("too_large"))

    def exchange_payload_short(self) -> Case:
        fields = self.exchange_fields(self.sender())
        payload = self.snapshot[: self.rng.randrange(0, self.nbytes)]
        return self.exchange("exchange payload short", fields, [payload], error("bad_size", busy=True))

    def exchange_not_finite(self) -> Case:
        values = np.frombuffer(self.snapshot, np.float32).copy()
        for _ in range(self.rng.randrange(1, 4)):
            values[self.rng.randrange(SIZE)] = self.rng.choice([np.nan, np.inf, -np.inf, 2 * MAX_VALUE, -2 * MAX_VALUE])
        return self.exchange(
            "exchange NaN, Inf or huge values",
            self.exchange_fields(self.sender()),
            [values.tobytes()],
            error("not_finite", busy=True),
        )

    def exchange_wrong_model(self) -> Case:
        fields = self.exchange_fields(self.sender())
        if self.rng.random() < 0.5:
            fields["fp"], reason = self.rng.randbytes(16), "bad_fingerprint"
        else:
            fields["dtype"], reason = self.rng.choice(["float16", "bfloat16", "int8"]), "bad_dtype"
        return self.exchange("exchange of another model", fields, [self.snapshot], error(reason, busy=True))

    def confirm(self, family, sender, xid, expect, extra=()) -> Case:
        rid = self.rid()
        return self.req(
            family,
            self.header("confirm", rid, **{"from": sender}, xid=xid),
            extra,
            expect,
            request_id=rid,
            sender=sender,
            xid=xid,
        )

    def remembered(self, sender: str, xid: int) -> str:
        return self.decided.get(sender, OrderedDict()).get(xid, "unknown")

    def confirm_random_xid(self) -> Case:
        xid = self.rng.choice([1, MAX_ID, self.rng.randrange(1, MAX_ID)])
        return self.confirm("confirm of an xid never given", self.sender(), xid, Expect("decision", outcome="unknown"))

    def confirm_bad_xid(self) -> Case:
        rid = self.rid()
        xid = self.rng.choice([0, -1, -(2**63), 1.5, math.nan, "1", None, b"\x01"])
        header = self.header("confirm", rid, **{"from": self.sender()}, xid=xid)
        return self.req("confirm xid 0 or not an integer", header, (), error("bad_header"))

    def confirm_foreign_xid(self) -> Case:
        """Someone else's exchange id: the server keys exchanges by (sender, xid)."""
        if not self.given:
            return self.confirm_random_xid()
        xid = self.rng.choice(list(self.given))
        sender = self.rng.choice([n for n in NAMES if n != self.given[xid]])
        return self.confirm(
            "confirm of another sender's xid", sender, xid, Expect("decision", outcome=self.remembered(sender, xid))
        )

    def confirm_again(self) -> Case:
        """A repeated confirm: answered with the remembered decision (the last 64 per sender), else unknown."""
        if not self.given:
            return self.confirm_random_xid()
        xid = self.rng.choice(list(self.given))
        sender = self.given[xid]
        return self.confirm(
            "repeated confirm of an own xid", sender, xid, Expect("decision", outcome=self.remembered(sender, xid))
        )

    def confirm_extra_frame(self) -> Case:
        return self.confirm(
            "confirm with a payload frame",
            self.sender(),
            self.rng.randrange(1, MAX_ID),
            error("bad_frames"),
            extra=[b"\x00" * self.rng.randrange(0, 64)],
        )

    # ----------------------------------------------------------------- the server's side of an exchange

    def served(self, sender: str, xid: int) -> None:
        """The node served an exchange: confirm it (commit), again (same answer), and as another sender (unknown)."""
        assert xid not in self.given, "the server handed out the same xid twice"
        self.given[xid] = sender
        other = self.rng.choice([n for n in NAMES if n != sender])
        self.followups += [
            self.confirm("confirm of another sender's xid", other, xid, Expect("decision", outcome="unknown")),
            self.confirm("confirm of an own xid", sender, xid, Expect("decision", outcome="commit")),
            self.confirm("repeated confirm of an own xid", sender, xid, Expect("decision", outcome="commit")),
        ]

    def decision(self, sender: str, xid: Hashable, outcome: str) -> None:
        """Mirror the server's memory of decisions: the last DECISIONS_PER_PEER per sender.

        `xid` is an int, or an object() that stands for an exchange whose xid we never learned."""
        if outcome == "unknown":
            return
        table = self.decided.setdefault(sender, OrderedDict())
        if xid not in table:
            table[xid] = outcome
            while len(table) > exchange_rules.DECISIONS_PER_PEER:
                table.popitem(last=False)


@dataclass
class Tally:
    answers: Counter = field(default_factory=Counter)  # what the node answered: params, error:<reason>, ...
    dropped: Counter = field(default_factory=Counter)  # requests whose reply the node counted as dropped
    busy_lag: int = 0  # bulk requests refused busy although the oracle expected another answer
    commits: int = 0
    unseen_exchanges: int = 0  # exchanges served whose reply was dropped (they expire: abort)


def check_reply(case: Case, reply: list[bytes], fuzzer: RequestFuzzer, tally: Tally) -> str | None:
    """Hold one reply against its case. Returns "commit" when a confirm committed (the node must then step)."""
    assert reply[0] == b"", f"{case.family}: no empty delimiter in the reply"
    header = decode(reply[1])  # whatever the request was, the reply is well-formed
    payload = reply[2:]
    label = header.kind if header.kind != "error" else f"error:{header['reason']}"
    tally.answers[label] += 1
    expect = case.expect
    if header.kind == "error":
        reason = header["reason"]
        assert reason in ALL_REASONS, f"{case.family}: unknown reason {reason!r}"
        assert not payload
        if header.id != 0:  # an error about a decoded request echoes its id
            assert case.request_id in (None, header.id) or expect.what == "any", (case.family, header)
        if expect.what == "error" and reason in expect.reasons:
            if case.request_id is not None and reason not in DECODE_REASONS:
                assert header.id == case.request_id, (case.family, header)
            return None
        if reason == "busy" and expect.may_be_busy:
            tally.busy_lag += 1
            return None
        assert expect.what == "any", f"{case.family}: expected {expect}, got error {reason}: {header['detail']}"
        return None
    assert expect.what in ("snapshot", "exchange", "decision", "any"), f"{case.family}: expected {expect}, got {label}"
    if case.request_id is not None:
        assert header.id == case.request_id, (case.family, header)
    if header.kind in ("params", "shm_params"):
        assert header["fp"] == fuzzer.fp and header["dtype"] == "float32" and header["nbytes"] == fuzzer.nbytes
        assert header["from"] == "w0"
        if header.kind == "params":
            assert len(payload) == 1 and payload[0] == fuzzer.snapshot, f"{case.family}: not the node's exact snapshot"
        else:
            assert not payload and (case.shm or expect.what == "any")
        if header.get("xid") is not None:  # an exchange was served (a well-formed one, or a mutation that stayed valid)
            assert expect.what in ("exchange", "any"), case.family
            assert header["f"] == 0.5
            request = decode(case.frames[1])
            fuzzer.served(request["from"], header["xid"])
        else:
            assert expect.what in ("snapshot", "any"), case.family
        return None
    assert header.kind == "decision", f"{case.family}: a {header.kind} reply"
    assert not payload
    if expect.what == "decision":
        assert header["xid"] == case.xid and header["outcome"] == expect.outcome, (case.family, case.xid, header)
    if header["outcome"] != "unknown":
        request = decode(case.frames[1])
        fuzzer.decision(request["from"], header["xid"], header["outcome"])
    if header["outcome"] == "commit":
        tally.commits += 1
        return "commit"
    return None


def await_reply(dealer: zmq.Socket, node, dropped_before: int, limit_s: float = 10.0) -> list[bytes] | None:
    """The reply to the one request in flight, or None once the node has counted it dropped."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if dealer.poll(20):
            return dealer.recv_multipart()
        if node.stats().get("replies_dropped", 0) > dropped_before:
            return None  # nothing else is in flight: it was this request's reply
    raise AssertionError(f"no reply within {limit_s} s, and none counted as dropped")


def account_dropped(case: Case, node, fuzzer: RequestFuzzer, tally: Tally) -> None:
    """A reply the node dropped: apply to the oracle what the node did all the same (see test docstring)."""
    tally.dropped[case.family] += 1
    try:
        request = decode(case.frames[1]) if len(case.frames) > 1 else None
    except Exception:
        request = None
    if request is not None and request.kind == "exchange":
        served = node.stats().get("exchanges_served", 0)
        if served > len(fuzzer.given) + tally.unseen_exchanges:  # served, id unknown to us: let it expire
            tally.unseen_exchanges += 1

            def expired() -> bool:
                node.update_wait()  # takes committed halves and expires pending ones
                return node.stats()["exchanges_pending"] == 0

            assert wait_until(expired, 10)
            fuzzer.decision(request["from"], object(), "abort")  # it takes a place in the sender's memory
    elif (
        request is not None
        and request.kind == "confirm"
        and case.expect.what == "decision"
        and case.expect.outcome == "commit"
    ):
        tally.commits += 1
        fuzzer.decision(request["from"], request["xid"], "commit")
    node.update_send()  # a fresh snapshot: the oracle assumes the current one serves no exchange yet
    node.update_wait()


def open_dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["pull", "symmetric"])
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_ten_thousand_requests_get_the_answer_the_protocol_prescribes(nodes, tmp_path, mode, transport):
    """Break: every request kind (fetch; exchange and confirm in mode symmetric) mutated every way
    (random and mutated msgpack, bit flips, truncations, extra and missing frames and fields,
    wrong payload sizes, out-of-range numbers, xid 0, foreign and repeated xids, wrong versions,
    unknown kinds, oversized headers). Promises: each gets exactly the prescribed answer; the
    node's counters agree with the replies reason by reason and count every request once; the
    parameters never change; exchange ids are never handed out twice; decisions are remembered;
    the node stays alive and then averages with an honest peer to known values."""
    extra = {"insecure": True, "same_host": "off"} if transport == "tcp" else {}
    cfg = make_config(3, fetch_probability=0, mode=mode, timeout_ms=3000, **extra)  # exchanges expire after 4 s
    original = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()  # publish, so fetches and exchanges can be served
    node.update_wait()
    fuzzer = RequestFuzzer(
        1234, node.params.fingerprint, node.nbytes, original.tobytes(), mode == "symmetric", node.model.rule
    )
    tally = Tally()
    endpoint = node.config.endpoint(node.spec)
    ctx = zmq.Context()
    sent = silent = 0
    try:
        dealer = open_dealer(ctx, endpoint)
        dropped = 0
        for i in range(REQUESTS + 3):  # and the follow-ups of a last exchange, if any
            if i >= REQUESTS and not fuzzer.followups:
                break
            case = fuzzer.make()
            dealer.send_multipart(case.frames)
            sent += 1
            if case.expect.what == "silent":
                silent += 1
                continue
            reply = await_reply(dealer, node, dropped)
            if reply is None:
                dropped += 1
                account_dropped(case, node, fuzzer, tally)
            elif check_reply(case, reply, fuzzer, tally) == "commit":
                node.update_send()  # a new snapshot (each serves one exchange), and the commit is applied: a no-op
                node.update_wait()
            if i % 500 == 499:
                assert mine.tobytes() == original.tobytes(), f"the parameters changed by request {i}"
                assert node.alive
            if fuzzer.rng.random() < 0.01 and not fuzzer.followups:  # now and then, a fresh connection
                dealer.close(linger=0)
                dealer = open_dealer(ctx, endpoint)
        dealer.close(linger=0)

        # Every request is counted exactly once (the silent ones too).
        def counted() -> int:
            return sum(node.stats()[k] for k in ("requests_served", "requests_rejected", "requests_refused"))

        assert wait_until(lambda: counted() >= sent, 10), (counted(), sent)
    finally:
        ctx.destroy(linger=0)
    node.update_wait()  # apply whatever was committed
    stats = node.stats()
    assert counted() == sent
    assert stats.get("rejected.internal", 0) == 0
    assert stats.get("rejected.bad_envelope", 0) == silent
    # Reason by reason, the node counted what it answered, plus the replies it dropped: nothing
    # else. (It drops one now and then although this client reads every reply: libzmq updates the
    # send credit of a SNDHWM 2 pipe lazily, and Server._send gives up at the first EAGAIN.)
    answered = sum(tally.answers.values())
    assert answered + sum(tally.dropped.values()) + silent == sent
    assert stats.get("replies_dropped", 0) == sum(tally.dropped.values())
    excess = 0
    for key, count in stats.items():
        if key.startswith(("rejected.", "refused.")) and key != "rejected.bad_envelope":
            seen = tally.answers[f"error:{key.split('.', 1)[1]}"]
            assert count >= seen, (key, count, seen)
            excess += count - seen
    served_seen = sum(tally.answers[k] for k in ("params", "shm_params", "decision"))
    assert stats["requests_served"] >= served_seen
    assert excess + stats["requests_served"] - served_seen == sum(tally.dropped.values())
    assert mine.tobytes() == original.tobytes()  # no request ever touched the model
    if mode == "symmetric":
        assert stats["exchanges_decided.commit"] == tally.commits
        assert stats.get("mirrored", 0) == len(fuzzer.given)  # each commit applied once (a no-op by construction)
        assert stats.get("exchanges_expired", 0) == tally.unseen_exchanges
        assert tally.commits >= 2 * len(fuzzer.given)  # each confirmed, then again (and later repeats)
        assert stats["exchanges_pending"] == 0
    assert node.alive

    # The node still serves and averages: an honest peer at 0 meets it with f = 1/2.
    # (w1 first: with two nodes the first starts every exchange, pairing auto being a hypercube)
    honest_cfg = {**cfg, "nodes": [cfg["nodes"][1], cfg["nodes"][0]], "fetch_probability": 1}
    theirs = np.zeros(SIZE, np.float32)
    peer = nodes(honest_cfg, "w1", NumpyParams(theirs))
    assert step_until_averaged(peer, 30, peer="w0") is not None
    assert np.array_equal(theirs, original / 2)
    node.update_wait()
    expected_mine = original / 2 if mode == "symmetric" else original  # the server moves only in symmetric mode
    assert np.array_equal(mine, expected_mine)
    if mode == "symmetric":
        acknowledge_commits(endpoint, fuzzer)

    report = {
        "mode": mode,
        "transport": transport,
        "requests": sent,
        "by_family": dict(fuzzer.families),
        "answers": dict(tally.answers),
        "dropped": dict(tally.dropped),
        "busy_lag": tally.busy_lag,
        "exchanges_served": len(fuzzer.given),
    }
    (tmp_path / "fuzz-requests.json").write_text(json.dumps(report, indent=1))
    print(f"\n{table(f'fuzz requests ({mode}, {transport}): by mutation', dict(fuzzer.families))}")
    print(table("  answered", dict(tally.answers)))
    print(
        f"  replies dropped by the node: {sum(tally.dropped.values())} {dict(tally.dropped)}; busy (tracker lag): "
        f"{tally.busy_lag}; exchanges served and committed: {len(fuzzer.given)}"
    )


def acknowledge_commits(endpoint: str, fuzzer: RequestFuzzer) -> None:
    """Tell the node each sender holds the commits it was given, as a closing requester does (``ack`` of its
    latest: the server counts the earlier ones held too). The fuzzer serves no ``known``, so without this
    the node's close would wait its whole deadline for word from requesters that cannot give it."""
    latest: dict[str, int] = {}
    for xid, sender in fuzzer.given.items():  # in the order served
        decided = fuzzer.decided.get(sender)
        if decided is not None and decided.get(xid) == "commit":
            latest[sender] = xid
    ctx = zmq.Context()
    try:
        dealer = open_dealer(ctx, endpoint)
        for sender, xid in latest.items():
            dealer.send_multipart([b"", encode(ACK, 1, **{"from": sender}, xid=xid)])
            assert dealer.poll(5000), "no answer to an ack"
            reply = decode(dealer.recv_multipart()[1])
            assert reply.kind == "decision" and reply["outcome"] == "commit", (sender, xid, reply)
    finally:
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- the reply side


def snapshot_fields(model_fp: bytes, **overrides) -> dict:
    fields = {
        "from": "w1",
        "fp": model_fp,
        "dtype": "float32",
        "nbytes": SIZE * 4,
        "clock": 1.0,
        "loss": None,
        "version": 1,
    }
    fields.update(overrides)
    return fields


def reply_header(kind: str, request_id: int, **fields) -> bytes:
    return packed({"v": PROTOCOL_VERSION, "kind": kind, "id": request_id, **fields})


def rule_of(request) -> dict:
    """The rule field a peer's reply carries: the requesting node's own (a reply without it is refused)."""
    rule = (request.header if hasattr(request, "header") else request).get("rule")
    return {"rule": rule} if rule is not None else {}


def bad_snapshot_replies(rng: random.Random, fp: bytes, good: bytes):
    """(mutation, expected outcome, expected reason or None for any, make(request) -> frames), each invalid."""

    def params(request, **overrides):
        return reply_header("params", request.id, **snapshot_fields(fp, **{**rule_of(request), **overrides}))

    def values(*bad):
        array = np.frombuffer(good, np.float32).copy()
        for _ in range(rng.randrange(1, 4)):
            array[rng.randrange(SIZE)] = rng.choice(bad)
        return array.tobytes()

    def flipped(data: bytes) -> bytes:
        bits = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            bits[rng.randrange(len(bits))] ^= 1 << rng.randrange(8)
        return bytes(bits)

    def oversized(request):
        header = params(request, pad="")
        limit = KINDS["params"].max_header_bytes
        return [params(request, pad="x" * (limit + rng.randrange(1, 200) - len(header))), good]

    return [
        (
            "NaN or Inf in the parameters",
            "rejected",
            "not_finite",
            lambda r: [params(r), values(np.nan, np.inf, -np.inf)],
        ),
        (
            "values beyond MAX_VALUE",
            "rejected",
            "not_finite",
            lambda r: [params(r), values(2 * MAX_VALUE, -2 * MAX_VALUE)],
        ),
        ("header bit flips", "rejected", None, lambda r: [flipped(params(r, fp=b"\x00" * 16)), good]),
        ("wrong fingerprint", "rejected", "bad_fingerprint", lambda r: [params(r, fp=rng.randbytes(16)), good]),
        (
            "wrong dtype",
            "rejected",
            "bad_dtype",
            lambda r: [params(r, dtype=rng.choice(["float16", "bfloat16", "int8"])), good],
        ),
        (
            "dtype not a wire dtype",
            "rejected",
            "bad_header",
            lambda r: [params(r, dtype=rng.choice(["int16", "", 4])), good],
        ),
        (
            "byte count lies",
            "rejected",
            "bad_size",
            lambda r: [params(r, nbytes=rng.choice([0, SIZE * 4 - 4, SIZE * 4 + 4, 1 << 40])), good],
        ),
        (
            "byte count out of range",
            "rejected",
            "bad_header",
            lambda r: [params(r, nbytes=rng.choice([-1, (1 << 40) + 1, 8192.0, "8192"])), good],
        ),
        (
            "payload truncated or extended",
            "rejected",
            "bad_size",
            lambda r: [params(r), good[: rng.randrange(SIZE * 4)] if rng.random() < 0.5 else good + b"\x00" * 4],
        ),
        ("payload frame missing", "rejected", "bad_reply", lambda r: [params(r)]),
        ("extra frame", "rejected", "bad_reply", lambda r: [params(r), good, rng.randbytes(8)]),
        (
            "wrong request id",
            "rejected",
            "bad_id",
            lambda r: [reply_header("params", (r.id + 1) % 2**64, **snapshot_fields(fp)), good],
        ),
        ("garbage header", "rejected", None, lambda r: [rng.randbytes(rng.randrange(1, 100)), good]),
        (
            "unsolicited shared-memory slot",
            "rejected",
            "bad_reply",
            lambda r: [
                reply_header(
                    "shm_params", r.id, **snapshot_fields(fp, **rule_of(r)), shm_slot=0, shm_id="0123456789abcdef"
                )
            ],
        ),
        (
            "clock out of range",
            "rejected",
            "bad_header",
            lambda r: [params(r, clock=rng.choice([-1.0, MAX_CLOCK * 2, math.nan, math.inf, -math.inf])), good],
        ),
        (
            "loss not finite or huge",
            "rejected",
            "bad_header",
            lambda r: [params(r, loss=rng.choice([math.nan, math.inf, -math.inf, MAX_LOSS * 10])), good],
        ),
        ("snapshot version 0", "rejected", "bad_header", lambda r: [params(r, version=0), good]),
        (
            "a request kind as the reply",
            "rejected",
            "unexpected_kind",
            lambda r: [
                reply_header(rng.choice(["fetch", "exchange", "confirm", "decision"]), r.id, **snapshot_fields(fp)),
                good,
            ],
        ),
        (
            "wrong protocol version",
            "rejected",
            "bad_version",
            lambda r: [
                packed({"v": rng.choice([1, 3, None]), "kind": "params", "id": r.id, **snapshot_fields(fp)}),
                good,
            ],
        ),
        (
            "unknown kind",
            "rejected",
            "bad_kind",
            lambda r: [reply_header("parameters", r.id, **snapshot_fields(fp)), good],
        ),
        ("oversized header", "rejected", "header_too_large", oversized),
        ("unexpected field", "rejected", "bad_header", lambda r: [params(r, extra=1), good]),
        (
            "malformed error reply",
            "rejected",
            "bad_header",
            lambda r: [reply_header("error", r.id, reason="no such reason!", detail="x")],
        ),
        (
            "a refusal",
            "refused",
            "not_ready",
            lambda r: [reply_header("error", r.id, reason="not_ready", detail="later")],
        ),
    ]


@pytest.mark.timeout(180)
def test_a_thousand_bad_replies_are_never_applied(nodes, tmp_path):
    """Break: a fake peer answers a real pulling node's 1,000 fetches with replies each invalid by
    construction (or a refusal). Promises: none is ever applied (the parameters stay bit-identical),
    each outcome and reason is the one expected, the node's counters count them, the node stays
    alive, and then it averages with an honest peer on the same port to values known in advance."""
    cfg = make_config(2, **ORIGINAL, same_host="off", insecure=True, timeout_ms=2000)
    original = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    rng = random.Random(99)
    good = np.full(SIZE, 3.0, np.float32).tobytes()
    makers = bad_snapshot_replies(rng, node.params.fingerprint, good)
    plan = [makers[i % len(makers)] for i in range(REPLIES)]
    rng.shuffle(plan)
    queue = list(plan)

    def respond(request):
        assert request.kind == "fetch" and request.header["from"] == "w0"
        return queue.pop(0)[3](request)

    ctx = zmq.Context()
    fake = FakePeer(ctx, node.config.endpoint(node.config.node("w1")), respond)
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    try:
        for i, (name, outcome, reason, _) in enumerate(plan):
            node.update_send()
            update = node.update_wait()
            assert not update.averaged, (name, update)
            got = update.reason.split(":")[0]
            assert update.outcome == outcome and got == (reason or got), (i, name, update, fake.errors[:1])
            if reason is None:
                assert got in DECODE_REASONS | {"bad_fingerprint", "bad_id", "bad_reply", "bad_dtype", "bad_size"}, (
                    name,
                    got,
                )
            outcomes[update.outcome] += 1
            reasons[got] += 1
            if i % 100 == 99:
                assert mine.tobytes() == original.tobytes()
        assert not fake.errors, fake.errors[0]
        assert fake.handled == REPLIES
    finally:
        fake.close()
        ctx.destroy(linger=0)
    assert mine.tobytes() == original.tobytes()
    stats = node.stats()
    assert stats["fetches_rejected"] == outcomes["rejected"] and stats["fetches_refused"] == outcomes["refused"]
    assert stats["averaged"] == 0 and stats["fetches_ok"] == 0
    assert node.alive

    # An honest peer on the same port: w0 at x meets w1 at 0 with f = 1/2.
    theirs = np.zeros(SIZE, np.float32)
    honest = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    honest.update_send()
    assert step_until_averaged(node, 30, peer="w1") is not None
    assert np.array_equal(mine, original / 2)

    by_mutation = Counter(name for name, *_ in plan)
    (tmp_path / "fuzz-replies.json").write_text(
        json.dumps({"by_mutation": by_mutation, "outcomes": outcomes, "reasons": reasons}, indent=1)
    )
    print(f"\n{table('fuzz replies (pull): by mutation', dict(by_mutation))}")
    print(table("  outcome reasons", dict(reasons)))


def exchange_cases(rng: random.Random, fp: bytes, good: bytes):
    """(mutation, what the node's step must report, the exchange reply, the first decision or None)."""

    def params(request, exchange_id, **overrides):
        fields = snapshot_fields(fp, xid=exchange_id, f=0.5, **rule_of(request))
        fields.update(overrides)
        for key in [k for k, v in overrides.items() if v is DROP]:
            del fields[key]
        return reply_header("params", request.id, **fields)

    def not_finite():
        array = np.frombuffer(good, np.float32).copy()
        array[rng.randrange(SIZE)] = rng.choice([np.nan, np.inf, 2 * MAX_VALUE])
        return array.tobytes()

    def decision(request, xid, outcome):
        return [reply_header("decision", request.id, xid=xid, outcome=outcome)]

    def ok(r, x):
        return [params(r, x), good]

    return [
        # the exchange's reply is bad: no confirm is sent, nothing is applied on either side
        ("reply without xid and f", "rejected:bad_reply", lambda r, x: [params(r, x, xid=DROP, f=DROP), good], None),
        (
            "f above 1/2",
            "rejected:bad_header",
            lambda r, x: [params(r, x, f=rng.choice([0.5000001, 0.75, 1.0, 2.0])), good],
            None,
        ),
        (
            "f negative or not finite",
            "rejected:bad_header",
            lambda r, x: [params(r, x, f=rng.choice([-0.1, math.nan, math.inf])), good],
            None,
        ),
        (
            "f differs from ours",
            "rejected:bad_factor",
            lambda r, x: [params(r, x, f=rng.choice([0.0, 0.25, 0.4999])), good],
            None,
        ),
        ("xid 0 or negative", "rejected:bad_header", lambda r, x: [params(r, rng.choice([0, -1])), good], None),
        ("NaN, Inf or huge values", "rejected:not_finite", lambda r, x: [params(r, x), not_finite()], None),
        (
            "wrong fingerprint",
            "rejected:bad_fingerprint",
            lambda r, x: [params(r, x, fp=rng.randbytes(16)), good],
            None,
        ),
        ("payload size lies", "rejected:bad_size", lambda r, x: [params(r, x), good[:-4]], None),
        ("a decision as the exchange reply", "rejected:unexpected_kind", lambda r, x: decision(r, x, "commit"), None),
        (
            "refused",
            "refused:not_ready",
            lambda r, x: [reply_header("error", r.id, reason="not_ready", detail="later")],
            None,
        ),
        # the exchange's reply is fine, the decision is not a commit of it: nothing is applied
        ("decision abort", "refused:aborted", ok, lambda r, x: decision(r, x, "abort")),
        ("decision unknown", "refused:aborted", ok, lambda r, x: decision(r, x, "unknown")),
        ("commit of another xid", "in_doubt", ok, lambda r, x: decision(r, x ^ 1, "commit")),
        (
            "decision outcome not in the schema",
            "in_doubt",
            ok,
            lambda r, x: [reply_header("decision", r.id, xid=x, outcome=rng.choice(["COMMIT", "yes", 1, None]))],
        ),
        ("decision with a payload frame", "in_doubt", ok, lambda r, x: decision(r, x, "commit") + [good]),
        (
            "decision to another request id",
            "in_doubt",
            ok,
            lambda r, x: [reply_header("decision", (r.id + 1) % 2**64, xid=x, outcome="commit")],
        ),
        ("garbage decision", "in_doubt", ok, lambda r, x: [rng.randbytes(rng.randrange(1, 50))]),
        (
            "error reply to the confirm",
            "in_doubt",
            ok,
            lambda r, x: [reply_header("error", r.id, reason="internal", detail="oops")],
        ),
    ]


DROP = object()


@pytest.mark.timeout(180)
def test_bad_exchange_replies_and_decisions_are_never_applied(nodes, tmp_path):
    """Break: a fake peer answers a real symmetric node's exchanges with invalid replies (no xid,
    f > 1/2, f unlike ours, xid 0, NaN, wrong model, wrong size, wrong kind), or with a valid reply
    and then a decision that is not a commit of that exchange (abort, unknown, a commit of another
    xid, a malformed decision, an error). Promises: nothing is ever applied (bit-identical
    parameters, averaged == 0), exchanges in doubt are resolved by asking again (the fake then
    answers abort) and never applied, the node stays alive, and then it exchanges with an honest
    peer: both sides reach values known in advance."""
    cfg = make_config(2, mode="symmetric", same_host="off", insecure=True, timeout_ms=2000)
    original = np.random.default_rng(2).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    rng = random.Random(7)
    good = np.full(SIZE, 3.0, np.float32).tobytes()
    cases = exchange_cases(rng, node.params.fingerprint, good)
    plan = [cases[i % len(cases)] for i in range(EXCHANGE_REPLIES)]
    rng.shuffle(plan)
    # Flow control counts an exchange left in doubt as a miss, and two misses in a row with the only
    # peer make the node back off for seconds (see the report on dpwa.gossip.membership.flow): never two in a row.
    for i in range(1, len(plan)):
        if plan[i][1] == plan[i - 1][1] == "in_doubt":
            j = next(
                j
                for j in range(len(plan))
                if plan[j][1] != "in_doubt"
                and plan[j - 1][1] != "in_doubt"
                and (j + 1 == len(plan) or plan[j + 1][1] != "in_doubt")
                and abs(j - i) > 1
            )
            plan[i], plan[j] = plan[j], plan[i]
    assert not any(plan[i][1] == plan[i - 1][1] == "in_doubt" for i in range(1, len(plan)))
    queue = list(plan)
    pending: dict[int, tuple] = {}  # xid -> its case, until its first confirm
    asked_again: Counter[str] = Counter()

    def respond(request):
        assert request.header["from"] == "w0"
        if request.kind == "exchange":
            assert len(request.payload) == 1 and request.payload[0] == mine.tobytes()  # w0's own snapshot
            case = queue.pop(0)
            xid = rng.randrange(2, MAX_ID)
            pending[xid] = case
            return case[2](request, xid)
        assert request.kind == "confirm", request.header
        xid = request.header["xid"]
        case = pending.pop(xid, None)
        if case is None:  # asked again about an exchange in doubt: the fake decides abort
            asked_again["abort"] += 1
            return [reply_header("decision", request.id, xid=xid, outcome="abort")]
        assert case[3] is not None, f"{case[0]}: the node confirmed an exchange whose reply it should have rejected"
        return case[3](request, xid)

    ctx = zmq.Context()
    fake = FakePeer(ctx, node.config.endpoint(node.config.node("w1")), respond)
    outcomes: Counter[str] = Counter()
    try:
        for i, (name, expected, _, _) in enumerate(plan):
            assert wait_until(lambda: node.update_wait() and node.stats()["exchanges_unsettled"] == 0, 20), (
                f"an exchange in doubt was never resolved ({node.stats()})"
            )
            node.update_send()
            update = node.update_wait()
            got = update.outcome if update.outcome == "in_doubt" else f"{update.outcome}:{update.reason.split(':')[0]}"
            assert got == expected and not update.averaged, (i, name, update, fake.errors[-1:])
            outcomes[got] += 1
            if i % 50 == 49:
                assert mine.tobytes() == original.tobytes()
        assert wait_until(lambda: node.update_wait() and node.stats()["exchanges_unsettled"] == 0, 20)
        assert not fake.errors, fake.errors[0]
    finally:
        fake.close()
        ctx.destroy(linger=0)
    assert mine.tobytes() == original.tobytes()
    stats = node.stats()
    assert stats["averaged"] == 0 and stats.get("mirrored", 0) == 0
    assert stats["exchanges_in_doubt"] == outcomes["in_doubt"] == asked_again["abort"]
    assert stats["exchanges_aborted"] == outcomes["in_doubt"]  # each resolved, to abort
    assert stats["fetches_rejected"] == sum(v for k, v in outcomes.items() if k.startswith("rejected"))
    assert node.alive

    # An honest symmetric peer on the same port: x and 0 meet at x / 2 on both sides.
    theirs = np.zeros(SIZE, np.float32)
    honest = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    honest.update_send()
    assert step_until_averaged(node, 30, peer="w1") is not None
    honest.update_wait()
    assert np.array_equal(mine, original / 2) and np.array_equal(theirs, original / 2)

    (tmp_path / "fuzz-exchanges.json").write_text(json.dumps({"outcomes": outcomes}, indent=1))
    print(f"\n{table('fuzz exchange replies (symmetric): by mutation', dict(Counter(c[0] for c in plan)))}")
    print(table("  outcomes", dict(outcomes)))


# --------------------------------------------------------------------------- int8 payloads


def int8_snapshot(values: np.ndarray) -> bytes:
    from dpwa.mixing.codecs import int8 as quantize

    out = np.empty(quantize.encoded_bytes(values.size), np.uint8)
    quantize.encode(values, out)
    return out.tobytes()


def bad_int8_replies(rng: random.Random, fp: bytes, good: bytes):
    """(mutation, expected reason, make(request) -> frames): int8 replies, each invalid by construction."""
    encoded = len(good)

    def params(request, **overrides):
        return reply_header(
            "params",
            request.id,
            **snapshot_fields(fp, **{"dtype": "int8", "nbytes": encoded, **rule_of(request), **overrides}),
        )

    def scaled(*bad):
        data = bytearray(good)
        scales = np.frombuffer(data, np.float32, count=SIZE // 1024)
        scales = scales.copy()
        scales[rng.randrange(scales.size)] = rng.choice(bad)
        data[: scales.nbytes] = scales.tobytes()
        return bytes(data)

    return [
        ("a NaN or infinite scale", "bad_scale", lambda r: [params(r), scaled(np.nan, np.inf, -np.inf)]),
        ("a negative scale", "bad_scale", lambda r: [params(r), scaled(-1.0, -1e-30)]),
        ("a scale beyond MAX_VALUE / 128", "bad_scale", lambda r: [params(r), scaled(MAX_VALUE / 127, 1e30)]),
        ("float32 bytes sent as int8", "bad_size", lambda r: [params(r, nbytes=SIZE * 4), b"\x00" * SIZE * 4]),
        ("payload truncated", "bad_size", lambda r: [params(r), good[: rng.randrange(encoded)]]),
        ("float32 sent to an int8 cluster", "bad_dtype", lambda r: [params(r, dtype="float32", nbytes=SIZE * 4), good]),
    ]


@pytest.mark.timeout(120)
def test_bad_int8_replies_are_never_applied(nodes):
    """Break: with wire_dtype int8, a fake peer answers 300 fetches with int8 replies whose scales are NaN,
    infinite, negative or large enough to carry a value past the bound, or whose size or dtype lies.
    Promises: none is applied (the parameters stay bit-identical), each is rejected for the reason
    expected, and then an honest int8 reply is applied exactly (scale 2^-7: codes carry k / 128 exactly)."""
    cfg = make_config(2, **ORIGINAL, same_host="off", insecure=True, timeout_ms=2000, wire_dtype="int8")
    original = np.random.default_rng(2).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    rng = random.Random(7)
    theirs = (np.arange(SIZE) % 255 - 127).astype(np.float32) / np.float32(128)
    good = int8_snapshot(theirs)
    makers = bad_int8_replies(rng, node.params.fingerprint, good)
    plan = [makers[i % len(makers)] for i in range(300)]
    rng.shuffle(plan)
    queue = list(plan) + [
        (
            "honest",
            None,
            lambda r: [
                reply_header(
                    "params",
                    r.id,
                    **snapshot_fields(node.params.fingerprint, dtype="int8", nbytes=len(good), **rule_of(r)),
                ),
                good,
            ],
        )
    ]
    ctx = zmq.Context()
    fake = FakePeer(ctx, node.config.endpoint(node.config.node("w1")), lambda request: queue.pop(0)[2](request))
    reasons: Counter[str] = Counter()
    try:
        for name, reason, _ in plan:
            node.update_send()
            update = node.update_wait()
            assert not update.averaged and update.outcome == "rejected", (name, update)
            assert update.reason.split(":")[0] == reason, (name, update.reason)
            reasons[reason] += 1
        assert mine.tobytes() == original.tobytes()
        node.update_send()
        assert node.update_wait().averaged
        expected = original.copy()
        kernels.lerp_(expected, theirs, 0.5)  # the blend of exactly `theirs`, with the blend's own rounding
        assert np.array_equal(mine, expected)
        assert not fake.errors, fake.errors[0]
    finally:
        fake.close()
        ctx.destroy(linger=0)
    assert set(reasons) == {"bad_scale", "bad_size", "bad_dtype"} and node.alive


@pytest.mark.timeout(60)
def test_a_symmetric_int8_server_refuses_bad_scales_and_moves_nobody(nodes, zctx):
    """An exchange request whose int8 snapshot has a NaN, negative or huge scale is refused with bad_scale
    before anything is held; the server's parameters stay as they were and it still exchanges after."""
    cfg = make_config(2, mode="symmetric", rule="delta", same_host="off", insecure=True, wire_dtype="int8")
    theirs = np.zeros(SIZE, np.float32)
    server = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    server.update_send()
    sock = zctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.config.endpoint(server.config.node("w1")))
    good = int8_snapshot(np.ones(SIZE, np.float32))
    for rid, bad in enumerate((np.nan, -1.0, 1e30), start=1):
        data = bytearray(good)
        data[:4] = np.float32(bad).tobytes()
        header = encode(
            exchange_rules.EXCHANGE,
            rid,
            **{"from": "w0"},
            fp=server.params.fingerprint,
            dtype="int8",
            nbytes=len(good),
            clock=1.0,
            loss=None,
            rule=server.model.rule,
        )
        sock.send_multipart([header, bytes(data)])
        assert sock.poll(5000), "no answer"
        answer = decode(sock.recv_multipart()[0])
        assert answer.kind == "error" and answer.fields["reason"] == "bad_scale", dict(answer.fields)
    assert not theirs.any() and server.stats().get("exchanges_pending", 0) == 0
