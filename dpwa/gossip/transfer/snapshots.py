"""Published snapshots: the training thread writes, the Rx thread serves, nobody waits.

A :class:`SnapshotStore` owns a few flat buffers ("slots"). ``publish`` copies
the model into a slot that nobody is reading and then, under a lock held for
a pointer swap only, makes it the current snapshot. Readers take a
:class:`Lease` on the current slot; a slot with a live lease is never written.
A lease ends when its owner releases it (a ``with`` block), or, for a
zero-copy ZeroMQ send, when ZeroMQ's ``MessageTracker`` says the bytes left.

So a snapshot is never served torn, and publishing never waits for a reader:
when every slot is held, a new one is allocated, up to ``max_slots``. Past
that the publish is skipped, and readers get the previous snapshot; or, with
``rewrite_in_place`` (and always with one slot), the current slot is
rewritten when nobody holds it: while it is written no lease is given
(:meth:`SnapshotStore.refusal` says why), and the new snapshot is current
once it is whole. A slot
held *only* by others (unsent replies, or a same-host reader's file lock) for
longer than ``hold_limit_s`` is **retired**: the store forgets it (its memory
lives on until the last sender or reader lets go) and allocates a fresh one
in its place. So a peer that asks and never reads can delay publishing by at
most ``hold_limit_s``, never stop it. Leases this process holds itself
(an exchange waiting for its decision) are never retired: their number is
bounded by their owners. Retired slots still alive are bounded by
``max_retired``; past it a publish is skipped and counted.

A slot's memory is an ordinary array, or a shared-memory file
(:class:`dpwa.wire.shm.SlotFile`) that same-host peers read in place;
:class:`SlotAllocator` falls back to the heap, once and with one warning,
when shared memory fails (a full ``/dev/shm``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import zmq

from ...logs import logger
from ...wire.shm import SharedSlots

__all__ = ["HeapMemory", "Lease", "SlotAllocator", "SlotMemory", "Snapshot", "SnapshotStore"]


class SlotMemory(Protocol):
    """Where a slot's bytes live."""

    array: np.ndarray
    shared: bool  # same-host peers can read it in place

    def begin_write(self) -> bool:
        """Claim the memory for writing if no out-of-process reader holds it; never waits."""

    def end_write(self, version: int) -> None:
        """Writing is over; `version` is now in it (0: nothing valid)."""

    def retire(self) -> None:
        """The store lets go of this memory; whoever still reads it keeps it alive."""


class HeapMemory:
    """Slot memory that only this process can see."""

    shared = False

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def begin_write(self) -> bool:
        return True

    def end_write(self, version: int) -> None:
        pass

    def retire(self) -> None:
        pass


class SlotAllocator:
    """Makes slot memory: shared-memory files when same-host peers exist, else (or once those fail) heap arrays."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype,
        allocate: Callable[[int, np.dtype], np.ndarray],
        shared: SharedSlots | None = None,
        name: str = "dpwa",
    ) -> None:
        self.size, self.dtype, self._allocate, self._shared, self._name = size, dtype, allocate, shared, name
        self.shared_failed: str | None = None  # why shared memory stopped being used

    def __call__(self, index: int) -> SlotMemory:
        if self._shared is not None and self.shared_failed is None:
            try:
                return self._shared.allocate(index)
            except OSError as exc:
                self.shared_failed = f"{exc.strerror or exc} ({self._shared.dir})"
                logger.warning(
                    "%s: shared memory failed: %s; snapshots from now on go over TCP to same-host peers too",
                    self._name,
                    self.shared_failed,
                )
        return HeapMemory(self._allocate(self.size, self.dtype))


@dataclass(frozen=True)
class Snapshot:
    """One published state of the model."""

    array: np.ndarray  # the flat parameters; read-only by convention while leased
    version: int  # 1 for the first publish, then +1 each time
    clock: float  # samples (or batches) trained when it was published
    loss: float | None  # the loss reported with it, None if unknown
    slot: int = 0  # which slot holds it
    shared: bool = False  # in a shared-memory slot that same-host peers can read


class _Slot:
    __slots__ = ("index", "memory", "array", "leases", "trackers", "blocked_since")

    def __init__(self, index: int, memory: SlotMemory) -> None:
        self.index = index
        self.memory = memory
        self.array = memory.array
        self.leases = 0  # live leases of this process
        self.trackers: list[tuple[zmq.MessageTracker, float]] = []  # unsent replies, since when
        self.blocked_since: float | None = None  # an out-of-process reader's lock stopped a write

    def held(self) -> bool:
        self.trackers = [(t, since) for t, since in self.trackers if not t.done]
        return bool(self.leases or self.trackers)

    def stale(self, now: float, limit_s: float) -> bool:
        """Held only by others, for longer than `limit_s`."""
        if self.leases:
            return False
        oldest = min([since for _, since in self.trackers] + [self.blocked_since or now])
        return now - oldest > limit_s


class Lease:
    """A claim on one snapshot: its slot is not rewritten until the lease ends. A context manager."""

    __slots__ = ("snapshot", "_store", "_slot", "_live")

    def __init__(self, store: SnapshotStore, slot: _Slot, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._store, self._slot, self._live = store, slot, True

    def release(self) -> None:
        """End the lease. Idempotent."""
        with self._store._lock:
            if self._live:
                self._live = False
                self._slot.leases -= 1

    def share(self) -> Lease:
        """A second, independent lease on the same snapshot."""
        with self._store._lock:
            self._slot.leases += 1
        return Lease(self._store, self._slot, self.snapshot)

    def release_when(self, tracker: zmq.MessageTracker) -> None:
        """Hand the lease to `tracker`: the slot stays held until ``tracker.done`` (or is retired)."""
        with self._store._lock:
            self._slot.trackers.append((tracker, time.monotonic()))
        self.release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SnapshotStore:
    """Multi-buffered snapshots of one flat model, for one publisher and many readers.

    Args:
        size, dtype: elements per snapshot and their (storage) dtype.
        max_slots: the most slots in use at once.
        memory: makes slot `index`'s memory; heap arrays by default.
        hold_limit_s: a slot held only by others for longer is retired.
        max_retired: retired slots still alive (held by their readers) at most.
        rewrite_in_place: past `max_slots`, rewrite the current slot when nobody holds it, instead of
            skipping the publish (no lease is given meanwhile). Right where a snapshot serves one
            exchange (mode symmetric): once spent it is refused anyway, and this brings the next one
            sooner. One slot is always rewritten in place: there is no other to fill.
    """

    def __init__(
        self,
        size: int,
        dtype: np.dtype | type = np.float32,
        *,
        max_slots: int = 6,
        memory: Callable[[int], SlotMemory] | None = None,
        hold_limit_s: float = 5.0,
        max_retired: int = 8,
        rewrite_in_place: bool = False,
    ) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.size = size
        self.dtype = np.dtype(dtype)
        self.max_slots = max_slots
        self.in_place = rewrite_in_place or max_slots == 1
        self.hold_limit_s = hold_limit_s
        self.max_retired = max_retired
        self._memory = memory or (lambda index: HeapMemory(np.empty(self.size, dtype=self.dtype)))
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._slots: list[_Slot] = []
        self._retired: list[_Slot] = []
        self._current: tuple[_Slot, Snapshot] | None = None
        self._writing: _Slot | None = None  # the current slot, while it is rewritten in place (no lease given)
        self.skipped = 0  # publishes dropped because every slot was held
        self.retired = 0  # slots retired because others held them too long
        self.lent = 0  # slots lent to receive a peer's snapshot into (borrow)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def slots(self) -> int:
        """How many slots are in use now (retired ones not counted)."""
        return len(self._slots)

    def retired_alive(self) -> int:
        """Retired slots whose memory a reader still holds."""
        with self._lock:
            self._retired = [s for s in self._retired if s.held()]
            return len(self._retired)

    def publish(self, fill: Callable[[np.ndarray], None], clock: float, loss: float | None) -> bool:
        """Fill a free slot with `fill(array)` and make it current.

        Returns False (and serves the previous snapshot on) when no slot is
        free and none can be made. Never waits for a reader.
        """
        if not self._publishing.acquire(blocking=False):
            raise RuntimeError("SnapshotStore.publish called from two threads at once; it has one publisher")
        try:
            slot = self._free_slot()  # claimed (one lease of ours) until it is whole
            if slot is None:
                self.skipped += 1
                return False
            version = self._current[1].version + 1 if self._current else 1
            try:
                fill(slot.array)  # outside the lock: readers only ever lease the current slot, never this one
            except BaseException:
                slot.memory.end_write(0)
                with self._lock:
                    slot.leases -= 1
                    if self._writing is slot:  # the current snapshot was being rewritten: it is gone
                        self._current, self._writing = None, None
                raise
            slot.memory.end_write(version)
            snapshot = Snapshot(slot.array, version, float(clock), loss, slot.index, slot.memory.shared)
            with self._lock:
                slot.leases -= 1
                self._current, self._writing = (slot, snapshot), None
            return True
        finally:
            self._publishing.release()

    def _free_slot(self) -> _Slot | None:
        """A slot nobody holds, claimed for writing; a new or replacing one if needed; None if impossible."""
        now = time.monotonic()
        with self._lock:
            current = self._current[0] if self._current else None
            stale = None
            for slot in self._slots:
                if slot is current:
                    continue
                if not slot.held():
                    if slot.memory.begin_write():
                        slot.blocked_since = None
                        slot.leases += 1  # claimed for the fill: nobody borrows it meanwhile
                        return slot
                    slot.blocked_since = slot.blocked_since or now  # a same-host reader holds its lock
                if stale is None and slot.stale(now, self.hold_limit_s):
                    stale = slot
            # Else (not in_place) a publish that finds every other slot held is skipped, and peers get the
            # previous snapshot: a rewrite in place would answer them `busy` while it lasts.
            single = self.max_slots == 1
            if single and stale is None and current is not None and current.stale(now, self.hold_limit_s):
                stale = current  # retired like any other; it is served until the fresh one is whole
            if len(self._slots) < self.max_slots:
                index = len(self._slots)
            elif self.in_place and current is not None and not current.held() and current.memory.begin_write():
                self._writing = current  # rewritten in place: no lease of it until the new snapshot is whole
                current.blocked_since = None
                current.leases += 1
                return current
            elif stale is not None:
                self._retired = [s for s in self._retired if s.held()]
                if len(self._retired) >= self.max_retired:
                    return None
                index = stale.index
            else:
                return None
        # Allocate outside the lock: a model-sized allocation can take milliseconds.
        fresh = _Slot(index, self._memory(index) if stale is None else self._replace(stale))
        fresh.memory.begin_write()
        fresh.leases = 1  # claimed for the fill
        with self._lock:
            if stale is None:
                self._slots.append(fresh)
            else:
                self._slots[self._slots.index(stale)] = fresh
        return fresh

    def _replace(self, stale: _Slot) -> SlotMemory:
        stale.memory.retire()
        with self._lock:
            self._retired.append(stale)
            self.retired += 1
        logger.warning(
            "snapshot slot %d was held by readers for over %.1f s; retired it and made a new one",
            stale.index,
            self.hold_limit_s,
        )
        return self._memory(stale.index)

    def borrow(self) -> tuple[np.ndarray, Callable[[], None]] | None:
        """A slot that is not current and that nobody holds, lent as memory to receive into (a peer's snapshot,
        until it is blended), with the function that gives it back (idempotent); None when there is none.

        So a node that receives a peer's snapshot needs no buffer of its own beside its two slots
        (docs/design.md#memory). While it is lent, nothing is published into the slot and it is never retired:
        a publish that needs it is skipped (mode pull) or rewrites the current slot (mode symmetric), as when a
        reader holds it. Given back, it holds no snapshot (version 0) until the next publish fills it."""
        with self._lock:
            current = self._current[0] if self._current else None
            for slot in self._slots:
                if slot is not current and not slot.held() and slot.memory.begin_write():
                    slot.leases += 1
                    self.lent += 1
                    break
            else:
                return None
        lent = [slot]

        def give_back() -> None:
            with self._lock:
                if lent:
                    lent.pop().leases -= 1
                    slot.memory.end_write(0)

        return slot.array, give_back

    def current(self) -> Snapshot | None:
        """The latest snapshot's metadata (do not read its array without a lease)."""
        with self._lock:
            return self._current[1] if self._current else None

    def lease(self) -> Lease | None:
        """Lease the current snapshot, or None if there is none to lease now (:meth:`refusal` says why)."""
        with self._lock:
            if self._current is None or self._current[0] is self._writing:
                return None
            slot, snapshot = self._current
            slot.leases += 1
            return Lease(self, slot, snapshot)

    def refusal(self) -> tuple[Literal["busy", "not_ready"], str]:
        """Why :meth:`lease` gave nothing: the refusal a requester gets (reason, in words)."""
        with self._lock:
            if self._current is not None:  # lease() found it being rewritten (it may be whole by now)
                return "busy", "the snapshot is being rewritten; ask again"
            return "not_ready", "no snapshot published yet"

    def held(self) -> int:
        """How many slots in use are held by readers now."""
        with self._lock:
            return sum(1 for slot in self._slots if slot.held())
