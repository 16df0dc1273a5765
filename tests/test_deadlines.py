"""Deadlines that follow the link (dpwa.gossip.membership.deadlines): RFC 6298's estimate, timeout_ms as the floor, the cap,
and the back-off after a timeout. Pure: the times are plain numbers."""

from __future__ import annotations

import pytest

from dpwa.gossip.membership.deadlines import CAP_FACTOR, Deadlines


def test_a_peer_never_sampled_gets_the_floor():
    d = Deadlines(0.3)
    assert d.deadline_s("a", "exchange") == 0.3
    assert d.cap_s == pytest.approx(CAP_FACTOR * 0.3)


def test_the_first_sample_sets_srtt_and_half_its_variance():
    d = Deadlines(0.1, cap_s=10.0)
    d.sample("a", "exchange", 0.2)
    est = d.estimate("a", "exchange")
    assert est is not None and (est.srtt, est.rttvar) == (0.2, 0.1)
    assert d.deadline_s("a", "exchange") == pytest.approx(0.2 + 4 * 0.1)  # srtt + 4 rttvar, above the floor


def test_later_samples_follow_rfc_6298():
    d = Deadlines(0.01, cap_s=10.0)
    d.sample("a", "x", 0.4)
    d.sample("a", "x", 0.2)
    est = d.estimate("a", "x")
    assert est is not None
    rttvar = 0.75 * 0.2 + 0.25 * abs(0.4 - 0.2)  # rttvar first, from the old srtt
    srtt = 0.875 * 0.4 + 0.125 * 0.2
    assert est.rttvar == pytest.approx(rttvar)
    assert est.srtt == pytest.approx(srtt)
    assert d.deadline_s("a", "x") == pytest.approx(srtt + 4 * rttvar)


def test_timeout_ms_is_the_floor_a_fast_link_keeps_it():
    d = Deadlines(0.3)
    for _ in range(50):
        d.sample("a", "exchange", 0.01)
    assert d.deadline_s("a", "exchange") == 0.3


def test_a_slow_link_gets_a_longer_deadline_up_to_the_cap():
    d = Deadlines(0.3)
    for _ in range(50):
        d.sample("a", "exchange", 0.5)  # every reply takes longer than timeout_ms
    assert 0.5 < d.deadline_s("a", "exchange") < 0.6  # srtt 0.5, the variance decayed
    for _ in range(50):
        d.sample("b", "exchange", 100.0)
    assert d.deadline_s("b", "exchange") == d.cap_s


def test_a_timeout_doubles_the_deadline_and_a_sample_resets_the_back_off():
    d = Deadlines(0.3)
    d.timed_out("a", "exchange")
    assert d.deadline_s("a", "exchange") == pytest.approx(0.6)
    d.timed_out("a", "exchange")
    assert d.deadline_s("a", "exchange") == pytest.approx(1.2)
    for _ in range(5):
        d.timed_out("a", "exchange")
    assert d.deadline_s("a", "exchange") == d.cap_s  # never past the cap
    d.sample("a", "exchange", 0.35)
    est = d.estimate("a", "exchange")
    assert est is not None and est.backoff == 1.0
    assert d.deadline_s("a", "exchange") < 1.2


def test_estimates_are_per_peer_and_kind_and_forgotten_with_the_peer():
    d = Deadlines(0.1)
    d.sample("a", "exchange", 1.0)
    assert d.deadline_s("a", "fetch") == 0.1
    assert d.deadline_s("b", "exchange") == 0.1
    d.forget("a")
    assert d.deadline_s("a", "exchange") == 0.1


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_glitched_sample_is_ignored(bad):
    d = Deadlines(0.1)
    d.sample("a", "x", bad)
    assert d.estimate("a", "x") is None


def test_bad_bounds_are_refused_with_their_values():
    with pytest.raises(ValueError, match="floor_s must be positive, got 0"):
        Deadlines(0)
    with pytest.raises(ValueError, match=r"cap_s \(0.1\) must be at least floor_s \(0.2\)"):
        Deadlines(0.2, cap_s=0.1)


def test_the_cap_is_four_timeouts_and_with_open_membership_no_longer_than_dead_after():
    """A node waiting out a deadline sends no digest, so its heartbeat stops rising: with open membership no
    deadline outlasts dead_after_ms (never less than timeout_ms, which the config checks against it)."""
    from dpwa.gossip.membership.deadlines import cap_s

    assert cap_s(1.0) == 4.0
    assert cap_s(1.0, dead_after_s=2.0) == 2.0  # the walkthrough's settings
    assert cap_s(1.0, dead_after_s=10.0) == 4.0
    assert cap_s(1.0, dead_after_s=0.5) == 1.0
    d = Deadlines(1.0, cap_s(1.0, dead_after_s=2.0))
    for _ in range(5):
        d.timed_out("a", "exchange")
    assert d.deadline_s("a", "exchange") == 2.0
