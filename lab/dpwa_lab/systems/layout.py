"""A model seen as named variables in one flat order, and the checks every received tensor must pass.

A :class:`ModelLayout` lists a module's variables: its parameters (which
gradients change) and its floating-point buffers (BatchNorm running
statistics, which change by adding the deltas workers measured), each with
its shape and its offset in one flat float32 vector. It is pure data: a
master or a parameter server checks a peer's layout by its fingerprint, and
splits and joins flat vectors with it, without a model in hand.

A :class:`ModuleView` binds a layout to a live module: it copies parameters,
gradients and buffers to flat numpy buffers and back, without replacing any
tensor's storage.

    >>> import torch
    >>> view = ModuleView(torch.nn.Linear(3, 2))
    >>> view.layout.param_size, view.layout.buffer_size
    (8, 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpwa.mixing.params import fingerprint

if TYPE_CHECKING:  # torch is imported by those who use a ModuleView
    import torch
    from torch import nn

__all__ = ["MAX_ABS_VALUE", "ModelLayout", "ModuleView", "Variable", "check_values"]

MAX_ABS_VALUE = 1e12  # a gradient, delta or parameter beyond this is refused: no update can overflow float32
KINDS = ("param", "buffer")


@dataclass(frozen=True)
class Variable:
    """One tensor of the model, as it sits in the flat vector of its kind."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "param" (changed by gradients) or "buffer" (changed by deltas)
    offset: int  # first element in the flat vector of its kind
    size: int  # elements

    @property
    def nbytes(self) -> int:
        return 4 * self.size


class ModelLayout:
    """The variables of a model: parameters first, then floating-point buffers, each in module order.

    Args:
        entries: (name, shape, kind) for every variable, kind "param" or "buffer".
    """

    def __init__(self, entries: Iterable[tuple[str, Sequence[int], str]]) -> None:
        params: list[Variable] = []
        buffers: list[Variable] = []
        seen: set[str] = set()
        for name, shape, kind in entries:
            if kind not in KINDS:
                raise ValueError(f"variable {name!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
            if name in seen:
                raise ValueError(f"variable {name!r} appears twice")
            seen.add(name)
            shape = tuple(int(d) for d in shape)
            size = int(np.prod(shape, dtype=np.int64)) if shape else 1
            target = params if kind == "param" else buffers
            offset = target[-1].offset + target[-1].size if target else 0
            target.append(Variable(name, shape, kind, offset, size))
        if not params:
            raise ValueError("a model needs at least one parameter")
        self.params: tuple[Variable, ...] = tuple(params)
        self.buffers: tuple[Variable, ...] = tuple(buffers)
        self.param_size = sum(v.size for v in params)
        self.buffer_size = sum(v.size for v in buffers)
        self.fingerprint = fingerprint((v.name, v.shape, f"float32/{v.kind}") for v in self.variables)

    @property
    def variables(self) -> tuple[Variable, ...]:
        return self.params + self.buffers

    def __len__(self) -> int:
        return len(self.params) + len(self.buffers)

    @classmethod
    def from_module(cls, module: nn.Module) -> ModelLayout:
        """The layout of `module`: every parameter, and every floating-point buffer (integer ones are left out)."""
        import torch

        entries: list[tuple[str, Sequence[int], str]] = []
        for name, p in module.named_parameters():
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {name!r} is {p.dtype}; only float32 models are supported")
            entries.append((name, tuple(p.shape), "param"))
        for name, b in module.named_buffers():
            if b is not None and b.is_floating_point():
                if b.dtype != torch.float32:
                    raise ValueError(f"buffer {name!r} is {b.dtype}; only float32 models are supported")
                entries.append((name, tuple(b.shape), "buffer"))
        return cls(entries)


def check_values(array: np.ndarray, what: str, limit: float = MAX_ABS_VALUE) -> None:
    """Raise ValueError unless every value of `array` is finite and within ±`limit`."""
    if array.size == 0:
        return
    if not np.isfinite(array).all():
        raise ValueError(f"{what} holds NaN or Inf")
    largest = float(np.abs(array).max())
    if largest > limit:
        raise ValueError(f"{what} holds {largest:.3g}, beyond ±{limit:g}")


class ModuleView:
    """A module's variables, in the order of its :class:`ModelLayout`, copied to and from flat buffers.

    Args:
        module: the model (on the CPU). Its tensors are read and written in
            place; their storage is never replaced, so an optimizer holding
            them keeps working.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.layout = ModelLayout.from_module(module)
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        self._params: list[torch.Tensor] = [params[v.name] for v in self.layout.params]
        self._buffers: list[torch.Tensor] = [buffers[v.name] for v in self.layout.buffers]

    def _copy_out(self, tensors: Sequence[torch.Tensor], variables: Sequence[Variable], out: np.ndarray) -> np.ndarray:
        import torch

        flat = torch.from_numpy(out)
        for tensor, v in zip(tensors, variables, strict=True):
            flat[v.offset : v.offset + v.size].copy_(tensor.detach().reshape(-1))
        return out

    def _copy_in(self, tensors: Sequence[torch.Tensor], variables: Sequence[Variable], flat: np.ndarray) -> None:
        import torch

        source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        with torch.no_grad():
            for tensor, v in zip(tensors, variables, strict=True):
                tensor.copy_(source[v.offset : v.offset + v.size].view(v.shape))

    def params(self, out: np.ndarray | None = None) -> np.ndarray:
        """The parameters as one flat float32 vector (into `out` if given)."""
        out = np.empty(self.layout.param_size, np.float32) if out is None else out
        return self._copy_out(self._params, self.layout.params, out)

    def buffers(self, out: np.ndarray | None = None) -> np.ndarray:
        """The floating-point buffers as one flat float32 vector (into `out` if given)."""
        out = np.empty(self.layout.buffer_size, np.float32) if out is None else out
        return self._copy_out(self._buffers, self.layout.buffers, out)

    def grads(self, out: np.ndarray | None = None) -> np.ndarray:
        """The parameters' gradients as one flat vector; a parameter without a gradient gives zeros."""
        import torch

        out = np.empty(self.layout.param_size, np.float32) if out is None else out
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        return self._copy_out(grads, self.layout.params, out)

    def state(self) -> np.ndarray:
        """Parameters then buffers, one flat vector (what an evaluation needs)."""
        out = np.empty(self.layout.param_size + self.layout.buffer_size, np.float32)
        self.params(out[: self.layout.param_size])
        self.buffers(out[self.layout.param_size :])
        return out

    def load_params(self, flat: np.ndarray) -> None:
        self._check_size(flat, self.layout.param_size, "parameters")
        self._copy_in(self._params, self.layout.params, flat)

    def load_buffers(self, flat: np.ndarray) -> None:
        self._check_size(flat, self.layout.buffer_size, "buffers")
        self._copy_in(self._buffers, self.layout.buffers, flat)

    def load_state(self, flat: np.ndarray) -> None:
        """Load parameters then buffers from one flat vector, as :meth:`state` made it."""
        self._check_size(flat, self.layout.param_size + self.layout.buffer_size, "state")
        self.load_params(flat[: self.layout.param_size])
        self.load_buffers(flat[self.layout.param_size :])

    @staticmethod
    def _check_size(flat: np.ndarray, expected: int, what: str) -> None:
        if flat.ndim != 1 or flat.size != expected:
            raise ValueError(f"{what}: expected a flat vector of {expected} values, got shape {flat.shape}")
