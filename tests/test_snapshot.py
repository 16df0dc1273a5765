"""Snapshot slots: a leased snapshot is never overwritten, and publishing never waits."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dpwa.snapshot import SnapshotStore


def fill_with(value):
    return lambda out: out.fill(value)


def test_publish_and_lease():
    store = SnapshotStore(4, np.float32)
    assert store.lease() is None  # nothing published yet
    assert store.publish(fill_with(1.0), clock=3, loss=0.5)
    with store.lease() as lease:
        snap = lease.snapshot
        assert snap.version == 1 and snap.clock == 3.0 and snap.loss == 0.5
        assert np.all(snap.array == 1.0)


def test_a_leased_snapshot_is_never_overwritten():
    store = SnapshotStore(1000, np.float32, max_slots=3)
    store.publish(fill_with(1.0), 0, None)
    lease = store.lease()
    for value in range(2, 50):
        store.publish(fill_with(float(value)), 0, None)
        assert np.all(lease.snapshot.array == 1.0)  # untouched while held
    assert store.current().version == 49
    lease.release()


def test_publishing_skips_instead_of_waiting_when_every_slot_is_held():
    store = SnapshotStore(10, np.float32, max_slots=2)
    store.publish(fill_with(1.0), 0, None)
    first = store.lease()
    store.publish(fill_with(2.0), 0, None)  # second slot
    second = store.lease()
    assert store.slots == 2 and store.held() == 2
    assert not store.publish(fill_with(3.0), 0, None)  # both held: skipped, not blocked
    assert store.skipped == 1
    assert np.all(store.lease().snapshot.array == 2.0)  # the previous snapshot is still served
    first.release()
    assert store.publish(fill_with(4.0), 0, None)
    assert np.all(first.snapshot.array == 4.0)  # the freed slot was reused
    second.release()


class FakeTracker:
    def __init__(self):
        self.done = False


def test_a_lease_handed_to_a_tracker_lasts_until_the_send_is_done():
    store = SnapshotStore(10, np.float32, max_slots=2)
    store.publish(fill_with(1.0), 0, None)
    tracker = FakeTracker()
    store.lease().release_when(tracker)
    store.publish(fill_with(2.0), 0, None)
    assert not store.publish(fill_with(3.0), 0, None)  # slot 1 still being sent
    tracker.done = True
    assert store.publish(fill_with(3.0), 0, None)


def test_slots_are_allocated_lazily_and_bounded():
    allocations = []

    def allocate(n, dtype):
        allocations.append(n)
        return np.empty(n, dtype)

    store = SnapshotStore(10, np.float32, max_slots=4, allocate=allocate)
    for value in range(100):
        store.publish(fill_with(float(value)), 0, None)
    assert len(allocations) == 2  # nobody reads: two slots suffice


def test_concurrent_readers_never_see_a_torn_snapshot():
    store = SnapshotStore(50_000, np.float32, max_slots=4)
    store.publish(fill_with(0.0), 0, None)
    stop = threading.Event()
    torn = []

    def reader():
        while not stop.is_set():
            lease = store.lease()
            a = lease.snapshot.array
            first, last = a[0], a[-1]
            if first != last or not np.all(a == first):
                torn.append((first, last))
            lease.release()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for value in range(1, 300):
        store.publish(fill_with(float(value)), 0, None)
    stop.set()
    for t in threads:
        t.join(10)
    assert not torn


def test_only_one_publisher_at_a_time():
    store = SnapshotStore(10, np.float32)
    inside = threading.Event()
    release = threading.Event()

    def slow_fill(out):
        inside.set()
        release.wait(10)

    t = threading.Thread(target=store.publish, args=(slow_fill, 0, None))
    t.start()
    assert inside.wait(10)
    with pytest.raises(RuntimeError, match="one publisher"):
        store.publish(fill_with(1.0), 0, None)
    release.set()
    t.join(10)
