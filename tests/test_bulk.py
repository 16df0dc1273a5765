"""The raw-TCP data path for large snapshots (dpwa.wire.bulk): exact bytes, one-use tokens,
budgets, and clients that never send a token, never read, or flood the port."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from dpwa import NumpyParams
from dpwa.gossip.node import BULK_MIN_BYTES
from dpwa.stats import Counters
from dpwa.wire.curve import generate
from dpwa.wire.bulk import BLOCK_BYTES, HELLO_TIMEOUT_S, TOKEN_BYTES, BulkReceiver, BulkServer
from dpwa.wire.messages import ProtocolError
from dpwa.wire.server import Refused, TransportError

from conftest import make_config, wait_until


class FakeHold:
    def __init__(self) -> None:
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    def release_when(self, tracker) -> None:  # pragma: no cover - not used by the bulk path
        raise AssertionError


@pytest.fixture
def server():
    made = []

    def make(**kwargs) -> BulkServer:
        made.append(BulkServer("127.0.0.1", name="b", counters=Counters(), **kwargs))
        return made[-1]

    yield make
    for s in made:
        assert s.close()


def test_bytes_arrive_exactly_checked_block_by_block_over_one_reused_connection(server):
    bulk = server()
    data = np.random.default_rng(0).integers(0, 256, 3 * BLOCK_BYTES + 123, dtype=np.uint8)
    receiver = BulkReceiver("r")
    try:
        for round_ in range(2):
            hold = FakeHold()
            token = bulk.offer("w0", [data], hold, ttl_s=10)
            out = np.zeros_like(data)
            blocks = []
            receiver.receive("127.0.0.1", bulk.port, token, out, time.monotonic() + 10,
                             check=lambda start, end: blocks.append((start, end)))
            assert np.array_equal(out, data)
            assert blocks == [(0, BLOCK_BYTES), (BLOCK_BYTES, 2 * BLOCK_BYTES), (2 * BLOCK_BYTES, 3 * BLOCK_BYTES),
                              (3 * BLOCK_BYTES, data.size)]
            assert hold.released.wait(10)  # the snapshot is let go once sent
        assert bulk.counters.get("bulk_sent") == 2 and len(receiver._socks) == 1
    finally:
        receiver.close()


def test_tokens_serve_once_a_wrong_one_closes_the_connection_and_offers_expire(server):
    bulk = server()
    data = np.arange(1000, dtype=np.uint8)
    hold = FakeHold()
    token = bulk.offer("w0", [data], hold, ttl_s=10)
    receiver = BulkReceiver("r")
    out = np.zeros_like(data)
    try:
        with pytest.raises(TransportError, match="closed the bulk stream"):
            receiver.receive("127.0.0.1", bulk.port, b"x" * TOKEN_BYTES, out, time.monotonic() + 5)
        assert bulk.counters.get("bulk_bad_tokens") == 1 and not hold.released.is_set()
        receiver.receive("127.0.0.1", bulk.port, token, out, time.monotonic() + 5)  # still claimable
        assert np.array_equal(out, data)
        with pytest.raises(TransportError):
            receiver.receive("127.0.0.1", bulk.port, token, out, time.monotonic() + 5)  # used
        expiring = FakeHold()
        bulk.offer("w0", [data], expiring, ttl_s=0.2)
        assert expiring.released.wait(5) and bulk.pending() == 0 and bulk.counters.get("bulk_expired") == 1
    finally:
        receiver.close()


def test_each_sender_has_a_budget_of_pending_transfers(server):
    bulk = server(max_per_sender=2, max_pending=3)
    holds = [FakeHold() for _ in range(4)]
    bulk.offer("a", [b"1"], holds[0], 10)
    bulk.offer("a", [b"2"], holds[1], 10)
    with pytest.raises(Refused, match="busy"):
        bulk.offer("a", [b"3"], holds[2], 10)
    assert not holds[2].released.is_set()  # the caller still owns what was refused
    bulk.offer("b", [b"4"], holds[3], 10)
    with pytest.raises(Refused, match="busy"):
        bulk.offer("c", [b"5"], FakeHold(), 10)  # the total


def test_silent_flooding_and_never_reading_clients_cost_bounded_time_and_nobody_else_waits(server):
    """Four connections that never send a token fill the connection limit with a fifth that
    claims a 64 MB transfer and never reads; more connections are closed at once. The silent
    ones are dropped after HELLO_TIMEOUT_S, the reader-less one when its transfer expires (its
    snapshot released), and then an honest requester gets its bytes."""
    bulk = server(max_connections=5)
    big, big_hold = np.ones(64 << 20, np.uint8), FakeHold()
    token = bulk.offer("evil", [big], big_hold, ttl_s=HELLO_TIMEOUT_S + 1)
    silent = [socket.create_connection(("127.0.0.1", bulk.port)) for _ in range(4)]
    stuck = socket.create_connection(("127.0.0.1", bulk.port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(token)
    try:
        assert wait_until(lambda: bulk.counters.get("bytes_out") > 0, 10)
        extra = socket.create_connection(("127.0.0.1", bulk.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once: the limit
        extra.close()
        assert bulk.counters.get("bulk_refused_connections") >= 1
        assert big_hold.released.wait(HELLO_TIMEOUT_S + 10)  # the stuck transfer expired
        assert wait_until(lambda: bulk.counters.get("bulk_dropped") >= 5, HELLO_TIMEOUT_S + 10)
        data, hold = np.arange(4096, dtype=np.uint8), FakeHold()
        good = bulk.offer("w0", [data], hold, ttl_s=10)
        out = np.zeros_like(data)
        receiver = BulkReceiver("r")
        receiver.receive("127.0.0.1", bulk.port, good, out, time.monotonic() + 10)
        receiver.close()
        assert np.array_equal(out, data) and hold.released.wait(5)
    finally:
        for s in silent + [stuck]:
            s.close()


def test_a_failed_check_stops_the_stream_and_the_connection_is_not_reused(server):
    bulk = server()
    data = np.zeros(4 * BLOCK_BYTES, np.uint8)
    receiver = BulkReceiver("r")
    out = np.empty_like(data)

    def refuse_second(start, end):
        if start >= BLOCK_BYTES:
            raise ProtocolError("not_finite", "poisoned")

    try:
        with pytest.raises(ProtocolError, match="poisoned"):
            receiver.receive("127.0.0.1", bulk.port, bulk.offer("w0", [data], FakeHold(), 10), out,
                             time.monotonic() + 10, check=refuse_second)
        assert receiver._socks == {}
        receiver.receive("127.0.0.1", bulk.port, bulk.offer("w0", [data], FakeHold(), 10), out,
                         time.monotonic() + 10)
    finally:
        receiver.close()


def test_insecure_tcp_nodes_stream_large_snapshots_and_refuse_poisoned_ones(nodes):
    """Two nodes over TCP without keys and a model of BULK_MIN_BYTES: fetches go by stream,
    average exactly, and a peer whose parameters hold a NaN in its last block is refused
    with the requester's model untouched."""
    size = BULK_MIN_BYTES // 4
    cfg = make_config(2, insecure=True, same_host="off")
    theirs, mine = np.full(size, 4.0, np.float32), np.zeros(size, np.float32)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    peer.update_send()
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait()
    assert update.averaged and np.all(mine == 2.0)
    assert node.stats()["bulk_fetches"] == 1 and peer.stats()["bulk_served"] == 1
    theirs[-1] = np.nan
    peer.update_send()
    node.update_send()
    update = node.update_wait()
    assert not update.averaged and "not_finite" in update.reason
    assert np.all(mine == 2.0)
    assert peer.stats()["bulk_pending"] == 0  # the refused transfer was sent, not left waiting


def _fetch_a_bulk_sized_model(nodes, cfg):
    """w0 (zeros) fetches once from w1 (fours), a model of BULK_MIN_BYTES; returns both nodes and w0's array."""
    size = BULK_MIN_BYTES // 4
    theirs, mine = np.full(size, 4.0, np.float32), np.zeros(size, np.float32)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    peer.update_send()
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    return node, peer, node.update_wait(), mine


def test_bulk_off_keeps_everything_on_zeromq(nodes):
    cfg = make_config(2, insecure=True, same_host="off", bulk="off")
    node, _, update, mine = _fetch_a_bulk_sized_model(nodes, cfg)
    assert update.averaged and np.all(mine == 2.0)
    assert "bulk_fetches" not in node.stats()


def test_a_node_with_keys_never_streams(nodes, tmp_path):
    cfg = make_config(2, same_host="off")
    for spec in cfg["nodes"]:
        _, secret, pair = generate(spec["name"], tmp_path / "keys")
        spec["public_key"], spec["secret_key_file"] = pair.public.decode(), str(secret)
    node, peer, update, mine = _fetch_a_bulk_sized_model(nodes, cfg)
    assert update.averaged and np.all(mine == 2.0)
    assert "bulk_fetches" not in node.stats() and peer._bulk is None


SERVE = """
import sys, numpy as np
from dpwa.wire.bulk import BulkServer
server = BulkServer("127.0.0.1", name="child")
token = server.offer("w0", [np.ones(64 << 20, np.uint8)], None, ttl_s=60)
print(server.port, token.hex(), flush=True)
sys.stdin.read()
"""


def test_a_server_killed_mid_stream_fails_the_transfer_and_nothing_half_read_is_kept():
    """The receiver holds back after the first block (its check blocks) until the serving
    process is killed with SIGKILL; the rest of the stream never comes: TransportError."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port, token = proc.stdout.readline().split()
        killed = threading.Event()

        def check(start, end):
            if start == 0:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                killed.set()

        out = np.zeros(64 << 20, np.uint8)
        receiver = BulkReceiver("r")
        with pytest.raises(TransportError, match="closed the bulk stream|failed"):
            receiver.receive("127.0.0.1", int(port), bytes.fromhex(token), out, time.monotonic() + 20, check=check)
        assert killed.is_set() and receiver._socks == {}
        assert out[-1] == 0  # the end never arrived
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
