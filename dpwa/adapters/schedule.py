"""Learning-rate schedules driven by the cluster's clock, so that every node decays at the same point.

A node's ``clock`` counts what ``update_send`` counts (batches by default, or
samples with ``batch_size=len(batch)``) and is blended with the peer's clock at
every exchange, by the same rule as the parameters (docs/design.md, "Which
combinations are meaningful"). In mode symmetric (the default) the two clocks of
an exchange move towards each other (with the default f = 1/2 they meet), so
nodes' clocks stay close, and the sum of all clocks is what the nodes trained:
each clock follows the cluster's mean count, not the node's own. In mode pull
only the requester's clock moves, towards its peer's. A schedule of the clock therefore gives every node about the same learning
rate at the same time, where one of each node's own step count (or of its own
validation loss) lets them drift apart. A node that joins, or resumes with
``restore(clock=...)``, takes up the schedule where the cluster is.

Example::

    from dpwa import ClockSchedule, DpwaPyTorchAdapter, step_decay

    conn = DpwaPyTorchAdapter(net, "w1", "cluster.yaml", optimizer=optimizer)
    schedule = ClockSchedule(optimizer, conn, step_decay([20_000, 30_000], gamma=0.25))
    loss = None
    for inputs, targets in loader:
        conn.update_send(loss)
        loss = train_batch(net, inputs, targets)   # optimizer.step() inside
        conn.update_wait(loss)
        schedule.step()                            # the lr of the next batch, from the blended clock

No torch here: any optimizer with ``param_groups`` (a list of dicts with an
``"lr"``) works.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["ClockSchedule", "ClockSource", "step_decay"]


class ClockSource(Protocol):
    """Anything with a ``clock``: a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter` or a :class:`~dpwa.Node`."""

    @property
    def clock(self) -> float: ...


class ClockSchedule:
    """Sets every param group's ``lr`` to ``base_lr * lr_lambda(clock)`` at each :meth:`step`.

    Args:
        optimizer: anything with ``param_groups`` (a ``torch.optim.Optimizer``).
            Each group's base rate is its ``"initial_lr"`` if it has one (as
            torch's schedulers leave it, and as an optimizer's ``state_dict``
            keeps it), else its ``"lr"`` now, which is then stored as its
            ``"initial_lr"``: so a schedule made after loading a checkpoint's
            optimizer state starts from the undecayed rate.
        clock: where the clock comes from: an object with a ``clock``
            attribute (the adapter, a ``Node``), or a function that returns it.
        lr_lambda: the factor of the base rate at a clock (a float, in the
            units ``update_send`` counts); must return a finite number >= 0.

    The constructor applies the rate of the clock as it is (a node that
    joined a running cluster starts at the cluster's rate). Call :meth:`step`
    once per batch, after ``update_wait``, so that the next batch uses the
    rate of the clock the exchange left.
    """

    def __init__(
        self,
        optimizer: Any,
        clock: ClockSource | Callable[[], float],
        lr_lambda: Callable[[float], float],
    ) -> None:
        if not callable(lr_lambda):
            raise TypeError(f"lr_lambda must be a function of the clock, got {type(lr_lambda).__name__}")
        if callable(clock):
            self._read: Callable[[], float] = clock
        elif hasattr(clock, "clock"):
            source = clock
            self._read = lambda: source.clock
        else:
            raise TypeError(f"clock must have a .clock attribute or be a function, got {type(clock).__name__}")
        self.optimizer = optimizer
        self.lr_lambda = lr_lambda
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs: list[float] = [float(group["initial_lr"]) for group in optimizer.param_groups]
        self.last_clock = 0.0
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> float:
        """Set every group's rate from the clock now; returns that clock."""
        clock = float(self._read())
        factor = float(self.lr_lambda(clock))
        if not (math.isfinite(factor) and factor >= 0):
            raise ValueError(f"lr_lambda({clock:g}) returned {factor!r}; a learning-rate factor must be finite, >= 0")
        self._last_lr = [base * factor for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr
        self.last_clock = clock
        return clock

    def get_last_lr(self) -> list[float]:
        """The rate of each param group set by the last :meth:`step` (as torch's schedulers name it)."""
        return list(self._last_lr)


def step_decay(milestones: Sequence[float], gamma: float = 0.1) -> Callable[[float], float]:
    """``gamma ** k``, where k counts the milestones the clock has reached (``clock >= milestone``).

    torch's ``MultiStepLR`` on the clock instead of the step count: ``step_decay([20_000, 30_000],
    gamma=0.25)`` divides the rate by 4 at clock 20,000 and again at 30,000. Milestones are in the
    units of the clock (batches, or samples if ``update_send`` is given the batch size), each node's own
    count: with n nodes each node still trains its own batches, so a milestone is not multiplied by n.
    """
    points = sorted(float(m) for m in milestones)
    if not all(math.isfinite(m) and m >= 0 for m in points):
        raise ValueError(f"milestones must be finite clocks >= 0, got {list(milestones)!r}")
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma must be finite and >= 0, got {gamma!r}")

    def factor(clock: float) -> float:
        return gamma ** bisect.bisect_right(points, clock)

    return factor
