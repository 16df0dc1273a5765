"""Outer optimizers: the step a worker takes on a pseudo-gradient after local steps (DiLoCo's Nesterov step).

Methods that train locally for H steps and then communicate (DiLoCo, Douillard
et al. 2023, arXiv 2311.08105) treat the change since the last synchronisation
as a gradient: the *pseudo-gradient* ``g = anchor - params`` (the parameters at
the last synchronisation minus the parameters now), averaged over the workers.
An *outer* optimizer then moves the anchor by it, and every worker starts its
next H steps from the new anchor. With SGD, outer learning rate 1 and no
momentum, that is plain averaging of the workers' parameters; DiLoCo's default
is Nesterov momentum, outer learning rate 0.7 and momentum 0.9.

The rule of :func:`nesterov_step` is ``torch.optim.SGD``'s with
``nesterov=True`` and no dampening or weight decay, with the momentum buffer
starting at zero (so the first step's buffer is the gradient, as torch's)::

    buf = momentum * buf + g
    x  -= lr * (g + momentum * buf)

Everything here is pure math over flat float32 numpy arrays, updated in place:
no sockets, no ``torch.distributed``. Who averages the pseudo-gradient (an
all-reduce, a gossip exchange) is the caller's business.

    >>> import numpy as np
    >>> outer = OuterNesterov(2, OuterSettings(lr=0.7, momentum=0.9))
    >>> anchor = np.array([1.0, 2.0], np.float32)
    >>> outer.step(anchor, np.array([0.5, -1.0], np.float32))
    >>> [round(float(v), 4) for v in anchor]
    [0.335, 3.33]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["OuterNesterov", "OuterSettings", "nesterov_step", "pseudo_gradient"]


@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer's settings (DiLoCo's defaults)."""

    lr: float = 0.7  # outer learning rate
    momentum: float = 0.9  # Nesterov momentum; 0: plain SGD on the pseudo-gradient

    def __post_init__(self) -> None:
        if not 0 < self.lr <= 10:
            raise ValueError(f"outer lr must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")


def _check(name: str, array: np.ndarray, size: int | None = None) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != 1:
        got = f"{array.dtype} of shape {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"{name} must be a flat float32 array, got {got}")
    if size is not None and array.size != size:
        raise ValueError(f"{name} has {array.size} values, expected {size}")


def pseudo_gradient(anchor: np.ndarray, params: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``anchor - params`` (into `out` if given): how far the local steps moved, as a gradient would point."""
    _check("anchor", anchor)
    _check("params", params, anchor.size)
    if out is None:
        out = np.empty_like(anchor)
    _check("out", out, anchor.size)
    np.subtract(anchor, params, out=out)
    return out


def nesterov_step(params: np.ndarray, grad: np.ndarray, buf: np.ndarray, lr: float, momentum: float) -> None:
    """One Nesterov SGD step, in place on `params` and the momentum buffer `buf` (see the module)."""
    _check("params", params)
    _check("grad", grad, params.size)
    _check("buf", buf, params.size)
    buf *= np.float32(momentum)
    buf += grad
    update = buf * np.float32(momentum)
    update += grad
    update *= np.float32(lr)
    params -= update


class OuterNesterov:
    """The outer optimizer of one worker: its momentum buffer, and the steps taken.

    Args:
        size: values in the flat parameter vector it steps.
        settings: outer learning rate and momentum.
    """

    def __init__(self, size: int, settings: OuterSettings | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.settings = settings or OuterSettings()
        self.buf = np.zeros(size, np.float32)
        self.steps = 0

    def step(self, anchor: np.ndarray, grad: np.ndarray) -> None:
        """Move `anchor` (in place) by the averaged pseudo-gradient `grad`."""
        nesterov_step(anchor, grad, self.buf, self.settings.lr, self.settings.momentum)
        self.steps += 1

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the momentum buffer (a copy) and the step count."""
        return {"buf": self.buf.copy(), "steps": self.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`'s output (checked: size, dtype, finite values)."""
        buf = state.get("buf")
        steps = state.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"outer state: steps must be a count, got {steps!r}")
        if not isinstance(buf, np.ndarray):
            raise ValueError(f"outer state: buf must be an array, got {type(buf).__name__}")
        _check("outer state buf", buf, self.buf.size)
        if not np.isfinite(buf).all():
            raise ValueError("outer state: buf holds NaN or Inf")
        self.buf[:] = buf
        self.steps = steps
