"""Defaults that are safe at every size: two and three real nodes average, they never swap their models.

Before the rule of dpwa.mixing.admission, two nodes with the defaults (mode symmetric, f = 1/2) each started
an exchange with the other and served the other's in the same step, both from one snapshot: each ended at
the other's values (0 and 8 became 8 and 0), step after step. These tests run the library's defaults (only
`join: never`, so that each node keeps the values the test gives it, and the free ports differ).
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from conftest import close_together, filled, make_config
from dpwa import NumpyParams, parse_config


def defaults(n: int, **settings) -> dict:
    """make_config's cluster with the library's own defaults: no mode, rule, pairing or interpolation set."""
    cfg = make_config(n, **settings)
    for key in ("mode", "rule", "interpolation", "constant", "fetch_probability", "timeout_ms"):
        if key not in settings:
            cfg.pop(key, None)
    return cfg


def rounds_until(group, arrays, target: float, limit: int) -> int:
    """Step every node together (nothing trained) until every value is within 1e-6 of `target`; the rounds."""
    for round_ in range(1, limit + 1):
        for node in group:
            node.update_send()
        for node in group:
            node.update_wait()
        if all(np.abs(a - target).max() <= 1e-6 for a in arrays):
            return round_
    raise AssertionError(f"after {limit} rounds: {[float(a[0]) for a in arrays]}, expected all at {target}")


def test_the_defaults_are_what_these_tests_run():
    cfg = parse_config(defaults(2, join="never"))
    assert (cfg.mode, cfg.rule, cfg.pairing, cfg.interpolation, cfg.constant.value) == (
        "symmetric",
        "delta",
        "auto",
        "constant",
        0.5,
    )


@pytest.mark.parametrize("pairing", ["auto", "random", "hypercube"])
def test_two_nodes_with_the_defaults_meet_at_their_mean_and_stay_there(nodes, pairing):
    """0 and 8, mode symmetric, f = 1/2: one exchange moves both to 4, whichever pairing; five more rounds
    keep them at 4 (a swap would put them at 8 and 0)."""
    cfg = defaults(2, join="never", pairing=pairing)
    arrays = [filled(0), filled(8)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(k)) for k in range(2)]
    assert rounds_until(group, arrays, 4.0, limit=20) <= 10
    for _ in range(5):
        for node in group:
            node.update_send()
        for node in group:
            node.update_wait()
        assert all(np.abs(a - 4.0).max() <= 1e-6 for a in arrays), [float(a[0]) for a in arrays]
    stats = [node.stats() for node in group]
    started, served = sum(s.get("averaged", 0) for s in stats), sum(s.get("mirrored", 0) for s in stats)
    assert 1 <= served <= started <= served + 1  # the last server half may wait for the server's next step


@pytest.mark.parametrize("mode", ["symmetric", "pull"])
def test_two_nodes_meet_at_their_mean_in_either_mode(nodes, mode):
    """Pull too: both publish, then each pulls the other's snapshot of that round, so 0 and 8 both become 4
    (pull keeps no mean in general; here the two pulls are mirror images)."""
    cfg = defaults(2, join="never", mode=mode, timeout_ms=3000)
    arrays = [filled(0), filled(8)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(k)) for k in range(2)]
    for node in group:  # both publish before anyone asks
        node.update_send()
    for node in group:
        node.update_wait()
    assert all(np.abs(a - 4.0).max() <= 1e-6 for a in arrays)


@pytest.mark.parametrize("pairing", ["auto", "random"])
def test_three_nodes_with_the_defaults_meet_at_their_mean(nodes, pairing):
    """0, 8 and 1 (mean 3), mode symmetric, f = 1/2: a random matching each round, one pair exchanging and one
    node resting, so the spread shrinks geometrically and the sum is kept: every node ends within 1e-6 of 3."""
    cfg = defaults(3, join="never", pairing=pairing)
    arrays = [filled(0), filled(8), filled(1)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(k)) for k in range(3)]
    rounds_until(group, arrays, 3.0, limit=200)
    close_together(group)  # settles every commit on both sides (a server half waits for the server's next step
    # until then: with three nodes, two servers may each hold one)
    stats = [node.stats() for node in group]
    started, served = sum(s.get("averaged", 0) for s in stats), sum(s.get("mirrored", 0) for s in stats)
    assert started == served > 0, (started, served)


def test_closing_one_after_another_settles_everything_without_a_warning(nodes, caplog):
    """Three nodes exchange, then close one after another, as a script's processes end. Every commit is
    applied on both sides, and nothing is logged as unsettled. (Before, each closing node's ack to a peer
    that had already closed went first and the live peer's ack expired in the queue behind it: the live
    peer then warned that its commits were "not yet known" after a close that had lost nothing.)"""
    cfg = defaults(3, join="never")
    arrays = [filled(0), filled(8), filled(1)]
    group = [nodes(cfg, f"w{k}", NumpyParams(arrays[k]), rng=random.Random(k)) for k in range(3)]
    rounds_until(group, arrays, 3.0, limit=200)
    caplog.set_level(logging.INFO, logger="dpwa")
    for node in group:
        node.close()
    stats = [node.stats() for node in group]
    assert sum(s.get("averaged", 0) for s in stats) == sum(s.get("mirrored", 0) for s in stats) > 0
    unsettled = [r.getMessage() for r in caplog.records if "unsettled" in r.getMessage()]
    assert unsettled == []
