"""Flow control: bounded scores, AIMD updates, and choice frequencies proportional to score."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dpwa.gossip.flow import SCORE_MAX, SCORE_MIN, PeerSelector


def test_scores_are_bounded_and_follow_the_documented_rule():
    sel = PeerSelector(["a", "b"])
    assert sel.score("a") == SCORE_MAX == 1.0
    sel.failure("a")
    assert sel.score("a") == 0.5
    sel.failure("a")
    assert sel.score("a") == 0.25
    for _ in range(20):
        sel.failure("a")
    assert sel.score("a") == SCORE_MIN == 0.05  # never below the floor: never dropped
    sel.success("a")
    assert sel.score("a") == pytest.approx(0.30)
    for _ in range(10):
        sel.success("a")
    assert sel.score("a") == SCORE_MAX  # never above the ceiling
    assert sel.score("b") == 1.0


@pytest.mark.parametrize("failures", [[0, 0, 0], [0, 1, 5], [20, 0, 2]])
def test_choice_frequencies_match_score_shares(failures):
    """Peer i is picked with probability score_i / sum(scores).

    With N = 40,000 draws a frequency's standard deviation is at most
    sqrt(0.25 / N) = 0.0025; the tolerance of 0.015 is six of those.
    """
    names = ["a", "b", "c"]
    sel = PeerSelector(names, rng=random.Random(1234))
    for name, count in zip(names, failures):
        for _ in range(count):
            sel.failure(name)
    expected = sel.probabilities()
    n = 40_000
    counts = Counter(sel.choose() for _ in range(n))
    for name in names:
        assert counts[name] / n == pytest.approx(expected[name], abs=0.015), (name, counts)


def test_a_dead_peer_is_still_tried_and_recovers():
    sel = PeerSelector(["up", "down"], rng=random.Random(7))
    for _ in range(30):
        sel.failure("down")
    p_down = sel.probabilities()["down"]
    assert p_down == pytest.approx(0.05 / 1.05)
    picks = [sel.choose() for _ in range(2000)]
    assert 0 < picks.count("down") < 200  # rarely, but not never
    for _ in range(4):
        sel.success("down")
    assert sel.score("down") == SCORE_MAX


def test_no_peers_means_no_choice():
    assert PeerSelector([]).choose() is None


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        PeerSelector(["a", "a"])
