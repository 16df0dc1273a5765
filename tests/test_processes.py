"""Nodes in separate processes. Every child is stopped and reaped by PID (see conftest.children)."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
from test_node import RecordingParams, disagreement

from conftest import ORIGINAL, filled, port_is_free, step_until_averaged, wait_until
from dpwa import NumpyParams
from dpwa.gossip.node import WAIT_SLACK_S

pytestmark = pytest.mark.slow


def test_exact_bytes_and_known_blends_across_processes(nodes, children, make_cluster):
    cfg = make_cluster(4, **ORIGINAL, constant={"value": 0.5})  # a peer by score: every peer is asked
    pattern = children(cfg, "w1", seed=11, size=50_000, fetch=False)
    fills = [children(cfg, f"w{k}", fill=k, size=50_000, fetch=False) for k in (2, 3)]
    for child in [pattern] + fills:
        child.expect("ready")
    expected_pattern = np.random.default_rng(11).standard_normal(50_000).astype(np.float32)

    mine = RecordingParams(filled(0, 50_000))
    node = nodes(cfg, "w0", mine, rng=random.Random(2))
    seen = set()
    for _ in range(30):
        before = mine.array.copy()
        node.update_send()
        update = node.update_wait()
        assert update.averaged, update
        seen.add(update.peer)
        received = mine.received[-1]
        if update.peer == "w1":
            assert received.tobytes() == expected_pattern.tobytes()
            peer_values = expected_pattern
        else:
            peer_values = np.full(50_000, float(update.peer[1:]), np.float32)
            assert np.all(received == peer_values)
        np.testing.assert_allclose(mine.array, 0.5 * before + 0.5 * peer_values, rtol=1e-6, atol=1e-6)
    assert seen == {"w1", "w2", "w3"}
    for child in [pattern] + fills:
        assert child.stop() == 0


def test_four_processes_gossip_to_consensus(children, make_cluster):
    """Four processes, node k starting at k everywhere, each pulling from a random peer
    each step with f = 1/2. Theory for fresh snapshots gives a contraction of the
    disagreement by 1/3 per round; with the nodes running freely (stale snapshots,
    uneven speed) we assert only a 100-fold drop over 40 steps (theory: 1e-19)."""
    n = 4
    cfg = make_cluster(n, **ORIGINAL, timeout_ms=2000)
    group = [children(cfg, f"w{k}", fill=k, size=10_000, rng_seed=k) for k in range(n)]
    for child in group:
        child.expect("ready")
    d0 = disagreement([filled(k, 10_000) for k in range(n)])
    for child in group:
        child.send(cmd="steps", n=40)
    results = [child.expect("steps_done", timeout_s=90) for child in group]
    for child in group:
        child.send(cmd="values")
    finals = [np.array(child.expect("values")["values"], np.float32) for child in group]
    for r in results:
        ok = sum(1 for outcome, _ in r["outcomes"] if outcome == "ok")
        assert ok >= 30, r["outcomes"]
        assert r["min"] >= 0.0 and r["max"] <= n - 1  # a blend of values in [0, 3] stays in [0, 3]
    assert disagreement(finals) < d0 / 100
    ports = [node["port"] for node in cfg["nodes"]]
    for child in group:
        assert child.stop() == 0
    assert all(port_is_free(p) for p in ports)


def test_a_killed_peer_costs_bounded_waits_and_is_used_again_after_restart(nodes, children, make_cluster):
    timeout_ms = 400
    cfg = make_cluster(2, timeout_ms=timeout_ms)
    peer = children(cfg, "w1", fill=1, fetch=False)
    peer.expect("ready")
    mine = filled(0)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    assert node.update_wait().averaged

    peer.proc.send_signal(signal.SIGKILL)
    peer.proc.wait(10)
    outcomes = []
    for _ in range(3):
        node.update_send()
        t0 = time.monotonic()
        update = node.update_wait()
        assert time.monotonic() - t0 <= timeout_ms / 1000 + WAIT_SLACK_S + 0.5
        outcomes.append(update.outcome)
    assert outcomes[0] == "timeout"  # then, alone, the node backs off: later steps may not even try
    assert all(o in ("timeout", "no_fetch") for o in outcomes)
    value = mine[0]
    mine += 1.0  # training goes on between the failed exchanges
    assert np.all(mine == value + 1.0)

    assert wait_until(lambda: port_is_free(cfg["nodes"][1]["port"]), 10)
    restarted = children(cfg, "w1", fill=5, fetch=False)
    restarted.expect("ready")
    assert step_until_averaged(node, 30) is not None  # the next probe finds it
    assert np.allclose(mine, (value + 1.0 + 5.0) / 2)
    assert restarted.stop() == 0
