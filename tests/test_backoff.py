"""The one back-off every retry uses (dpwa/backoff.py): its waits, its cap, its jitter, its reset."""

from __future__ import annotations

import random

import pytest

from dpwa.backoff import Backoff, Backoffs


def test_waits_double_from_the_initial_wait_up_to_the_cap_and_start_over_after_a_reset():
    backoff = Backoff(0.1, 1.0)
    assert [backoff.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.failures == 6
    backoff.reset()
    assert backoff.next() == pytest.approx(0.1)


def test_fail_says_when_to_try_again_and_ready_says_whether_that_time_came():
    backoff = Backoff(0.5, 4.0, factor=3.0)
    assert backoff.ready(0.0)
    assert backoff.fail(10.0) == pytest.approx(10.5)
    assert not backoff.ready(10.4) and backoff.ready(10.5)
    assert backoff.fail(11.0) == pytest.approx(12.5)
    assert backoff.peek() == pytest.approx(4.0)  # 4.5, capped


def test_jitter_shortens_a_wait_by_at_most_its_fraction_and_a_seed_replays_it():
    waits = [Backoff(1.0, 1.0, jitter=0.25, rng=random.Random(7)).next() for _ in range(200)]
    assert all(0.75 <= w <= 1.0 for w in waits) and len(set(waits)) == 1  # same seed, same wait
    spread = Backoff(1.0, 1.0, jitter=0.25, rng=random.Random(7))
    assert len({spread.next() for _ in range(50)}) > 1


def test_a_huge_number_of_failures_stays_at_the_cap():
    assert Backoff(0.001, 30.0).after(10_000) == 30.0


@pytest.mark.parametrize(
    "args, word", [((0, 1), "initial_s"), ((2, 1), "cap_s"), ((1, 2, 0.5), "factor"), ((1, 2, 2, 1.0), "jitter")]
)
def test_settings_that_make_no_sense_are_refused_by_name(args, word):
    with pytest.raises(ValueError, match=word):
        Backoff(*args)


def test_backoffs_keep_one_per_key_and_forget_a_key_on_reset():
    each: Backoffs[str] = Backoffs(1.0, 8.0)
    assert each.ready("a", 0.0) and each.failures("a") == 0
    assert each.fail("a", 0.0) == 1.0 and each.fail("a", 1.0) == 3.0
    assert each.fail("b", 0.0) == 1.0
    assert not each.ready("a", 2.9) and each.ready("a", 3.0) and each.failures("a") == 2
    each.reset("a")
    assert "a" not in each and each.ready("a", 0.0) and each.retry_at("a") == 0.0
    assert each.fail("a", 5.0) == 6.0
