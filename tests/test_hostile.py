"""Hostile input: the node stays up, keeps serving, and never applies a bad message."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from dpwa import NumpyParams
from dpwa.protocol import PROTOCOL_VERSION, decode_header, encode_header

from conftest import filled, make_config, wait_until

SIZE = 1000


def serving_only(config):
    return {**config, "fetch_probability": 0}


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def req(ctx, port, **options):
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    for k, v in options.items():
        s.setsockopt(k, v)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def fetch_header(node, **overrides):
    fields = {"from": "tester", "fp": node.params.fingerprint, "dtype": "float32"}
    fields.update(overrides)
    return encode_header("fetch", 77, **fields)


def ask(sock, frames, timeout_ms=3000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the node did not answer"
    return sock.recv_multipart()


def good_fetch_works(ctx, node, port):
    s = req(ctx, port)
    try:
        reply = ask(s, [fetch_header(node)])
        header = decode_header(reply[0])
        return header.kind == "params" and np.all(np.frombuffer(reply[1], np.float32) == node.params.array)
    finally:
        s.close(0)


@pytest.mark.parametrize("frames, reason", [
    ([b"garbage"], "bad_header"),
    ([b"\x93\x01\x02"], "bad_header"),                                  # a msgpack array, not a map
    ([msgpack.packb({"v": PROTOCOL_VERSION, "kind": "fetch"})], "bad_header"),  # truncated: fields missing
    ([msgpack.packb({"v": 99, "kind": "fetch", "id": 1})], "bad_version"),
    ([msgpack.packb({"v": PROTOCOL_VERSION, "kind": "exec", "id": 1})], "bad_kind"),
    (["PARAMS"], "unexpected_kind"),                                    # a reply kind sent as a request
    (["BAD_FP"], "bad_fingerprint"),
    (["BAD_DTYPE"], "bad_dtype"),
    ([b"\xdb\xff\xff\xff\xff"], "bad_header"),                           # claims a 4 GB string
])
def test_bad_requests_get_an_error_and_change_nothing(nodes, zctx, frames, reason):
    cfg = make_config(2)
    mine = filled(5, SIZE)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    port = cfg["nodes"][0]["port"]
    params_header = encode_header("params", 1, **{"from": "x"}, fp=b"0" * 16, dtype="float32",
                                  nbytes=10**12, clock=0, loss=None)
    special = {"PARAMS": params_header, "BAD_FP": fetch_header(node, fp=b"\x00" * 16),
               "BAD_DTYPE": fetch_header(node, dtype="float64")}
    frames = [special.get(f, f) if isinstance(f, str) else f for f in frames]
    s = req(zctx, port)
    reply = ask(s, frames)
    s.close(0)
    header = decode_header(reply[0])
    assert header.kind == "error" and header["reason"] == reason
    assert len(reply) == 1  # no parameters were sent
    assert np.all(mine == 5)
    assert node.stats()[f"rejected.{reason}"] == 1
    assert good_fetch_works(zctx, node, port)


def test_raw_garbage_half_frames_and_stalled_connections_stall_nobody(nodes, zctx):
    cfg = make_config(2)
    mine = filled(3, SIZE)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    port = cfg["nodes"][0]["port"]
    raw = []
    rng = np.random.default_rng(0)
    try:
        for i in range(20):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            raw.append(c)
            if i % 3 == 0:
                c.sendall(rng.bytes(int(rng.integers(1, 4096))))  # random bytes
            elif i % 3 == 1:
                c.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")  # half a ZMTP greeting, then silence
            # else: connect and say nothing at all
        for _ in range(3):  # the node still answers real peers while those connections hang
            assert good_fetch_works(zctx, node, port)
        # and the training thread is never held up
        for _ in range(5):
            node.update_send()
            node.update_wait()
    finally:
        for c in raw:
            c.close()
    assert np.all(mine == 3)


def test_a_dealer_without_the_req_envelope_is_rejected(nodes, zctx):
    cfg = make_config(2)
    node = nodes(serving_only(cfg), "w0", NumpyParams(filled(1, SIZE)))
    node.update_send()
    port = cfg["nodes"][0]["port"]
    d = zctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://127.0.0.1:{port}")
    d.send_multipart([fetch_header(node)])  # no empty delimiter frame
    assert wait_until(lambda: node.stats().get("rejected.bad_envelope", 0) == 1, 5)
    d.close(0)
    assert good_fetch_works(zctx, node, port)


def test_an_oversized_request_is_dropped_before_it_is_allocated(nodes, zctx):
    cfg = make_config(2)
    node = nodes(serving_only(cfg), "w0", NumpyParams(filled(1, SIZE)))
    node.update_send()
    port = cfg["nodes"][0]["port"]
    s = req(zctx, port)
    s.send(b"\x00" * (8 << 20))  # 8 MB where requests are at most 4 KB: the connection is dropped
    assert not s.poll(500)
    s.close(0)
    assert good_fetch_works(zctx, node, port)
    assert node.stats().get("requests_served", 0) == 1  # only the good fetch was served


def test_a_peer_that_asks_and_never_reads_stalls_nobody(nodes, zctx):
    """Greedy DEALER clients ask for large snapshots and never read them.

    The node's replies to them queue up (up to the send high-water mark, then
    they are dropped) and hold snapshot slots, but other peers are still
    served, and publishing never blocks: at worst it is skipped and counted,
    and peers get a slightly older snapshot.
    """
    size = 2_000_000  # 8 MB snapshots
    cfg = make_config(2)
    mine = filled(1, size)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    port = cfg["nodes"][0]["port"]
    greedy = []
    for _ in range(6):
        d = zctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 1)
        d.setsockopt(zmq.RCVBUF, 4096)
        d.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(4):
            d.send_multipart([b"", fetch_header(node)])
        greedy.append(d)
    t0 = time.monotonic()
    for step in range(20):
        node.update_send()  # must not wait for the greedy readers
        node.update_wait()
    assert time.monotonic() - t0 < 30
    assert good_fetch_works(zctx, node, port)
    stats = node.stats()
    assert stats["requests_served"] >= 7
    assert stats["snapshot_slots"] <= 6
    for d in greedy:
        d.close(0)


class EvilPeer:
    """A fake peer on a ROUTER socket that answers each fetch with the next crafted reply."""

    def __init__(self, ctx, port, replies):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.replies = list(replies)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set() and self.replies:
            if not self.sock.poll(50):
                continue
            ident, empty, raw_header = self.sock.recv_multipart()
            request = decode_header(raw_header)
            make = self.replies.pop(0)
            self.sock.send_multipart([ident, b""] + make(request))

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


def test_bad_replies_from_a_peer_are_rejected_and_never_applied(nodes, zctx):
    cfg = make_config(2, timeout_ms=500)
    mine = filled(2, SIZE)
    node = nodes(cfg, "w0", NumpyParams(mine))
    fp = node.params.fingerprint
    good_payload = np.full(SIZE, 9, np.float32).tobytes()

    def params(request, **overrides):
        fields = {"from": "w1", "fp": fp, "dtype": "float32", "nbytes": SIZE * 4, "clock": 1, "loss": None}
        fields.update(overrides)
        return encode_header("params", overrides.pop("id", request.id), **fields)

    replies = [
        lambda r: [b"\x00garbage"],                                         # undecodable header
        lambda r: [params(r), good_payload[:-4]],                           # truncated payload
        lambda r: [params(r, nbytes=10**12), good_payload],                 # oversized claim
        lambda r: [params(r, fp=b"\x01" * 16), good_payload],               # wrong fingerprint
        lambda r: [params(r, dtype="float16"), good_payload],               # wrong dtype
        lambda r: [params(r)],                                              # payload missing
        lambda r: [params(r), good_payload, good_payload],                  # extra frame
        lambda r: [encode_header("params", r.id + 1, **{"from": "w1"}, fp=fp, dtype="float32",
                                 nbytes=SIZE * 4, clock=1, loss=None), good_payload],  # wrong request id
        lambda r: [encode_header("fetch", r.id, **{"from": "w1"}, fp=fp, dtype="float32")],  # wrong kind
        lambda r: [params(r), good_payload],                                # finally, a good one
    ]
    evil = EvilPeer(zctx, cfg["nodes"][1]["port"], replies)
    try:
        outcomes = []
        for _ in range(len(replies) - 1):
            node.update_send()
            update = node.update_wait()
            outcomes.append(update.outcome)
            assert not update.averaged and np.all(mine == 2), update
        assert outcomes == ["rejected"] * (len(replies) - 1)
        assert node.stats()["fetches_rejected"] == len(replies) - 1
        node.update_send()
        update = node.update_wait()
        assert update.averaged, update  # the node is fine, and takes the good reply
        assert np.all(mine == 5.5)
    finally:
        evil.close()
