"""The simulator: the node's mixing code against randomized-gossip theory and exact averaging."""

from __future__ import annotations

import numpy as np
import pytest

from dpwa_lab import sim


@pytest.mark.parametrize("n", [4, 8, 16])
def test_symmetric_decay_matches_randomized_gossip_theory(n):
    """One symmetric exchange of a uniformly random pair with f = 1/2 on the complete graph has
    E[D'/D] = 1 - 4 f (1 - f) / (n - 1) (derived in sim.symmetric_decay), whatever the state.

    So the mean of the observed ratios over 3,000 exchanges estimates it without bias, and
    its standard error is sd / sqrt(3000); the test allows 4 standard errors (a false
    failure about once in 15,000 runs) plus 1e-3 for float32 rounding of D.
    """
    r = sim.consensus(n, "symmetric", "delta", 0.5, exchanges=3000, seed=n)
    expected = sim.symmetric_decay(n, 0.5)
    assert abs(r["mean_ratio"] - expected) <= 4 * r["standard_error"] + 1e-3, r
    assert r["max_mean_drift"] < 1e-5  # the mean is kept up to float rounding


def test_pull_does_not_keep_the_mean():
    r = sim.consensus(8, "pull", "state", 0.5, exchanges=300, seed=1)
    assert r["max_mean_drift"] > 0.05


def test_the_simulator_gives_the_real_nodes_numbers():
    """The same exchange as test_symmetric.test_a_symmetric_exchange_moves_both_sides:
    w0 at 0 asks w1 at 10, w1 trains +1 meanwhile: 5 and 6."""
    arrays = [np.zeros(10, np.float32), np.full(10, 10.0, np.float32)]
    gossip = sim.Gossip(arrays, mode="symmetric", rule="delta")
    snapshots = [a.copy() for a in arrays]
    arrays[1] += 1.0
    gossip.exchange(0, 1, snapshots)
    assert np.all(arrays[0] == 5.0) and np.all(arrays[1] == 6.0)


def test_blend_is_the_older_name_of_rule_and_still_taken():
    """Gossip(..., blend=) and --blend, the rule's older names, give what rule= and --rule give; the keyword
    warns that rule= is the name now, and both at once are an error (which one would win?)."""
    start = [np.zeros(10, np.float32), np.full(10, 10.0, np.float32)]
    now = sim.Gossip([a.copy() for a in start], mode="pull", rule="delta")
    with pytest.warns(DeprecationWarning, match=r"write rule='delta'"):
        old = sim.Gossip([a.copy() for a in start], mode="pull", blend="delta")
    for gossip in (now, old):
        snapshots = [a.copy() for a in gossip.arrays]
        gossip.arrays[0] += 2.0  # a step since the snapshot: delta keeps it whole (state, the default, halves it)
        gossip.exchange(0, 1, snapshots)
    assert np.all(now.arrays[0] == 7.0) and np.all(old.arrays[0] == 7.0)  # 2 + (10 - 0) / 2, not 2 + (10 - 2) / 2
    with pytest.raises(TypeError, match="rule='delta', blend='state'"):
        sim.Gossip([a.copy() for a in start], rule="delta", blend="state")


def test_the_simulators_blend_option_is_a_hidden_alias_of_rule(capsys):
    from dpwa_lab.sim.simulate import main

    for option in ("--rule", "--blend"):
        assert main(["consensus", "--nodes", "4", "--mode", "pull", option, "state", "--exchanges", "20"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first == second and first.startswith("4 nodes, pull/state, f = 0.5: mean D'/D per exchange"), first
    with pytest.raises(SystemExit):
        main(["rounds", "--help"])
    shown = capsys.readouterr().out
    assert "--rule" in shown and "--blend" not in shown, shown


@pytest.mark.timeout(180)
def test_the_new_modes_train_like_exact_averaging():
    """The convergence study at reduced size (2 seeds): pull/delta and symmetric/delta reach the
    loss threshold within 10% of exact averaging's steps, with test accuracy within 1 point;
    the original pull/state rule with a fetch every step needs about twice the steps."""
    rules = [
        r
        for r in sim.RULES
        if r.label.startswith(("exact", "pull, state, p = 1", "pull, delta", "symmetric, delta")) and r.period == 1
    ]
    result = sim.study(seeds=2, rules=rules)
    rows = {r["label"]: r for r in result["rows"]}
    for label in ("pull, delta, p = 1", "symmetric, delta, p = 1"):
        assert rows[label]["steps_vs_exact"] <= 1.10, rows[label]
        assert rows[label]["accuracy_vs_exact_points"] >= -1.0, rows[label]
    assert rows["pull, state, p = 1 (the original)"]["steps_vs_exact"] >= 1.5


@pytest.mark.timeout(180)
def test_an_outer_step_makes_up_for_exchanging_every_8_steps_only():
    """The study's outer-step rows (2 seeds), with the node's own GossipOuter: exchanging every 8 steps
    without an outer step needs more steps than exact averaging; with NoLoCo's or Nesterov's outer step
    (DiLoCo's lr 0.7 and momentum 0.9, which amplify the averaged step) fewer, and the test accuracy
    stays within a point of exact averaging's."""
    rules = [r for r in sim.RULES if r.mode == "exact" or r.period == 8]
    rows = {r["label"]: r for r in sim.study(seeds=2, rules=rules)["rows"]}
    assert rows["pull, state, every 8 steps"]["steps_vs_exact"] > 1.0
    for label in (
        "pull, state, every 8 steps, noloco",
        "symmetric, delta, every 8 steps, noloco",
        "symmetric, delta, every 8 steps, nesterov",
    ):
        assert rows[label]["steps_vs_exact"] < 0.5, rows[label]
        assert rows[label]["accuracy_vs_exact_points"] >= -1.0, rows[label]


def test_hypercube_pairing_reaches_the_exact_average_in_log2_n_rounds():
    """8 nodes in step, f = 1/2, nothing trained: after 3 = log2 8 hypercube rounds every node holds
    the mean (to float32 rounding); random pairing is still far from it."""
    for mode, rule in (("symmetric", "delta"), ("pull", "state")):
        hyper = sim.rounds(8, mode, rule, "hypercube", 3, seed=1)["relative_disagreement"]
        randomly = sim.rounds(8, mode, rule, "random", 3, seed=1)["relative_disagreement"]
        assert hyper[2] < 1e-12 and hyper[1] > 1e-2  # exact at round 3, not before
        assert randomly[2] > 1e-3


def test_hypercube_partners():
    from dpwa.mixing.pairing import hypercube_partner, initiates

    assert [hypercube_partner(5, 8, t) for t in range(4)] == [4, 7, 1, 4]
    assert initiates(4, 5, "symmetric") and not initiates(5, 4, "symmetric") and initiates(5, 4, "pull")
    with pytest.raises(ValueError, match="power of two"):
        hypercube_partner(0, 6, 0)
