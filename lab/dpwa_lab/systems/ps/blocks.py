"""One block on a parameter server: its values, its optimizer, its version, and its own queue and applier thread.

Updates to a block are applied one at a time, in the order they arrived,
by the block's applier thread, which takes them from the block's bounded
queue (a blocking queue: the thread sleeps until an update comes). There is
no barrier: blocks, and servers, advance independently. A parameter block's
update is a gradient, applied with SGD (:class:`~..optim.FlatSGD`); a buffer
block's (BatchNorm running statistics) is a delta, added. Both are scaled
by ``scale`` (a server fed by N trainers uses 1/N, so N updates move the
model as far as one synchronous step over the N batches would).

**Staleness** is recorded at apply time: the block's version (updates
applied so far) minus the version the update was computed on.

Reads (a trainer's pull) copy the values under the block's lock, so a pull
never sees half an update.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpwa.logs import logger

from ..optim import FlatSGD, SGDSettings
from .sharding import Block

__all__ = ["BlockApplier", "BlockUpdate"]

_STOP = object()
MAX_STALENESS_KEY = 4095  # staleness beyond this is counted under this key


@dataclass
class BlockUpdate:
    """One trainer's update to one block."""

    values: np.ndarray  # gradient or delta (a view into the received frame, which it keeps alive)
    version: int  # the block's version the trainer computed it on
    batch: int  # samples behind it
    received: float  # time.monotonic() when it arrived


class BlockApplier:
    """A block's state and the thread that applies its updates.

    Args:
        block: which variable, and where it sits.
        values: the block's values (a view into the server's flat vector), updated in place.
        settings, schedule: the optimizer of a parameter block (schedule: lr by samples applied).
        scale: every update is multiplied by this.
        queue_depth: updates that may wait; beyond, the server refuses pushes ``busy``.
    """

    def __init__(
        self,
        block: Block,
        values: np.ndarray,
        settings: SGDSettings,
        schedule: Callable[[int], float] | None,
        *,
        scale: float = 1.0,
        queue_depth: int = 8,
        name: str = "ps",
    ) -> None:
        if values.shape != (block.size,):
            raise ValueError(f"block {block.variable.name}: {values.shape} values for {block.size} elements")
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {scale}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.block = block
        self.values = values
        self.scale = scale
        self.kind = block.variable.kind
        self._optimizer = FlatSGD(values, settings, schedule) if self.kind == "param" else None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_depth + 1)  # +1: room for the stop marker
        self._depth = queue_depth
        self._lock = threading.Lock()
        self.version = 0
        self.samples = 0
        self.staleness: Counter[int] = Counter()
        self.wait_s = 0.0  # time updates spent queued, summed
        self._thread = threading.Thread(target=self._run, name=f"dpwa-{name}-{block.variable.name}", daemon=True)

    # ----------------------------------------------------------------- lifetime

    def start(self) -> BlockApplier:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread after the update it is applying; updates still queued are dropped. True if it ended."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: applier thread still running %.1f s after close()", self._thread.name, timeout_s)
            return False
        return True

    # ----------------------------------------------------------------- the server's thread

    def has_room(self) -> bool:
        """Whether one more update fits (only the server's thread adds, so a True stays true until it does)."""
        return self._queue.qsize() < self._depth

    def offer(self, update: BlockUpdate) -> None:
        self._queue.put_nowait(update)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def read(self, out: np.ndarray) -> tuple[int, int]:
        """Copy the values into `out`; return (version, samples) of what was copied."""
        with self._lock:
            np.copyto(out, self.values)
            return self.version, self.samples

    def staleness_counts(self) -> Counter[int]:
        """A copy of the staleness histogram (versions behind -> updates)."""
        with self._lock:
            return Counter(self.staleness)

    # ----------------------------------------------------------------- the applier thread

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            try:
                self._apply(item)
            except Exception:  # a bug must be loud, and must not stop the block
                logger.exception("%s: failed to apply an update", self._thread.name)

    def _apply(self, update: BlockUpdate) -> None:
        with self._lock:
            stale = max(0, self.version - update.version)
            self.staleness[min(stale, MAX_STALENESS_KEY)] += 1
            if self._optimizer is not None:
                self._optimizer.step(update.values, self.samples, self.scale)
            else:
                self.values += np.float32(self.scale) * update.values
            self.version += 1
            self.samples += update.batch
            self.wait_s += time.monotonic() - update.received
