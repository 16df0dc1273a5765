"""Flow control: bounded scores, AIMD updates, choice frequencies proportional to score, and
the back-offs for unreachable peers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dpwa.gossip.membership.flow import SCORE_MAX, SCORE_MIN, FlowControl, PeerSelector


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
    for name, count in zip(names, failures, strict=True):
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unreachable_peer_rests_for_a_doubling_time_while_the_others_are_asked():
    """After two misses in a row a peer is not asked for timeout (1 s), then 2 s after its
    next miss, then 4 s, and 4 s (ALONE_BACKOFF_MAX_S) from then on; any answer ends that. The others are asked meanwhile."""
    clock = FakeClock()
    flow = FlowControl("w0", ["a", "dead"], 1.0, 1.0, random.Random(3), clock=clock)
    flow.record("dead", "timeout")
    assert "dead" in flow.candidates()  # one miss: still asked
    flow.record("dead", "timeout")
    assert flow.unreachable() == ["dead"] and not flow.alone
    rests = []
    for _ in range(8):
        start = clock.now
        while flow.candidates() == ["a"]:  # "dead" rests; "a" alone is asked
            clock.now += 0.25
        assert set(flow.candidates()) == {"a", "dead"}  # rested: asked again (by score)
        rests.append(clock.now - start)
        flow.record("dead", "timeout")  # and it misses again
    assert rests == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    flow.heard("dead")  # any answer (a refusal, a confirm) shows it alive
    assert set(flow.candidates()) == {"a", "dead"} and flow.unreachable() == []


def test_when_every_peer_is_unreachable_the_node_is_alone_and_probes_any_of_them():
    clock = FakeClock()
    flow = FlowControl("w0", ["a", "b"], 1.0, 1.0, random.Random(3), clock=clock)
    for peer in ("a", "b", "a", "b"):
        flow.record(peer, "failed")
    assert flow.alone and flow.candidates() == []  # the first probe waits a timeout
    clock.now += 1.0
    assert set(flow.candidates()) == {"a", "b"}  # a probe may go to either, resting or not
    assert flow.candidates() == []  # then the next one waits twice as long
    flow.record("a", "timeout")  # the probe went to "a", and it missed: "a" rests 2 s from now
    flow.record("b", "refused", "busy")  # "b" answered something: it is alive
    assert not flow.alone and flow.candidates() == ["b"]
    clock.now += 2.0
    assert set(flow.candidates()) == {"a", "b"}


def test_a_peer_that_asks_us_ends_its_rest_and_a_lone_nodes_wait_for_the_next_probe():
    """A peer whose request reaches our Rx thread is alive: a resting peer is asked again at once, and a node
    alone probes at its next step instead of waiting out its back-off (up to ALONE_BACKOFF_MAX_S)."""
    clock = FakeClock()
    flow = FlowControl("w0", ["a", "b"], 1.0, 1.0, random.Random(3), clock=clock)
    flow.record("a", "timeout")
    flow.record("a", "timeout")  # "a" rests 1 s
    assert flow.candidates() == ["b"]
    clock.now += 0.25
    flow.signs.heard("a")  # it asked us
    assert set(flow.candidates()) == {"a", "b"}
    for peer in ("a", "b", "a", "b"):
        flow.record(peer, "failed")
    clock.now += 0.25  # (no sign since the rests began)
    assert flow.alone and flow.candidates() == []  # the first probe waits a timeout
    clock.now += 1.0
    assert flow.candidates() != []  # probed: the next waits 2 s ...
    clock.now += 0.5
    assert flow.candidates() == []
    flow.signs.heard("b")  # ... unless a peer asks us meanwhile
    clock.now += 0.01
    assert flow.candidates() != [] and flow.alone  # probed now; alone until it answers
    assert flow.candidates() == []  # one probe per sign


def test_a_peer_heard_from_while_its_request_was_out_is_slow_not_rested():
    """Rest the dead, not the slow: timeouts of a peer that showed a sign of life while the request was out
    (a request of its own reached our Rx thread) lower its score but never rest it; the same timeouts
    without a sign of life rest it after UNREACHABLE_AFTER, as before."""
    clock = FakeClock()
    flow = FlowControl("w0", ["slow", "dead"], 1.0, 1.0, random.Random(3), clock=clock)
    for _ in range(5):
        started = clock.now
        clock.now += 0.5
        flow.signs.heard("slow")  # its own request reached us meanwhile
        flow.record("slow", "timeout", started=started)
        flow.record("dead", "timeout", started=started)
        clock.now += 0.5
    assert flow.unreachable() == ["dead"] and flow.slow == 5
    assert flow.selector.score("slow") < 0.1  # asked less ...
    assert flow.candidates() == ["slow"]  # ... but asked, while the dead one rests
    started = clock.now
    clock.now += 0.5
    flow.record("slow", "timeout", started=started)  # no sign since this request went out: a miss
    flow.record("slow", "timeout", started=started)
    assert sorted(flow.unreachable()) == ["dead", "slow"]


def test_signs_of_life_are_bounded_and_keep_the_latest():
    from dpwa.gossip.membership.flow import SignsOfLife

    clock = FakeClock()
    signs = SignsOfLife(clock, max_peers=3)
    for i, peer in enumerate(["a", "b", "c", "a", "d"]):
        clock.now = float(i)
        signs.heard(peer)
    assert signs.since("a", 3.0) and not signs.since("a", 3.5)
    assert not signs.since("b", 0.0)  # the oldest went when "d" came
    assert signs.since("c", 2.0) and signs.since("d", 4.0)


def test_members_that_never_complete_an_exchange_get_half_the_first_asks_at_most():
    """Issue 41: fakes that answer busy and keep sending news filled a view with 1,003 members, and a node's
    averaging rate with its honest peers fell from 43.4/s to 2.6/s: it asked fakes nearly every step. Peers
    that completed an exchange with us (proven) come first in PROVEN_FIRST of the rankings, so 1,000 fakes
    get at most about half of the first asks (one exchange asks dpwa.gossip.exchange.symmetric.EXCHANGE_PEERS_MAX
    candidates at most, so the other half costs a step a few busy answers, not a thousand)."""
    from dpwa.gossip.membership.flow import PROVEN_FIRST, PeerSelector

    fakes = [f"fake{i}" for i in range(1000)]
    selector = PeerSelector(["w1", "w2", "w3", *fakes], rng=random.Random(7))
    firsts = [selector.ranked()[0] for _ in range(400)]
    assert sum(name.startswith("w") for name in firsts) < 20  # before any success: by score, as before
    for honest in ("w1", "w2", "w3"):
        selector.success(honest)
    firsts = [selector.ranked()[0] for _ in range(2000)]
    share = sum(name.startswith("w") for name in firsts) / len(firsts)
    assert PROVEN_FIRST - 0.05 < share < PROVEN_FIRST + 0.05, share  # and the fakes the rest at most
    selector.remove("w1")
    assert "w1" not in selector.ranked()
