"""Blend rules and the mean-preserving symmetric exchange, with real nodes."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from dpwa import NumpyParams
from dpwa.exchange import Pending, PendingExchanges
from dpwa.gossip.snapshots import SnapshotStore

from conftest import filled, make_config, step_until_averaged, wait_until
from helpers.proxy import Proxy


def serving_only(cfg):
    return {**cfg, "fetch_probability": 0}


@pytest.mark.parametrize("blend, expected", [("state", 5.5), ("delta", 6.0)])
def test_delta_keeps_the_local_step_whole(nodes, blend, expected):
    """We publish 0, train one step (+1), then blend with a peer at 10, f = 1/2.
    state: 1 + (10 - 1) / 2 = 5.5 (half the step is lost); delta: 1 + (10 - 0) / 2 = 6."""
    cfg = make_config(2, blend=blend)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(filled(10)))
    peer.update_send()
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(batch_size=4)
    mine += 1.0
    update = node.update_wait()
    assert update.averaged and np.all(mine == expected)
    # the clock follows the same rule: snapshot clocks 0 (ours) and 0 (the peer's), ours now 4
    assert update.clock == (2.0 if blend == "state" else 4.0)


def test_a_symmetric_exchange_moves_both_sides(nodes, make_cluster):
    """w0 (0) asks w1 (10), f = 1/2, blend delta. w0: 0 + (10 - 0) / 2 = 5. w1 trains +1 meanwhile,
    then applies the mirror at its next update: 11 + (0 - 10) / 2 = 6. The sum gained exactly the +1."""
    cfg = make_cluster(2, mode="symmetric", blend="delta")
    theirs = filled(10)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    peer.update_send(batch_size=3)
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(batch_size=5)
    theirs += 1.0
    update = node.update_wait()
    assert update.averaged and update.factor == 0.5 and np.all(mine == 5.0)
    peer.update_wait()
    assert np.all(theirs == 6.0)
    assert node.clock + peer.clock == 5.0 + 3.0  # clocks: 5 + (0 - 0)/2 and 3 + (0 - 0)/2
    assert peer.stats()["mirrored"] == 1 and node.stats()["exchanges_confirmed"] == 1


def total(arrays) -> np.ndarray:
    return np.sum([a.astype(np.float64) for a in arrays], axis=0)


@pytest.mark.parametrize("mode", ["symmetric", "pull"])
def test_symmetric_mode_keeps_the_mean_while_training(nodes, make_cluster, mode):
    """Four nodes start at k + noise and each adds a known step d_k every round (the "gradient"),
    then exchange with f = 1/2 and blend delta, for 80 rounds: 320 requests, of which about
    70% are served in symmetric mode (a peer whose snapshot already serves an exchange
    answers "busy", see dpwa.mixing), so well over a hundred exchanges.

    Symmetric: every exchange adds f (s_j - s_i) on one side and f (s_i - s_j) on the other, so
    the sum of all parameters changes by exactly the local steps: sum_0 + rounds * sum_k d_k.
    Float32 rounding adds at most a few ulps of values near 10 per operation; over 320
    exchanges a random walk of such errors stays below 1e-4 per element, the tolerance.
    Pull: only the requester moves, by f (s_j - s_i), so the sum drifts by amounts of the
    order of the differences between nodes (here > 0.05).
    """
    n, rounds = 4, 80
    cfg = make_cluster(n, mode=mode, blend="delta", timeout_ms=2000)
    rng = np.random.default_rng(7)
    arrays = [(k + rng.standard_normal(500)).astype(np.float32) for k in range(n)]
    steps = [np.float32(0.01 * (k - 1.5)) for k in range(n)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(k)) for k in range(n)]
    expected = total(arrays) + rounds * float(np.sum(np.array(steps, np.float64)))
    averaged = 0
    for _ in range(rounds):
        for node in group:
            node.update_send()
        for k, node in enumerate(group):
            arrays[k] += steps[k]
        averaged += sum(node.update_wait().averaged for node in group)
    for node in group:  # the last confirmed mirrors are applied at each server's next update
        node.update_wait()
    assert averaged >= 0.5 * n * rounds
    drift = np.abs(total(arrays) - expected).max() / n
    if mode == "symmetric":
        assert drift < 1e-4, drift
        assert all(node.stats()["exchanges_pending"] == 0 for node in group)
    else:
        assert drift > 0.05, drift


def test_a_reply_delayed_past_the_timeout_changes_neither_side(nodes):
    """The reply to w0's exchange arrives after w0's deadline: w0 never confirms, so w1
    must not apply its half either (its pending exchange expires). Then, with the link
    healthy again, both sides move."""
    cfg = make_config(2, mode="symmetric", blend="delta", timeout_ms=300, same_host="off")
    theirs = filled(10)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    peer.update_send()
    proxy = Proxy(cfg["nodes"][1]["port"])
    try:
        client_cfg = {**cfg, "nodes": [cfg["nodes"][0], dict(cfg["nodes"][1], port=proxy.port)]}
        mine = filled(0)
        node = nodes(client_cfg, "w0", NumpyParams(mine))
        node.update_send()  # a first exchange connects (0 and 10 meet at 5)
        assert node.update_wait().averaged
        peer.update_wait()
        theirs += 2.0  # w1 trains: 7
        peer.update_send()
        proxy.delay_s = 0.6  # replies now arrive after the 300 ms deadline
        node.update_send()
        update = node.update_wait()
        assert not update.averaged and update.outcome == "timeout"

        def peer_step_and_check() -> bool:  # expired exchanges are dropped as the server updates
            peer.update_wait()
            peer.update_send()
            return peer.stats()["exchanges_expired"] >= 1

        assert wait_until(peer_step_and_check, 5)
        assert np.all(mine == 5.0) and np.all(theirs == 7.0)  # neither side moved
        assert peer.stats()["mirrored"] == 1  # only the first exchange was ever applied there
        proxy.delay_s = 0.0
        assert step_until_averaged(node, 30) is not None  # a new connection, once the delayed one is gone
        peer.update_wait()
        assert np.all(mine == 6.0) and np.all(theirs == 6.0)  # 5 + (7 - 5) / 2 and 7 + (5 - 7) / 2
    finally:
        proxy.close()


def test_a_symmetric_node_refuses_non_finite_snapshots(nodes):
    cfg = make_config(2, mode="symmetric", blend="delta")
    theirs = filled(10)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    peer.update_send()
    bad = filled(0)
    bad[3] = np.nan
    node = nodes(cfg, "w0", NumpyParams(bad))
    node.update_send()
    update = node.update_wait()
    assert not update.averaged and update.outcome == "refused" and "not_finite" in update.reason
    peer.update_wait()
    assert np.all(theirs == 10)  # the server never recorded it


# --------------------------------------------------------------------------- the bookkeeping alone


def pending(store, xid, peer="w0", ttl=10.0):
    released = []
    lease = store.lease()
    p = Pending(xid=xid, peer=peer, requester=np.zeros(4, np.float32), requester_clock=0.0, served=lease,
                expires=time.monotonic() + ttl, release_requester=lambda: released.append(xid))
    return p, released


def test_pending_exchanges_rules():
    store = SnapshotStore(4, np.float32)
    store.publish(lambda a: a.fill(1.0), 0, None)
    book = PendingExchanges(ttl_s=10.0, capacity=2)
    a, released_a = pending(store, 1)
    b, _ = pending(store, 2)
    c, _ = pending(store, 3)
    assert book.add(a) and book.add(b)
    assert not book.add(c)  # full
    assert not book.confirm(1, "w9", 0.5)  # not the requester's own exchange
    assert book.confirm(1, "w0", 0.5) and book.confirm(1, "w0", 0.5)  # idempotent
    assert not book.confirm(1, "w0", 0.25)  # but not with another factor
    assert [p.xid for p in book.take_confirmed()] == [1]
    assert book.confirm(1, "w0", 0.5)  # a repeated confirm after it was taken is still acknowledged
    a.release()
    assert released_a == [1]
    assert not book.confirm(99, "w0", 0.5)  # unknown


def test_unconfirmed_exchanges_expire_and_free_what_they_hold():
    store = SnapshotStore(4, np.float32, max_slots=2)
    store.publish(lambda a: a.fill(1.0), 0, None)
    book = PendingExchanges(ttl_s=0.0, capacity=4)
    p, released = pending(store, 7, ttl=0.0)
    assert book.add(p)
    assert book.take_confirmed() == []  # expired instead
    assert released == [7] and book.expired == 1 and len(book) == 0
    assert not book.confirm(7, "w0", 0.5)
    assert store.held() == 0


@pytest.mark.parametrize("settings, f, mine_after, theirs_after", [
    # loss interpolation from the two snapshots: f = 3 / (3 + 1)
    ({"interpolation": "loss"}, 0.75, 6.0, 2.0),
    # divergence: our snapshot's loss 0.1 is below 0.2, so f = 0.5 * 0.1 / 0.2
    ({"divergence_threshold": 0.2}, 0.25, 2.0, 6.0),
])
def test_interpolation_works_in_symmetric_mode(nodes, settings, f, mine_after, theirs_after):
    """In symmetric mode f comes from the two exchanged snapshots, and both sides use it:
    w0 (0) moves by f (8 - 0), w1 (8) by f (0 - 8); their sum stays 8."""
    cfg = make_config(2, mode="symmetric", blend="delta", **settings)
    theirs = filled(8)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    peer.update_send(loss=1.0)
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(loss=3.0 if "interpolation" in settings else 0.1)
    update = node.update_wait()
    peer.update_wait()
    assert update.factor == pytest.approx(f)
    assert np.all(mine == mine_after) and np.all(theirs == theirs_after)
