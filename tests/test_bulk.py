"""The raw-TCP data path for large snapshots (dpwa.wire.bulk): exact bytes, plain and sealed, one-use
tokens, budgets, fair accepting, clients that never send a token, never read, or flood the port, the
fallback to ZeroMQ when a stream fails, and `bind` with an interface name.
(Hostile sealed streams: tests/test_bulk_keyed.py.)"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from conftest import ORIGINAL, make_config, wait_until
from dpwa import NumpyParams
from dpwa.gossip.services import BULK_MIN_BYTES
from dpwa.stats import Counters
from dpwa.wire.bulk import (
    BLOCK_BYTES,
    EVICTED_ATTEMPTS,
    HELLO_TIMEOUT_S,
    TOKEN_BYTES,
    BulkError,
    BulkReceiver,
    BulkServer,
)
from dpwa.wire.curve import generate
from dpwa.wire.errors import ProtocolError, Refused
from helpers.flood import Flood, SilentListener, StallingRelay


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


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.io
def test_bytes_arrive_exactly_checked_block_by_block_over_one_reused_connection(server, sealed):
    bulk = server(sealed=sealed)
    data = np.random.default_rng(0).integers(0, 256, 3 * BLOCK_BYTES + 123, dtype=np.uint8)
    receiver = BulkReceiver("r")
    blocks: list[tuple[int, int]] = []  # (start, end) of each block checked, this round

    def record(start: int, end: int) -> None:
        blocks.append((start, end))

    try:
        for _ in range(2):
            hold = FakeHold()
            ticket = bulk.offer("w0", [data], hold, ttl_s=10)
            assert (ticket.key is not None) == sealed
            out = np.zeros_like(data)
            blocks.clear()
            receiver.receive(
                "127.0.0.1",
                bulk.port,
                ticket.token,
                out,
                time.monotonic() + 10,
                check=record,
                key=ticket.key,
            )
            assert np.array_equal(out, data)
            assert blocks == [
                (0, BLOCK_BYTES),
                (BLOCK_BYTES, 2 * BLOCK_BYTES),
                (2 * BLOCK_BYTES, 3 * BLOCK_BYTES),
                (3 * BLOCK_BYTES, data.size),
            ]
            assert hold.released.wait(10)  # the snapshot is let go once sent
        assert bulk.counters.get("bulk_sent") == 2 and len(receiver._socks) == 1
    finally:
        receiver.close()


@pytest.mark.io
def test_tokens_serve_once_a_wrong_one_closes_the_connection_and_offers_expire(server):
    bulk = server()
    data = np.arange(1000, dtype=np.uint8)
    hold = FakeHold()
    token = bulk.offer("w0", [data], hold, ttl_s=10).token
    receiver = BulkReceiver("r")
    out = np.zeros_like(data)
    try:
        with pytest.raises(BulkError, match="closed the bulk stream"):
            receiver.receive("127.0.0.1", bulk.port, b"x" * TOKEN_BYTES, out, time.monotonic() + 5)
        assert bulk.counters.get("bulk_bad_tokens") == 1 and not hold.released.is_set()
        receiver.receive("127.0.0.1", bulk.port, token, out, time.monotonic() + 5)  # still claimable
        assert np.array_equal(out, data)
        with pytest.raises(BulkError):
            receiver.receive("127.0.0.1", bulk.port, token, out, time.monotonic() + 5)  # used
        expiring = FakeHold()
        bulk.offer("w0", [data], expiring, ttl_s=0.2)
        assert expiring.released.wait(5) and bulk.pending() == 0 and bulk.counters.get("bulk_expired") == 1
    finally:
        receiver.close()


@pytest.mark.io
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


class ResettingServer:
    """A bulk server stand-in on its own thread: resets its first `resets` connections once it has read their
    token (as an eviction does), then streams `data` to the next one. Records every token it read."""

    def __init__(self, data: bytes, resets: int) -> None:
        self.data, self.resets = data, resets
        self.tokens: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _accept(self) -> socket.socket | None:
        deadline = time.monotonic() + 15
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                return self.listener.accept()[0]
            except TimeoutError:
                continue
        return None

    def _serve(self) -> None:
        for k in range(self.resets + 1):
            conn = self._accept()
            if conn is None:  # stopped: the receiver has given up
                return
            with conn:
                conn.settimeout(10)
                token = b""
                while len(token) < TOKEN_BYTES and (chunk := conn.recv(TOKEN_BYTES - len(token))):
                    token += chunk
                self.tokens.append(token)
                if k < self.resets:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with a reset
                conn.sendall(self.data)
                conn.recv(1)  # until the receiver closes

    def close(self) -> None:
        self.stop.set()
        self.thread.join(20)
        self.listener.close()
        assert not self.thread.is_alive()


@pytest.mark.parametrize("resets", [1, 3])
@pytest.mark.io
def test_a_requester_reset_before_its_first_byte_connects_again_with_the_same_token(resets):
    """An evicted connection is reset; the requester's token is still unused, so it connects again (up to
    EVICTED_ATTEMPTS connections in all) and gets its bytes."""
    data = np.random.default_rng(2).integers(0, 256, BLOCK_BYTES + 5, dtype=np.uint8)
    fake = ResettingServer(data.tobytes(), resets)
    receiver = BulkReceiver("r")
    try:
        out = np.zeros_like(data)
        receiver.receive("127.0.0.1", fake.port, b"t" * TOKEN_BYTES, out, time.monotonic() + 10)
        assert np.array_equal(out, data)
    finally:
        receiver.close()
        fake.close()
    assert fake.tokens == [b"t" * TOKEN_BYTES] * (resets + 1)


@pytest.mark.io
def test_a_requester_reset_every_time_gives_up_after_the_allowed_connections():
    fake = ResettingServer(b"", EVICTED_ATTEMPTS + 5)
    receiver = BulkReceiver("r")
    try:
        with pytest.raises(BulkError, match="failed"):
            receiver.receive("127.0.0.1", fake.port, b"t" * TOKEN_BYTES, np.zeros(10, np.uint8), time.monotonic() + 10)
    finally:
        receiver.close()
        fake.close()
    assert len(fake.tokens) == EVICTED_ATTEMPTS


@pytest.mark.io
def test_silent_flooding_and_never_reading_clients_cost_bounded_time_and_nobody_else_waits(server):
    """Four connections that never send a token fill the connection limit with a fifth that
    claims a 64 MB transfer and never reads. A newcomer evicts the oldest silent one (never the
    one that claimed a transfer). The silent ones are dropped after HELLO_TIMEOUT_S, the
    reader-less one when its transfer expires (its snapshot released), and then an honest
    requester gets its bytes."""
    bulk = server(max_connections=5)
    big, big_hold = np.ones(64 << 20, np.uint8), FakeHold()
    token = bulk.offer("evil", [big], big_hold, ttl_s=HELLO_TIMEOUT_S + 1).token
    silent = [socket.create_connection(("127.0.0.1", bulk.port)) for _ in range(4)]
    stuck = socket.create_connection(("127.0.0.1", bulk.port))
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.sendall(token)
    try:
        assert wait_until(lambda: bulk.counters.get("bytes_out") > 0, 10)
        extra = socket.create_connection(("127.0.0.1", bulk.port))
        silent[0].settimeout(5)
        with pytest.raises(ConnectionResetError):  # the oldest silent connection made room for the newcomer
            silent[0].recv(1)
        assert bulk.counters.get("bulk_evicted") == 1 and bulk.counters.get("bulk_refused_connections") == 0
        silent.append(extra)
        assert big_hold.released.wait(HELLO_TIMEOUT_S + 10)  # the stuck transfer expired
        assert wait_until(lambda: bulk.counters.get("bulk_dropped") >= 5, HELLO_TIMEOUT_S + 10)
        data, hold = np.arange(4096, dtype=np.uint8), FakeHold()
        good = bulk.offer("w0", [data], hold, ttl_s=10).token
        out = np.zeros_like(data)
        receiver = BulkReceiver("r")
        receiver.receive("127.0.0.1", bulk.port, good, out, time.monotonic() + 10)
        receiver.close()
        assert np.array_equal(out, data) and hold.released.wait(5)
    finally:
        for s in silent + [stuck]:
            s.close()


@pytest.mark.io
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
            receiver.receive(
                "127.0.0.1",
                bulk.port,
                bulk.offer("w0", [data], FakeHold(), 10).token,
                out,
                time.monotonic() + 10,
                check=refuse_second,
            )
        assert receiver._socks == {}
        receiver.receive(
            "127.0.0.1", bulk.port, bulk.offer("w0", [data], FakeHold(), 10).token, out, time.monotonic() + 10
        )
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


def keyed(cfg, directory):
    """`cfg` with CURVE keys for every node (key files under `directory`)."""
    for spec in cfg["nodes"]:
        _, secret, pair = generate(spec["name"], directory)
        spec["public_key"], spec["secret_key_file"] = pair.public.decode(), str(secret)
    return cfg


def test_nodes_with_keys_stream_sealed(nodes, tmp_path):
    cfg = keyed(make_config(2, same_host="off"), tmp_path / "keys")
    node, peer, update, mine = _fetch_a_bulk_sized_model(nodes, cfg)
    assert update.averaged and np.all(mine == 2.0)
    assert node.stats()["bulk_fetches"] == 1 and peer.services.bulk is not None and peer.services.bulk.sealed


SERVE = """
import sys, numpy as np
from dpwa.wire.bulk import BulkServer
server = BulkServer("127.0.0.1", name="child")
token = server.offer("w0", [np.ones(64 << 20, np.uint8)], None, ttl_s=60).token
print(server.port, token.hex(), flush=True)
sys.stdin.read()
"""


@pytest.mark.io
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
        with pytest.raises(BulkError, match="closed the bulk stream|failed"):
            receiver.receive("127.0.0.1", int(port), bytes.fromhex(token), out, time.monotonic() + 20, check=check)
        assert killed.is_set() and receiver._socks == {}
        assert out[-1] == 0  # the end never arrived
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# --------------------------------------------------------------------------- fair accepting


@pytest.mark.io
def test_a_newcomer_is_refused_only_when_every_connection_belongs_to_a_sender(server):
    """Two connections each claim a transfer and never read (the limit is 2): they belong to a
    sender, so a third connection cannot evict them and is closed at once."""
    bulk = server(max_connections=2)
    big = np.ones(16 << 20, np.uint8)
    stuck = []
    try:
        for sender in ("a", "b"):
            sock = socket.create_connection(("127.0.0.1", bulk.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(bulk.offer(sender, [big], FakeHold(), ttl_s=20).token)
            stuck.append(sock)
        assert wait_until(lambda: bulk.counters.get("bytes_out") > 0 and bulk.pending() == 0, 10)
        extra = socket.create_connection(("127.0.0.1", bulk.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""
        extra.close()
        assert bulk.counters.get("bulk_refused_connections") == 1 and bulk.counters.get("bulk_evicted") == 0
    finally:
        for sock in stuck:
            sock.close()


@pytest.mark.io
def test_a_sender_owns_at_most_max_per_sender_connections(server):
    """A third connection that claims a transfer for a sender with two idle connections closes the
    oldest of them; a sender whose connections are all streaming cannot claim on another one."""
    bulk = server(max_per_sender=2, max_connections=8)
    data = np.arange(4096, dtype=np.uint8)
    socks = []
    try:
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", bulk.port))
            sock.sendall(bulk.offer("a", [data], FakeHold(), ttl_s=10).token)
            sock.settimeout(5)
            got = bytearray()
            while len(got) < data.nbytes:
                got += sock.recv(data.nbytes - len(got))
            socks.append(sock)
        third = socket.create_connection(("127.0.0.1", bulk.port))
        third.sendall(bulk.offer("a", [data], FakeHold(), ttl_s=10).token)
        socks.append(third)
        socks[0].settimeout(5)
        assert socks[0].recv(1) == b""  # its oldest idle connection made room
        assert wait_until(lambda: bulk.counters.get("bulk_sent") == 3, 10)
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.io
def test_a_flood_of_silent_connections_delays_a_stream_but_cannot_stop_it(server):
    """Thirty silent connections, each reopened as soon as it is closed, against a limit of 5:
    a requester that connects anew for each of ten transfers still gets every one."""
    bulk = server(max_connections=5)
    data = np.random.default_rng(1).integers(0, 256, 2 * BLOCK_BYTES, dtype=np.uint8)
    with Flood(bulk.port, 30) as flood:
        assert wait_until(lambda: flood.closed_by_server > 30, 10)
        receiver = BulkReceiver("r")
        try:
            for _ in range(10):
                out = np.zeros_like(data)
                hold = FakeHold()
                receiver.receive(
                    "127.0.0.1", bulk.port, bulk.offer("w0", [data], hold, 10).token, out, time.monotonic() + 10
                )
                assert np.array_equal(out, data) and hold.released.wait(5)
                receiver.close()  # the next transfer connects anew, into the flood
        finally:
            receiver.close()
    assert bulk.counters.get("bulk_evicted") > 30 and bulk.counters.get("bulk_sent") == 10


@pytest.mark.slow
@pytest.mark.parametrize("with_keys", [False, True], ids=["insecure", "keys"])
def test_a_flood_on_the_bulk_port_cannot_keep_a_new_peer_from_averaging(nodes, tmp_path, with_keys):
    """Issue 16, item 5: thirty silent connections to a node's bulk port, reopened as they close,
    kept a newly started peer from averaging at all (0 of 35,444 steps in 12 s, measured on the
    code before the fix). Now the new peer averages every step, by stream."""
    size = BULK_MIN_BYTES // 4
    cfg = make_config(2, **ORIGINAL, insecure=True, same_host="off")
    if with_keys:
        del cfg["insecure"]
        keyed(cfg, tmp_path / "keys")
    theirs, mine = np.full(size, 4.0, np.float32), np.zeros(size, np.float32)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    peer.update_send()
    with Flood(peer.services.bulk.port, 30) as flood:
        assert wait_until(lambda: flood.closed_by_server > 30, 10)
        node = nodes(cfg, "w0", NumpyParams(mine))
        steps = averaged = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and steps < 200:
            node.update_send()
            averaged += node.update_wait().averaged
            steps += 1
    assert steps >= 10 and averaged >= 0.9 * steps, (averaged, steps)
    assert node.stats()["bulk_fetches"] >= 0.5 * steps  # by stream: fair accepting lets them through
    assert peer.stats()["bulk_evicted"] > 0
    assert np.all(mine == mine[0]) and 0 < mine[0] <= 4.0


# --------------------------------------------------------------------------- falling back to ZeroMQ


@pytest.mark.parametrize("with_keys", [False, True], ids=["insecure", "keys"])
@pytest.mark.parametrize("failure", ["refused", "silent", "stalls"])
def test_a_fetch_falls_back_to_zeromq_when_the_bulk_connection_fails(nodes, tmp_path, monkeypatch, with_keys, failure):
    """The peer's bulk port refuses connections (nobody listens), accepts and never sends, or (a relay in
    between) passes the stream's first byte and then stalls: the fetch asks again over ZeroMQ within its
    deadline and averages exactly; the failure is counted, the next fetch from that peer does not ask for
    a stream, and once the pause is over it does. (Before, a stream that stalled after its first byte
    held the fetch to its deadline and failed it: 0 of 6 fetches averaged in a keyed cluster.)"""
    from conftest import free_port
    from dpwa.gossip.transfer import requesting

    monkeypatch.setattr(requesting, "BULK_PAUSE_S", 0.5)
    size = BULK_MIN_BYTES // 4
    cfg = make_config(2, **ORIGINAL, insecure=True, same_host="off", timeout_ms=2000)
    if with_keys:
        del cfg["insecure"]
        keyed(cfg, tmp_path / "keys")
    theirs, mine = np.full(size, 4.0, np.float32), np.zeros(size, np.float32)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    peer.update_send()
    node = nodes(cfg, "w0", NumpyParams(mine))
    real_port = peer.services.bulk.port
    silent: SilentListener | StallingRelay | None = None
    if failure == "silent":
        silent = SilentListener()
    elif failure == "stalls":
        silent = StallingRelay(real_port, passed=1)
    try:
        peer.services.bulk.port = silent.port if silent else free_port()  # what the peer's replies will name
        node.update_send()
        started = time.monotonic()
        update = node.update_wait()
        assert update.averaged and np.all(mine == 2.0), update
        assert time.monotonic() - started < 2.0 + 0.5  # within the fetch's deadline (and update_wait's slack)
        stats = node.stats()
        assert stats["bulk_fallbacks"] == 1 and stats.get("bulk_fetches", 0) == 0 and stats["fetches_ok"] == 1
        node.update_send()  # paused: over ZeroMQ at once, no stream asked for
        assert node.update_wait().averaged and np.all(mine == 3.0)
        assert peer.stats()["bulk_served"] == 1 and node.stats()["bulk_fallbacks"] == 1
    finally:
        peer.services.bulk.port = real_port
        if silent:
            silent.close()
    averaged = []

    def step() -> bool:
        node.update_send()
        averaged.append(node.update_wait().averaged)
        return node.stats().get("bulk_fetches", 0) == 1

    assert wait_until(step, 10)  # once the pause (BULK_PAUSE_S, patched to 0.5 s) is over, it streams again
    assert all(averaged) and np.all(mine == mine[0]) and 3.5 <= mine[0] <= 4.0
    assert node.stats()["bulk_fallbacks"] == 1


def test_a_bulk_server_out_of_budget_answers_over_zeromq(nodes):
    """A requester that asks for streams and never claims them: past the bulk server's budget for
    it (3), the snapshot comes in the reply itself, as long as its ZeroMQ budget allows."""
    import zmq

    from dpwa.gossip.transfer.protocol import FETCH
    from dpwa.wire.schema import decode, encode

    size = BULK_MIN_BYTES // 4
    cfg = make_config(2, insecure=True, same_host="off", fetch_probability=0)
    peer = nodes(cfg, "w1", NumpyParams(np.full(size, 4.0, np.float32)))
    peer.update_send()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    kinds = []
    try:
        sock.connect(f"tcp://127.0.0.1:{cfg['nodes'][1]['port']}")
        for request_id in range(1, 5):
            sock.send(
                encode(
                    FETCH, request_id, **{"from": "w0", "fp": peer.params.fingerprint, "dtype": "float32", "bulk": True}
                )
            )
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            kinds.append(decode(frames[0]).kind)
    finally:
        sock.close(0)
        ctx.term()
    assert kinds == ["bulk_params"] * 3 + ["params"]
    assert peer.stats()["bulk_declined"] == 1


# the fields of a bulk reply (BULK_PARAMS) for a 4 KiB model, without a key
BULK_REPLY_FIELDS = {
    "from": "w1",
    "fp": b"f" * 16,
    "dtype": "float32",
    "nbytes": 4096,
    "clock": 0.0,
    "loss": None,
    "version": 1,
    "port": 1,
    "token": b"t" * TOKEN_BYTES,
}


def test_a_keyed_requester_refuses_a_plain_stream():
    """With keys, a bulk reply without a key would stream the snapshot in the clear: refused."""
    from dpwa.gossip.transfer.paths import PeerPaths
    from dpwa.gossip.transfer.protocol import BULK_PARAMS
    from dpwa.gossip.transfer.requesting import ReplyReader
    from dpwa.gossip.transfer.validation import PeerValues
    from dpwa.mixing.model import WireModel
    from dpwa.wire.calls import Response
    from dpwa.wire.schema import decode, encode

    fields = dict(BULK_REPLY_FIELDS)
    header = decode(encode(BULK_PARAMS, 7, **fields))
    reader = ReplyReader(
        WireModel(b"f" * 16, "float32", 1024),
        PeerValues("float32", 0.0, lambda: None),
        {},
        Counters(),
        lambda message: None,
        PeerPaths(stream_hosts={"w1": "127.0.0.1"}),
        sealed=True,
    )
    try:
        with pytest.raises(ProtocolError, match="plain bulk stream"):
            reader.read(Response(header, []), "w1", time.monotonic() + 5)
    finally:
        reader.close()


# --------------------------------------------------------------------------- bind: an interface name


def test_bind_to_an_interface_name_serves_a_bulk_sized_model(nodes):
    """Issue 16, item 9: `bind: lo` with `insecure: true` and a 4 MiB model failed to start (ZeroMQ
    binds an interface name, a Python socket does not). Both listeners now bind lo's address."""
    cfg = make_config(2, insecure=True, same_host="off")
    for spec in cfg["nodes"]:
        spec["bind"] = "lo"
    node, peer, update, mine = _fetch_a_bulk_sized_model(nodes, cfg)
    assert update.averaged and np.all(mine == 2.0) and node.stats()["bulk_fetches"] == 1
    assert peer.services.bulk._listener.getsockname()[0] == "127.0.0.1"


def test_bind_to_an_interface_this_machine_lacks_is_refused_before_anything_starts(nodes):
    import threading

    from dpwa import ConfigError

    cfg = make_config(2, insecure=True, same_host="off")
    cfg["nodes"][0]["bind"] = "nosuchif0"
    before = threading.active_count()
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.bind is 'nosuchif0'.*interface of this machine"):
        nodes(cfg, "w0", NumpyParams(np.zeros(BULK_MIN_BYTES // 4, np.float32)))
    assert threading.active_count() == before


@pytest.mark.parametrize("key", [b"k" * 31, b"k" * 33, "k" * 32])
def test_a_bulk_reply_whose_key_is_not_32_bytes_is_refused_by_its_schema(key):
    import msgpack

    from dpwa.gossip.transfer.protocol import BULK_PARAMS
    from dpwa.wire.schema import decode, encode

    fields = dict(BULK_REPLY_FIELDS)
    good = msgpack.unpackb(encode(BULK_PARAMS, 7, **fields, key=b"k" * 32))
    assert decode(msgpack.packb({**good})).get("key") == b"k" * 32
    with pytest.raises(ProtocolError, match="key"):
        decode(msgpack.packb({**good, "key": key}))
