"""A sync-SGD worker's loop: get a task; for each minibatch update the model if out of date, compute, report.

The worker keeps no optimizer: its parameters are always the master's model
of some version. Before each forward pass the BatchNorm buffers are reset to
the master's, so the delta a report carries is what this one batch did to
them.

A report refused as ``stale_version`` (the master stepped meanwhile) is
computed again on the new model, up to ``max_retries`` times; past that the
task is reported failed and goes back to todo. A report refused as
``not_held`` means the lease expired (this worker was too slow or stalled)
and the task was handed to another worker: the worker drops it and asks for
a new one.

Example::

    with MasterClient(endpoint, "w1", view.layout) as client:
        stats = SyncWorker(client, view, compute, batches_for).run()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..layout import ModuleView
from .client import MasterClient
from .master import Assignment, NoMoreTask, Refusal, Segment, Wait

__all__ = ["SyncWorker", "WorkerStats"]

Compute = Callable[[Any], tuple[float, int]]  # forward + backward of one batch on the module: (loss, samples)


@dataclass
class WorkerStats:
    tasks_done: int = 0
    tasks_failed: int = 0  # reported failed after too many refusals
    tasks_lost: int = 0  # the lease expired while this worker held the task
    reports_accepted: int = 0
    reports_refused: int = 0  # refused as stale_version, and computed again
    models_fetched: int = 0
    samples: int = 0  # samples of accepted reports
    computed_samples: int = 0  # samples of every gradient computed, accepted or not
    steps: int = 0  # gradients computed
    compute_s: float = 0.0  # forward + backward
    run_s: float = 0.0
    waits: int = 0  # "wait" answers: every remaining task was held by others
    last_loss: float | None = None
    finished: str = ""  # why run() returned: no_more_task, stopped

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SyncWorker:
    """Runs the worker's loop against a master.

    Args:
        client: the connection to the master.
        view: the worker's model, seen through its layout.
        compute: runs forward and backward of one batch on ``view.module`` (the
            gradients are left in the parameters' ``.grad``); returns (loss, samples).
        batches: the minibatches of a task (a data segment), in order.
        max_retries: how many times a refused report is computed again before the task fails.
        stop: checked between minibatches; when it turns true the held task is reported failed.
    """

    def __init__(
        self,
        client: MasterClient,
        view: ModuleView,
        compute: Compute,
        batches: Callable[[Segment], Iterable[Any]],
        *,
        max_retries: int = 3,
        stop: Callable[[], bool] = lambda: False,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be at least 0, got {max_retries}")
        if client.layout.fingerprint != view.layout.fingerprint:
            raise ValueError("the client and the model have different layouts")
        self.client = client
        self.view = view
        self.compute = compute
        self.batches = batches
        self.max_retries = max_retries
        self.stop = stop
        self.version = -1  # no model yet
        self._buffers = view.buffers()
        self.stats = WorkerStats()

    def run(self, max_tasks: int | None = None) -> WorkerStats:
        """Work until the master says there is no more task, `stop` turns true, or `max_tasks` were taken."""
        start = time.monotonic()
        taken = 0
        try:
            while not self.stop() and (max_tasks is None or taken < max_tasks):
                answer = self.client.get_task()
                if isinstance(answer, NoMoreTask):
                    self.stats.finished = "no_more_task"
                    break
                if isinstance(answer, Wait):
                    self.stats.waits += 1
                    time.sleep(min(answer.retry_s, 1.0))
                    continue
                taken += 1
                self._run_task(answer)
            else:
                self.stats.finished = "stopped"
        finally:
            self.stats.run_s = time.monotonic() - start
        return self.stats

    def _update_model(self) -> None:
        got = self.client.update_model(self.version)
        if got is None:
            return
        version, params, buffers = got
        self.view.load_params(params)
        self._buffers = buffers.copy()
        self.version = version
        self.stats.models_fetched += 1

    def _compute(self, batch: Any) -> tuple[np.ndarray, np.ndarray, int]:
        self.view.load_buffers(self._buffers)
        self.view.module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss, samples = self.compute(batch)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.computed_samples += samples
        self.stats.last_loss = loss
        grads = self.view.grads()
        deltas = self.view.buffers() - self._buffers
        return grads, deltas, samples

    def _run_task(self, task: Assignment) -> None:
        for seq, batch in enumerate(self.batches(task.task), start=1):
            if self.stop():
                self._report(task, "failed")
                return
            for _attempt in range(self.max_retries + 1):
                self._update_model()
                grads, deltas, samples = self._compute(batch)
                try:
                    self.client.report_gradients(task, seq, self.version, samples, grads, deltas)
                except Refusal as exc:
                    if exc.reason == "stale_version":
                        self.stats.reports_refused += 1
                        continue
                    if exc.reason == "not_held":
                        self.stats.tasks_lost += 1
                        return
                    raise
                self.stats.reports_accepted += 1
                self.stats.samples += samples
                break
            else:
                self.stats.tasks_failed += 1
                self._report(task, "failed")
                return
        if self._report(task, "done"):
            self.stats.tasks_done += 1

    def _report(self, task: Assignment, status: str) -> bool:
        try:
            self.client.report_task(task, status)
        except Refusal as exc:
            if exc.reason == "not_held":  # the lease expired meanwhile; the task is another worker's now
                self.stats.tasks_lost += 1
                return False
            raise
        return True
