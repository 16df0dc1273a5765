"""Relays with sockets (dpwa.wire.relay), over 127.0.0.1: a RelayServer, RelayClients and a member's own server
(an echo server of the test's), with strangers and raw members speaking the protocol by hand.

Checked: bytes arrive intact both ways through concurrent streams; each bound the module states (streams_max,
rate_bytes_s, PIPE_BUFFER, PENDING_MAX, HELLO_TIMEOUT_S, PAIR_TIMEOUT_S, SILENT_S) holds against a peer trying to
break it; strangers, garbage and unknown tokens are closed without disturbing a member; registrations are refused
for a taken name, a full range, `admit`'s reason or a wrong proof; a member gets its port back from a restarted
relay; a member that leaves is dropped; close() stops every thread. The protocol's pure rules: test_relaying.py.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq
from zmq.utils import z85

from conftest import free_port, port_is_free, wait_until
from dpwa.cluster.processes import port_range
from dpwa.stats import Counters
from dpwa.wire.relay import (
    HELLO_TIMEOUT_S,
    PAIR_TIMEOUT_S,
    PENDING_MAX,
    PIPE_BUFFER,
    Admit,
    Local,
    RelayAddress,
    RelayClient,
    RelayServer,
)
from dpwa.wire.relaying import MAX_MESSAGE, SILENT_S, TOKEN_BYTES, Hello, Reader, encode, proof_holds
from helpers.ports import fresh_listener, remember

pytestmark = pytest.mark.io

IO_TIMEOUT_S = 10.0  # what any one socket operation of the test may take before it fails


# --------------------------------------------------------------------------- ports


def ports_in_a_row(count: int, avoid: int) -> range:
    """`count` consecutive ports, each free a moment ago (within $DPWA_PORTS where it is set), not `avoid`."""
    _, hi = port_range() or (0, 65535)
    for _ in range(100):
        first = free_port()
        block = range(first, first + count)
        if block[-1] <= hi and avoid not in block and all(port_is_free(p) for p in block[1:]):
            for p in block[1:]:
                remember(p)
            return block
    raise OSError(f"no {count} free ports in a row")


# --------------------------------------------------------------------------- the member's own server


class Echo:
    """A member's own server, on a thread of the test's: echoes every byte on every connection, or (with
    `read=False`) accepts connections and never reads them."""

    def __init__(self, read: bool = True, rcvbuf: int = 0) -> None:
        self.read = read
        self.listener = fresh_listener()
        if rcvbuf:  # inherited by the connections it accepts (and turns off autotuning there)
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, None)
        pending: dict[socket.socket, bytearray] = {}
        try:
            while not self._stop.is_set():
                for key, mask in selector.select(0.05):
                    if key.data is None:
                        try:
                            conn, _ = self.listener.accept()
                        except BlockingIOError:
                            continue
                        conn.setblocking(False)
                        self.accepted += 1
                        pending[conn] = bytearray()
                        if self.read:
                            selector.register(conn, selectors.EVENT_READ, "conn")
                        continue
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    out = pending[sock]
                    try:
                        if mask & selectors.EVENT_READ:
                            data = sock.recv(1 << 16)
                            if not data:
                                raise ConnectionResetError
                            out += data
                        if out:
                            del out[: sock.send(out)]
                    except BlockingIOError:
                        pass
                    except OSError:
                        selector.unregister(sock)
                        sock.close()
                        del pending[sock]
                        continue
                    room = selectors.EVENT_READ if len(out) < 1 << 20 else 0  # never both 0: a full buffer waits to go
                    selector.modify(sock, room | (selectors.EVENT_WRITE if out else 0), "conn")
        finally:
            for sock in pending:
                sock.close()
            self.listener.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(IO_TIMEOUT_S)
        assert not self._thread.is_alive(), "the echo server did not stop"


# --------------------------------------------------------------------------- the test's sockets


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)


def move(flows: list[tuple[socket.socket, socket.socket, bytes]], timeout_s: float = IO_TIMEOUT_S) -> list[bytes]:
    """Send each flow's payload on its first socket and read as many bytes on its second (the same socket, for an
    echo), all at once; what each flow read. The sockets are left non-blocking. Fails on EOF or at the deadline."""
    selector = selectors.DefaultSelector()
    sends: dict[socket.socket, int] = {src: i for i, (src, _, _) in enumerate(flows)}
    reads: dict[socket.socket, int] = {dst: i for i, (_, dst, _) in enumerate(flows)}
    sent = [0] * len(flows)
    got = [bytearray() for _ in flows]
    try:
        for sock in {*sends, *reads}:
            sock.setblocking(False)
            selector.register(sock, (selectors.EVENT_READ if sock in reads else 0) | selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout_s
        while any(len(g) < len(f[2]) for g, f in zip(got, flows, strict=True)):
            left = deadline - time.monotonic()
            assert left > 0, f"moved {[len(g) for g in got]} of {[len(f[2]) for f in flows]} bytes in {timeout_s} s"
            for key, mask in selector.select(min(left, 0.5)):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                sock = ready
                i = sends.get(sock)
                if i is not None and mask & selectors.EVENT_WRITE and sent[i] < len(flows[i][2]):
                    try:
                        sent[i] += sock.send(flows[i][2][sent[i] : sent[i] + (1 << 18)])
                    except BlockingIOError:
                        pass
                j = reads.get(sock)
                if j is not None and mask & selectors.EVENT_READ:
                    try:
                        data = sock.recv(1 << 18)
                    except BlockingIOError:
                        data = None
                    if data is not None:
                        assert data, f"stream {j} closed after {len(got[j])} of {len(flows[j][2])} bytes"
                        got[j] += data
                if key.events & selectors.EVENT_WRITE and (i is None or sent[i] == len(flows[i][2])):
                    if sock in reads:
                        selector.modify(sock, selectors.EVENT_READ)
                    else:
                        selector.unregister(sock)
        return [bytes(g) for g in got]
    finally:
        selector.close()


def exchange(pairs: list[tuple[socket.socket, bytes]], timeout_s: float = IO_TIMEOUT_S) -> list[bytes]:
    """Send each payload on its socket and read as many bytes back (through an echo), all at once."""
    return move([(sock, sock, data) for sock, data in pairs], timeout_s)


def echoes(socks: list[socket.socket], size: int = 1000, seed: int = 0) -> None:
    """Each socket's bytes come back intact (each its own payload)."""
    payloads = [payload(size, seed + i) for i in range(len(socks))]
    assert exchange(list(zip(socks, payloads, strict=True))) == payloads


def payload(size: int, seed: int) -> bytes:
    block = bytes((seed * 31 + i * 7) % 251 for i in range(4096)) + seed.to_bytes(4, "big")
    return (block * (size // len(block) + 1))[:size]


def framed(msg: dict[str, Any]) -> bytes:
    """A message as encode frames it, but with any fields (encode's own checks bypassed)."""
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("!I", len(body)) + body


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(IO_TIMEOUT_S)
    out = b""
    while len(out) < n:
        data = sock.recv(n - len(out))
        assert data, f"closed after {out!r}"
        out += data
    return out


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True once the other end closed `sock` (EOF or reset) within `timeout_s`, reading and dropping what comes."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return False


def refuses_connections(port: int) -> bool:
    """True if nothing accepts on `port` now: refused, or closed at once by whoever accepted."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=1.0)
    except OSError:
        return True
    with sock:
        return closed_by_peer(sock, 1.0)


class Raw:
    """The relay protocol spoken by hand, over a blocking socket to the relay's port."""

    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        self.reader = Reader()
        self.challenge = self.read()
        assert self.challenge["t"] == "challenge"

    def read(self) -> dict[str, Any]:
        """The next message (what follows it stays in the reader)."""
        data = b""  # first, a message already read
        while True:
            for msg in self.reader.feed(data):
                return msg
            data = self.sock.recv(4096)
            if not data:
                raise ConnectionResetError("closed by the relay")

    def read_skipping_pings(self) -> dict[str, Any]:
        while True:
            msg = self.read()
            if msg["t"] != "ping":
                return msg


class RawMember(Raw):
    """A member registered by hand: it picks up a peer's connection only when asked (pick_up), never pings."""

    def __init__(self, port: int, name: str, want: int = 0) -> None:
        super().__init__(port)
        self.relay_port = port
        self.sock.sendall(encode("hello", name=name, want=want))
        self.answer = self.read()
        assert self.answer["t"] == "ok", self.answer
        self.port: int = self.answer["port"]

    def pick_up(self, data_socks: list[socket.socket]) -> bytes:
        """The next peer's connection the relay holds, spliced to a data connection (returned through
        `data_socks`); its token."""
        opened = self.read_skipping_pings()
        assert opened["t"] == "open", opened
        data = Raw(self.relay_port)
        data_socks.append(data.sock)
        data.sock.sendall(encode("data", token=opened["token"]))
        return bytes(opened["token"])


# --------------------------------------------------------------------------- what a test starts, all closed after it


class Made:
    """Relays, clients, echo servers and sockets a test starts; closed after it, each bounded."""

    def __init__(self) -> None:
        self.servers: list[RelayServer] = []
        self.clients: list[RelayClient] = []
        self.echos: list[Echo] = []
        self.socks: list[socket.socket] = []
        self._names = iter(range(1_000_000))

    def relay(
        self, count: int = 4, port: int = 0, ports: range | None = None, **kwargs: Any
    ) -> tuple[RelayServer, range]:
        port = port or free_port()
        ports = ports if ports is not None else ports_in_a_row(count, avoid=port)
        server = RelayServer("127.0.0.1", port, ports, name=f"t{next(self._names)}", counters=Counters(), **kwargs)
        self.servers.append(server)
        return server.start(), ports

    def echo(self, **kwargs: Any) -> Echo:
        self.echos.append(Echo(**kwargs))
        return self.echos[-1]

    def client(self, relay: RelayServer, name: str, local: Echo | None = None, **kwargs: Any) -> RelayClient:
        address = kwargs.pop("address", RelayAddress("127.0.0.1", relay.port))
        local = local or self.echo()
        client = RelayClient(name, [address], Local("127.0.0.1", local.port), counters=Counters(), **kwargs)
        self.clients.append(client)
        return client.start()

    def member(
        self, relay: RelayServer, name: str, local: Echo | None = None, **kwargs: Any
    ) -> tuple[RelayClient, int]:
        """A client registered: it and its port."""
        client = self.client(relay, name, local, **kwargs)
        granted = client.wait_granted(IO_TIMEOUT_S)
        assert granted is not None, client.refusals
        return client, granted[1]

    def peer(self, port: int) -> socket.socket:
        self.socks.append(connect(port))
        return self.socks[-1]

    def raw(self, port: int) -> Raw:
        raw = Raw(port)
        self.socks.append(raw.sock)
        return raw

    def raw_member(self, port: int, name: str, want: int = 0) -> RawMember:
        member = RawMember(port, name, want)
        self.socks.append(member.sock)
        return member

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        try:
            for client in self.clients:
                assert client.close(IO_TIMEOUT_S), f"{client.name}'s relay client did not stop"
            for server in self.servers:
                assert server.close(IO_TIMEOUT_S), f"the relay {server.name} did not stop"
        finally:
            for echo in self.echos:
                echo.close()


def relay_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(("-relay", "-relayed"))]


@pytest.fixture
def made() -> Iterator[Made]:
    before = set(relay_threads())
    things = Made()
    try:
        yield things
    finally:
        things.close()
    left = [t for t in relay_threads() if t not in before and t.is_alive()]
    assert not left, f"threads left behind: {left}"


def counted(counters: Counters, key: str, n: int = 1, timeout_s: float = IO_TIMEOUT_S) -> bool:
    return wait_until(lambda: counters.get(key) >= n, timeout_s)


def refused_for(client: RelayClient, why: str) -> Callable[[], bool]:
    return lambda: any(why in refusal for refusal in client.refusals)


def gauge(counters: Counters, key: str) -> Callable[[], Any]:
    return lambda: counters.snapshot().get(key)


# --------------------------------------------------------------------------- bytes through the relay


def test_megabytes_come_back_intact_both_ways_through_concurrent_streams(made):
    relay, ports = made.relay()
    client, port = made.member(relay, "m1")
    assert port in ports and client.granted == ("127.0.0.1", port)
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 1, IO_TIMEOUT_S)
    socks = [made.peer(port) for _ in range(4)]
    payloads = [payload(3 << 20, seed) for seed in range(len(socks))]  # 3 MB each way, each stream its own
    assert exchange(list(zip(socks, payloads, strict=True)), timeout_s=30) == payloads
    assert relay.counters.get("relay.streams_opened") == 4 and client.counters.get("relay.streams_opened") == 4
    for sock in socks:
        sock.close()
    assert wait_until(lambda: gauge(relay.counters, "relay.streams")() == 0, IO_TIMEOUT_S)
    assert counted(relay.counters, "relay.bytes", 2 * sum(map(len, payloads)))  # counted as each stream closes
    assert wait_until(lambda: gauge(client.counters, "relay.streams")() == 0, IO_TIMEOUT_S)


def test_two_members_are_relayed_apart_each_to_its_own_server(made):
    relay, _ = made.relay()
    ones, twos = made.echo(), made.echo()
    _, port1 = made.member(relay, "m1", ones)
    _, port2 = made.member(relay, "m2", twos)
    assert port1 != port2
    echoes([made.peer(port1), made.peer(port2), made.peer(port1)])
    assert (ones.accepted, twos.accepted) == (2, 1)


# --------------------------------------------------------------------------- bounds


def test_streams_max_closes_a_third_stream_at_once_and_the_first_two_go_on(made):
    relay, _ = made.relay(streams_max=2)
    _, port = made.member(relay, "m1")
    first, second = made.peer(port), made.peer(port)
    echoes([first, second])  # both spliced: two streams
    third = made.peer(port)
    assert closed_by_peer(third, IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.streams") == 1
    echoes([first, second], size=200_000, seed=5)  # untouched
    first.close()  # one stream ends: its place is free again
    assert wait_until(lambda: gauge(relay.counters, "relay.streams")() == 1, IO_TIMEOUT_S)
    fourth = made.peer(port)
    echoes([fourth, second], seed=9)
    assert relay.counters.get("relay.refused.streams") == 1


def test_a_member_that_reregisters_keeps_its_streams_and_still_gets_no_more_than_streams_max(made):
    relay, ports = made.relay(count=1, streams_max=2)
    member = made.raw_member(relay.port, "m1")
    data: list[socket.socket] = []
    peers = []
    for _ in range(2):
        peers.append(made.peer(member.port))
        member.pick_up(data)
    made.socks.extend(data)
    for peer, mine in zip(peers, data, strict=True):
        peer.sendall(b"hello")
        assert recv_exactly(mine, 5) == b"hello"
    assert wait_until(lambda: gauge(relay.counters, "relay.streams")() == 2, IO_TIMEOUT_S)

    member.sock.close()  # its control connection ends; its two streams go on
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 0, IO_TIMEOUT_S)
    again = made.raw_member(relay.port, "m1", want=member.port)
    assert again.port == member.port
    peers[0].sendall(b"still")
    assert recv_exactly(data[0], 5) == b"still"

    late = made.peer(member.port)  # a third stream of m1 while two are live: over streams_max
    assert closed_by_peer(late, IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.streams") == 1
    assert gauge(relay.counters, "relay.streams")() == 2

    for sock in (*peers, *data):  # both old streams end: two new ones fit, a third does not
        sock.close()
    assert wait_until(lambda: gauge(relay.counters, "relay.streams")() == 0, IO_TIMEOUT_S)
    fresh: list[socket.socket] = []
    for _ in range(2):
        made.peer(member.port)
        again.pick_up(fresh)
    made.socks.extend(fresh)
    assert closed_by_peer(made.peer(member.port), IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.streams") == 2


def test_a_members_streams_together_move_no_faster_than_rate_bytes_s(made):
    rate = 4e6
    relay, _ = made.relay(rate_bytes_s=rate)
    _, port = made.member(relay, "m1")
    socks = [made.peer(port), made.peer(port)]
    payloads = [payload(1 << 20, seed) for seed in range(2)]
    start = time.monotonic()
    assert exchange(list(zip(socks, payloads, strict=True)), timeout_s=30) == payloads
    elapsed = time.monotonic() - start
    moved = 2 * sum(map(len, payloads))  # each byte through the relay twice: to the member and back
    assert elapsed >= 0.7 * moved / rate, f"{moved} bytes in {elapsed:.2f} s: over {rate:.0f} bytes/s"


def test_a_member_that_reregisters_shares_its_rate_between_its_old_streams_and_new_ones(made):
    rate = 2e6
    relay, _ = made.relay(count=1, rate_bytes_s=rate)
    member = made.raw_member(relay.port, "m1")
    data: list[socket.socket] = []
    peers = [made.peer(member.port)]
    member.pick_up(data)
    peers[0].sendall(b"x")
    assert recv_exactly(data[0], 1) == b"x"  # spliced
    member.sock.close()  # its control connection ends; its stream goes on
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 0, IO_TIMEOUT_S)
    again = made.raw_member(relay.port, "m1", want=member.port)
    peers.append(made.peer(again.port))
    again.pick_up(data)
    made.socks.extend(data)
    payloads = [payload(1 << 20, seed) for seed in range(2)]
    start = time.monotonic()
    assert move([(p, d, b) for p, d, b in zip(peers, data, payloads, strict=True)], timeout_s=30) == payloads
    elapsed = time.monotonic() - start
    moved = sum(map(len, payloads))
    assert elapsed >= 0.7 * moved / rate, f"{moved} bytes in {elapsed:.2f} s: over {rate:.0f} bytes/s"


def test_a_stream_nobody_reads_holds_at_most_pipe_buffer_in_the_relay(made):
    stalled = made.echo(read=False, rcvbuf=64 << 10)
    relay, _ = made.relay()
    _, port = made.member(relay, "m1", stalled)
    peer = made.peer(port)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    peer.setblocking(False)
    chunk = bytes(1 << 20)
    cap = 512 << 20  # if the relay buffered without bound, all of it would go
    pushed = 0
    with selectors.DefaultSelector() as selector:
        selector.register(peer, selectors.EVENT_WRITE)
        while pushed < cap and selector.select(0.5):  # on until 0.5 s without room
            try:
                pushed += peer.send(chunk)
            except BlockingIOError:
                pass
    assert pushed < cap, "the relay took every byte of a stream nobody reads"
    pipes = relay._pipes
    assert len(pipes) == 1
    assert all(len(buf) <= PIPE_BUFFER for pipe, _ in pipes for buf in pipe.out)
    assert wait_until(lambda: stalled.accepted == 1, IO_TIMEOUT_S)


# --------------------------------------------------------------------------- strangers


def test_a_silent_stranger_is_closed_after_hello_timeout_s_and_a_member_goes_on_meanwhile(made):
    relay, _ = made.relay()
    _, port = made.member(relay, "m1")
    start = time.monotonic()
    stranger = made.raw(relay.port)  # reads the challenge, then says nothing
    half = made.peer(relay.port)
    half.sendall(b"\x00\x00")  # half a length, then nothing
    echoes([made.peer(port)], size=100_000)
    assert relay.counters.get("relay.refused.silent") == 0
    assert closed_by_peer(stranger.sock, HELLO_TIMEOUT_S + IO_TIMEOUT_S)
    assert time.monotonic() - start >= 0.9 * HELLO_TIMEOUT_S
    assert closed_by_peer(half, IO_TIMEOUT_S)
    assert counted(relay.counters, "relay.refused.silent", 2)
    echoes([made.peer(port)], size=100_000, seed=3)


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"\xff\xff\xff\xff", "too_large"),
        (struct.pack("!I", MAX_MESSAGE + 1), "too_large"),  # closed before any body
        (struct.pack("!I", 3) + b"\xc1\xc1\xc1", "malformed"),
        (struct.pack("!I", 1) + b"\x93", "malformed"),  # a list of three, cut short
        (encode("ping"), "bad_kind"),  # a kind that does not open a connection
        (encode("ok", port=1), "bad_kind"),
        (framed({"t": "evil"}), "bad_kind"),
        (framed({"t": "hello", "name": "w/1", "want": 0}), "bad_field"),
        (framed({"t": "data", "token": bytes(TOKEN_BYTES - 1)}), "bad_field"),
        (framed({"t": "hello", "name": "w1", "want": 0, "admin": True}), "bad_field"),
    ],
    ids=[
        "ones",
        "over-max",
        "malformed",
        "cut-short",
        "ping",
        "ok",
        "unknown-kind",
        "bad-name",
        "short-token",
        "extra",
    ],
)
def test_a_stranger_that_sends_garbage_is_closed_at_once_and_a_member_goes_on(made, wire, reason):
    relay, _ = made.relay()
    _, port = made.member(relay, "m1")
    stream = made.peer(port)
    echoes([stream])
    stranger = made.raw(relay.port)
    stranger.sock.sendall(wire)
    assert closed_by_peer(stranger.sock, 0.75 * HELLO_TIMEOUT_S), "not closed before the hello timeout"
    assert counted(relay.counters, f"relay.refused.{reason}")
    assert relay.counters.get("relay.refused.silent") == 0
    echoes([stream, made.peer(port)], size=100_000, seed=2)


def test_a_data_connection_with_an_unknown_or_used_token_is_closed(made):
    relay, _ = made.relay()
    member = made.raw_member(relay.port, "m1")
    stranger = made.raw(relay.port)
    stranger.sock.sendall(encode("data", token=os.urandom(TOKEN_BYTES)))
    assert closed_by_peer(stranger.sock, IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.token") == 1

    peer = made.peer(member.port)
    data: list[socket.socket] = []
    token = member.pick_up(data)
    made.socks.extend(data)
    peer.sendall(b"once")
    assert recv_exactly(data[0], 4) == b"once"
    replay = made.raw(relay.port)  # the same token again: it served once
    replay.sock.sendall(encode("data", token=token))
    assert closed_by_peer(replay.sock, IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.token") == 2
    peer.sendall(b"twice")
    assert recv_exactly(data[0], 5) == b"twice"  # the stream it opened is untouched


def test_pending_max_strangers_push_out_the_oldest_and_a_member_still_registers(made):
    relay, _ = made.relay()
    strangers = [made.raw(relay.port) for _ in range(PENDING_MAX)]  # each accepted (its challenge read), in order
    assert relay.counters.get("relay.refused.pending") == 0
    made.raw(relay.port)
    assert closed_by_peer(strangers[0].sock, IO_TIMEOUT_S)  # the oldest
    assert counted(relay.counters, "relay.refused.pending", 1)
    _, port = made.member(relay, "m1")  # pushes out one more, and registers
    assert closed_by_peer(strangers[1].sock, IO_TIMEOUT_S)
    assert counted(relay.counters, "relay.refused.pending", 2)
    assert relay.counters.get("relay.refused.pending") == 2
    echoes([made.peer(port)])
    strangers[-1].sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        strangers[-1].sock.recv(1)  # the newest stranger still waits its turn


def test_a_peer_nobody_picks_up_is_closed_after_pair_timeout_s_and_a_silent_member_after_silent_s(made):
    relay, _ = made.relay()
    _, good_port = made.member(relay, "good")
    quiet = made.raw_member(relay.port, "quiet")  # never pings, never picks up
    registered = time.monotonic()
    peer = made.peer(quiet.port)
    assert quiet.read_skipping_pings()["t"] == "open"
    assert closed_by_peer(peer, PAIR_TIMEOUT_S + IO_TIMEOUT_S)
    assert time.monotonic() - registered >= 0.9 * PAIR_TIMEOUT_S
    assert counted(relay.counters, "relay.refused.unclaimed", 1)
    assert gauge(relay.counters, "relay.members")() == 2
    assert closed_by_peer(quiet.sock, SILENT_S + IO_TIMEOUT_S)  # the relay hangs up on it
    assert time.monotonic() - registered >= 0.9 * SILENT_S
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 1, IO_TIMEOUT_S)
    assert wait_until(lambda: refuses_connections(quiet.port), IO_TIMEOUT_S)
    echoes([made.peer(good_port)])  # the member that pings stays, past SILENT_S


# --------------------------------------------------------------------------- registration


def test_a_name_already_registered_is_refused(made):
    relay, _ = made.relay()
    made.member(relay, "m1")
    twin = made.client(relay, "m1")
    assert twin.wait_granted(0.5) is None
    assert wait_until(refused_for(twin, "registered"), IO_TIMEOUT_S), twin.refusals
    assert relay.counters.get("relay.refused.registered") >= 1
    assert twin.granted is None and gauge(relay.counters, "relay.members")() == 1


def test_a_full_range_refuses_the_next_member(made):
    relay, _ = made.relay(count=1)
    made.member(relay, "m1")
    late = made.client(relay, "m2")
    assert late.wait_granted(0.5) is None
    assert wait_until(refused_for(late, "full"), IO_TIMEOUT_S), late.refusals
    assert relay.counters.get("relay.refused.full") >= 1


def test_admit_refuses_with_its_reason_and_sees_the_hello_and_challenge(made):
    seen: list[tuple[Hello, bytes]] = []

    def admit(hello: Hello, challenge: bytes) -> str | None:
        seen.append((hello, challenge))
        return None if hello.name == "friend" else "not on the list"

    relay, _ = made.relay(admit=admit)
    stranger = made.client(relay, "stranger")
    assert stranger.wait_granted(0.5) is None
    assert wait_until(refused_for(stranger, "not on the list"), IO_TIMEOUT_S)
    assert relay.counters.get("relay.refused.not_on_the_list") >= 1
    made.member(relay, "friend")
    hello, challenge = seen[-1]
    assert hello.name == "friend" and hello.want == 0 and hello.key is None and len(challenge) == 16


def keyed_admit(relay_secret: bytes) -> Admit:
    def admit(hello: Hello, challenge: bytes) -> str | None:
        if hello.key is None:
            return "no key"
        if not proof_holds(relay_secret, z85.decode(hello.key), challenge, hello.name, hello.proof):
            return "no proof"
        return None

    return admit


def raw_keypair() -> tuple[bytes, bytes, str]:
    public, secret = zmq.curve_keypair()
    return z85.decode(secret), z85.decode(public), public.decode()


def test_a_member_registers_with_a_proof_of_its_key_and_a_wrong_secret_is_refused(made):
    relay_secret, relay_public, _ = raw_keypair()
    member_secret, _, member_key = raw_keypair()
    other_secret, _, _ = raw_keypair()
    relay, _ = made.relay(admit=keyed_admit(relay_secret))
    address = RelayAddress("127.0.0.1", relay.port, relay_public)

    _, port = made.member(relay, "m1", secret=(member_secret, member_key, "cert"), address=address)
    echoes([made.peer(port)])

    impostor = made.client(relay, "m2", secret=(other_secret, member_key, "cert"), address=address)
    keyless = made.client(relay, "m3")
    unknown_relay_key = made.client(relay, "m4", secret=(member_secret, member_key, "cert"))
    for client, why in ((impostor, "no proof"), (keyless, "no key"), (unknown_relay_key, "public_key")):
        assert client.wait_granted(0.2) is None
        assert wait_until(refused_for(client, why), IO_TIMEOUT_S), client.refusals
    assert gauge(relay.counters, "relay.members")() == 1


# --------------------------------------------------------------------------- lifetimes


def test_a_member_gets_its_port_back_from_a_restarted_relay(made):
    relay, ports = made.relay(count=3)
    other, low = made.member(relay, "other")
    client, port = made.member(relay, "m1")
    assert (low, port) == (ports[0], ports[1])
    assert other.close(IO_TIMEOUT_S)  # ports[0] is free: a member that lost its port would get it
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 1, IO_TIMEOUT_S)
    assert relay.close(IO_TIMEOUT_S)

    again, _ = made.relay(port=relay.port, ports=ports)
    assert counted(client.counters, "relay.registered", 2, timeout_s=IO_TIMEOUT_S)
    assert client.granted == ("127.0.0.1", port)
    assert client.counters.get("relay.moved") == 0
    assert wait_until(lambda: gauge(again.counters, "relay.members")() == 1, IO_TIMEOUT_S)
    echoes([made.peer(port)])


def test_a_member_that_leaves_is_dropped_and_its_port_closes(made):
    relay, _ = made.relay()
    client, port = made.member(relay, "m1")
    echoes([made.peer(port)])
    assert client.close(IO_TIMEOUT_S)
    assert wait_until(lambda: gauge(relay.counters, "relay.members")() == 0, SILENT_S + 2)
    assert wait_until(lambda: refuses_connections(port), SILENT_S + 2)
    assert not [t for t in relay_threads() if t.name == "m1-relayed"]


def test_close_stops_both_threads_and_ends_their_streams(made):
    relay, _ = made.relay()
    client, port = made.member(relay, "m1")
    stream = made.peer(port)
    echoes([stream])
    start = time.monotonic()
    assert relay.close(IO_TIMEOUT_S) and client.close(IO_TIMEOUT_S)
    assert time.monotonic() - start < IO_TIMEOUT_S
    assert closed_by_peer(stream, IO_TIMEOUT_S)
    assert not [t for t in relay_threads() if t.name in (f"{relay.name}-relay", "m1-relayed")]
    assert refuses_connections(relay.port) and refuses_connections(port)


def test_a_client_whose_relay_is_gone_keeps_trying_and_closes_at_once(made):
    relay, _ = made.relay()
    assert relay.close(IO_TIMEOUT_S)
    client = made.client(relay, "m1")
    assert client.wait_granted(0.5) is None
    assert wait_until(refused_for(client, "cannot connect"), IO_TIMEOUT_S), client.refusals
    start = time.monotonic()
    assert client.close(IO_TIMEOUT_S)
    assert time.monotonic() - start < IO_TIMEOUT_S
