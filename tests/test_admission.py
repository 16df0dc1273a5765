"""The rule that keeps a node's own state in every pattern of symmetric exchanges (dpwa.mixing.admission),
checked over the arithmetic the node applies (dpwa.mixing.rules, dpwa.mixing.kernels), without sockets.

One node takes part in k = 1..4 exchanges that overlap in every order: each is started by the node (its own,
blended by the requester's rule, `state` or `delta`) or served by it (the mirror), on whatever snapshot the node
has published when the exchange begins, and is applied (committed) or given back (aborted) later; the node
publishes fresh snapshots in between. The node and its partners start at basis vectors, so every value is a
vector of weights on the starting states.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from dpwa.mixing import rules
from dpwa.mixing.admission import OWN_WEIGHT_FLOOR, Admission
from dpwa.mixing.params import NumpyParams


class Everything(Admission):
    """The control: admits every exchange (what a node did before the rule, counting only served ones)."""

    def take(self, version: int, role: str) -> bool:
        self.unsettled = role
        return True


def schedules(k: int, count: int, seed: int) -> list[list[tuple[str, int]]]:
    """Orders of events for k exchanges: ("begin", e) before ("end", e), with ("publish", -1) anywhere.
    Every order when there are few, else `count` drawn with `seed`."""
    events = [("begin", e) for e in range(k)] + [("end", e) for e in range(k)]
    orders: list[list[tuple[str, int]]] = []
    if k <= 2:
        for permuted in itertools.permutations(events):
            if all(permuted.index(("begin", e)) < permuted.index(("end", e)) for e in range(k)):
                orders.append(list(permuted))
    else:
        rng = random.Random(seed)
        while len(orders) < count:
            order = events[:]
            rng.shuffle(order)
            if all(order.index(("begin", e)) < order.index(("end", e)) for e in range(k)):
                orders.append(order)
    with_publishes = []
    for order in orders:  # a publish after every event, after none, and after some
        for mask in (0, (1 << len(order)) - 1, 0b0101_0101, 0b1010_1010):
            steps = [("publish", -1)]
            for i, event in enumerate(order):
                steps.append(event)
                if mask >> i & 1:
                    steps.append(("publish", -1))
            with_publishes.append(steps)
    return with_publishes


def play(admission: Admission, steps, roles, outcomes, f: float, rule: rules.Rule):
    """Run one schedule. Returns, for each applied exchange, (a, b, exact, kept): the node is now
    a * (its state just before) + b * (the partner's snapshot), exactly so (`exact`: nothing else in it),
    and the pair's sum is what it was (`kept`)."""
    k = len(roles)
    size = k + 1
    x = np.zeros(size, np.float32)
    x[0] = 1.0  # the node's own starting state
    partners = [np.eye(size, dtype=np.float32)[e + 1] for e in range(k)]  # each partner is in this exchange only
    node = NumpyParams(x)
    snapshot, version = x.copy(), 0  # every schedule publishes first
    taken: dict[int, np.ndarray] = {}  # exchange -> the node's snapshot it took part with
    seen = []
    for kind, e in steps:
        if kind == "publish":
            snapshot, version = x.copy(), version + 1
        elif kind == "begin":
            if admission.take(version, roles[e]):
                taken[e] = snapshot
        elif e in taken:
            own = taken.pop(e)
            if not outcomes[e]:
                admission.give_back()
                continue
            before, partner_before = x.copy(), partners[e].copy()
            peer = partners[e].copy()  # the partner's snapshot: it has not moved
            if roles[e] == "own":
                rule.blend(node, own, peer, f, "float32")
            else:
                rule.mirror(node, own, peer, f, "float32")
            partners[e] += np.float32(f) * (own - peer)  # the partner's half: always the mirror of ours
            admission.settle(version)
            # x = a * before + b * peer: solve on the coordinates of the node's own state and of this partner
            a = float(x[0] / before[0])
            b = float(x[e + 1] - a * before[e + 1])
            exact = np.allclose(x, a * before + b * np.eye(size)[e + 1], atol=1e-6)
            kept = np.allclose(x + partners[e], before + partner_before, atol=1e-6)
            seen.append((a, b, exact, kept))
    return seen


@pytest.mark.parametrize("rule", [rules.rule_class("state")(), rules.rule_class("delta")()], ids=["state", "delta"])
@pytest.mark.parametrize("f", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_nodes_own_weight_stays_at_or_above_the_floor_in_every_pattern(k, f, rule):
    """With the rule, every applied exchange leaves the node at (1 - f) of its state just before plus f of its
    partner's snapshot (so its own weight is 1 - f >= 1/2), and the pair's sum is what it was. Roles are every
    mix of started and served; each exchange is committed, or (in the second half) some are aborted."""
    applied = 0
    for roles in itertools.product(("own", "served"), repeat=k):
        for outcomes in ([True] * k, [e % 2 == 0 for e in range(k)]):
            for steps in schedules(k, count=60, seed=k):
                for a, b, exact, kept in play(Admission(), steps, roles, outcomes, f, rule):
                    applied += 1
                    assert exact and a >= OWN_WEIGHT_FLOOR
                    assert a == pytest.approx(1 - f, abs=1e-6) and b == pytest.approx(f, abs=1e-6)
                    assert kept
    assert applied > 0


def test_without_the_rule_two_exchanges_on_one_snapshot_swap_the_models():
    """The control, so the test above can fail: admitting both a started and a served exchange on one snapshot,
    f = 1/2, leaves the node with none of its own state (two nodes asking each other swap their models)."""
    steps = [("publish", -1), ("begin", 0), ("begin", 1), ("end", 0), ("end", 1)]
    (a0, _, exact0, kept0), (a1, _, _, kept1) = play(
        Everything(), steps, ["own", "served"], [True, True], 0.5, rules.rule_class("delta")()
    )
    assert exact0 and a0 == pytest.approx(0.5) and kept0 and kept1  # the first is fine; the mean is kept
    assert a1 == pytest.approx(0.0, abs=1e-6)  # the second erases what was left of the node's own state


def test_the_rule_refuses_a_second_exchange_and_a_stale_snapshot():
    admission = Admission()
    assert admission.take(1, "own")
    assert "another exchange" in admission.refusal(1) and not admission.take(1, "served")
    admission.give_back()  # nothing applied: the same snapshot may serve
    assert admission.take(1, "served")
    admission.settle(2)  # applied while snapshot 2 was the latest: 1 and 2 are stale
    assert not admission.take(2, "own") and "already took part" in admission.refusal(2)
    assert admission.spent(2) and not admission.spent(3)
    assert admission.take(3, "own")


def test_an_own_exchange_hands_over_to_a_served_one_only_on_a_fresh_snapshot():
    """A crossing request: our own exchange, not yet confirmed, gives way to the peer's (it will never be
    applied), so the node's one unsettled exchange becomes the served one, on a snapshot that has not taken
    part in an applied exchange."""
    admission = Admission()
    assert not admission.hand_over(1, "served")  # nothing unsettled: nothing to hand over
    assert admission.take(1, "own")
    assert admission.hand_over(1, "served") and admission.unsettled == "served"
    assert "another exchange" in admission.refusal(1)  # still one unsettled exchange at a time
    admission.settle(1)
    assert admission.take(2, "own")
    assert not admission.hand_over(1, "served") and admission.unsettled == "own"  # snapshot 1 is stale
