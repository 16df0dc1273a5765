"""The model as the core sees it: one flat buffer of numbers, read and blended in place.

The core (:mod:`dpwa.gossip.node`) never sees a framework tensor. An adapter gives it a
:class:`FlatParams`: how many elements, a fingerprint of the layout, a way to
copy the current values into a flat buffer of the wire dtype (publishing) and
a way to blend a peer's flat buffer into the model in place (averaging), in
float32 whatever the wire dtype.
:class:`NumpyParams` is the implementation over one numpy array; the PyTorch
adapter has its own over a module's tensors.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import msgpack
import numpy as np

from . import kernels

__all__ = ["FlatParams", "NumpyParams", "checked_vector", "fingerprint"]


def fingerprint(entries: Iterable[tuple[str, tuple[int, ...], str]]) -> bytes:
    """A 16-byte digest of a model's layout: each tensor's name, shape and dtype, in order."""
    canonical = [[name, [int(d) for d in shape], str(dtype)] for name, shape, dtype in entries]
    return hashlib.blake2b(msgpack.packb(canonical, use_bin_type=True), digest_size=16).digest()


class FlatParams(ABC):
    """A model's parameters seen as one flat vector of `size` numbers.

    Flat buffers exchanged with the node hold a wire dtype (see
    :mod:`dpwa.mixing.kernels`: float32, float16, or bfloat16 stored as uint16).
    """

    size: int
    fingerprint: bytes  # equal on two nodes exactly when their layouts are equal
    natural_wire = "float32"  # the wire dtype that holds these parameters whole (`wire_dtype: auto`)

    @abstractmethod
    def copy_to(self, out: np.ndarray, wire: str = "float32") -> None:
        """Copy the current parameters into the flat buffer `out`, converting to `wire`."""

    @abstractmethod
    def lerp_from(self, peer: np.ndarray, f: float, wire: str = "float32") -> None:
        """In place: params = f * peer + (1 - f) * params. Storage is never replaced."""

    @abstractmethod
    def add_scaled_diff_from(self, a: np.ndarray, b: np.ndarray, f: float, wire: str = "float32") -> None:
        """In place: params += f * (a - b), for two flat buffers of wire dtype `wire`."""

    def allocate(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A flat buffer for snapshots (the CUDA adapter returns pinned memory)."""
        return np.empty(size, dtype=dtype)

    def statistics(self) -> list[tuple[int, int]]:
        """The [start, end) ranges of the flat vector that hold running statistics, not parameters
        (BatchNorm's running mean and variance): an outer step leaves them where averaging put them."""
        return []

    def add_to_parameters(self, v: np.ndarray, w: float = 1.0) -> None:
        """In place: ``x += w v`` over the parameters; the running statistics (:meth:`statistics`) are left as
        they are. `v` is a float32 vector of `size` elements, a rule's own (a momentum): its values on the
        statistics' ranges are not read. This default goes through :meth:`add_scaled_diff_from` with two
        copies of the model; the adapters add in place."""
        current = self.allocate(self.size, np.dtype(np.float32))
        self.copy_to(current)
        target = current + np.float32(w) * checked_vector(v, self.size)
        for start, end in self.statistics():
            target[start:end] = current[start:end]  # x += 1 (x - x): unchanged
        self.add_scaled_diff_from(target, current, 1.0)

    def within(self, bound: float) -> bool:
        """True if every value is finite and lies in [-bound, bound] (a guarded rule's check,
        docs/rules.md#a-broken-rule). This default copies the parameters out once; the adapters read them
        in place."""
        out = self.allocate(self.size, np.dtype(np.float32))
        self.copy_to(out)
        return kernels.within(out, bound)

    def load_from(self, source: np.ndarray, wire: str = "float32") -> None:
        """In place: params = `source` (a flat buffer of wire dtype `wire`), exactly, whatever the parameters
        held, NaN included (a broken rule's write undone). This default is :meth:`lerp_from` at f = 1,
        which is exact only over finite values; the adapters zero the parameters first."""
        self.lerp_from(source, 1.0, wire)


class NumpyParams(FlatParams):
    """Parameters that live in one flat, contiguous float32 numpy array, blended in place.

    Args:
        array: a 1-D C-contiguous float32 array; it is updated in place.
        layout: (name, shape, dtype) entries for the fingerprint; by default the
            array is one tensor named "flat".
        statistics: [start, end) ranges of `array` that hold running statistics (a BatchNorm's), treated as
            the PyTorch adapter treats a model's buffers: :meth:`add_scaled_diff_from` moves them towards
            `a` (``x += f (a - x)``), not by ``a - b``. So a rule that would break a real model's running
            statistics breaks them in the simulator too.
    """

    def __init__(
        self,
        array: np.ndarray,
        layout: Iterable[tuple[str, tuple[int, ...], str]] | None = None,
        statistics: Iterable[tuple[int, int]] = (),
    ) -> None:
        if array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError(f"expected a flat contiguous array, got shape {array.shape}")
        if array.dtype != np.float32:
            raise ValueError(f"expected a float32 array, got {array.dtype}")
        if not array.flags.writeable:
            raise ValueError("the parameter array must be writable: blending updates it in place")
        self.array = array
        self.size = array.size
        entries = list(layout) if layout is not None else [("flat", array.shape, str(array.dtype))]
        self.fingerprint = fingerprint(entries)
        self._statistics = [(int(s), int(e)) for s, e in statistics]
        if any(not 0 <= s < e <= self.size for s, e in self._statistics):
            raise ValueError(f"statistics ranges must lie within [0, {self.size}), got {self._statistics}")

    def statistics(self) -> list[tuple[int, int]]:
        return list(self._statistics)

    def copy_to(self, out: np.ndarray, wire: str = "float32") -> None:
        kernels.encode_(out, self.array, wire)

    def within(self, bound: float) -> bool:
        return kernels.within(self.array, bound)

    def add_to_parameters(self, v: np.ndarray, w: float = 1.0) -> None:
        v = checked_vector(v, self.size)
        start = 0
        for s, e in [*sorted(self._statistics), (self.size, self.size)]:
            self.array[start:s] += np.float32(w) * v[start:s]
            start = max(start, e)

    def load_from(self, source: np.ndarray, wire: str = "float32") -> None:
        self.array.fill(0.0)  # lerp at f = 1 from zeros is the source exactly; from a NaN it stays NaN
        kernels.lerp_(self.array, source, 1.0, wire)

    def lerp_from(self, peer: np.ndarray, f: float, wire: str = "float32") -> None:
        kernels.lerp_(self.array, peer, f, wire)

    def add_scaled_diff_from(self, a: np.ndarray, b: np.ndarray, f: float, wire: str = "float32") -> None:
        """Parameters: ``x += f (a - b)``; running statistics (`statistics`): ``x += f (a - x)``, as the PyTorch
        adapter does."""
        if not self._statistics:
            kernels.add_scaled_diff_(self.array, a, b, f, wire)
            return
        kept = [self.array[s:e].copy() for s, e in self._statistics]
        kernels.add_scaled_diff_(self.array, a, b, f, wire)
        for (s, e), before in zip(self._statistics, kept, strict=True):
            self.array[s:e] = before
            kernels.lerp_(self.array[s:e], a[s:e], f, wire)  # x += f (a - x): towards the peer's statistics


def checked_vector(v: np.ndarray, size: int) -> np.ndarray:
    """A rule's own vector for :meth:`FlatParams.add_to_parameters`: float32, flat, of the model's size."""
    if not isinstance(v, np.ndarray) or v.dtype != np.float32 or v.shape != (size,):
        shown = f"{v.dtype} of shape {v.shape}" if isinstance(v, np.ndarray) else type(v).__name__
        raise ValueError(f"add_to_parameters takes a float32 vector of shape ({size},), the model's size; got {shown}")
    return v
