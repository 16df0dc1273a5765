"""Joining: a node that starts late (or restarts) takes the cluster's state from a peer, checked by
hash; at a fresh start every node takes the first node's initial parameters."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import numpy as np
import pytest

from dpwa import Node, NumpyParams

from conftest import filled, make_config, wait_until
from helpers.chaos import ChaosProxy


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(array.astype(np.float32).tobytes()).hexdigest()


class Training:
    """A node stepping on its own thread (+1 every step) until told to stop."""

    def __init__(self, node, step=1.0):
        self.node, self.steps, self.stop = node, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(step,))
        self.thread.start()

    def _run(self, step):
        while not self.stop.is_set() and self.steps < 10_000:
            self.node.update_send(batch_size=2)
            self.node.params.array += np.float32(step)
            self.node.update_wait()
            self.steps += 1

    def join(self):
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_a_late_node_takes_a_trained_peers_state_before_it_starts(nodes):
    """w0 and w1 train; w2 starts late with join: auto. Before its constructor returns it holds the
    state of a donor (same hash as the donor's offer), the donor's clock and barrier counters."""
    cfg = make_config(3, join="auto", fetch_probability=0, timeout_ms=500)
    w0 = nodes(cfg, "w0", NumpyParams(filled(1, 10_000)))
    w1 = nodes(cfg, "w1", NumpyParams(filled(1, 10_000)))
    w0.restore(barriers={"start": 1, "epoch": 3})
    w1.restore(barriers={"start": 1, "epoch": 3})
    trainers = [Training(w0), Training(w1)]
    try:
        assert wait_until(lambda: w0.clock > 10 and w1.clock > 10, 20)
        late = filled(-7, 10_000)
        w2 = nodes(cfg, "w2", NumpyParams(late))
        joined = w2.joined
        assert joined is not None and joined.donor in ("w0", "w1")
        assert sha(late) == hashlib.sha256(joined.params.tobytes()).hexdigest()
        assert np.all(late == late[0]) and late[0] > 1  # a donor's value: 1 + its steps so far
        assert hashlib.blake2b(joined.params.tobytes() + joined.extra.tobytes(), digest_size=32).digest() == joined.digest
        assert w2.clock == joined.clock > 10
        assert w2.barrier_counters() == {"start": 1, "epoch": 3}
        assert w2.stats()["joined"] == 1
    finally:
        for t in trainers:
            t.join()


def test_at_a_fresh_start_every_node_takes_the_first_nodes_initial_parameters(nodes):
    """Three nodes start together from different random values (as if seeded differently); with
    join: auto, w1 and w2 start from w0's values, like DDP's broadcast from rank 0. Clocks stay 0."""
    cfg = make_config(3, join="auto", timeout_ms=500)
    values = [np.random.default_rng(k).standard_normal(1000).astype(np.float32) for k in range(3)]
    made, errors = {}, []

    def start(k):
        try:
            made[k] = nodes(cfg, f"w{k}", NumpyParams(values[k]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    first = np.copy(values[0])
    threads = [threading.Thread(target=start, args=(k,)) for k in (2, 1, 0)]  # w0 starts last
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(np.array_equal(v, first) for v in values)
    assert made[0].joined is None and made[1].joined.donor == "w0" and made[2].joined.donor == "w0"
    assert all(made[k].clock == 0 and made[k].barrier_counters() == {} for k in range(3))


def test_without_the_first_node_a_node_starts_from_its_own_and_says_so(nodes, caplog, monkeypatch):
    monkeypatch.setattr("dpwa.gossip.node.JOIN_WAIT_MIN_S", 1.0)
    cfg = make_config(2, join="auto", timeout_ms=200)
    mine = filled(5)
    caplog.set_level(logging.WARNING, logger="dpwa")
    t0 = time.monotonic()
    node = nodes(cfg, "w1", NumpyParams(mine))
    assert time.monotonic() - t0 < 10
    assert node.joined is None and np.all(mine == 5)
    assert any("w0 did not answer" in r.getMessage() for r in caplog.records)


def test_join_never_keeps_the_given_state(nodes):
    cfg = make_config(2, fetch_probability=0)
    w0 = nodes(cfg, "w0", NumpyParams(filled(3)))
    w0.update_send()
    w0.update_wait()
    mine = filled(9)
    node = nodes({**cfg, "join": "never"}, "w1", NumpyParams(mine))
    assert node.joined is None and np.all(mine == 9)


@pytest.mark.timeout(180)
def test_a_donor_killed_during_the_transfer_is_replaced_by_another(children, nodes):
    """Two donors in child processes hold a 64 MB model (16 chunks of 4 MB), each behind a proxy.
    Whichever donor the joiner asks first is killed with SIGKILL as soon as its first chunk has
    gone through; the joiner takes the other donor's state whole (one value everywhere)."""
    size = 16_000_000
    cfg = make_config(3, join="auto", timeout_ms=1000, insecure=True, same_host="off")
    donors = {f"w{k}": children({**cfg, "join": "never"}, f"w{k}", fill=k + 1, size=size, fetch=False) for k in (0, 1)}
    for donor in donors.values():
        donor.expect("ready")
        donor.send(cmd="churn")  # training: a clock above 0, and a step that makes an offer when asked
    proxies, killed = {}, []
    try:
        entries = []
        for spec in cfg["nodes"]:
            if spec["name"] in donors:
                proxy = proxies[spec["name"]] = ChaosProxy(spec["port"])

                def kill(name=spec["name"]):
                    if not killed:
                        killed.append(name)
                        donors[name].proc.kill()

                proxy.on("join_data", kill)
                spec = dict(spec, port=proxy.port)
            entries.append(spec)
        mine = np.zeros(size, np.float32)
        node = nodes({**cfg, "nodes": entries}, "w2", NumpyParams(mine))
        assert len(killed) == 1 and node.joined is not None
        assert node.joined.donor != killed[0]
        assert mine[0] > 0 and np.all(mine == mine[0])
        assert node.clock > 0
    finally:
        for proxy in proxies.values():
            proxy.close()
