"""In-place array math over flat buffers: the only place that touches every element.

All functions work on 1-D numpy arrays and never allocate a buffer the size of
the model: the destination is updated in place (so parameter storage is never
replaced) and inputs are read where they lie.

torch's CPU kernels do ``x += f * (y - x)`` in one pass, about three times
faster than numpy's three passes, so they are used through zero-copy views when
torch is importable; the numpy path is the fallback and the reference the tests
compare against.
"""

from __future__ import annotations

import warnings

import numpy as np



__all__ = ["aligned", "as_torch", "lerp_", "add_scaled_diff_", "all_finite", "use_torch"]

_CHUNK = 1 << 16  # elements per numpy block: keeps the temporaries in cache

use_torch = True  # set to False to force the numpy path (tests compare the two)
_torch_module = None


def _torch():
    """torch, imported on first use (importing dpwa must stay cheap), or None."""
    global _torch_module, use_torch
    if _torch_module is None and use_torch:
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency; this is a fallback
            use_torch = False
        else:
            _torch_module = torch
    return _torch_module if use_torch else None


def aligned(array: np.ndarray) -> np.ndarray:
    """`array` itself if its data is aligned for its dtype, else an aligned copy.

    Frames received from ZeroMQ can start at any byte address.
    """
    if array.ctypes.data % array.dtype.itemsize == 0:
        return array
    return array.copy()


def as_torch(array: np.ndarray):
    """A torch tensor sharing `array`'s memory."""
    import torch

    with warnings.catch_warnings():
        # Frames received from ZeroMQ are read-only; we only ever read them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def lerp_(x: np.ndarray, y: np.ndarray, f: float) -> None:
    """x = f * y + (1 - f) * x, in place."""
    _check(x, y)
    y = aligned(y)
    if _torch() is not None:
        as_torch(x).lerp_(as_torch(y), float(f))
        return
    scratch = np.empty(min(_CHUNK, x.size), dtype=x.dtype)
    for start in range(0, x.size, _CHUNK):
        xs, ys = x[start:start + _CHUNK], y[start:start + _CHUNK]
        t = scratch[: xs.size]
        np.subtract(ys, xs, out=t)
        np.multiply(t, f, out=t)
        np.add(xs, t, out=xs)


def add_scaled_diff_(x: np.ndarray, a: np.ndarray, b: np.ndarray, f: float) -> None:
    """x += f * (a - b), in place."""
    _check(x, a)
    _check(x, b)
    a, b = aligned(a), aligned(b)
    if _torch() is not None:
        tx, ta, tb = as_torch(x), as_torch(a), as_torch(b)
        # Block-wise so the difference never needs a model-sized temporary.
        for start in range(0, x.size, 1 << 20):
            end = start + (1 << 20)
            tx[start:end].add_(ta[start:end] - tb[start:end], alpha=float(f))
        return
    scratch = np.empty(min(_CHUNK, x.size), dtype=x.dtype)
    for start in range(0, x.size, _CHUNK):
        xs, as_, bs = x[start:start + _CHUNK], a[start:start + _CHUNK], b[start:start + _CHUNK]
        t = scratch[: xs.size]
        np.subtract(as_, bs, out=t)
        np.multiply(t, f, out=t)
        np.add(xs, t, out=xs)


def all_finite(y: np.ndarray) -> bool:
    """True if no element is NaN or infinite.

    A float32 sum is one fast pass and is finite whenever every element is;
    only when it is not (a NaN, an Inf, or an overflow of huge finite values)
    is the exact element-wise check run.
    """
    if y.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(y, dtype=y.dtype)):
            return True
    return bool(np.isfinite(y).all())


def _check(x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"flat 1-D arrays expected, got shapes {x.shape} and {y.shape}")
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(
            f"arrays must match: destination is {x.dtype}[{x.size}], source is {y.dtype}[{y.size}]"
        )
    if not x.flags.writeable:
        raise ValueError("the destination array is read-only")
