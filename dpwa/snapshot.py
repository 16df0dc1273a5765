"""Published snapshots: the training thread writes, the Rx thread serves, nobody waits.

A :class:`SnapshotStore` owns a few flat buffers ("slots"). ``publish`` copies
the model into a slot that nobody is reading and then, under a lock held for
a pointer swap only, makes it the current snapshot. Readers take a
:class:`Lease` on the current slot; a slot with a live lease is never written.
A lease ends when it is released, or, for a zero-copy ZeroMQ send, when
ZeroMQ's ``MessageTracker`` says the bytes have left.

So a snapshot is never served torn, and publishing never waits for a reader:
when every slot is held (peers that ask and never read, say), a new slot is
allocated, up to ``max_slots``; past that the publish is skipped and counted,
and peers keep getting the previous snapshot.

A slot's memory is an ordinary array, or a shared-memory file
(:class:`dpwa.shm.SlotFile`) that same-host peers read directly; those peers
hold the slot with a file lock, which ``begin_write`` respects.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

__all__ = ["Lease", "Snapshot", "SnapshotStore"]


class _Hold(Protocol):
    @property
    def done(self) -> bool: ...


class _ManualHold:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


class SlotMemory(Protocol):
    """Where a slot's bytes live."""

    array: np.ndarray

    def begin_write(self) -> bool:
        """Claim the memory for writing if no out-of-process reader holds it; never waits."""

    def end_write(self, version: int) -> None:
        """Writing is over; `version` is now in it (0: nothing valid)."""


class HeapMemory:
    """Slot memory that only this process can see."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def begin_write(self) -> bool:
        return True

    def end_write(self, version: int) -> None:
        pass


@dataclass(frozen=True)
class Snapshot:
    """One published state of the model."""

    array: np.ndarray  # the flat parameters; read-only by convention while leased
    version: int  # 1 for the first publish, then +1 each time
    clock: float  # samples (or batches) trained when it was published
    loss: float | None  # the loss reported with it, None if unknown
    slot: int = 0  # which slot holds it


class _Slot:
    __slots__ = ("index", "memory", "array", "holds")

    def __init__(self, index: int, memory: SlotMemory) -> None:
        self.index = index
        self.memory = memory
        self.array = memory.array
        self.holds: list[_Hold] = []

    def busy(self) -> bool:
        self.holds = [h for h in self.holds if not h.done]
        return bool(self.holds)


class Lease:
    """A reader's claim on one snapshot; release it when done reading."""

    __slots__ = ("snapshot", "_store", "_slot", "_hold")

    def __init__(self, store: "SnapshotStore", slot: _Slot, snapshot: Snapshot, hold: _ManualHold) -> None:
        self.snapshot = snapshot
        self._store, self._slot, self._hold = store, slot, hold

    def release(self) -> None:
        """End the lease. Idempotent."""
        self._hold.done = True

    def share(self) -> "Lease":
        """A second, independent lease on the same snapshot."""
        hold = _ManualHold()
        with self._store._lock:
            self._slot.holds.append(hold)
        return Lease(self._store, self._slot, self.snapshot, hold)

    def release_when(self, tracker: _Hold) -> None:
        """Hand the lease to `tracker`: the slot stays held until ``tracker.done``."""
        with self._store._lock:
            self._slot.holds.append(tracker)
        self._hold.done = True

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SnapshotStore:
    """Multi-buffered snapshots of one flat model, for one publisher and many readers."""

    def __init__(
        self,
        size: int,
        dtype: np.dtype | type = np.float32,
        *,
        max_slots: int = 8,
        allocate: Callable[[int, np.dtype], np.ndarray] | None = None,
        memory: Callable[[int], SlotMemory] | None = None,
    ) -> None:
        """
        Args:
            size, dtype: elements per snapshot and their (storage) dtype.
            max_slots: the most buffers ever allocated.
            allocate: makes a heap buffer (size, dtype) -> array; np.empty by default.
            memory: makes slot `index`'s memory instead (shared-memory files).
        """
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if max_slots < 2:
            raise ValueError(f"max_slots must be >= 2 (one to serve, one to fill), got {max_slots}")
        self.size = size
        self.dtype = np.dtype(dtype)
        self.max_slots = max_slots
        allocate = allocate or (lambda n, dt: np.empty(n, dtype=dt))
        self._memory = memory or (lambda index: HeapMemory(allocate(self.size, self.dtype)))
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        self._slots: list[_Slot] = []
        self._current: tuple[_Slot, Snapshot] | None = None
        self.skipped = 0  # publishes dropped because every slot was held

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def slots(self) -> int:
        """How many buffers exist now."""
        return len(self._slots)

    def publish(self, fill: Callable[[np.ndarray], None], clock: float, loss: float | None) -> bool:
        """Fill a free slot with `fill(array)` and make it current.

        Returns False (and serves the previous snapshot on) when every slot is
        held and ``max_slots`` is reached. Never waits for a reader.
        """
        if not self._publishing.acquire(blocking=False):
            raise RuntimeError("SnapshotStore.publish called from two threads at once; it has one publisher")
        try:
            slot = self._free_slot()
            if slot is None:
                self.skipped += 1
                return False
            version = self._current[1].version + 1 if self._current else 1
            try:
                fill(slot.array)  # outside the lock: readers only ever lease the current slot
            except BaseException:
                slot.memory.end_write(0)
                raise
            slot.memory.end_write(version)
            with self._lock:
                self._current = (slot, Snapshot(slot.array, version, float(clock), loss, slot.index))
            return True
        finally:
            self._publishing.release()

    def _free_slot(self) -> _Slot | None:
        """A slot nobody holds, claimed for writing; None when all are held and max_slots is reached."""
        with self._lock:
            current = self._current[0] if self._current else None
            for slot in self._slots:
                if slot is not current and not slot.busy() and slot.memory.begin_write():
                    return slot
            if len(self._slots) >= self.max_slots:
                return None
            index = len(self._slots)
        # Allocate outside the lock: a model-sized allocation can take milliseconds.
        slot = _Slot(index, self._memory(index))
        slot.memory.begin_write()
        with self._lock:
            self._slots.append(slot)
        return slot

    def current(self) -> Snapshot | None:
        """The latest snapshot's metadata (do not read its array without a lease)."""
        with self._lock:
            return self._current[1] if self._current else None

    def lease(self) -> Lease | None:
        """Lease the current snapshot, or None if nothing was published yet."""
        with self._lock:
            if self._current is None:
                return None
            slot, snapshot = self._current
            hold = _ManualHold()
            slot.holds.append(hold)
            return Lease(self, slot, snapshot, hold)

    def held(self) -> int:
        """How many slots are held by readers now."""
        with self._lock:
            return sum(1 for slot in self._slots if slot.busy())
