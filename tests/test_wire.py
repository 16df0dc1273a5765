"""The transport on its own: the client thread's deadlines and outcomes, the server's routes,
checks and budget, and the bounded rate-limited log. No gossip node here."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from conftest import free_port, wait_until
from dpwa.logs import RateLimitedLog
from dpwa.stats import Counters
from dpwa.wire.client import ClientThread, DirectClient
from dpwa.wire.errors import Refused
from dpwa.wire.schema import KINDS, Integer, Text, decode, encode, message_kind
from dpwa.wire.server import Reply, Request, Route, Server

PING = KINDS.get("test_ping") or message_kind("test_ping", {"from": Text(16), "n": Integer(0, 100)})
PONG = KINDS.get("test_pong") or message_kind("test_pong", {"n": Integer(0, 100)})
BLOB = KINDS.get("test_blob") or message_kind("test_blob", {"from": Text(16)}, payload=1)


class Echo:
    """A server whose handler records what it saw; `refuse` makes it answer busy."""

    def __init__(self, zctx, **kwargs):
        self.seen = []
        self.refuse = False
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        routes = {PING.name: Route(PING, self.ping), BLOB.name: Route(BLOB, self.blob, max_payload_bytes=100)}
        self.server = Server(zctx, self.endpoint, routes, name="echo", senders=["a", "b"], **kwargs).start()

    def ping(self, request: Request) -> Reply:
        self.seen.append(request.header["n"])
        if self.refuse:
            raise Refused("busy", "try later")
        return Reply(encode(PONG, request.header.id, n=request.header["n"]))

    def blob(self, request: Request) -> Reply:
        return Reply(encode(PONG, request.header.id, n=len(request.payload[0])))


class PingTask:
    def __init__(self, peer, deadline, n, name="a"):
        self.peer, self.deadline, self.n, self.name = peer, deadline, n, name

    def run(self, ask):
        return ask(lambda rid: [encode(PING, rid, **{"from": self.name}, n=self.n)], {PONG.name: PONG}).header["n"]


def test_a_task_whose_deadline_passed_in_the_queue_is_never_sent(zctx):
    """Queued behind a slow request, a task whose deadline passes before its turn ends
    "expired": nothing goes out, and it is not the peer's fault (not a timeout)."""
    echo = Echo(zctx)
    silent_port = free_port()
    silent = zctx.socket(zmq.ROUTER)  # accepts, never answers
    silent.bind(f"tcp://127.0.0.1:{silent_port}")
    client = ClientThread(
        zctx, {"echo": echo.endpoint, "silent": f"tcp://127.0.0.1:{silent_port}"}, name="t", max_reply_bytes=4096
    ).start()
    try:
        now = time.monotonic()
        slow = client.submit(PingTask("silent", now + 0.5, 1))
        late = client.submit(PingTask("echo", now + 0.2, 2))
        fine = client.submit(PingTask("echo", now + 5.0, 3))
        for call in (slow, late, fine):
            assert call.wait(10)
        assert slow.outcome == "timeout"
        assert late.outcome == "expired" and 2 not in echo.seen
        assert fine.outcome == "ok" and fine.take() == 3
    finally:
        client.close()
        echo.server.close()
        silent.close(0)


def test_outcomes_refused_rejected_and_a_task_that_moves_to_another_peer(zctx):
    echo, other = Echo(zctx), Echo(zctx)
    client = ClientThread(zctx, {"e": echo.endpoint, "o": other.endpoint}, name="t", max_reply_bytes=4096).start()

    class Hop:
        """Asks e; if busy, moves on to o (as an exchange looks for a free partner)."""

        peer, deadline = "e", time.monotonic() + 5

        def run(self, ask):
            try:
                return PingTask.run(PingTask(self.peer, self.deadline, 7), ask)
            except Refused:
                self.peer = "o"
                return PingTask.run(PingTask(self.peer, self.deadline, 8), ask)

    try:
        echo.refuse = True
        refused = client.submit(PingTask("e", time.monotonic() + 5, 5))
        assert refused.wait(10) and refused.outcome == "refused" and refused.refusal == "busy"
        hop = client.submit(Hop())
        assert hop.wait(10) and hop.outcome == "ok" and hop.take() == 8 and hop.peer == "o"
        liar = client.submit(PingTask("e", time.monotonic() + 5, 5, name="intruder"))  # not a known sender
        assert liar.wait(10) and liar.outcome == "refused" and liar.refusal == "bad_identity"
        assert echo.server.counters.get("rejected.bad_identity") == 1
        assert echo.server.counters.get("refused.busy") == 2  # the first task, and the hop's first ask
    finally:
        client.close()
        echo.server.close()
        other.server.close()


def test_payload_frames_are_counted_and_sized_before_the_handler_runs(zctx):
    echo = Echo(zctx)
    sock = zctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo.endpoint)
    try:

        def ask(frames):
            sock.send_multipart(frames)
            assert sock.poll(5000)
            return [f for f in sock.recv_multipart()]

        from dpwa.wire.schema import decode

        header = encode(BLOB, 1, **{"from": "a"})
        assert decode(ask([header, b"x" * 50])[0])["n"] == 50
        for frames, reason in (
            ([header], "bad_frames"),
            ([header, b"x", b"y"], "bad_frames"),
            ([header, b"x" * 101], "too_large"),
        ):
            reply = decode(ask(frames)[0])
            assert reply.kind == "error" and reply["reason"] == reason
    finally:
        sock.close(0)
        echo.server.close()


def test_the_rate_limited_log_remembers_a_bounded_number_of_keys(caplog):
    log = RateLimitedLog(logging.getLogger("dpwa.test"), interval_s=60, max_keys=8)
    caplog.set_level(logging.WARNING, logger="dpwa.test")
    for i in range(10_000):  # an attacker choosing a new key for every message
        log(30, ("auth", f"key{i}"), "refused %s", i)
    assert len(log._last) == 8
    assert len(caplog.records) == 10_000  # every new key is logged once: nothing is merged wrongly
    log(30, ("auth", "key9999"), "refused %s", 9999)
    assert len(caplog.records) == 10_000  # a recent key is still rate-limited


def test_a_server_closes_in_bounded_time_while_clients_hammer_it(zctx):
    echo = Echo(zctx)
    stop = threading.Event()
    counters = Counters()

    def hammer():
        client = ClientThread(zctx, {"e": echo.endpoint}, name="h", max_reply_bytes=4096).start()
        try:
            while not stop.is_set():
                call = client.submit(PingTask("e", time.monotonic() + 0.5, 1))
                call.wait(2)
                counters.add(call.outcome)
        finally:
            client.close()

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    assert wait_until(lambda: counters.get("ok") > 20, 20)
    t0 = time.monotonic()
    assert echo.server.close(5.0)
    assert time.monotonic() - t0 < 5.0
    stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()


class FirstPing(PingTask):
    """A PingTask that can say its first request, so a DirectClient sends it at start()."""

    def first_request(self, rid):
        return [encode(PING, rid, **{"from": self.name}, n=self.n)], {PONG.name: PONG}


def test_a_direct_client_sends_at_start_and_takes_the_reply_on_the_callers_thread(zctx):
    """No thread is started; a reply that arrived in time is taken even when the caller comes
    for it after the deadline; the call's outcome is what a ClientThread would give."""
    echo = Echo(zctx)
    before = set(threading.enumerate())
    direct = DirectClient(zctx, {"e": echo.endpoint}, name="d", max_reply_bytes=4096)
    try:
        call = direct.start(FirstPing("e", time.monotonic() + 0.3, 7))
        assert wait_until(lambda: echo.seen == [7], 5)  # it went out at start(), nobody waiting yet
        assert wait_until(lambda: time.monotonic() > call.task.deadline, 5)
        assert call.wait(None) and call.outcome == "ok" and call.take() == 7  # late, but it had come in time
        assert set(threading.enumerate()) == before
    finally:
        direct.close()
        echo.server.close()


def test_a_direct_call_times_out_at_its_deadline_and_an_abandoned_one_frees_its_socket(zctx):
    echo = Echo(zctx)
    silent = zctx.socket(zmq.ROUTER)  # accepts, never answers
    silent_port = free_port()
    silent.bind(f"tcp://127.0.0.1:{silent_port}")
    direct = DirectClient(
        zctx, {"e": echo.endpoint, "s": f"tcp://127.0.0.1:{silent_port}"}, name="d", max_reply_bytes=4096
    )
    try:
        t0 = time.monotonic()
        slow = direct.start(FirstPing("s", t0 + 0.3, 1))
        slow.wait(None)
        assert slow.outcome == "timeout" and 0.3 <= time.monotonic() - t0 < 3
        again = direct.start(FirstPing("s", time.monotonic() + 0.1, 2))  # a fresh socket: it can send
        again.wait(None)
        assert again.outcome == "timeout"
        never = direct.start(FirstPing("e", time.monotonic() + 5, 3))  # its reply is never taken ...
        echo.refuse = True
        refused = direct.start(FirstPing("e", time.monotonic() + 5, 4))  # ... so this one replaces the socket
        assert never.done.is_set() and never.outcome == "cancelled"
        assert refused.wait(None) and refused.outcome == "refused" and refused.refusal == "busy"
        unknown = direct.start(FirstPing("nobody", time.monotonic() + 5, 5))
        assert unknown.done.is_set() and unknown.outcome == "failed"
        assert 4 in echo.seen and set(echo.seen) <= {3, 4}  # 3 may have died with its socket, unsent
    finally:
        direct.close()
        silent.close(0)
        echo.server.close()


def test_channels_to_peers_the_book_dropped_are_closed_at_the_next_request(zctx):
    """Issue 41: members removed from the view kept their sockets (two waves of 1,020 fake members left a
    node with 1,014 to 1,022 sockets, and 'Too many open files'). A client's channels follow its PeerBook:
    after 200 peers were asked and then dropped, the next request closes their channels, and the process's
    descriptors come back to where they were; a peer that moved gets a fresh channel; a kept one stays."""
    import os

    from dpwa.wire.client import PeerBook

    echo = Echo(zctx)
    silent_port = free_port()  # nobody listens: each fake member's socket keeps trying to connect
    book = PeerBook({"e": echo.endpoint})
    direct = DirectClient(zctx, book, name="d", max_reply_bytes=4096)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    try:
        assert direct.start(FirstPing("e", time.monotonic() + 5, 1)).wait(None)
        before = fds()
        fakes = [f"fake{i}" for i in range(200)]
        for name in fakes:
            book.put(name, f"tcp://127.0.0.1:{silent_port}")
            direct.start(FirstPing(name, time.monotonic() + 30, 2))  # sent (queued: nobody listens), never waited for
        assert len(direct._channels) == 201 and fds() > before + 100  # a socket (and descriptors) each
        generation = book.generation
        for name in fakes:
            book.drop(name)
        assert book.generation != generation
        assert direct.start(FirstPing("e", time.monotonic() + 5, 3)).wait(None)  # the next request sweeps
        assert len(direct._channels) == 1 and list(direct._waiting) == []  # their calls let go, too
        assert wait_until(lambda: fds() <= before + 2, 5), (fds(), before)
        channel = direct._channels.get("e")
        book.put("e", echo.endpoint)  # the same endpoint: kept
        assert direct.start(FirstPing("e", time.monotonic() + 5, 4)).wait(None)
        assert direct._channels.get("e") is channel
    finally:
        direct.close()
        echo.server.close()


def test_a_late_reply_is_dropped_and_a_reply_to_a_request_never_sent_is_bad_id(zctx):
    """The channel outlives a request it let go (timed out, or cancelled): that request's reply, when it
    comes, is read and dropped (counted late, and the peer is heard), never taken for the next request's;
    the connection stays. A reply whose id no request of this channel had is still bad_id."""
    from dpwa.wire.channel import Channel
    from dpwa.wire.errors import ProtocolError, RequestCancelled, RequestTimeout

    port = free_port()
    server = zctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(f"tcp://127.0.0.1:{port}")
    heard: list[int] = []
    channel = Channel(zctx, f"tcp://127.0.0.1:{port}", name="t", heard=lambda: heard.append(1))

    def ping(request_id: int, n: int) -> list[bytes]:
        return [encode(PING, request_id, **{"from": "a"}, n=n)]

    def answer(n: int, request_id: int | None = None) -> None:
        assert server.poll(5000)
        routing, _, header = server.recv_multipart()[:3]
        rid = decode(header).id if request_id is None else request_id
        server.send_multipart([routing, b"", encode(PONG, rid, n=n)])

    accept = {PONG.name: PONG}
    channel.send(ping(9, 9), 9, time.monotonic() + 5)  # a first exchange: the socket has heard its peer, so a
    answer(9)  # timeout keeps it (one that never heard anything is replaced, as the Lazy Pirate does)
    assert channel.receive(9, time.monotonic() + 5, accept=accept).header["n"] == 9
    with pytest.raises(RequestTimeout):  # nobody answers in time
        channel.request(ping(1, 1), 1, time.monotonic() + 0.2, accept=accept)
    channel.send(ping(2, 2), 2, time.monotonic() + 5)
    with pytest.raises(RequestCancelled):
        channel.receive(2, time.monotonic() + 5, accept=accept, cancelled=lambda: True)
    answer(1)  # the timed-out request's reply, late
    answer(2)  # the cancelled one's, late
    channel.send(ping(3, 3), 3, time.monotonic() + 5)
    answer(3)
    assert channel.receive(3, time.monotonic() + 5, accept=accept).header["n"] == 3
    assert channel.late == 2 and len(heard) == 4
    channel.send(ping(4, 4), 4, time.monotonic() + 5)
    answer(4, request_id=99)  # an id this channel never sent
    with pytest.raises(ProtocolError, match="bad_id"):
        channel.receive(4, time.monotonic() + 5, accept=accept)
    channel.close()
    server.close()
