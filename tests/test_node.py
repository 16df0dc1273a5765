"""Nodes as threads in one process, over real sockets on 127.0.0.1."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from conftest import (
    ORIGINAL,
    endpoint_is_free,
    filled,
    free_port,
    make_config,
    port_is_free,
    serving_only,
    step_until_averaged,
    wait_until,
)
from dpwa import Node, NumpyParams, Update
from dpwa.gossip.membership.deadlines import CAP_FACTOR
from dpwa.gossip.node import WAIT_SLACK_S
from dpwa.wire.errors import TransportError


class RecordingParams(NumpyParams):
    """NumpyParams that keeps a copy of every peer buffer it is given."""

    def __init__(self, array):
        super().__init__(array)
        self.received: list[np.ndarray] = []

    def lerp_from(self, peer, f, wire="float32"):
        self.received.append(np.array(peer, copy=True))
        super().lerp_from(peer, f, wire)


def publish(node: Node, loss=None, batch_size=1, steps=1) -> None:
    for _ in range(steps):
        node.update_send(loss, batch_size)
        node.update_wait(loss)


@pytest.mark.parametrize("same_host", ["auto", "off"])
def test_a_node_publishes_into_two_snapshot_slots_or_the_one_its_config_says(nodes, same_host):
    """docs/design.md#memory: 2 slots by default, on one host or over TCP; `snapshot_slots: 1` saves a copy."""
    for slots in (None, 1):
        cfg = make_config(2, same_host=same_host, insecure=True, **({"snapshot_slots": slots} if slots else {}))
        node = nodes(cfg, "w0", NumpyParams(np.zeros(10, np.float32)))
        assert bool(node.services.local) == (same_host == "auto")
        assert node.services.store.max_slots == (slots or 2)
        node.close()


def test_a_fetch_returns_the_peers_exact_bytes(nodes, make_cluster):
    cfg = make_cluster(2, **ORIGINAL, constant={"value": 1.0})
    theirs = np.random.default_rng(3).standard_normal(100_003).astype(np.float32)
    theirs[:4] = [-1e18, float(np.finfo(np.float32).tiny), -0.0, 1e-45]  # extremes (within MAX_VALUE) survive the wire
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs.copy()))
    publish(peer)
    mine = RecordingParams(np.zeros_like(theirs))
    node = nodes(cfg, "w0", mine)
    assert node.update_send()
    update = node.update_wait()
    assert update.averaged and update.peer == "w1" and update.factor == 1.0
    assert mine.received[0].tobytes() == theirs.tobytes()
    assert np.array_equal(mine.array, theirs)  # f = 1 takes the peer whole (-0.0 may come out as 0.0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_blends_match_values_known_in_advance(nodes, n, make_cluster):
    """Node k holds k everywhere. w0 pulls with f = 1/2, so after a blend with peer k
    its value is (x + k) / 2, exactly representable in float32 for these steps. A random peer by score
    each step (pairing: random), so every peer is used."""
    cfg = make_cluster(n, **ORIGINAL)
    for k in range(1, n):
        publish(nodes(serving_only(cfg), f"w{k}", NumpyParams(filled(k))))
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine), rng=random.Random(n))
    expected = 0.0
    seen = set()
    for _ in range(20):  # 20 halvings of values < 4 stay exact in float32's 24-bit significand
        assert node.update_send()
        update = node.update_wait()
        assert update.averaged, update
        k = int(update.peer[1:])
        seen.add(k)
        expected = (expected + k) / 2
        assert np.all(mine == np.float32(expected)), (update, mine[:3], expected)
    assert seen == set(range(1, n))  # every peer was used
    stats = node.stats()
    assert stats["fetches_ok"] == 20 and stats["averaged"] == 20
    if make_cluster.transport == "tcp":
        assert stats["bytes_in"] == 20 * mine.nbytes and stats["same_host_fetches"] == 0
    else:
        assert stats["same_host_fetches"] == 20 and stats["bytes_in"] == 0
    assert set(stats["peers"]) == {f"w{k}" for k in range(1, n)}


def test_clock_interpolation_and_clock_blend(nodes, make_cluster):
    cfg = make_cluster(2, **ORIGINAL, interpolation="clock")
    peer = nodes(serving_only(cfg), "w1", NumpyParams(filled(4)))
    publish(peer, batch_size=10, steps=3)  # clock 30
    peer.update_send(batch_size=10)  # publishes clock 30
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(batch_size=10)
    update = node.update_wait()  # own clock 10, peer 30: f = 30 / 40
    assert update.factor == pytest.approx(0.75)
    assert np.all(mine == 3.0)
    assert update.clock == pytest.approx(0.75 * 30 + 0.25 * 10)


def test_loss_interpolation_and_divergence(nodes, make_cluster):
    cfg = make_cluster(2, **ORIGINAL, interpolation="loss")
    peer = nodes(serving_only(cfg), "w1", NumpyParams(filled(8)))
    peer.update_send(loss=1.0)  # the peer's snapshot carries loss 1.0
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(loss=5.0)
    update = node.update_wait(loss=3.0)  # the newest loss counts: f = 3 / (3 + 1)
    assert update.factor == pytest.approx(0.75) and np.all(mine == 6.0)

    cfg = make_cluster(2, **ORIGINAL, divergence_threshold=0.2)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(filled(8)))
    publish(peer)
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait(loss=0.1)  # below the threshold: f = 0.5 * 0.1 / 0.2
    assert update.factor == pytest.approx(0.25) and np.allclose(mine, 2.0)


def test_update_wait_returns_at_once_without_a_fetch(nodes):
    cfg = make_config(2, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1)))
    assert node.update_send() is False
    update = node.update_wait()
    assert (update.averaged, update.outcome) == (False, "no_fetch")
    assert update.clock == 1.0
    single = nodes(
        {"nodes": [{"name": "solo", "host": "127.0.0.1", "port": free_port()}]}, "solo", NumpyParams(filled(1))
    )
    assert single.update_send() is False and single.update_wait().outcome == "no_fetch"


def test_a_skipped_update_wait_still_counts_the_batch(nodes):
    cfg = make_config(2, **ORIGINAL, timeout_ms=200)  # w1 never starts: every fetch fails
    node = nodes(cfg, "w0", NumpyParams(filled(0)))
    node.update_send(batch_size=5)
    node.update_send(batch_size=5)  # no update_wait in between: the first fetch is abandoned
    assert not node.update_wait().averaged
    assert node.clock == 10.0  # both batches counted
    assert node.stats()["fetches_abandoned"] == 1


def test_a_node_serves_its_initial_values_from_the_moment_it_is_made(nodes):
    """A node publishes once in its constructor: a peer that fetches before its first step gets
    its initial parameters, never "not ready"."""
    cfg = make_config(2, **ORIGINAL, constant={"value": 1.0})
    nodes(serving_only(cfg), "w1", NumpyParams(filled(7)))  # never steps
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait()
    assert (update.averaged, update.outcome) == (True, "ok")
    assert np.all(mine == 7)


def disagreement(arrays) -> float:
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    return float(((stacked - stacked.mean(axis=0)) ** 2).sum())


@pytest.mark.parametrize("n", [3, 4])
def test_averaging_alone_reaches_consensus_geometrically(nodes, n, make_cluster):
    """Nodes that only average contract their disagreement D = sum ||x_i - mean||^2 geometrically.

    With fresh snapshots and f = 1/2, one round (every node pulls once from a
    uniform random peer) gives E[D'] = D (n - 2) / (2 (n - 1)): 1/4 for n = 3
    and 1/3 for n = 4. Each round is two steps (period: 2): in the first every
    node only publishes, so every fetch of the second sees the values its peer
    holds now, never a snapshot from the round before (a stale snapshot from
    before the first blend once lifted D above D_0 in round 1, under CI's load).
    The peers are drawn from seeded generators, so the rounds are the same in
    every run; the test asserts D_r <= D_0 * 0.7^r for every round r, and a
    1000-fold drop over 30 rounds (theory: about 10^-14).
    """
    cfg = make_cluster(n, **ORIGINAL, period=2)
    arrays = [filled(k) for k in range(n)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(100 + k)) for k in range(n)]

    def step() -> list[Update]:
        for node in group:
            node.update_send()
        return [node.update_wait() for node in group]

    d0 = disagreement(arrays)
    for r in range(1, 31):
        assert not any(u.averaged for u in step())  # publish only
        updates = step()
        assert all(u.averaged for u in updates), updates
        d = disagreement(arrays)
        assert d <= d0 * 0.7**r + 1e-9, (r, d, d0)
    assert disagreement(arrays) < d0 * 1e-3


def test_a_dead_peer_costs_one_timeout_and_training_goes_on(nodes, make_cluster):
    timeout_ms = 300
    cfg = make_cluster(3, timeout_ms=timeout_ms)
    dead_port = cfg["nodes"][2]["port"]
    publish(nodes(serving_only(cfg), "w1", NumpyParams(filled(1))))
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine), rng=random.Random(5))
    outcomes = []
    for step in range(20):
        node.update_send()
        mine += 0.0  # the "training" of this step would happen here
        t0 = time.monotonic()
        update = node.update_wait()
        waited = time.monotonic() - t0
        # the bound is the contract: the request's deadline, which grows after timeouts up to 4 x timeout_ms
        # (dpwa.gossip.membership.deadlines.CAP_FACTOR: a peer whose connection is still being set up cannot be told from a
        # dead one), plus slack, and a margin for a loaded machine
        assert waited <= CAP_FACTOR * timeout_ms / 1000 + WAIT_SLACK_S + 0.5, (step, waited, update)
        outcomes.append((update.peer, update.outcome))
    assert ("w2", "timeout") in outcomes
    assert ("w1", "ok") in outcomes
    assert node.stats()["peers"]["w2"]["score"] < 1.0
    assert node.stats()["fetches_timed_out"] == outcomes.count(("w2", "timeout"))

    # The dead peer comes up on its port: it is chosen again (its score never reaches 0)
    assert port_is_free(dead_port)
    publish(nodes(serving_only(cfg), "w2", NumpyParams(filled(2))))
    assert step_until_averaged(node, 60, peer="w2") is not None
    assert node.stats()["peers"]["w2"]["score"] > 0.05


def test_a_restarted_peer_on_the_same_port_is_used_again(nodes, make_cluster):
    cfg = make_cluster(2, timeout_ms=300)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(filled(1)))
    publish(peer)
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    assert node.update_send() and node.update_wait().averaged
    peer.close()
    node.update_send()
    assert node.update_wait().outcome == "timeout"
    restarted = nodes(serving_only(cfg), "w1", NumpyParams(filled(3)))
    publish(restarted)
    assert step_until_averaged(node, 30) is not None  # the next probe finds it
    assert np.all(mine >= 1.0)  # blended with the restarted peer's 3s


def test_close_frees_the_port_at_once_and_leaves_no_thread(make_cluster):
    cfg = make_cluster(2)
    before = set(threading.enumerate())
    node = Node(cfg, "w0", NumpyParams(filled(0)))
    try:
        assert not endpoint_is_free(cfg, "w0")
        assert node.update_send() is True  # a fetch in flight to a peer that does not exist
    finally:
        node.close()
    assert endpoint_is_free(cfg, "w0")
    assert set(threading.enumerate()) - before == set()
    node.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        node.update_send()
    with Node(cfg, "w0", NumpyParams(filled(0))) as again:  # the port is usable at once
        assert again.update_send() is True
    assert endpoint_is_free(cfg, "w0")


@pytest.mark.parametrize(
    "insecure, message",
    [
        (True, r"cannot bind tcp://127\.0\.0\.1:\d+: .*using that port"),
        (False, r"cannot bind ipc://\S+ is in use by another process.*using that port"),
    ],
)
def test_a_port_in_use_is_a_clear_error_and_leaves_nothing_behind(nodes, insecure, message):
    cfg = make_config(2, insecure=insecure)
    nodes(cfg, "w0", NumpyParams(filled(0)))
    before = set(threading.enumerate())
    with pytest.raises(TransportError, match=message):
        Node(cfg, "w0", NumpyParams(filled(0)))
    assert wait_until(lambda: set(threading.enumerate()) - before == set(), 5)


def test_mismatched_models_never_blend(nodes, make_cluster):
    cfg = make_cluster(2, **ORIGINAL)
    publish(nodes(serving_only(cfg), "w1", NumpyParams(filled(1, size=999))))
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait()
    assert not update.averaged and update.outcome == "refused" and "bad_fingerprint" in update.reason
    assert np.all(mine == 0)
    assert node.stats()["fetches_refused"] == 1


def test_loss_may_be_a_tensor_or_unknown(nodes):
    torch = pytest.importorskip("torch")
    cfg = make_config(2, interpolation="loss")
    publish(nodes(serving_only(cfg), "w1", NumpyParams(filled(4))), loss=torch.tensor(1.0))
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send(torch.tensor(float("nan")))
    assert node.update_wait(None).factor == 0.5  # unknown own loss: even split
    with pytest.raises(TypeError, match="loss must be a number"):
        node.update_send("high")
    with pytest.raises(ValueError, match=r"batch_size must be a number in \[0, 1e\+15\], got -1"):
        node.update_send(1.0, batch_size=-1)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_half_precision_wire_halves_the_bytes_and_blends_in_float32(nodes, make_cluster, wire):
    """Small integers are exact in every wire dtype, so the blend of 8 into 0 at f = 1/2 is exactly 4."""
    cfg = make_cluster(2, wire_dtype=wire)
    publish(nodes(serving_only(cfg), "w1", NumpyParams(filled(8))))
    mine = filled(0)
    mine[0] = 2.0**-20  # a float32 detail no half format holds: our side keeps float32 precision
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    assert node.update_wait().averaged
    assert np.all(mine[1:] == 4.0)
    assert mine[0] == np.float32(0.5 * 2.0**-20 + 4.0)
    if make_cluster.transport == "tcp":
        assert node.stats()["bytes_in"] == mine.size * 2


def test_nodes_with_different_wire_dtypes_refuse_each_other(nodes):
    cfg = make_config(2, **ORIGINAL, same_host="off")
    publish(nodes({**serving_only(cfg), "wire_dtype": "float16"}, "w1", NumpyParams(filled(8))))
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    update = node.update_wait()
    assert update.outcome == "refused" and "bad_dtype" in update.reason and np.all(mine == 0)
