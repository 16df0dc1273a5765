"""Fuzzing a live node: 10,000+ random and mutated requests, 1,000+ invalid replies.

The generator is seeded, so a failure replays exactly. After the storm the node
must still serve its exact parameters, still average correctly, and its
parameters must never have been changed by any of the bad messages.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from dpwa import NumpyParams
from dpwa.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION, decode_header, encode_header

from conftest import make_config
from test_hostile import EvilPeer

pytestmark = pytest.mark.slow

SIZE = 2048
REQUESTS = 10_000
REPLIES = 1_000


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, float("nan"), float("inf"), 1e308, rng.random()])
    if kind == 4:
        return "".join(rng.choice("abcfetchparams\x00é") for _ in range(rng.randrange(0, 20)))
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 6:
        return rng.choice(["fetch", "params", "error", "float32", "float16"])
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {str(random_value(rng, depth + 1))[:10]: random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


class RequestFuzzer:
    """Makes one bad request at a time, as the frames a REQ client would send (without envelope)."""

    def __init__(self, seed: int, fp: bytes) -> None:
        self.rng = random.Random(seed)
        self.fp = fp
        self.valid = {"v": PROTOCOL_VERSION, "kind": "fetch", "id": 5, "from": "fuzz", "fp": fp, "dtype": "float32"}
        self.kinds = Counter()

    def packed(self, header: dict) -> bytes:
        return msgpack.packb(header, use_bin_type=True)

    def make(self) -> list[bytes]:
        rng = self.rng
        choice = rng.randrange(10)
        valid = self.packed(self.valid)
        if choice == 0:
            name, frames = "random bytes", [rng.randbytes(rng.randrange(0, 300))]
        elif choice == 1:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 9)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            name, frames = "bit flips", [bytes(data)]
        elif choice == 2:
            name, frames = "truncated", [valid[: rng.randrange(0, len(valid))]]
        elif choice == 3:
            name, frames = "extended", [valid + rng.randbytes(rng.randrange(1, 64))]
        elif choice == 4:
            name, frames = "random msgpack", [self.packed_any(random_value(rng))]
        elif choice == 5:
            header = dict(self.valid)
            header[rng.choice(list(header))] = random_value(rng)
            name, frames = "field replaced", [self.packed_any(header)]
        elif choice == 6:
            header = dict(self.valid)
            if rng.random() < 0.5:
                del header[rng.choice(list(header))]
            else:
                header[str(random_value(rng))[:8] or "x"] = random_value(rng)
            name, frames = "field missing or extra", [self.packed_any(header)]
        elif choice == 7:
            extra = [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))]
            name, frames = "extra frames", [self.packed({**self.valid, "fp": b"\x00" * 16})] + extra
        elif choice == 8:
            header = dict(self.valid)
            header["fp"] = rng.randbytes(16) if rng.random() < 0.5 else self.fp
            header["dtype"] = rng.choice(["float64", "int8", "", "float16"]) if header["fp"] == self.fp else "float32"
            header["kind"] = rng.choice(["fetch", "params", "error", "push", "Fetch"])
            name, frames = "wrong fingerprint, dtype or kind", [self.packed_any(header)]
        else:
            name, frames = "oversized header", [self.packed({**self.valid, "from": "x" * rng.randrange(MAX_HEADER_BYTES, MAX_HEADER_BYTES + 200)})]
        self.kinds[name] += 1
        return frames

    def packed_any(self, obj) -> bytes:
        try:
            return msgpack.packb(obj, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return b"\xc1"  # never valid msgpack


def drain(sock: zmq.Socket, expected: int, deadline_s: float, quiet_ms: int = 200) -> int:
    """Read replies until `expected` came, none came for `quiet_ms`, or the deadline passed.

    Not every bad request gets a reply (no envelope, or a frame so large the
    connection is dropped), so silence ends the wait too.
    """
    got = 0
    deadline = time.monotonic() + deadline_s
    while got < expected and time.monotonic() < deadline:
        if not sock.poll(quiet_ms):
            break
        while True:
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
    return got


@pytest.mark.timeout(240)
def test_ten_thousand_bad_requests_change_nothing(nodes, tmp_path):
    cfg = make_config(2, same_host="off", timeout_ms=1000)
    rng = np.random.default_rng(0)
    original = rng.standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()  # publish, so a fetch from the fuzzer could be served
    node.update_wait()
    port = cfg["nodes"][0]["port"]
    fuzzer = RequestFuzzer(seed=1234, fp=node.params.fingerprint)
    ctx = zmq.Context()
    sent = 0
    try:
        dealer = None
        while sent < REQUESTS:
            if dealer is None:
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(f"tcp://127.0.0.1:{port}")
            batch = 250
            for _ in range(batch):
                frames = fuzzer.make()
                envelope = [b""] if fuzzer.rng.random() < 0.97 else []  # a few without the REQ delimiter
                dealer.send_multipart(envelope + frames)
            sent += batch
            drain(dealer, batch, 2.0)
            if fuzzer.rng.random() < 0.2:  # now and then, a fresh connection
                dealer.close(0)
                dealer = None
        if dealer is not None:
            dealer.close(0)
        # A plain valid fetch after the storm: the node serves its exact parameters.
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(encode_header("fetch", 9, **{"from": "check"}, fp=node.params.fingerprint, dtype="float32"))
        assert req.poll(5000), "the node stopped answering"
        header_bytes, payload = req.recv_multipart()
        assert decode_header(header_bytes).kind == "params"
        assert payload == original.tobytes()
        req.close(0)
    finally:
        ctx.destroy(linger=0)
    assert mine.tobytes() == original.tobytes()  # no bad request ever touched the model
    stats = node.stats()
    assert stats["requests_rejected"] >= 0.8 * REQUESTS * 0.97 - 400, stats
    assert node.alive

    # The node still averages correctly with a real peer.
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(np.zeros(SIZE, np.float32)))
    peer.update_send()
    node.update_send()
    assert node.update_wait().averaged
    assert np.allclose(mine, original / 2)

    report = {"requests": sent, "by_mutation": dict(fuzzer.kinds), "served": stats["requests_served"],
              "rejected": stats["requests_rejected"],
              "rejected_by_reason": {k[9:]: v for k, v in stats.items() if k.startswith("rejected.")}}
    (tmp_path / "fuzz-requests.json").write_text(json.dumps(report, indent=1))
    print("\nfuzz requests:", json.dumps(report))


def bad_replies(seed: int, fp: bytes):
    """Reply makers, each invalid by construction; yields (mutation name, maker)."""
    rng = random.Random(seed)
    good_payload = np.full(SIZE, 3.0, np.float32)

    def params(request, **overrides):
        fields = {"from": "w1", "fp": fp, "dtype": "float32", "nbytes": SIZE * 4, "clock": 1, "loss": None}
        fields.update(overrides)
        return encode_header("params", request.id, **fields)

    def non_finite():
        payload = good_payload.copy()
        for _ in range(rng.randrange(1, 4)):
            payload[rng.randrange(SIZE)] = rng.choice([np.nan, np.inf, -np.inf])
        return payload.tobytes()

    def flipped(data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)

    makers = [
        ("NaN or Inf in the parameters", lambda r: [params(r), non_finite()]),
        ("header bit flips", lambda r: [flipped(params(r, fp=b"\x00" * 16)), good_payload.tobytes()]),
        ("wrong fingerprint", lambda r: [params(r, fp=rng.randbytes(16)), good_payload.tobytes()]),
        ("wrong dtype", lambda r: [params(r, dtype=rng.choice(["float16", "bfloat16"])), good_payload.tobytes()]),
        ("byte count lies", lambda r: [params(r, nbytes=rng.choice([0, SIZE * 4 - 4, SIZE * 4 + 4, 2**40])),
                                       good_payload.tobytes()]),
        ("payload truncated or extended", lambda r: [params(r), good_payload.tobytes()[: rng.randrange(SIZE * 4)]
                                                      if rng.random() < 0.5 else good_payload.tobytes() + b"\x00" * 4]),
        ("missing or extra frames", lambda r: [params(r)] if rng.random() < 0.5
         else [params(r), good_payload.tobytes(), rng.randbytes(8)]),
        ("wrong request id", lambda r: [encode_header("params", (r.id + 1) % 2**64, **{"from": "w1"}, fp=fp,
                                                      dtype="float32", nbytes=SIZE * 4, clock=1, loss=None),
                                        good_payload.tobytes()]),
        ("garbage header", lambda r: [rng.randbytes(rng.randrange(0, 100)), good_payload.tobytes()]),
        ("unsolicited shared-memory slot", lambda r: [encode_header("params", r.id, **{"from": "w1"}, fp=fp,
                                                                    dtype="float32", nbytes=SIZE * 4, clock=1,
                                                                    loss=None, version=1, shm_slot=0,
                                                                    shm_id="0123456789abcdef")]),
    ]
    for i in range(REPLIES):
        yield makers[i % len(makers)]


@pytest.mark.timeout(240)
def test_a_thousand_invalid_replies_are_never_applied(nodes):
    cfg = make_config(2, same_host="off", timeout_ms=500)
    original = np.random.default_rng(1).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    makers = list(bad_replies(99, node.params.fingerprint))
    ctx = zmq.Context()
    evil = EvilPeer(ctx, cfg["nodes"][1]["port"], [maker for _, maker in makers])
    outcomes = Counter()
    try:
        for _ in range(REPLIES):
            node.update_send()
            update = node.update_wait()
            assert not update.averaged, update
            outcomes[update.outcome] += 1
            assert mine.tobytes() == original.tobytes()
    finally:
        evil.close()
        ctx.destroy(linger=0)
    assert outcomes["rejected"] >= 0.95 * REPLIES, outcomes
    print("\nfuzz replies:", dict(outcomes), dict(Counter(name for name, _ in makers)))
