"""The master's global model: flat parameters and buffers, the sums of one step, and published copies.

:class:`GlobalModel` is the :class:`~.master.Aggregator` the master steps:
``add`` sums a report (gradients weighted by their batch, buffer deltas),
``step`` applies the sample-weighted mean gradient with :class:`~..optim.FlatSGD`
and adds the mean buffer delta (a BatchNorm running statistic moves as if one
worker had seen every batch of the step), then publishes a fresh read-only
copy that replies send without copying again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..layout import ModelLayout
from ..optim import FlatSGD, SGDSettings

__all__ = ["GlobalModel"]


class GlobalModel:
    """The model a sync master keeps.

    Args:
        layout: the model's variables.
        params, buffers: initial values (copied).
        settings: the optimizer.
        schedule: learning rate as a function of the samples applied so far.
    """

    def __init__(
        self,
        layout: ModelLayout,
        params: np.ndarray,
        buffers: np.ndarray,
        settings: SGDSettings,
        schedule: Callable[[int], float] | None = None,
    ) -> None:
        if params.shape != (layout.param_size,) or buffers.shape != (layout.buffer_size,):
            raise ValueError(
                f"expected {layout.param_size} parameters and {layout.buffer_size} buffer values, "
                f"got shapes {params.shape} and {buffers.shape}"
            )
        self.layout = layout
        self.params = np.array(params, dtype=np.float32)
        self.buffers = np.array(buffers, dtype=np.float32)
        self._optimizer = FlatSGD(self.params, settings, schedule)
        self._grad_sum = np.zeros(layout.param_size, np.float64)
        self._delta_sum = np.zeros(layout.buffer_size, np.float64)
        self._batch_sum = 0
        self.count = 0
        self.samples = 0  # samples applied in steps so far
        self.published = self._publish()

    def add(self, grads: np.ndarray, deltas: np.ndarray, batch: int) -> None:
        if grads.shape != self._grad_sum.shape or deltas.shape != self._delta_sum.shape:
            raise ValueError(f"a report of shapes {grads.shape}, {deltas.shape} does not fit this model")
        self._grad_sum += grads.astype(np.float64) * batch  # each gradient is a mean over its batch
        self._delta_sum += deltas
        self._batch_sum += batch
        self.count += 1

    def step(self) -> None:
        if not self.count:
            return
        mean = (self._grad_sum / self._batch_sum).astype(np.float32)
        self._optimizer.step(mean, self.samples)
        self.buffers += (self._delta_sum / self.count).astype(np.float32)
        self.samples += self._batch_sum
        self._grad_sum[:] = 0
        self._delta_sum[:] = 0
        self._batch_sum = 0
        self.count = 0
        self.published = self._publish()

    @property
    def lr(self) -> float:
        return self._optimizer.lr

    def _publish(self) -> tuple[np.ndarray, np.ndarray]:
        params, buffers = self.params.copy(), self.buffers.copy()
        params.flags.writeable = False
        buffers.flags.writeable = False
        return params, buffers

    def state(self) -> np.ndarray:
        """Parameters then buffers, one flat vector (a copy)."""
        return np.concatenate([self.params, self.buffers])
