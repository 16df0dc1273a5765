"""The master of synchronous SGD as pure state: three task queues with leases, the model version, the step rule.

No sockets, no threads, no clock of its own: every call takes ``now`` (a
``time.monotonic()`` value), so tests drive time by hand. The transport
(:mod:`.service`) calls it from one thread.

**Tasks.** A task is a data segment (an epoch and a segment number) that a
worker trains on minibatch by minibatch. :class:`TaskBoard` keeps three
queues: ``todo``, ``doing`` and ``done``. ``GetTask`` moves a task from todo
to doing under a *lease*: the worker, an unguessable token, and an expiry
that every call about the task renews. A lease that expires (its worker died
or stalled) puts the task back at the front of todo; a failed task goes back
the same way. Only the lease's holder can report on a task, so once a task
was handed out again its first holder's reports are refused (``not_held``),
and no task is ever completed twice.

**The model.** The master's global model has a version. ``ReportGradients``
is accepted only for the current version (an older one is refused
``stale_version``: the worker fetches the new model and computes again). Once
``sufficient`` gradients for the version arrived, the master applies their
mean with its optimizer (an :class:`Aggregator`) and the version goes up by
one. ``sufficient`` is fixed, or by default the number of live workers:
those that called within the lease time and were not yet told there is no
more work.

**Retried requests.** A worker's transport may resend a request whose reply
was lost. Reports carry a sequence number within their lease: a resent
report that was already accepted is answered ``accepted`` again without
being added twice, and a resent ``done`` is answered as recorded.

Example::

    master = Master(make_tasks(epochs=1, segments=2), aggregator, lease_s=5.0)
    job = master.get_task("w1", now=0.0)            # an Assignment (task, token, version)
    master.report_gradients("w1", job.task.id, job.token, 1, job.version, 32, grads, deltas, now=0.1)
    master.report_task("w1", job.task.id, job.token, "done", now=0.2)
"""

from __future__ import annotations

import secrets
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..layout import check_values

__all__ = [
    "Accepted",
    "Aggregator",
    "Assignment",
    "BadRequest",
    "Holding",
    "Master",
    "NoMoreTask",
    "Refusal",
    "Segment",
    "TaskBoard",
    "Wait",
    "make_tasks",
]

MAX_BATCH = 1 << 16  # samples in one minibatch; more is a lie
WAIT_RETRY_S = 0.1  # what a worker is told to wait when every remaining task is held by others


class Refusal(Exception):
    """An ordinary refusal (an old version, a task no longer held): the worker can go on."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class BadRequest(Refusal):
    """A request no honest worker sends (an unknown task, a future version, bad values)."""


@dataclass(frozen=True)
class Segment:
    """A data segment: segment `segment` of epoch `epoch`."""

    id: int
    epoch: int
    segment: int


def make_tasks(epochs: int, segments: int) -> list[Segment]:
    """Every segment of every epoch, epoch by epoch; ids count from 0."""
    if epochs < 1 or segments < 1:
        raise ValueError(f"epochs and segments must be at least 1, got {epochs} and {segments}")
    return [Segment(e * segments + s, e, s) for e in range(epochs) for s in range(segments)]


@dataclass
class Holding:
    """Who holds a task in `doing`, and until when."""

    worker: str
    token: int
    expires_at: float
    reports: int = 0  # reports accepted within this lease (the last sequence number seen)


@dataclass(frozen=True)
class Assignment:
    task: Segment
    token: int  # proves the lease in every later call about the task
    version: int  # the model version when the task was handed out


@dataclass(frozen=True)
class Wait:
    """No task now, but some are held by others and may come back: ask again after `retry_s`."""

    retry_s: float


@dataclass(frozen=True)
class NoMoreTask:
    """Training is complete."""


@dataclass(frozen=True)
class Accepted:
    version: int  # the current version after this report
    stepped: bool  # this report completed a step
    duplicate: bool = False  # a resent report that had been accepted already


class Aggregator(Protocol):
    """The model side of the master: sums reported gradients and applies their mean."""

    count: int  # reports added since the last step

    def add(self, grads: np.ndarray, deltas: np.ndarray, batch: int) -> None: ...

    def step(self) -> None:
        """Apply the mean of what was added (optimizer step, buffer deltas) and clear the sums."""


class TaskBoard:
    """The todo, doing and done queues, with leases.

    Args:
        tasks: every task of the run.
        lease_s: how long a task stays held without a call about it.
        token: where lease tokens come from (unguessable by default).
    """

    def __init__(self, tasks: Sequence[Segment], lease_s: float, token: Callable[[], int] | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.tasks = {t.id: t for t in tasks}
        if len(self.tasks) != len(tasks):
            raise ValueError("task ids must be unique")
        self.lease_s = lease_s
        self.todo: deque[int] = deque(t.id for t in tasks)
        self.doing: dict[int, Holding] = {}
        self.done: dict[int, tuple[str, int]] = {}  # task id -> the worker and token that completed it
        self.completions: Counter[int] = Counter()  # times each task was recorded done (never more than once)
        self.retried = 0  # times a task went back to todo (failed or lease expired)
        self.expired = 0
        self.failed = 0
        self._token = token or (lambda: secrets.randbits(63) + 1)

    @property
    def complete(self) -> bool:
        return not self.todo and not self.doing

    @property
    def done_twice(self) -> int:
        return sum(n - 1 for n in self.completions.values() if n > 1)

    def expire(self, now: float) -> list[int]:
        """Put every task whose lease expired back at the front of todo; return their ids."""
        expired = [tid for tid, lease in self.doing.items() if lease.expires_at <= now]
        for tid in expired:
            del self.doing[tid]
            self.todo.appendleft(tid)
            self.retried += 1
            self.expired += 1
        return expired

    def renew(self, worker: str, now: float) -> None:
        """Extend every lease `worker` holds: any call from it shows it is alive."""
        for lease in self.doing.values():
            if lease.worker == worker:
                lease.expires_at = now + self.lease_s

    def take(self, worker: str, now: float) -> tuple[Segment, Holding] | None:
        """Move the next task from todo to doing, leased to `worker`; None if todo is empty."""
        if not self.todo:
            return None
        tid = self.todo.popleft()
        lease = self.doing[tid] = Holding(worker, self._token(), now + self.lease_s)
        return self.tasks[tid], lease

    def holding(self, task_id: int, worker: str, token: int, now: float) -> Holding:
        """The lease of `task_id` if `worker` holds it with `token` (renewed); else refuse."""
        if task_id not in self.tasks:
            raise BadRequest("unknown_task", f"task {task_id} is not a task of this run (0..{len(self.tasks) - 1})")
        lease = self.doing.get(task_id)
        if lease is None or lease.worker != worker or lease.token != token:
            where = "done" if task_id in self.done else "todo" if task_id in self.todo else "held by another worker"
            raise Refusal("not_held", f"task {task_id} is not held by {worker} with this token (it is {where})")
        lease.expires_at = now + self.lease_s
        return lease

    def finish(self, task_id: int, worker: str, token: int, status: str, now: float) -> bool:
        """Record the holder's end of a task: done (to done) or failed (back to todo). True if newly done.

        A resent ``done`` from the worker whose token completed the task is answered again (False).
        """
        if status not in ("done", "failed"):
            raise BadRequest("bad_status", f"status must be done or failed, got {status!r}")
        if status == "done" and self.done.get(task_id) == (worker, token):
            return False  # a resent report: recorded already
        lease = self.holding(task_id, worker, token, now)
        del self.doing[task_id]
        if status == "done":
            self.done[task_id] = (worker, lease.token)
            self.completions[task_id] += 1
            return True
        self.todo.appendleft(task_id)
        self.retried += 1
        self.failed += 1
        return False


class Master:
    """Synchronous SGD's master: the task board, the model version, live workers and the step rule.

    Args:
        tasks: every task of the run (see :func:`make_tasks`).
        aggregator: sums gradients and applies their mean.
        lease_s: a task returns to todo this long after the last call about it;
            a worker counts as live this long after its last call.
        sufficient: gradients per step; None: the number of live workers.
        max_batch: the largest minibatch a report may claim.
    """

    def __init__(
        self,
        tasks: Sequence[Segment],
        aggregator: Aggregator,
        *,
        lease_s: float = 10.0,
        sufficient: int | None = None,
        max_batch: int = MAX_BATCH,
        token: Callable[[], int] | None = None,
    ) -> None:
        if sufficient is not None and sufficient < 1:
            raise ValueError(f"num_gradients_sufficient must be at least 1, got {sufficient}")
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH}, got {max_batch}")
        self.board = TaskBoard(tasks, lease_s, token)
        self.aggregator = aggregator
        self.lease_s = lease_s
        self.fixed_sufficient = sufficient
        self.max_batch = max_batch
        self.version = 0
        self.steps = 0
        self.samples = 0  # samples of accepted gradients
        self.seen: dict[str, float] = {}  # worker -> last call, while it may still work
        self.finished: set[str] = set()  # workers told there is no more task
        self.refused: Counter[str] = Counter()  # refusals by reason

    # ----------------------------------------------------------------- who is live

    def _saw(self, worker: str, now: float) -> None:
        self.board.expire(now)  # first: a lease that expired is not brought back by a late call
        self.board.renew(worker, now)
        if worker not in self.finished:
            self.seen[worker] = now

    def live_workers(self, now: float) -> list[str]:
        return sorted(w for w, t in self.seen.items() if now - t < self.lease_s)

    def sufficient(self, now: float) -> int:
        if self.fixed_sufficient is not None:
            return self.fixed_sufficient
        return max(1, len(self.live_workers(now)))

    def _refuse(self, exc: Refusal) -> Refusal:
        self.refused[exc.reason] += 1
        return exc

    # ----------------------------------------------------------------- the calls

    def get_task(self, worker: str, now: float) -> Assignment | Wait | NoMoreTask:
        """GetTask: the next task, leased to `worker`; Wait while others hold the rest; NoMoreTask at the end."""
        self._saw(worker, now)
        taken = self.board.take(worker, now)
        if taken is not None:
            task, lease = taken
            return Assignment(task, lease.token, self.version)
        if self.board.complete:
            self.finished.add(worker)
            self.seen.pop(worker, None)
            return NoMoreTask()
        return Wait(WAIT_RETRY_S)

    def model_out_of_date(self, worker: str, version: int, now: float) -> bool:
        """UpdateModelIfOutOfDate: True if the worker's `version` is old (so the model should be sent)."""
        self._saw(worker, now)
        if version > self.version:
            raise self._refuse(BadRequest("bad_version", f"version {version} is ahead of the master's {self.version}"))
        return version < self.version

    def report_gradients(
        self,
        worker: str,
        task_id: int,
        token: int,
        seq: int,
        version: int,
        batch: int,
        grads: np.ndarray,
        deltas: np.ndarray,
        now: float,
    ) -> Accepted:
        """ReportGradients: accept gradients computed on the current version by the holder of a task.

        Refusals: ``not_held`` (the task is not this worker's any more), ``stale_version``
        (computed on an older model). Bad requests: an unknown task, a version ahead of
        the master's, a sequence number out of order, a batch out of range, values that
        are NaN, Inf or huge.
        """
        self._saw(worker, now)
        try:
            lease = self.board.holding(task_id, worker, token, now)
            if seq == lease.reports and seq > 0:
                return Accepted(self.version, stepped=False, duplicate=True)
            if seq != lease.reports + 1:
                raise BadRequest("bad_seq", f"report {seq} of task {task_id}, expected {lease.reports + 1}")
            if version > self.version:
                raise BadRequest("bad_version", f"version {version} is ahead of the master's {self.version}")
            if version < self.version:
                raise Refusal("stale_version", f"gradients for version {version}; the model is at {self.version}")
            if not 1 <= batch <= self.max_batch:
                raise BadRequest("bad_batch", f"batch {batch} is not in 1..{self.max_batch}")
            try:
                check_values(grads, "the gradients")
                check_values(deltas, "the buffer deltas")
            except ValueError as exc:
                raise BadRequest("bad_values", str(exc)) from None
        except Refusal as exc:
            raise self._refuse(exc) from None
        self.aggregator.add(grads, deltas, batch)
        lease.reports = seq
        self.samples += batch
        stepped = self.aggregator.count >= self.sufficient(now)
        if stepped:
            self._step()
        return Accepted(self.version, stepped)

    def report_task(self, worker: str, task_id: int, token: int, status: str, now: float) -> bool:
        """ReportTask: done moves the task to done, failed back to todo. True if this completed training."""
        self._saw(worker, now)
        try:
            self.board.finish(task_id, worker, token, status, now)
        except Refusal as exc:
            raise self._refuse(exc) from None
        if self.board.complete and self.aggregator.count:
            self._step()  # the last gradients, fewer than a full step's
        return self.board.complete

    def _step(self) -> None:
        self.aggregator.step()
        self.version += 1
        self.steps += 1

    def holders(self) -> dict[str, list[list[int]]]:
        """Worker -> [[task id, reports accepted in its lease], ...] for the tasks in doing."""
        out: dict[str, list[list[int]]] = {}
        for tid, lease in self.board.doing.items():
            out.setdefault(lease.worker, []).append([tid, lease.reports])
        return out

    def status(self, now: float) -> dict[str, Any]:
        """Counts for monitors and tests (no tensors)."""
        self.board.expire(now)
        board = self.board
        return {
            "version": self.version,
            "steps": self.steps,
            "samples": self.samples,
            "total": len(board.tasks),
            "todo": len(board.todo),
            "doing": len(board.doing),
            "done": len(board.done),
            "retried": board.retried,
            "expired": board.expired,
            "failed": board.failed,
            "done_twice": board.done_twice,
            "complete": board.complete,
            "live": self.live_workers(now),
            "sufficient": self.sufficient(now),
            "pending_gradients": self.aggregator.count,
            "holders": self.holders(),
            "refused": dict(self.refused),
        }
