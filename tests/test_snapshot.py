"""Snapshot slots: a leased snapshot is never overwritten, and publishing never waits."""

from __future__ import annotations

import threading
from typing import cast

import numpy as np
import pytest
import zmq

from dpwa.gossip.transfer.snapshots import HeapMemory, Lease, Snapshot, SnapshotStore


def leased(store: SnapshotStore) -> Lease:
    """A lease of the newest snapshot, which the test has published."""
    lease = store.lease()
    assert lease is not None
    return lease


def newest(store: SnapshotStore) -> Snapshot:
    """The newest snapshot, which the test has published."""
    snapshot = store.current()
    assert snapshot is not None
    return snapshot


def fill_with(value):
    return lambda out: out.fill(value)


def test_publish_and_lease():
    store = SnapshotStore(4, np.float32)
    assert store.lease() is None  # nothing published yet
    assert store.publish(fill_with(1.0), clock=3, loss=0.5)
    with leased(store) as lease:
        snap = lease.snapshot
        assert snap.version == 1 and snap.clock == 3.0 and snap.loss == 0.5
        assert np.all(snap.array == 1.0)


def test_a_leased_snapshot_is_never_overwritten():
    store = SnapshotStore(1000, np.float32, max_slots=3)
    store.publish(fill_with(1.0), 0, None)
    lease = leased(store)
    for value in range(2, 50):
        store.publish(fill_with(float(value)), 0, None)
        assert np.all(lease.snapshot.array == 1.0)  # untouched while held
    assert newest(store).version == 49
    lease.release()


def test_publishing_skips_instead_of_waiting_when_every_slot_is_held():
    store = SnapshotStore(10, np.float32, max_slots=2)
    store.publish(fill_with(1.0), 0, None)
    first = leased(store)
    store.publish(fill_with(2.0), 0, None)  # second slot
    second = leased(store)
    assert store.slots == 2 and store.held() == 2
    assert not store.publish(fill_with(3.0), 0, None)  # both held: skipped, not blocked
    assert store.skipped == 1
    assert np.all(leased(store).snapshot.array == 2.0)  # the previous snapshot is still served
    first.release()
    assert store.publish(fill_with(4.0), 0, None)
    assert np.all(first.snapshot.array == 4.0)  # the freed slot was reused
    second.release()


class FakeTracker:
    """Stands in for a ZeroMQ MessageTracker: `done` once the reply has left."""

    def __init__(self):
        self.done = False


def test_a_lease_handed_to_a_tracker_lasts_until_the_send_is_done():
    store = SnapshotStore(10, np.float32, max_slots=2)
    store.publish(fill_with(1.0), 0, None)
    tracker = FakeTracker()
    sent = leased(store)
    sent.release_when(cast(zmq.MessageTracker, tracker))
    store.publish(fill_with(2.0), 0, None)  # slot 1
    assert leased(store).snapshot.slot == 1
    leased(store).release_when(cast(zmq.MessageTracker, FakeTracker()))  # slot 1 being sent too
    assert not store.publish(fill_with(3.0), 0, None)  # both still being sent: skipped
    assert np.all(sent.snapshot.array == 1.0)
    tracker.done = True
    assert store.publish(fill_with(3.0), 0, None) and newest(store).slot == 0


def test_two_slots_with_the_other_held_skip_the_publish_and_serve_the_previous_snapshot():
    """Two slots, one held by a reader, the current one free: the publish is skipped rather than the current
    rewritten in place, so a requester (mode pull above all) gets the previous snapshot, never `busy`."""
    store = SnapshotStore(10, np.float32, max_slots=2)
    store.publish(fill_with(1.0), 0, None)
    reader = leased(store)  # slot 0, held
    store.publish(fill_with(2.0), 0, None)  # slot 1, current, free
    assert not store.publish(fill_with(3.0), 0, None) and store.skipped == 1
    snap = newest(store)
    assert snap.slot == 1 and snap.version == 2 and np.all(snap.array == 2.0)
    reader.release()
    assert store.publish(fill_with(3.0), 0, None) and newest(store).slot == 0


def test_with_rewrite_in_place_the_current_slot_is_rewritten_and_leased_to_nobody_meanwhile():
    """Mode symmetric's store: two slots, one held by a reader; the next publish rewrites the current one
    (nobody holds it). While it is written, no lease is given, and the refusal says why (busy); then the
    new snapshot is current."""
    store = SnapshotStore(10, np.float32, max_slots=2, rewrite_in_place=True)
    store.publish(fill_with(1.0), 0, None)
    reader = leased(store)  # slot 0, held
    store.publish(fill_with(2.0), 0, None)  # slot 1, current, free
    during: list[object] = []

    def fill(array: np.ndarray) -> None:
        during.append(store.lease())
        during.append(store.refusal())
        array[:] = 3.0

    assert store.publish(fill, 0, None)
    assert during == [None, ("busy", "the snapshot is being rewritten; ask again")]
    snap = newest(store)
    assert snap.slot == 1 and snap.version == 3 and np.all(snap.array == 3.0)
    assert np.all(reader.snapshot.array == 1.0) and store.slots == 2 and store.skipped == 0
    reader.release()


def test_a_single_slot_is_rewritten_in_place_and_leased_to_nobody_meanwhile():
    """`snapshot_slots: 1`: the slot is rewritten in place when nobody holds it. While it is written no lease
    is given, and the refusal says why (busy); then the new snapshot is current. A held slot skips the
    publish instead."""
    store = SnapshotStore(10, np.float32, max_slots=1)
    store.publish(fill_with(1.0), 0, None)
    during: list[object] = []

    def fill(array: np.ndarray) -> None:
        during.append(store.lease())
        during.append(store.refusal())
        array[:] = 3.0

    assert store.publish(fill, 0, None)
    assert during == [None, ("busy", "the snapshot is being rewritten; ask again")]
    snap = newest(store)
    assert snap.slot == 0 and snap.version == 2 and np.all(snap.array == 3.0)
    reader = leased(store)
    assert not store.publish(fill_with(4.0), 0, None) and store.skipped == 1
    assert np.all(reader.snapshot.array == 3.0) and store.slots == 1
    reader.release()


def test_a_failed_rewrite_in_place_leaves_no_snapshot_to_lease():
    """The fill raises while the one slot is rewritten in place: its contents are gone, so nothing is
    leased (not a half-written snapshot) until the next publish."""
    store = SnapshotStore(10, np.float32, max_slots=1)
    store.publish(fill_with(1.0), 0, None)

    def broken(array: np.ndarray) -> None:
        array[:5] = 9.0
        raise RuntimeError("the copy failed")

    with pytest.raises(RuntimeError, match="the copy failed"):
        store.publish(broken, 0, None)
    assert store.lease() is None and store.refusal()[0] == "not_ready"
    assert store.publish(fill_with(4.0), 0, None) and np.all(newest(store).array == 4.0)


def counting_memory(allocations: list[int]):
    def memory(index):
        allocations.append(index)
        return HeapMemory(np.empty(10, np.float32))

    return memory


def test_slots_are_allocated_lazily_and_bounded():
    allocations: list[int] = []
    store = SnapshotStore(10, np.float32, max_slots=4, memory=counting_memory(allocations))
    for value in range(100):
        store.publish(fill_with(float(value)), 0, None)
    assert allocations == [0, 1]  # nobody reads: two slots suffice
    leases = [leased(store)]
    for value in range(10):  # each snapshot leased and kept: the store grows to max_slots, then skips
        store.publish(fill_with(float(value)), 0, None)
        leases.append(leased(store))
    assert allocations == [0, 1, 2, 3] and store.slots == 4
    assert store.skipped == 7 and store.retired == 0  # our own leases are never retired
    for lease in leases:
        lease.release()
    assert store.publish(fill_with(1.0), 0, None)


def test_a_slot_held_too_long_by_unsent_replies_is_retired_and_publishing_goes_on(monkeypatch):
    allocations: list[int] = []
    store = SnapshotStore(
        10, np.float32, max_slots=2, memory=counting_memory(allocations), hold_limit_s=5.0, max_retired=1
    )
    now = [1000.0]
    monkeypatch.setattr("dpwa.gossip.transfer.snapshots.time.monotonic", lambda: now[0])
    trackers: list[FakeTracker] = []

    def serve_to_a_client_that_never_reads():
        lease = leased(store)
        trackers.append(FakeTracker())
        lease.release_when(cast(zmq.MessageTracker, trackers[-1]))

    store.publish(fill_with(1.0), 0, None)
    serve_to_a_client_that_never_reads()  # slot 0 held
    store.publish(fill_with(2.0), 0, None)  # slot 1
    serve_to_a_client_that_never_reads()  # slot 1 held too
    assert not store.publish(fill_with(3.0), 0, None)  # both held, none for long: skipped
    assert newest(store).array[0] == 2.0
    now[0] += 5.5  # slot 0 has been held past the limit
    assert store.publish(fill_with(3.0), 0, None)  # retired and replaced by a fresh one
    assert newest(store).array[0] == 3.0 and store.retired == 1 and allocations == [0, 1, 0]
    assert store.retired_alive() == 1  # its memory lives on for the reader that holds it
    serve_to_a_client_that_never_reads()
    now[0] += 5.5
    assert not store.publish(fill_with(4.0), 0, None)  # max_retired retired slots are alive already
    trackers[0].done = True  # the first reader finally read its reply
    assert store.retired_alive() == 0
    assert store.publish(fill_with(4.0), 0, None) and store.retired == 2


def test_concurrent_readers_never_see_a_torn_snapshot():
    store = SnapshotStore(50_000, np.float32, max_slots=4)
    store.publish(fill_with(0.0), 0, None)
    stop = threading.Event()
    torn = []

    def reader():
        while not stop.is_set():
            lease = leased(store)
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


def test_a_slot_nobody_holds_is_lent_to_receive_into_and_is_neither_published_into_nor_lent_twice():
    """The memory budget (docs/design.md#memory): a peer's snapshot is received into the node's own slot that
    is not current and that nobody holds, so two slots are all the node holds. Never the current slot, a
    leased one, or one a publish is filling; while lent, a publish that would need it is skipped (two slots,
    mode pull) or rewrites the current one (mode symmetric); given back, it is lent or published into again."""
    store = SnapshotStore(10, np.float32, max_slots=2)
    assert store.borrow() is None  # no slot yet
    store.publish(fill_with(1.0), 0, None)
    assert store.borrow() is None  # the one slot is current
    store.publish(fill_with(2.0), 0, None)  # slot 1 current, slot 0 free
    lent = store.borrow()
    assert lent is not None and store.lent == 1
    array, give_back = lent
    assert store.borrow() is None  # lent once
    array[:] = 9.0  # a peer's snapshot arrives
    assert not store.publish(fill_with(3.0), 0, None) and store.skipped == 1  # slot 0 is not written
    assert np.all(array == 9.0) and newest(store).version == 2
    give_back()
    give_back()  # idempotent
    assert store.publish(fill_with(3.0), 0, None) and newest(store).slot == 0
    with leased(store):  # slot 0 current and leased; slot 1 free
        lent = store.borrow()
        assert lent is not None and lent[0] is not newest(store).array
        lent[1]()

    symmetric = SnapshotStore(10, np.float32, max_slots=2, rewrite_in_place=True)
    symmetric.publish(fill_with(1.0), 0, None)
    symmetric.publish(fill_with(2.0), 0, None)
    lent = symmetric.borrow()
    assert lent is not None
    assert symmetric.publish(fill_with(3.0), 0, None)  # the current slot, rewritten in place
    assert newest(symmetric).slot == 1 and np.all(newest(symmetric).array == 3.0)
    lent[1]()

    filling = SnapshotStore(10, np.float32, max_slots=2)
    filling.publish(fill_with(1.0), 0, None)
    seen: list[object] = []

    def fill(out: np.ndarray) -> None:
        seen.append(filling.borrow())
        out.fill(2.0)

    filling.publish(fill, 0, None)
    assert seen == [None]  # the slot being filled is claimed; the other is current
