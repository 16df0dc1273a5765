"""Linger: a node that finished training keeps serving peers that still train, and stops once
nobody is served any more (refusals and rejections do not keep it up)."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import zmq

from conftest import filled, make_config
from dpwa import NumpyParams, parse_config
from dpwa.gossip.reporting import STATUS
from dpwa.gossip.transfer.protocol import ACK, FETCH, KNOWN
from dpwa.wire.schema import decode, encode


class Lingering:
    """node.linger() on its own thread, as train.py runs it after its last epoch."""

    def __init__(self, node, idle_s, limit_s):
        self.spent = None
        self.thread = threading.Thread(target=self._run, args=(node, idle_s, limit_s))
        self.thread.start()

    def _run(self, node, idle_s, limit_s):
        self.spent = node.linger(idle_s, limit_s)

    def join(self, timeout_s):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive()
        return self.spent


def test_a_lingering_symmetric_node_keeps_exchanging_and_applies_its_halves(nodes):
    """w1 has finished and lingers; w0 trains 20 more steps (of about 5 ms). Each exchange w1
    serves is applied at once and a fresh snapshot published, so w0's requests do not hear
    "busy" (without that, every exchange after the first would), and the sum of the two
    models moves only by w0's own steps. Once w0 stops, w1 stops lingering after its idle
    time, long before its limit."""
    cfg = make_config(2, mode="symmetric", rule="delta", timeout_ms=2000)
    theirs, mine = filled(10), filled(0)
    peer = nodes(cfg, "w1", NumpyParams(theirs))
    node = nodes(cfg, "w0", NumpyParams(mine))
    peer.update_send()
    peer.update_wait()  # a snapshot to serve, then training is over for w1
    lingering = Lingering(peer, idle_s=1.0, limit_s=60.0)
    assert peer.state in ("lingering", "training")
    outcomes = []
    for _ in range(20):
        node.update_send()
        mine += 0.5  # w0's training step ...
        time.sleep(0.005)  # ... and its duration (not a synchronization: nothing waits for it)
        outcomes.append(node.update_wait().outcome)
    stopped_training = time.monotonic()
    spent = lingering.join(30)
    assert time.monotonic() - stopped_training < 10 and spent < 30  # idle_s after the last exchange, not limit_s
    assert outcomes.count("ok") >= 15, outcomes  # a loaded machine may delay a republish now and then
    assert peer.stats()["mirrored"] == node.stats()["averaged"] == outcomes.count("ok")
    assert np.allclose(mine + theirs, 10 + 20 * 0.5)  # the sum moved by w0's steps only
    assert peer.state == "training"


def test_a_node_whose_last_snapshot_served_an_exchange_publishes_a_fresh_one_to_linger(nodes):
    """w1's last snapshot already served (and settled) an exchange when it starts lingering:
    one snapshot serves one exchange, so without a fresh one every request from w0 would
    hear "busy". The lingering node republishes once the spent snapshot is settled."""
    cfg = make_config(2, mode="symmetric", rule="delta", timeout_ms=2000)
    theirs, mine = filled(10), filled(0)
    peer = nodes(cfg, "w1", NumpyParams(theirs))
    node = nodes(cfg, "w0", NumpyParams(mine))
    peer.update_send()  # w1's last step: its snapshot ...
    node.update_send()
    assert node.update_wait().outcome == "ok"  # ... serves w0's exchange, committed when w0 hears of it
    peer.update_wait()  # w1 applies its half: the snapshot is spent and settled
    assert peer.stats()["mirrored"] == 1
    lingering = Lingering(peer, idle_s=1.0, limit_s=60.0)
    outcomes = []
    for _ in range(20):
        node.update_send()
        mine += 0.5
        time.sleep(0.005)  # w0's training step (not a synchronization)
        outcomes.append(node.update_wait().outcome)
    lingering.join(30)
    assert outcomes.count("ok") >= 15, outcomes
    assert peer.stats()["mirrored"] == node.stats()["averaged"] == 1 + outcomes.count("ok")
    assert np.allclose(mine + theirs, 10 + 20 * 0.5)


def linger_pestered(cfg, peer, request) -> tuple[float, list]:
    """`peer`.linger(idle_s=1, limit_s=20) while a client sends it `request(i)` for i = 1, 2, ... on a fresh REQ
    socket each, until the linger ends. Returns the time lingered and each request's reply kind (None: none
    within 1 s)."""
    endpoint = parse_config(cfg).endpoint(parse_config(cfg).node(peer.name))
    stop = threading.Event()
    replies: list = []

    def pester():
        ctx = zmq.Context()
        try:
            for i in itertools.count(1):  # bounded: until the linger ends (its limit is 20 s)
                if stop.is_set():
                    break
                s = ctx.socket(zmq.REQ)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.send(request(i))
                replies.append(decode(s.recv_multipart()[0]).kind if s.poll(1000) else None)
                s.close(0)
        finally:
            ctx.destroy(0)

    pesterer = threading.Thread(target=pester)
    pesterer.start()
    try:
        spent = peer.linger(idle_s=1.0, limit_s=20.0)
    finally:
        stop.set()
        pesterer.join(10)
    return spent, replies


def test_refused_and_rejected_requests_do_not_keep_a_node_lingering(nodes):
    """Requests that are refused or rejected (a wrong model, say) are not service: a client that
    keeps sending them cannot hold a finished node up until its limit."""
    cfg = make_config(2, insecure=True)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(1)))
    peer.update_send()
    peer.update_wait()
    spent, sent = linger_pestered(
        cfg, peer, lambda i: encode(FETCH, 1, **{"from": "w0"}, fp=b"\x00" * 16, dtype="float32")
    )
    assert spent < 10 and len(sent) > 5
    assert peer.stats()["rejected.bad_fingerprint"] == len(sent) or peer.stats()["rejected.bad_fingerprint"] > 5


def test_what_no_training_peer_sends_does_not_keep_a_node_lingering(nodes):
    """Status requests and what a closing peer sends (its acks, its queries) are served, but they are not a peer still
    training (LINGER_KINDS): a client that keeps sending them cannot hold a finished node up, and neither can
    peers that close one after another (the acks of each closing one once kept the next one lingering)."""
    cfg = make_config(2, insecure=True)
    peer = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(1)))
    peer.update_send()
    peer.update_wait()
    requests = (
        lambda i: encode(STATUS, i, **{"from": "w0"}),
        lambda i: encode(ACK, i, **{"from": "w0", "xid": i}),  # what a closing requester sends
        lambda i: encode(KNOWN, i, **{"from": "w0", "xids": [i]}),  # what a closing server asks
    )
    spent, sent = linger_pestered(cfg, peer, lambda i: requests[i % 3](i))
    stats = peer.stats()
    served = [stats.get(f"served.{kind}", 0) for kind in ("status", "ack", "known")]
    assert min(served) > 3, (stats, sent)  # each was served, all the while
    assert spent < 10
