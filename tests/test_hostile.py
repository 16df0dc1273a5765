"""Hostile clients and peers. Each test names the promise it tries to break.

The attacks are made for real: clients that ask for 8 MB snapshots and never
read them are raw ZMTP connections (helpers/raw_zmtp.py) with a tiny receive
buffer, since a libzmq socket always drains its connection; multipart floods
are raw frames with the MORE flag that never end. Memory is measured as the
node's resident set (VmRSS), in this process or in the child that runs it.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import stat
import time

import msgpack
import numpy as np
import pytest
import zmq

from conftest import ORIGINAL, filled, make_config, secure_config, serving_only, step_until_averaged, wait_until
from dpwa import NumpyParams
from dpwa.gossip.services import MAX_SNAPSHOT_SLOTS, UNSENT_PER_CLIENT
from dpwa.gossip.transfer.protocol import ACK, CONFIRM, EXCHANGE, FETCH, PARAMS
from dpwa.wire.schema import PROTOCOL_VERSION, decode, encode
from helpers.raw_peer import FakePeer
from helpers.raw_zmtp import RawZmtp, ZmtpError, frames_blob, greeting

SIZE = 1000
BIG = 2_000_000  # elements: 8 MB snapshots
MB = 1 << 20
NOBODY = 65534


def endpoint_of(node) -> str:
    return node.config.endpoint(node.spec)


def raw_address(node):
    """Where a raw socket connects: the ipc socket's path, or 127.0.0.1 and the TCP port."""
    endpoint = endpoint_of(node)
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    return ("127.0.0.1", node.spec.port)


def req_socket(ctx, endpoint, **options):
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    for key, value in options.items():
        sock.setsockopt(key, value)
    sock.connect(endpoint)
    return sock


def fetch_header(node, request_id=77, sender="w1", **overrides) -> bytes:
    fields = {"from": sender, "fp": node.params.fingerprint, "dtype": "float32"}
    fields.update(overrides)
    return encode(FETCH, request_id, **fields)


def ask(sock, frames, timeout_ms=5000):
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "the node did not answer"
    return sock.recv_multipart()


def good_fetch_works(ctx, node) -> bool:
    """A plain fetch is answered with the node's exact current parameters."""
    sock = req_socket(ctx, endpoint_of(node))
    try:
        reply = ask(sock, [fetch_header(node)])
        header = decode(reply[0])
        return header.kind == "params" and reply[1] == node.params.array.tobytes()
    finally:
        sock.close(0)


def rss_bytes(pid="self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --------------------------------------------------------------------------- malformed requests


def special_frames(node):
    params = encode(
        PARAMS, 1, **{"from": "w1"}, fp=b"0" * 16, dtype="float32", nbytes=10**12, clock=0, loss=None, version=1
    )
    exchange = encode(
        EXCHANGE,
        1,
        **{"from": "w1"},
        fp=node.params.fingerprint,
        dtype="float32",
        nbytes=node.nbytes,
        clock=0,
        loss=None,
    )
    return {
        "PARAMS": [params],
        "EXCHANGE": [exchange, node.params.array.tobytes()],
        "BAD_FP": [fetch_header(node, fp=b"\x00" * 16)],
        "BAD_DTYPE": [fetch_header(node, dtype="float16")],
        "NOT_A_NODE": [fetch_header(node, sender="intruder")],
        "EXTRA_FRAME": [fetch_header(node), b"x"],
    }


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([b"garbage"], "bad_header"),
        ([b"\x93\x01\x02"], "bad_header"),  # a msgpack array, not a map
        ([msgpack.packb({"v": PROTOCOL_VERSION, "kind": "fetch"})], "bad_header"),  # id and fields missing
        ([msgpack.packb({"v": 99, "kind": "fetch", "id": 1})], "bad_version"),
        ([msgpack.packb({"v": PROTOCOL_VERSION, "kind": "exec", "id": 1})], "bad_kind"),
        (["PARAMS"], "unexpected_kind"),  # a reply kind sent as a request
        (["EXCHANGE"], "unexpected_kind"),  # a symmetric-mode request to a pull node
        (["BAD_FP"], "bad_fingerprint"),
        (["BAD_DTYPE"], "bad_dtype"),
        (["NOT_A_NODE"], "bad_identity"),  # without CURVE, "from" must name a node of the config
        (["EXTRA_FRAME"], "bad_frames"),
        ([b"\xdb\xff\xff\xff\xff"], "bad_header"),  # claims a 4 GB string
    ],
)
def test_bad_requests_get_their_reason_and_change_nothing(nodes, zctx, make_cluster, frames, reason):
    """Break: malformed requests over each transport. Promise: each is answered with an error of
    exactly its reason, counted once under that reason, no parameters go out, nothing changes,
    and a good fetch right after is served the exact parameters."""
    cfg = make_cluster(2, **ORIGINAL)
    mine = filled(5, SIZE)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    special = special_frames(node)
    frames = special[frames[0]] if isinstance(frames[0], str) else frames
    sock = req_socket(zctx, endpoint_of(node))
    reply = ask(sock, frames)
    sock.close(0)
    header = decode(reply[0])
    assert header.kind == "error" and header["reason"] == reason, header
    assert len(reply) == 1  # no parameters were sent
    assert np.all(mine == 5)
    stats = node.stats()
    assert stats[f"rejected.{reason}"] == 1 and stats["requests_rejected"] == 1 and stats["requests_served"] == 0
    assert good_fetch_works(zctx, node)


def test_raw_garbage_half_greetings_and_silent_connections_stall_nobody(nodes, zctx, make_cluster):
    """Break: 20 raw connections that send random bytes, half a ZMTP greeting, or nothing, and stay
    open. Promise: the node still serves real peers at once, its training thread is never held
    up, and nothing changes."""
    cfg = make_cluster(2)
    mine = filled(3, SIZE)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    rng = np.random.default_rng(0)
    raw = []
    try:
        for i in range(20):
            conn = RawZmtp(raw_address(node), rcvbuf=None)
            raw.append(conn)
            if i % 3 == 0:
                conn.send_raw(rng.bytes(int(rng.integers(1, 4096))))  # random bytes
            elif i % 3 == 1:
                conn.send_raw(greeting()[:11])  # half a greeting, then silence
            # else: connect and say nothing at all
        for _ in range(3):
            assert good_fetch_works(zctx, node)
        for _ in range(5):
            node.update_send()
            node.update_wait()
    finally:
        for conn in raw:
            conn.close()
    assert np.all(mine == 3) and node.alive
    assert node.stats()["requests_served"] == 3


def test_a_dealer_without_the_req_envelope_is_rejected(nodes, zctx):
    """Break: a DEALER that sends a fetch without the empty delimiter. Promise: counted as
    bad_envelope (there is no envelope to answer to), and the node serves on."""
    cfg = make_config(2)
    node = nodes(serving_only(cfg), "w0", NumpyParams(filled(1, SIZE)))
    node.update_send()
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint_of(node))
    dealer.send_multipart([fetch_header(node)])
    assert wait_until(lambda: node.stats().get("rejected.bad_envelope", 0) == 1, 5)
    dealer.close(0)
    assert good_fetch_works(zctx, node)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_frame_over_the_size_limit_is_refused_before_it_is_read(nodes, zctx, transport):
    """Break: after a proper handshake, a frame that announces 1 GiB (then a few bytes). Promise:
    the node drops the connection as soon as it reads the size (ZMQ_MAXMSGSIZE), without waiting
    for or allocating the frame; nothing reaches a handler; the node serves on."""
    cfg = make_config(2, **({"insecure": True} if transport == "tcp" else {}))
    node = nodes(serving_only(cfg), "w0", NumpyParams(filled(1, SIZE)))
    node.update_send()
    before = rss_bytes()
    with RawZmtp(raw_address(node), rcvbuf=None) as conn:
        conn.handshake()
        conn.send_raw(b"\x01\x00")  # the REQ delimiter (an empty frame with MORE)
        conn.send_raw(bytes([0x02]) + (1 << 30).to_bytes(8, "big") + b"\x00" * 100)  # 1 GiB announced, 100 B sent
        closed = False
        try:
            for _ in range(100):  # bounded: heartbeats (PING commands) may come before the close
                conn.read_frame()
        except (ZmtpError, ConnectionResetError):
            closed = True
        except TimeoutError:
            pass
        assert closed, "the node kept a connection that announced a 1 GiB frame"
    assert rss_bytes() - before < 64 * MB
    stats = node.stats()
    assert stats["requests_served"] == 0 and stats["requests_rejected"] == 0
    assert good_fetch_works(zctx, node)


# --------------------------------------------------------------------------- clients that never read


class Attack:
    """Raw REQ clients that fetch 8 MB snapshots and never read a byte of the replies."""

    def __init__(self, node) -> None:
        self.node = node
        self.clients: list[RawZmtp] = []
        self.requests = 0

    def counted(self) -> int:
        stats = self.node.stats()
        return stats["requests_served"] + stats["requests_refused"] + stats["requests_rejected"]

    def open(self) -> RawZmtp:
        conn = RawZmtp(raw_address(self.node), rcvbuf=4096)  # the kernel may round it up; still tiny
        self.clients.append(conn)
        conn.handshake()
        return conn

    def ask(self, clients=None) -> None:
        """Each client (every one by default) sends one more fetch; returns once the node has handled them."""
        clients = self.clients if clients is None else clients
        start = self.counted()
        for conn in clients:
            self.requests += 1
            conn.send_request(fetch_header(self.node, request_id=self.requests, sender=f"w{2 + self.requests % 3}"))
        assert wait_until(lambda: self.counted() >= start + len(clients), 10)

    def close(self) -> None:
        for conn in self.clients:
            conn.close()


# Five nodes. The attackers claim to be w2, w3 and w4 (without CURVE "from" must name a node), and the
# unsent-reply budget is per sender: UNSENT_PER_CLIENT each, so the attackers can pin 3 x 3 = 9
# replies between them, more than the snapshot slots can hold, so slots must be retired, and never
# w1's budget (the honest peer). timeout_ms 300: a slot held only by unsent replies is retired after
# hold_limit_s = 1.3 s.
ATTACK_PEERS = 4
ATTACK_NAMES = 3  # w2, w3, w4
BUDGET = UNSENT_PER_CLIENT * ATTACK_NAMES
ATTACKERS = BUDGET // UNSENT_PER_CLIENT + 2  # two more than the budget can serve


def attack_cluster(transport: str) -> dict:
    """The attackers fetch, and so does the honest peer: the 2017 rule (a node of the default mode serves
    fetches the same way, but its peers exchange instead)."""
    extra = {"insecure": True, "same_host": "off"} if transport == "tcp" else {}
    return make_config(ATTACK_PEERS + 1, **ORIGINAL, timeout_ms=300, **extra)


def start_attack(node, mine) -> Attack:
    """Publish snapshots (the k-th all equal to k); a new attacker every UNSENT_PER_CLIENT steps,
    and each attacker fetches once per step and never reads: the budget is spent at once."""
    attack = Attack(node)
    for k in range(1, ATTACKERS * UNSENT_PER_CLIENT + 1):
        mine.fill(k)
        node.update_send()
        node.update_wait()
        if k % UNSENT_PER_CLIENT == 1 % UNSENT_PER_CLIENT:
            attack.open()
        attack.ask()
    return attack


def pin_distinct_snapshots(node, mine, attack: Attack, rss_peak: list) -> int:
    """The patient attacker: after every publish that went through (a new snapshot), one more
    fetch never read, until the whole budget pins BUDGET distinct snapshots. Publishes that find
    every slot held are skipped until a held slot is retired (hold_limit_s). Returns the last k."""
    k, pinned = 0, 0

    def step() -> bool:
        nonlocal k, pinned
        k += 1
        mine.fill(k)
        skipped = node.stats()["publish_skipped"]
        node.update_send()
        node.update_wait()
        rss_peak[0] = max(rss_peak[0], rss_bytes())
        if node.stats()["publish_skipped"] != skipped:
            return False  # every slot is held and none for long enough yet: the current snapshot is an old one
        attack.ask([attack.clients[pinned // UNSENT_PER_CLIENT]])
        pinned += 1
        assert node.stats()["requests_served"] == pinned  # within the budget: served, and never read
        return pinned == BUDGET

    assert wait_until(step, 60, interval_s=0.001), f"could not pin {BUDGET} snapshots: {node.stats()}"
    return k


@pytest.fixture
def patient_heartbeats(monkeypatch):
    """The node's heartbeats drop a client that answers none within 3 s, and a client that never reads
    answers none: a defence of its own. With two snapshot slots, pinning the whole budget takes about seven
    retirements of 1.3 s, so the attackers' connections are kept here (heartbeats every 10 s, 30 s to
    answer) for the budget and the retirement to be what is tested."""
    import dpwa.wire.server as server

    base = server.base_options
    monkeypatch.setattr(server, "base_options", lambda sock, heartbeat_ms: base(sock, 10_000))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_clients_that_never_read_pin_bounded_memory_and_publishing_goes_on(nodes, transport, patient_heartbeats):
    """Break: raw clients (TCP, or AF_UNIX on the default ipc transport) ask for 8 MB snapshots and
    never read, one fetch after every publish, so that the whole unsent-reply budget pins distinct
    snapshots; then two more clients ask. Promises: at most UNSENT_PER_CLIENT (3) unsent replies
    per sender name, so BUDGET (3 x 3 names = 9) for the attackers in all, later requests refused busy at once;
    slots held by unsent replies are retired after hold_limit_s, so publishing goes on
    (publish_skipped stops growing); only pinned slots are ever retired (at most BUDGET, and at
    least BUDGET - MAX_SNAPSHOT_SLOTS, since at most that many stay pinned, the current one included);
    snapshot slots stay <= MAX_SNAPSHOT_SLOTS; the node's memory grows by at most (MAX_SNAPSHOT_SLOTS
    slots + 9 retired) * 8 MB + 48 MB; and once the clients are gone an honest peer gets the latest
    snapshot."""
    cfg = attack_cluster(transport)
    mine = filled(0, BIG)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    node.update_wait()
    baseline = rss_bytes()
    peak = [baseline]
    attack = Attack(node)
    try:
        for _ in range(BUDGET // UNSENT_PER_CLIENT):
            attack.open()
        k = pin_distinct_snapshots(node, mine, attack, peak)
        extra = [attack.open(), attack.open()]
        for conn in attack.clients:  # one more each: every client is at its share, or the total is spent
            attack.ask([conn])
        attack.ask(extra)
        stats = node.stats()
        assert stats["requests_served"] == BUDGET, stats
        assert stats["refused.busy"] == attack.requests - BUDGET, stats
        # Publishing goes on: run steps until 10 in a row publish, then 30 more must all publish.
        quiet, last = [0], [stats["publish_skipped"]]

        def settled() -> bool:
            nonlocal k
            k += 1
            mine.fill(k)
            node.update_send()
            node.update_wait()
            peak[0] = max(peak[0], rss_bytes())
            skipped = node.stats()["publish_skipped"]
            quiet[0] = quiet[0] + 1 if skipped == last[0] else 0
            last[0] = skipped
            return quiet[0] >= 10

        assert wait_until(settled, 30, interval_s=0.001), f"publishing never recovered: {node.stats()}"
        for _ in range(30):
            k += 1
            mine.fill(k)
            node.update_send()
            node.update_wait()
            peak[0] = max(peak[0], rss_bytes())
        stats = node.stats()
        assert stats["publish_skipped"] == last[0], "publishing stopped again"
        assert BUDGET - MAX_SNAPSHOT_SLOTS <= stats["slots_retired"] <= BUDGET, stats
        assert stats["snapshot_slots"] <= MAX_SNAPSHOT_SLOTS
        growth = peak[0] - baseline
        assert growth < (MAX_SNAPSHOT_SLOTS + BUDGET) * BIG * 4 + 48 * MB, growth / MB
        assert node.alive
        print(
            f"\nnever-read clients ({transport}): {BUDGET} replies pinned, {stats['slots_retired']} slots retired, "
            f"{stats['publish_skipped']} publishes skipped, {stats['refused.busy']} refused busy, "
            f"RSS growth {growth / MB:.0f} MB (bound {(MAX_SNAPSHOT_SLOTS + BUDGET) * BIG * 4 / MB + 48:.0f} MB)"
        )
    finally:
        attack.close()
    # The clients are gone: their replies are dropped, the budget is free, and an honest peer
    # gets the latest snapshot (every element k): 0 + (k - 0) / 2.
    honest_cfg = {**cfg, "nodes": cfg["nodes"][:2], "fetch_probability": 1}
    theirs = filled(0, BIG)
    honest = nodes(honest_cfg, "w1", NumpyParams(theirs))
    assert step_until_averaged(honest, 30, peer="w0") is not None
    assert np.all(theirs == k / 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_clients_that_never_read_do_not_starve_an_honest_peer(nodes, transport):
    """Break: the same clients as above stay connected. Promise: an honest peer keeps receiving
    FRESH snapshots: in each of 3 rounds the publisher publishes a new value and the honest peer
    averages with exactly that value within 6 s (hold_limit_s is 1.3 s)."""
    cfg = attack_cluster(transport)
    mine = filled(0, BIG)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    node.update_wait()
    theirs = filled(0, BIG)
    honest = nodes({**cfg, "nodes": cfg["nodes"][:2], "fetch_probability": 1}, "w1", NumpyParams(theirs))
    attack = start_attack(node, mine)
    try:
        for value in (1000.0, 2000.0, 3000.0):
            mine.fill(value)
            theirs.fill(0)

            def fresh(value=value) -> bool:
                node.update_send()  # the publisher keeps training (and publishing the same value)
                node.update_wait()
                theirs.fill(0)
                honest.update_send()
                update = honest.update_wait()  # a stale snapshot (every slot pinned) may come first
                return update.averaged and bool(np.all(theirs == value / 2))

            assert wait_until(fresh, 6, interval_s=0.005), f"no fresh snapshot: {honest.stats()}"
    finally:
        attack.close()


# --------------------------------------------------------------------------- who can connect at all


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a child as another user")
def test_another_user_cannot_connect_to_the_ipc_endpoint(nodes):
    """Break: a process of another user (nobody) connects to a default node's ipc socket.
    Promise: it gets EACCES (the socket lives in this user's 0700 directory), so it cannot
    send a single byte, let alone an unending message. The owner can connect (a control)."""
    cfg = make_config(2)
    node = nodes(serving_only(cfg), "w0", NumpyParams(filled(1, SIZE)))
    node.update_send()
    path = raw_address(node)
    assert isinstance(path, str) and stat.S_ISSOCK(os.stat(path).st_mode)
    directory = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700 and os.stat(directory).st_uid == os.getuid()
    with RawZmtp(path, rcvbuf=None) as owner:  # the control: the path is right, and the owner gets in
        owner.handshake()

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit (this process has threads)
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                code = 0
            except OSError as exc:
                code = exc.errno if exc.errno is not None else 98  # an OSError without an errno: a failure
        except BaseException:
            code = 98
        finally:
            os.write(write_end, bytes([code]))
            os._exit(0)
    os.close(write_end)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)  # a bounded wait for the child to exit
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child did not exit")
        answer = os.read(read_end, 1)
    finally:
        os.close(read_end)
    assert answer and answer[0] in (errno.EACCES, errno.EPERM), (
        f"another user's connect gave {answer!r} (0 = connected)"
    )
    assert node.stats()["requests_served"] == 0 and node.alive


def child_stats(child) -> dict:
    child.send(cmd="steps", n=0)
    return child.expect("steps_done")["stats"]


@pytest.mark.timeout(120)
def test_without_keys_a_multipart_flood_never_gets_past_the_handshake(children, tmp_path):
    """Break: a CURVE node that takes 8 MB frames from its peers (mode symmetric). Raw TCP
    clients without its keys (one announcing NULL, one announcing CURVE and sending junk
    instead of HELLO) each try to stream 200 MB of 1 MB frames with the MORE flag, a message
    that never ends. Promise: the handshake fails, the node cuts the connection within a few
    MB, nothing reaches a handler, and the node's memory grows by less than 16 MB."""
    cfg = secure_config(tmp_path, 2, mode="symmetric", same_host="off")
    child = children(cfg, "w0", size=BIG, fetch=False)
    pid = child.expect("ready", 60)["pid"]
    address = ("127.0.0.1", cfg["nodes"][0]["port"])
    blob = frames_blob(MB, 16)
    before = rss_bytes(pid)
    accepted = []
    for mechanism in (b"NULL", b"CURVE"):
        with RawZmtp(address, rcvbuf=None) as conn:
            conn.send_raw(greeting(mechanism))
            accepted.append(conn.stream(blob, 200 * MB))
    assert all(n < 32 * MB for n in accepted), accepted
    assert wait_until(lambda: child_stats(child).get("handshakes_failed", 0) >= 2, 10)
    stats = child_stats(child)
    assert stats["requests_served"] == stats["requests_rejected"] == stats["requests_refused"] == 0
    assert rss_bytes(pid) - before < 16 * MB, (rss_bytes(pid) - before) / MB


@pytest.mark.timeout(120)
def test_with_insecure_tcp_an_unending_message_is_buffered(children, tmp_path):
    """Documents the limitation docs/design.md and docs/security.md state for ``insecure: true``
    only: a client that completes the plain (NULL) handshake and streams frames with the MORE
    flag, each under ZMQ_MAXMSGSIZE, makes libzmq buffer the whole unfinished message before
    dpwa sees any of it. 100 MB streamed grows the node by at least 50 MB, and nothing reaches a handler. (The
    two tests above show that without keys, or as another user, nobody gets that far.)"""
    cfg = make_config(2, insecure=True, same_host="off")
    child = children(cfg, "w0", size=SIZE, fetch=False)
    pid = child.expect("ready", 60)["pid"]
    before = rss_bytes(pid)
    with RawZmtp(("127.0.0.1", cfg["nodes"][0]["port"]), rcvbuf=None) as conn:
        conn.handshake()
        conn.send_raw(b"\x01\x00")  # the REQ delimiter, then 4000-byte frames (a fetch route takes 4 KB)
        sent = conn.stream(frames_blob(4000, 256), 100 * MB)
        assert sent >= 100 * MB, "the node cut the connection"
        assert wait_until(lambda: rss_bytes(pid) - before >= 50 * MB, 20), (rss_bytes(pid) - before) / MB
        stats = child_stats(child)
    assert stats["requests_served"] == stats["requests_rejected"] == stats["requests_refused"] == 0


# --------------------------------------------------------------------------- values a peer sends


def test_max_peer_distance_refuses_far_peers_and_applies_near_ones(nodes):
    """Break: with max_peer_distance 0.5, a node at 2 pulls from a far peer (10: distance 4)
    and a near one (2.5: distance 0.25). Promise: the far peer's snapshot is rejected too_far
    and never applied; the near one is blended exactly (2 + (2.5 - 2) / 2 = 2.25)."""
    cfg = make_config(3, **ORIGINAL, max_peer_distance=0.5, timeout_ms=2000)
    nodes(serving_only(cfg), "w1", NumpyParams(filled(10))).update_send()
    nodes(serving_only(cfg), "w2", NumpyParams(filled(2.5))).update_send()
    mine = filled(2)
    node = nodes(cfg, "w0", NumpyParams(mine), rng=random.Random(3))
    seen = {"w1": 0, "w2": 0}
    for _ in range(200):  # bounded: the peers are drawn at random
        node.update_send()
        update = node.update_wait()
        if update.peer == "w1":
            assert update.outcome == "rejected" and update.reason.startswith("too_far:"), update
            assert not update.averaged
        else:
            assert update.outcome == "ok" and update.averaged, update
        seen[update.peer] += 1
        # Only the near peer ever moves us: halfway to 2.5 each time (exact in float32).
        assert np.all(mine == 2.5 - 0.5 / 2 ** seen["w2"]), (seen, mine[0])
        if seen["w1"] and seen["w2"]:
            break
    assert seen["w1"] >= 1 and seen["w2"] >= 1, seen
    assert node.stats()["fetches_rejected"] == seen["w1"]
    assert node.stats()["averaged"] == seen["w2"]


def test_max_peer_distance_in_symmetric_exchanges_is_both_or_neither(nodes):
    """Break: symmetric exchanges across max_peer_distance 0.5, checked by the server (on the
    requester's snapshot) and by the requester (on the server's). Promise: a far snapshot is
    refused (server: the requester sees too_far) or rejected (requester: no confirm, the
    server's half expires) and neither side moves; a near exchange moves both to 2.25."""
    strict = make_config(2, mode="symmetric", rule="delta", max_peer_distance=0.5, timeout_ms=300)
    strict["nodes"] = strict["nodes"][::-1]  # w1 first: with two nodes the first starts every exchange
    lax = {**strict, "max_peer_distance": 0}
    # 1. The server checks: w0 (strict, at 2) is asked by a far w1 (10), then a near one (2.5).
    server_values = filled(2)
    server = nodes(serving_only(strict), "w0", NumpyParams(server_values))
    server.update_send()
    far = filled(10)
    requester = nodes(lax, "w1", NumpyParams(far))
    requester.update_send()
    update = requester.update_wait()
    assert update.outcome == "refused" and update.reason.startswith("too_far:"), update
    server.update_wait()
    assert np.all(far == 10) and np.all(server_values == 2)
    assert server.stats()["rejected.too_far"] == 1 and server.stats().get("mirrored", 0) == 0
    requester.close()
    near = filled(2.5)
    requester = nodes(lax, "w1", NumpyParams(near))
    server.update_send()
    assert step_until_averaged(requester, 30) is not None
    server.update_wait()
    assert np.all(near == 2.25) and np.all(server_values == 2.25)
    requester.close()
    server.close()
    # 2. The requester checks: w1 (strict, at 2) asks a far w0 (10, lax): no confirm is sent.
    far_server_values = filled(10)
    far_server = nodes(serving_only(lax), "w0", NumpyParams(far_server_values))
    far_server.update_send()
    mine = filled(2)
    strict_requester = nodes(strict, "w1", NumpyParams(mine))
    strict_requester.update_send()
    update = strict_requester.update_wait()
    assert update.outcome == "rejected" and update.reason.startswith("too_far:"), update

    def expired() -> bool:
        far_server.update_wait()
        return far_server.stats()["exchanges_pending"] == 0

    assert wait_until(expired, 10)
    assert far_server.stats().get("exchanges_decided.commit", 0) == 0
    assert np.all(mine == 2) and np.all(far_server_values == 10)


# --------------------------------------------------------------------------- exchange ids


def exchange_request(node_fp, nbytes, sender, values, request_id=1, rule=None):
    """An exchange request as a peer sends it; `rule`: the node's rule fingerprint (without it: bad_rule)."""
    fields = {"fp": node_fp, "dtype": "float32", "nbytes": nbytes, "clock": 0.0, "loss": None}
    if rule is not None:
        fields["rule"] = rule
    return [encode(EXCHANGE, request_id, **{"from": sender}, **fields), values.tobytes()]


def confirm_request(sender, xid, request_id=2):
    return [encode(CONFIRM, request_id, **{"from": sender}, xid=xid)]


def ack_request(sender, xid, request_id=3):
    return [encode(ACK, request_id, **{"from": sender}, xid=xid)]


@pytest.mark.timeout(120)
def test_foreign_unknown_and_repeated_exchange_ids_leak_nothing(nodes, zctx):
    """Break: clients confirm an xid they were not given, confirm another sender's xid, repeat
    confirms, let exchanges expire and confirm them late, and leave 20 exchanges unconfirmed.
    Promises: a foreign or unknown xid gets "unknown" and changes nothing; the owner's confirm
    commits once and every repeat gets the same answer (applied once: 0 -> 2 exactly); an
    expired one is "abort" every time; one exchange is pending at a time, and it expires;
    no snapshot slot leaks (slots <= 6, no publish skipped) and a fresh snapshot then reaches
    an honest peer (values known in advance)."""
    cfg = make_config(4, mode="symmetric", rule="delta", timeout_ms=300)
    mine = filled(0, SIZE)
    node = nodes(serving_only(cfg), "w0", NumpyParams(mine))
    node.update_send()
    fp, nbytes, rule = node.params.fingerprint, node.nbytes, node.model.rule

    def call(frames):
        # One connection per request: a burst of replies on one connection can be dropped by the
        # node although the client reads each (see test_fuzz); that is not what this test is about.
        sock = req_socket(zctx, endpoint_of(node))
        try:
            return decode(ask(sock, frames)[0])
        finally:
            sock.close(0)

    # An exchange from w1 (its snapshot: 4 everywhere): the server picks the id.
    reply = call(exchange_request(fp, nbytes, "w1", filled(4, SIZE), rule=rule))
    assert reply.kind == "params" and reply["f"] == 0.5
    x1 = reply["xid"]
    assert call(confirm_request("w2", x1))["outcome"] == "unknown"  # someone else's xid
    assert call(confirm_request("w1", x1 ^ 1 or 1))["outcome"] == "unknown"  # one never given
    assert call(confirm_request("w2", x1))["outcome"] == "unknown"  # still not w2's
    for _ in range(5):  # the owner: commit, then the same answer again and again
        decision = call(confirm_request("w1", x1))
        assert decision["xid"] == x1 and decision["outcome"] == "commit"
    node.update_wait()
    node.update_wait()
    assert np.all(mine == 2.0)  # 0 + (4 - 0) / 2, applied once
    assert node.stats()["mirrored"] == 1

    # An exchange left to expire (ttl = timeout + 1 s), confirmed late: abort, every time.
    node.update_send()  # a fresh snapshot: each serves one exchange
    reply = call(exchange_request(fp, nbytes, "w1", filled(8, SIZE), rule=rule))
    x2 = reply["xid"]
    assert x2 != x1
    assert call(confirm_request("w2", x2))["outcome"] == "unknown"

    def expired() -> bool:
        node.update_wait()
        return node.stats()["exchanges_pending"] == 0

    assert wait_until(expired, 10)
    for _ in range(3):
        assert call(confirm_request("w1", x2))["outcome"] == "abort"
    assert call(confirm_request("w2", x2))["outcome"] == "unknown"
    assert np.all(mine == 2.0) and node.stats()["mirrored"] == 1

    # Twenty exchanges nobody confirms (their senders' rivals try to): the first holds the node's one
    # unsettled exchange (dpwa.mixing.admission) until it expires; every other is refused busy.
    given: set[int] = set()
    busy = 0
    for i in range(20):
        node.update_send()
        reply = call(exchange_request(fp, nbytes, ("w1", "w2")[i % 2], filled(i, SIZE), rule=rule))
        if reply.kind == "error":
            assert reply["reason"] == "busy"
            busy += 1
            continue
        assert reply["xid"] not in given | {x1, x2}
        given.add(reply["xid"])
        assert call(confirm_request(("w2", "w1")[i % 2], reply["xid"]))["outcome"] == "unknown"
        assert node.stats()["exchanges_pending"] <= 1
    # the first holds it; a later one gets it only by preempting one older than half the deadline (0.15 s)
    assert len(given) + busy == 20 and len(given) == 1 + node.stats().get("exchanges_preempted", 0)
    assert wait_until(expired, 10)
    stats = node.stats()
    assert stats["snapshot_slots"] <= MAX_SNAPSHOT_SLOTS and stats["publish_skipped"] == 0
    assert stats["exchanges_expired"] + stats.get("exchanges_preempted", 0) == 1 + len(given)
    assert np.all(mine == 2.0) and stats["mirrored"] == 1

    # No lease leaked: publishing goes on for many steps, and a fresh snapshot reaches an honest
    # peer. w0 trains to 3; w3 (at 6) exchanges with it: both meet at 4.5.
    for _ in range(20):
        node.update_send()
        node.update_wait()
    assert node.stats()["publish_skipped"] == 0
    mine.fill(3.0)
    node.update_send()
    theirs = filled(6, SIZE)
    honest = nodes(  # w3 first: with two nodes the first starts every exchange (pairing auto: a hypercube)
        {**cfg, "nodes": [cfg["nodes"][3], cfg["nodes"][0]], "fetch_probability": 1}, "w3", NumpyParams(theirs)
    )
    assert step_until_averaged(honest, 30, peer="w0") is not None
    node.update_wait()
    assert np.all(theirs == 4.5) and np.all(mine == 4.5)
    # w1 says it holds its commit, as a closing requester does: a raw client serves no ``known``, and the
    # node's close would otherwise wait its whole deadline (5 s) for word from it
    assert call(ack_request("w1", x1))["outcome"] == "commit"


# --------------------------------------------------------------------------- a peer that garbles decisions


def test_a_peer_that_answers_every_confirm_is_not_treated_as_gone(nodes, zctx):
    """Break: a fake w1 answers two exchanges, each with a valid reply and then a malformed
    decision (so each is left in doubt), and answers the node's resolving confirms (abort).
    Promise: nothing is applied, both doubts are resolved, and since w1 answered every request
    the next step asks it again (flow control backs off only from peers that do not answer)."""
    cfg = make_config(2, mode="symmetric", insecure=True, same_host="off", timeout_ms=5000)
    mine = filled(2)
    node = nodes(cfg, "w0", NumpyParams(mine))
    fp = node.params.fingerprint
    first_confirm = set()

    def respond(request):
        if request.kind == "exchange":
            xid = random.randrange(1, 2**63)
            fields = {
                "from": "w1",
                "fp": fp,
                "dtype": "float32",
                "nbytes": SIZE * 4,
                "clock": 0.0,
                "loss": None,
                "version": 1,
                "xid": xid,
                "f": 0.5,
                "rule": node.model.rule,
            }
            return [encode(PARAMS, request.id, **fields), filled(4).tobytes()]
        xid = request.header["xid"]
        if xid not in first_confirm:
            first_confirm.add(xid)
            return [b"\x00not a decision"]
        return [encode("decision", request.id, xid=xid, outcome="abort")]

    fake = FakePeer(zctx, node.config.endpoint(node.config.node("w1")), respond)
    try:
        for _ in range(2):
            assert node.update_send()
            assert node.update_wait().outcome == "in_doubt"

            def resolved() -> bool:
                node.update_wait()
                return node.stats()["exchanges_unsettled"] == 0

            assert wait_until(resolved, 10)
        assert np.all(mine == 2) and node.stats()["exchanges_aborted"] == 2
        assert not fake.errors, fake.errors[0]
        assert node.update_send(), "w1 answered every request, yet the node does not ask it"
        node.update_wait()
    finally:
        fake.close()


# --------------------------------------------------------------------------- replies from a hostile peer


def test_bad_replies_from_a_peer_are_rejected_and_never_applied(nodes, zctx):
    """Break: a fake w1 answers each fetch with one malformed reply, then a good one. Promise:
    each bad one is rejected with its reason and never applied; the good one is blended."""
    cfg = make_config(2, **ORIGINAL, timeout_ms=1000, insecure=True, same_host="off")
    mine = filled(2)
    node = nodes(cfg, "w0", NumpyParams(mine))
    fp = node.params.fingerprint
    good_payload = filled(9).tobytes()

    def params(request_id, **overrides):
        fields = {
            "from": "w1",
            "fp": fp,
            "dtype": "float32",
            "nbytes": SIZE * 4,
            "clock": 1.0,
            "loss": None,
            "version": 1,
            "rule": node.model.rule,
        }
        fields.update(overrides)
        return msgpack.packb({"v": PROTOCOL_VERSION, "kind": "params", "id": request_id, **fields}, use_bin_type=True)

    replies = [
        ("bad_header", lambda r: [b"\x00garbage"]),
        ("bad_size", lambda r: [params(r.id), good_payload[:-4]]),
        ("bad_size", lambda r: [params(r.id, nbytes=10**12), good_payload]),
        ("bad_fingerprint", lambda r: [params(r.id, fp=b"\x01" * 16), good_payload]),
        ("bad_dtype", lambda r: [params(r.id, dtype="float16"), good_payload]),
        ("bad_reply", lambda r: [params(r.id)]),  # the payload frame is missing
        ("bad_reply", lambda r: [params(r.id), good_payload, good_payload]),  # one frame too many
        ("bad_id", lambda r: [params((r.id + 1) % 2**64), good_payload]),
        ("unexpected_kind", lambda r: [fetch_header(node, request_id=r.id)]),
        ("not_finite", lambda r: [params(r.id), np.full(SIZE, np.inf, np.float32).tobytes()]),
        ("bad_header", lambda r: [params(r.id, clock=-1.0), good_payload]),
        (None, lambda r: [params(r.id), good_payload]),  # finally, a good one
    ]
    queue = [make for _, make in replies]
    fake = FakePeer(zctx, node.config.endpoint(node.config.node("w1")), lambda r: queue.pop(0)(r))
    try:
        for reason, _ in replies[:-1]:
            node.update_send()
            update = node.update_wait()
            assert update.outcome == "rejected" and update.reason.startswith(f"{reason}:"), (reason, update)
            assert not update.averaged and np.all(mine == 2)
        assert node.stats()["fetches_rejected"] == len(replies) - 1
        node.update_send()
        update = node.update_wait()
        assert update.averaged, update
        assert np.all(mine == 5.5)
        assert not fake.errors, fake.errors[0]
    finally:
        fake.close()
