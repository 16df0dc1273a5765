"""The optimizer every system applies, over flat float32 vectors: SGD with momentum (``torch.optim.SGD``), or AdamW.

A master or a parameter server holds parameters as flat numpy vectors (or
slices of one), not as a module. :class:`FlatSGD` runs ``torch.optim.SGD``
(or ``torch.optim.AdamW``, with ``algorithm="adamw"``) over such a vector in
place, so the update is exactly the one a worker's own optimizer would take on
the same gradient: both are elementwise, and so are momentum, Adam's moments
and weight decay. :meth:`SGDSettings.make` builds the same optimizer over a
module's parameters, for the workers that step their own model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ALGORITHMS", "FlatSGD", "SGDSettings"]

ALGORITHMS = ("sgd", "adamw")


@dataclass(frozen=True)
class SGDSettings:
    """The optimizer's settings: those of ``torch.optim.SGD``, or of ``torch.optim.AdamW`` (algorithm "adamw")."""

    lr: float = 0.05  # peak learning rate; a schedule scales it
    momentum: float = 0.9  # sgd
    nesterov: bool = True  # sgd
    weight_decay: float = 5e-4  # sgd: L2 in the gradient; adamw: decoupled
    algorithm: str = "sgd"  # sgd or adamw
    betas: tuple[float, float] = (0.9, 0.95)  # adamw
    eps: float = 1e-8  # adamw

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be at least 0, got {self.weight_decay}")
        if self.algorithm == "sgd" and self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs a momentum above 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas) or not self.eps > 0:
            raise ValueError(f"betas must be two values in [0, 1) and eps positive, got {self.betas} and {self.eps}")

    def make(self, params: Iterable[Any]) -> Any:
        """The torch optimizer of these settings over `params` (a module's parameters, or a flat one)."""
        import torch

        if self.algorithm == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=self.weight_decay
        )


class FlatSGD:
    """``torch.optim.SGD`` (or AdamW, as `settings` say) over one flat float32 numpy vector, updated in place.

    Args:
        values: the parameters (a 1-D float32 array, or a view into one); updated in place.
        settings: the optimizer's settings.
        schedule: the learning rate as a function of the samples applied so far
            (None: ``settings.lr`` always).
    """

    def __init__(
        self, values: np.ndarray, settings: SGDSettings, schedule: Callable[[int], float] | None = None
    ) -> None:
        import torch

        if values.dtype != np.float32 or values.ndim != 1:
            raise ValueError(f"expected a flat float32 vector, got {values.dtype} of shape {values.shape}")
        self._param = torch.nn.Parameter(torch.from_numpy(values), requires_grad=True)
        self._opt = settings.make([self._param])
        self._schedule = schedule
        self.lr = settings.lr

    def step(self, grad: np.ndarray, samples: int, scale: float = 1.0) -> None:
        """One step with `grad` (same size), at the learning rate for `samples` applied so far, times `scale`."""
        import torch

        if grad.shape != self._param.shape:
            raise ValueError(f"gradient of shape {grad.shape}, parameters of shape {tuple(self._param.shape)}")
        self.lr = (self._schedule(samples) if self._schedule is not None else self._opt.defaults["lr"]) * scale
        self._opt.param_groups[0]["lr"] = self.lr
        grad = np.ascontiguousarray(grad, dtype=np.float32)
        if not grad.flags.writeable:  # a received frame: torch wants memory it could write
            grad = grad.copy()
        self._param.grad = torch.from_numpy(grad)
        self._opt.step()
        self._param.grad = None
