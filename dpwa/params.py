"""The model as the core sees it: one flat buffer of numbers, read and blended in place.

The core (:mod:`dpwa.node`) never sees a framework tensor. An adapter gives it a
:class:`FlatParams`: how many elements, their dtype, a fingerprint of the
layout, a way to copy the current values into a flat buffer (publishing) and a
way to blend a peer's flat buffer into the model in place (averaging).
:class:`NumpyParams` is the implementation over one numpy array; the PyTorch
adapter has its own over a module's tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

import numpy as np

from . import kernels
from .protocol import fingerprint

__all__ = ["FlatParams", "NumpyParams"]


class FlatParams(ABC):
    """A model's parameters seen as one flat vector of `size` elements of `dtype`."""

    size: int
    dtype: np.dtype
    fingerprint: bytes  # equal on two nodes exactly when their layouts are equal

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @abstractmethod
    def copy_to(self, out: np.ndarray) -> None:
        """Copy the current parameters into the flat array `out`."""

    @abstractmethod
    def lerp_from(self, peer: np.ndarray, f: float) -> None:
        """In place: params = f * peer + (1 - f) * params. Storage is never replaced."""

    def allocate(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A flat buffer for snapshots (the CUDA adapter returns pinned memory)."""
        return np.empty(size, dtype=dtype)


class NumpyParams(FlatParams):
    """Parameters that live in one flat, contiguous numpy array, blended in place.

    Args:
        array: a 1-D C-contiguous floating-point array; it is updated in place.
        layout: (name, shape, dtype) entries for the fingerprint; by default the
            array is one tensor named "flat".
    """

    def __init__(self, array: np.ndarray, layout: Iterable[tuple[str, tuple[int, ...], str]] | None = None) -> None:
        if array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError(f"expected a flat contiguous array, got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"expected a floating-point array, got {array.dtype}")
        if not array.flags.writeable:
            raise ValueError("the parameter array must be writable: blending updates it in place")
        self.array = array
        self.size = array.size
        self.dtype = array.dtype
        entries = list(layout) if layout is not None else [("flat", array.shape, str(array.dtype))]
        self.fingerprint = fingerprint(entries)

    def copy_to(self, out: np.ndarray) -> None:
        np.copyto(out, self.array)

    def lerp_from(self, peer: np.ndarray, f: float) -> None:
        kernels.lerp_(self.array, peer, f)
