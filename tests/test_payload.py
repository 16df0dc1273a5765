"""Payloads in chunks (dpwa.wire.payload): the layout, its parsing of hostile frame lists,
the receive-buffer pool, and large payloads through a real server and client."""

from __future__ import annotations

import time
from typing import cast

import numpy as np
import pytest
import zmq

from conftest import free_port
from dpwa.wire.channel import Channel
from dpwa.wire.errors import ProtocolError
from dpwa.wire.payload import CHUNK_BYTES, BufferPool, Payload, chunks, group, send_frames
from dpwa.wire.schema import KINDS, Integer, Text, decode, encode, message_kind
from dpwa.wire.server import Reply, Request, Route, Server
from dpwa.wire.sockets import FRAME_ALLOWANCE

C = 16  # a small chunk size for the pure tests
TWO = KINDS.get("test_two") or message_kind("test_two", {"from": Text(16)}, payload=2)
SUMS = KINDS.get("test_sums") or message_kind(
    "test_sums", {"a": Integer(0, 1 << 40), "b": Integer(0, 1 << 40)}, payload=2
)
SEEN = KINDS.get("test_seen") or message_kind("test_seen", {"n": Integer(0, 100)})


class FakeFrame:
    """What group() needs of a zmq.Frame: its length and buffer."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)

    def __len__(self) -> int:
        return self.buffer.nbytes


def as_frames(fakes: list[FakeFrame]) -> list[zmq.Frame]:
    """FakeFrames where group() and Payload take zmq.Frames: they stand in for them."""
    return cast(list[zmq.Frame], fakes)


def frames_of(*buffers: bytes, chunk: int = C) -> list[zmq.Frame]:
    return as_frames([FakeFrame(bytes(memoryview(f))) for f in chunks(buffers, chunk)])


@pytest.mark.parametrize("sizes", [(0,), (5,), (C - 1,), (C,), (C + 1,), (3 * C,), (0, 0), (C, 0), (2 * C, C + 3, 1)])
def test_payloads_split_and_group_back_exactly(sizes):
    rng = np.random.default_rng(len(sizes))
    buffers = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    frames = frames_of(*buffers)
    assert all(len(f) <= C for f in frames)
    assert len(frames) == sum(n // C + 1 if n >= C else 1 for n in sizes)
    payloads = group(frames, len(sizes), chunk_bytes=C)
    assert [bytes(p.buffer) for p in payloads] == buffers
    for p, data in zip(payloads, buffers, strict=True):
        out = np.empty(len(data), np.uint8)
        p.copy_into(out)
        assert out.tobytes() == data


@pytest.mark.parametrize(
    "frames, count, detail",
    [
        ([b"x" * C], 1, "an unfinished one"),  # a full chunk must be followed by a shorter one
        ([b"x" * (C + 1)], 1, "more than a chunk"),
        ([b"x", b"y"], 1, "make 2 payloads"),
        ([], 1, "make 0 payloads"),
        ([b"x" * C, b"x" * C, b""], 2, "make 1 payloads"),
    ],
)
def test_frame_lists_that_are_not_the_declared_payloads_are_refused(frames, count, detail):
    with pytest.raises(ProtocolError) as err:
        group(as_frames([FakeFrame(f) for f in frames]), count, chunk_bytes=C)
    assert err.value.reason == "bad_frames" and detail in err.value.detail


def test_a_single_frame_is_read_in_place_and_chunks_are_copied_into_the_pool():
    one = Payload(as_frames([FakeFrame(np.arange(3, dtype=np.float32).tobytes())]))
    array, release = one.array(np.float32)
    assert one.single and array.tolist() == [0.0, 1.0, 2.0]
    release()
    data = np.arange(3 * C, dtype=np.float32)
    many = group(frames_of(data.tobytes(), chunk=C), 1, chunk_bytes=C)[0]
    pool = BufferPool(data.nbytes, keep=1)
    first, give_back = many.array(np.float32, pool)
    assert np.array_equal(first, data) and many.frames == []  # the chunks are freed once copied
    give_back()
    give_back()  # idempotent: the buffer is kept once
    again = group(frames_of(data.tobytes(), chunk=C), 1, chunk_bytes=C)[0]
    second, _ = again.array(np.float32, pool)
    assert np.shares_memory(first, second)  # reused, not allocated again
    third, _ = group(frames_of(data.tobytes(), chunk=C), 1, chunk_bytes=C)[0].array(np.float32, pool)
    assert not np.shares_memory(second, third)  # the pool never hands out a buffer twice
    assert np.array_equal(third, data)


def test_large_payloads_travel_in_chunks_both_ways_and_no_frame_exceeds_a_chunk(zctx):
    """A request with two payloads of 2.5 and exactly 2 chunks, answered with both swapped:
    every byte arrives, and the server's frame limit is one chunk, not the model."""
    limit = 5 * CHUNK_BYTES

    def swap(request: Request) -> Reply:
        a, b = (np.frombuffer(p.buffer, np.uint8) for p in request.payload)
        return Reply(encode(SUMS, request.header.id, a=int(a.sum()), b=int(b.sum())), payload=[b.copy(), a.copy()])

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = Server(
        zctx, endpoint, {TWO.name: Route(TWO, swap, max_payload_bytes=limit, bulk=True)}, name="s", senders=["a"]
    ).start()
    channel = Channel(zctx, endpoint, max_reply_bytes=limit)
    try:
        assert server.max_frame_bytes == CHUNK_BYTES
        rng = np.random.default_rng(0)
        a = rng.integers(0, 256, CHUNK_BYTES * 5 // 2, dtype=np.uint8)
        b = rng.integers(0, 256, 2 * CHUNK_BYTES, dtype=np.uint8)
        reply = channel.request(
            [encode(TWO, 7, **{"from": "a"}), a, b], 7, time.monotonic() + 10, accept={SUMS.name: SUMS}
        )
        assert reply.header["a"] == int(a.sum()) and reply.header["b"] == int(b.sum())
        got_b, got_a = reply.frames
        assert [len(f) for f in got_b.frames] == [CHUNK_BYTES, CHUNK_BYTES, 0]
        assert np.array_equal(np.frombuffer(got_a.buffer, np.uint8), a)
        assert np.array_equal(np.frombuffer(got_b.buffer, np.uint8), b)
    finally:
        channel.close()
        server.close()


def test_a_frame_larger_than_a_chunk_never_reaches_the_handler_and_the_server_serves_on(zctx):
    """Past the CURVE allowance ZeroMQ drops the connection before allocating the frame;
    within it, the server refuses the message (bad_frames)."""
    seen = []
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    def handler(request: Request) -> Reply:
        seen.append([len(p) for p in request.payload])
        return Reply(encode(SEEN, request.header.id, n=len(seen)))

    server = Server(
        zctx, endpoint, {TWO.name: Route(TWO, handler, max_payload_bytes=8 * CHUNK_BYTES)}, name="s", senders=["a"]
    ).start()
    raw = zctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    channel = Channel(zctx, endpoint)
    try:
        raw.send_multipart([encode(TWO, 1, **{"from": "a"}), b"x" * (CHUNK_BYTES + 1), b""])
        assert raw.poll(5000)
        refusal = decode(raw.recv())
        assert refusal.kind == "error" and refusal["reason"] == "bad_frames"
        raw.send_multipart([encode(TWO, 2, **{"from": "a"}), b"x" * (CHUNK_BYTES + FRAME_ALLOWANCE + 1), b""])
        assert not raw.poll(500)  # ZeroMQ dropped the connection: no reply
        reply = channel.request(
            [encode(TWO, 3, **{"from": "a"}), b"y" * 10, b""], 3, time.monotonic() + 5, accept={SEEN.name: SEEN}
        )
        assert reply.header["n"] == 1 and seen == [[10, 0]]
    finally:
        raw.close(0)
        channel.close()
        server.close()


def test_send_frames_tracks_every_chunk(zctx):
    a, b = zctx.socket(zmq.PAIR), zctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    try:
        data = np.ones(3 * CHUNK_BYTES, np.uint8)
        tracker = send_frames(a, [b"head", data], track=True)
        assert tracker is not None
        assert b.poll(10_000)
        got = b.recv_multipart(copy=False)
        assert [len(f) for f in got] == [4, CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES, 0]
        tracker.wait(10)
        assert tracker.done
    finally:
        a.close(0)
        b.close(0)
