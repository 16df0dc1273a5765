"""The sealed bulk path (clusters with CURVE keys): what is on the wire, and hostile streams.

A raw socket acts as a malicious (or tampered-with) bulk server and sends a
real receiver blocks that were replayed, reordered, cut, forged, taken from
another transfer or sealed with another key. Each must make the transfer
fail with BulkError before any byte of the bad block is used, and leave no
socket behind; at the node, the fetch then goes over ZeroMQ and the model
only ever sees the honest values.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
from test_bulk import FakeHold, keyed

from conftest import ORIGINAL, make_config, wait_until
from dpwa import NumpyParams
from dpwa.gossip.services import BULK_MIN_BYTES
from dpwa.stats import Counters
from dpwa.wire.bulk import (
    BLOCK_BYTES,
    KEY_BYTES,
    TAG_BYTES,
    TOKEN_BYTES,
    BulkError,
    BulkReceiver,
    BulkServer,
    Cipher,
    associated_data,
    block_count,
    nonce,
    sealed_bytes,
)

DATA = np.random.default_rng(7).integers(0, 256, 3 * BLOCK_BYTES + 1000, dtype=np.uint8)


def seal(key: bytes, token: bytes, data: bytes) -> list[bytes]:
    """`data` as an honest sealed stream's blocks."""
    cipher, total = Cipher(key), len(data)
    return [
        cipher.encrypt(nonce(i), data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES], associated_data(token, i, total))
        for i in range(block_count(total))
    ]


def flip(block: bytes, at: int) -> bytes:
    return block[:at] + bytes([block[at] ^ 0x01]) + block[at + 1 :]


class RawBulkServer:
    """Accepts one connection, reads a token, sends `chunks` and closes (or, `hold`, keeps it open until
    closed). One thread, bounded in time."""

    def __init__(self, chunks: list[bytes], hold: bool = False) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        self.token = b""
        self._chunks, self._hold = chunks, hold
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-raw-bulk", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            while len(self.token) < TOKEN_BYTES:
                data = conn.recv(TOKEN_BYTES - len(self.token))
                if not data:
                    return
                self.token += data
            try:
                for chunk in self._chunks:
                    conn.sendall(chunk)
            except OSError:
                return  # the receiver gave up first
            if self._hold:
                self._done.wait(10)

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self.listener.close()
        assert not self._thread.is_alive()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


KEY, TOKEN = b"k" * KEY_BYTES, b"t" * TOKEN_BYTES
HONEST = seal(KEY, TOKEN, DATA.tobytes())
OTHER = seal(b"o" * KEY_BYTES, b"u" * TOKEN_BYTES, DATA.tobytes())  # another transfer: its own key and token
SAME_KEY_OTHER_TOKEN = seal(KEY, b"u" * TOKEN_BYTES, DATA.tobytes())
LONGER = seal(KEY, TOKEN, DATA.tobytes() + bytes(BLOCK_BYTES))  # the same transfer, announced longer
b = HONEST

# name: (the stream the server sends, the first block (0-based) that must fail; None: the stream is cut)
HOSTILE = {
    "replayed block": ([b[0], b[0], b[2], b[3]], 1),
    "replayed at the end": ([b[0], b[1], b[2], b[1]], 3),
    "reordered": ([b[1], b[0], b[2], b[3]], 0),
    "truncated between blocks": ([b[0], b[1]], None),
    "truncated inside a block": ([b[0], b[1][:1000]], None),
    "forged (a bit flipped)": ([b[0], flip(b[1], 12345), b[2], b[3]], 1),
    "forged tag": ([b[0], flip(b[1], len(b[1]) - 1), b[2], b[3]], 1),
    "a block from another transfer": ([b[0], OTHER[1], b[2], b[3]], 1),
    "the same key, another token": ([b[0], SAME_KEY_OTHER_TOKEN[1], b[2], b[3]], 1),
    "a longer transfer's blocks": (LONGER[:4], 0),
    "plaintext": ([DATA.tobytes()], 0),
    "another transfer entirely": (OTHER, 0),
}


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.io
def test_a_hostile_sealed_stream_fails_before_a_bad_block_is_used(name):
    chunks, bad = HOSTILE[name]
    fds = open_fds()
    server = RawBulkServer(chunks)
    receiver = BulkReceiver("r")
    out = np.zeros_like(DATA)
    checked: list[tuple[int, int]] = []
    try:
        with pytest.raises(BulkError, match="failed authentication" if bad is not None else "closed the bulk stream"):
            receiver.receive(
                "127.0.0.1",
                server.port,
                TOKEN,
                out,
                time.monotonic() + 10,
                check=lambda start, end: checked.append((start, end)),
                key=KEY,
            )
        assert receiver._socks == {}
    finally:
        receiver.close()
        server.close()
    good = bad if bad is not None else len(chunks) - (len(chunks[-1]) < BLOCK_BYTES + TAG_BYTES)
    assert checked == [(i * BLOCK_BYTES, (i + 1) * BLOCK_BYTES) for i in range(good)]  # nothing past it was used
    assert np.array_equal(out[: good * BLOCK_BYTES], DATA[: good * BLOCK_BYTES])
    assert server.token == TOKEN
    assert open_fds() == fds


@pytest.mark.io
def test_a_receiver_with_the_wrong_key_fails_at_the_first_block():
    fds = open_fds()
    server = RawBulkServer(HONEST, hold=True)
    receiver = BulkReceiver("r")
    checked: list[tuple[int, int]] = []
    try:
        with pytest.raises(BulkError, match="block 1 of 4 .* failed authentication"):
            receiver.receive(
                "127.0.0.1",
                server.port,
                TOKEN,
                np.zeros_like(DATA),
                time.monotonic() + 10,
                check=lambda start, end: checked.append((start, end)),
                key=b"w" * KEY_BYTES,
            )
    finally:
        receiver.close()
        server.close()
    assert checked == [] and open_fds() == fds


@pytest.mark.io
def test_the_honest_stream_of_the_same_test_passes():
    """The control for the hostile cases: the same server sending the honest blocks."""
    server = RawBulkServer(HONEST)
    receiver = BulkReceiver("r")
    out = np.zeros_like(DATA)
    try:
        receiver.receive("127.0.0.1", server.port, TOKEN, out, time.monotonic() + 10, key=KEY)
    finally:
        receiver.close()
        server.close()
    assert np.array_equal(out, DATA)


@pytest.mark.io
def test_a_sealed_server_sends_only_ciphertext_of_the_announced_length():
    """A raw client claims a sealed transfer: exactly sealed_bytes(total) bytes come, which decrypt
    to the snapshot with the ticket's key, and no 64-byte run of the plaintext is among them."""
    data = np.tile(np.arange(256, dtype=np.uint8), (2 * BLOCK_BYTES + 77) // 256 + 1)[: 2 * BLOCK_BYTES + 77]
    bulk = BulkServer("127.0.0.1", sealed=True, name="b", counters=Counters())
    sock = socket.create_connection(("127.0.0.1", bulk.port))
    try:
        hold = FakeHold()
        ticket = bulk.offer("w0", [data[: BLOCK_BYTES + 5], data[BLOCK_BYTES + 5 :]], hold, ttl_s=10)  # two buffers
        assert ticket.key is not None and len(ticket.key) == KEY_BYTES
        sock.sendall(ticket.token)
        sock.settimeout(5)
        wire = bytearray()
        while len(wire) < sealed_bytes(data.nbytes):
            chunk = sock.recv(1 << 20)
            assert chunk, "the server closed early"
            wire += chunk
        assert hold.released.wait(5) and len(wire) == sealed_bytes(data.nbytes)
        assert data[:64].tobytes() not in wire
        cipher, plain, offset = Cipher(ticket.key), bytearray(), 0
        for i in range(block_count(data.nbytes)):
            size = min(BLOCK_BYTES, data.nbytes - i * BLOCK_BYTES) + TAG_BYTES
            plain += cipher.decrypt(
                nonce(i), bytes(wire[offset : offset + size]), associated_data(ticket.token, i, data.nbytes)
            )
            offset += size
        assert plain == data.tobytes()
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # nothing more: the connection waits for the next token
    finally:
        sock.close()
        assert bulk.close()


@pytest.mark.io
def test_keys_are_fresh_for_every_transfer():
    bulk = BulkServer("127.0.0.1", sealed=True, name="b")
    try:
        tickets = [bulk.offer(f"w{i}", [b"x" * 10], None, 10) for i in range(3)]
    finally:
        assert bulk.close()
    assert len({t.key for t in tickets}) == 3 and len({t.token for t in tickets}) == 3


@pytest.mark.parametrize("corruption", ["flip", "replay"])
def test_a_tampered_sealed_stream_makes_the_node_fetch_over_zeromq(nodes, tmp_path, corruption):
    """A keyed pair whose serving node's sealed blocks are tampered with on the way out (a bit
    flipped in block 2, or block 1 sent again in its place): the requester refuses the stream,
    asks again over ZeroMQ (CURVE) within the deadline, and blends exactly the honest values;
    the tampered bytes never reach its model."""
    cfg = keyed(make_config(2, **ORIGINAL, same_host="off"), tmp_path / "keys")
    size = BULK_MIN_BYTES // 4
    theirs, mine = np.full(size, 4.0, np.float32), np.zeros(size, np.float32)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    peer.update_send()
    server = peer.services.bulk
    original = server._seal
    first_block: list[bytes] = []

    def tampered(conn, transfer, cipher):
        original(conn, transfer, cipher)
        buffer, view = conn.out[-1]
        if conn.block == 1:
            first_block.append(bytes(view))
        elif conn.block == 2:
            if corruption == "flip":
                view[100] ^= 0x40
            else:
                view[:] = first_block[0][: view.nbytes]

    server._seal = tampered
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait()
    assert update.averaged and np.all(mine == 2.0), update
    stats = node.stats()
    assert stats["bulk_fallbacks"] == 1 and stats.get("bulk_fetches", 0) == 0
    assert wait_until(lambda: server.pending() == 0, 5)
