"""Outer optimizers: the step a worker takes on a pseudo-gradient after local steps (DiLoCo's, NoLoCo's).

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .params import FlatParams

__all__ = [
    "OUTER_RULES",
    "GossipOuter",
    "OuterNesterov",
    "OuterSettings",
    "nesterov_step",
    "noloco_step",
    "pseudo_gradient",
]


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


def noloco_step(anchor: np.ndarray, mixed: np.ndarray, buf: np.ndarray, lr: float, momentum: float) -> None:
    """NoLoCo's outer step (Kolehmainen et al. 2025, arXiv 2506.10911), in place on `anchor` and `buf`.

    ``buf = momentum * buf + lr * (mixed - anchor); anchor += buf``, where `mixed` is the pair's mean of
    the fast weights. The paper's step is a momentum on the pair's mean pseudo-gradient plus a pull of the
    anchor toward the pair's mean anchor; with one rate for both (as its authors' code has),
    ``mean(fast - anchor_k) + (mean(anchor_k) - anchor)`` is ``mean(fast) - anchor``: only the peer's fast
    weights need to travel, which is what a gossip exchange sends.
    """
    _check("anchor", anchor)
    _check("mixed", mixed, anchor.size)
    _check("buf", buf, anchor.size)
    buf *= np.float32(momentum)
    step = mixed - anchor
    step *= np.float32(lr)
    buf += step
    anchor += buf


def _nesterov(
    anchor: np.ndarray, mixed: np.ndarray, buf: np.ndarray, scratch: np.ndarray, lr: float, mu: float
) -> None:
    grad = pseudo_gradient(anchor, mixed, scratch)  # `mixed` may be `scratch` itself: fine
    nesterov_step(anchor, grad, buf, lr, mu)


def _noloco(anchor: np.ndarray, mixed: np.ndarray, buf: np.ndarray, scratch: np.ndarray, lr: float, mu: float) -> None:
    noloco_step(anchor, mixed, buf, lr, mu)


# The named outer steps, by the name the config's `outer:` gives (with `none`): the one place that lists them.
# Each moves (anchor, buf) in place from the mixed parameters; `scratch` is a model-sized buffer of its own.
OUTER_RULES: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float], None]] = {
    "nesterov": _nesterov,
    "noloco": _noloco,
}


class GossipOuter:
    """One gossip node's outer optimizer: its anchor, its momentum buffer, and the rule.

    After a blend, :meth:`step` takes the node's parameters as they are (its fast weights mixed with a
    peer's), moves the anchor by the rule, and returns it: the node's parameters become the new anchor.
    ``nesterov``: DiLoCo's step on the pseudo-gradient ``anchor - mixed``; ``noloco``: :func:`noloco_step`.

    Both rules are linear in (parameters, anchor, momentum), so a weighted sum of the three is kept by every
    step (:meth:`kept_weights`). A symmetric exchange keeps the sum of the models, and an outer step keeps
    its node's weighted sum, so with outer steps a symmetric cluster keeps the sum of that quantity exact
    (whichever nodes take them), as it keeps the sum of the models without.

    Args:
        rule: ``nesterov`` or ``noloco``.
        anchor: the parameters at the start (a flat float32 array, copied).
        settings: the outer learning rate and momentum.
    """

    def __init__(self, rule: str, anchor: np.ndarray, settings: OuterSettings) -> None:
        if rule not in OUTER_RULES:
            raise ValueError(f"outer rule must be one of {', '.join(OUTER_RULES)}, got {rule!r}")
        _check("anchor", anchor)
        self.rule, self.settings = rule, settings
        self.anchor = anchor.copy()
        self.buf = np.zeros_like(self.anchor)
        self._grad = np.empty_like(self.anchor)
        self.steps = 0

    def step(self, mixed: np.ndarray) -> np.ndarray:
        """One outer step from the mixed parameters; returns the new anchor (the parameters to continue from)."""
        OUTER_RULES[self.rule](self.anchor, mixed, self.buf, self._grad, self.settings.lr, self.settings.momentum)
        self.steps += 1
        return self.anchor

    def apply(self, params: FlatParams) -> None:
        """The step a node takes after a blend, in place: its parameters (the mixed ones) become the new anchor.

        Ranges that hold running statistics (:meth:`FlatParams.statistics`) are not stepped: they stay as
        averaging left them, and their momentum at zero.
        """
        mixed = self._grad  # scratch: step() is done with it before it writes the pseudo-gradient
        params.copy_to(mixed, "float32")
        stats = params.statistics()
        kept = [mixed[s:e].copy() for s, e in stats]
        self.step(mixed)
        for (s, e), values in zip(stats, kept, strict=True):
            self.anchor[s:e] = values
            self.buf[s:e] = 0.0
        params.lerp_from(self.anchor, 1.0, "float32")  # f = 1: the anchor exactly

    def reanchor(self, params: FlatParams) -> None:
        """Start afresh from the parameters as they are (a join or a restore without outer state): the anchor
        is a copy of them, the momentum zero."""
        params.copy_to(self.anchor, "float32")
        self.buf[:] = 0.0
        self.steps = 0

    def kept_weights(self) -> tuple[float, float, float]:
        """(a, b, c) such that ``a * params + b * anchor + c * buf`` is the same before and after a step.

        With the parameters set to the anchor after the step. Derived by matching coefficients: for both
        rules a = lr / (1 - momentum) and b = 1 - a; c = -lr momentum^2 / (1 - momentum) for nesterov
        (its buffer is in gradient units) and momentum / (1 - momentum) for noloco (in parameter units).
        """
        lr, mu = self.settings.lr, self.settings.momentum
        a = lr / (1.0 - mu)
        c = -lr * mu * mu / (1.0 - mu) if self.rule == "nesterov" else mu / (1.0 - mu)
        return a, 1.0 - a, c

    def state(self) -> dict[str, Any]:
        """What a checkpoint or a joiner takes: the anchor, the momentum buffer (copies), the steps."""
        return {"anchor": self.anchor.copy(), "buf": self.buf.copy(), "steps": self.steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`'s output (checked: sizes, dtype, finite values; nothing taken if not)."""
        anchor, buf, steps = state.get("anchor"), state.get("buf"), state.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"outer state: steps must be a count, got {steps!r:.40}")
        if not isinstance(anchor, np.ndarray) or not isinstance(buf, np.ndarray):
            raise ValueError("outer state: anchor and buf must be arrays")
        for name, array in (("anchor", anchor), ("buf", buf)):
            _check(f"outer state {name}", array, self.anchor.size)
            if not np.isfinite(array).all():
                raise ValueError(f"outer state: {name} holds NaN or Inf")
        self.anchor[:] = anchor
        self.buf[:] = buf
        self.steps = steps
