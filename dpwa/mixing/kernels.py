"""In-place array math over flat buffers: the only place that touches every element.

All functions work on 1-D numpy arrays and never allocate a buffer the size of
the model: the destination is updated in place (so parameter storage is never
replaced) and inputs are read where they lie.

Parameters travel in a *wire dtype*: ``float32``, ``float16`` or ``bfloat16``.
numpy has no bfloat16, so such buffers are stored as ``uint16`` holding the
bit patterns. Blending always happens in float32: a half-precision input is
decoded block by block into a small float32 scratch buffer.

torch's CPU kernels do ``x += f * (y - x)`` in one pass, about three times
faster than numpy's three passes, and copy with all of torch's threads, so
they are used through zero-copy views; the numpy path is the fallback when
torch is missing, and the reference the tests compare against. Below
:data:`TORCH_MIN_ELEMENTS` float32 stays on numpy, and half precision goes
through torch in blocks small enough that torch runs them on the calling
thread (:data:`SERIAL_BLOCK`).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

__all__ = [
    "WIRE_STORAGE",
    "add_scaled_diff_",
    "aligned",
    "as_torch",
    "encode_",
    "lerp_",
    "distance",
    "relative_distance",
    "storage_dtype",
    "prepare",
    "use_torch",
    "within",
]

# wire dtype name -> numpy dtype of the stored elements
WIRE_STORAGE: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}

_BLOCK = 1 << 18  # elements per block when decoding or blending piecewise (1 MB of float32)
# Below this many elements torch's thread pool costs more than the work (and stalls for a scheduler time
# slice when the other cores are busy): float32 goes through numpy, half precision through SERIAL_BLOCKs.
TORCH_MIN_ELEMENTS = 1 << 20

# torch runs an element-wise kernel or a reduction on the calling thread when it has fewer elements than its
# grain (32,768): blocks this size never wake its thread pool, so they cannot stall when the cores are busy.
# Half-precision buffers below TORCH_MIN_ELEMENTS go through torch in such blocks: numpy converts float16
# 40 times slower than torch (100,000 values: 313 against 8 µs) and cannot read bfloat16.
SERIAL_BLOCK = 1 << 14

use_torch = True  # set to False to force the numpy path (the tests compare the two)
_torch_module = None


def _torch(size: int = TORCH_MIN_ELEMENTS):
    """torch, imported on first use (importing dpwa must stay cheap), if it is
    available and worth it for `size` elements; else None."""
    global _torch_module, use_torch
    if size < TORCH_MIN_ELEMENTS:
        return None
    if _torch_module is None and use_torch:
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency; this is a fallback
            use_torch = False
        else:
            _torch_module = torch
    return _torch_module if use_torch else None


def _backend(size: int, wire: str):
    """(torch, block) to work on `size` elements of wire dtype `wire` with torch, a block at a time; or
    (None, _BLOCK) for numpy. Large buffers: torch with its threads. Smaller half-precision ones: torch in
    blocks of SERIAL_BLOCK, on this thread. Smaller float32 ones: numpy (no thread pool to wake)."""
    torch = _torch(size)
    if torch is not None:
        return torch, _BLOCK
    if wire != "float32":
        torch = _torch()
        if torch is not None:
            return torch, SERIAL_BLOCK
    return None, _BLOCK


def storage_dtype(wire: str) -> np.dtype:
    """The numpy dtype that holds a buffer of wire dtype `wire`."""
    try:
        return WIRE_STORAGE[wire]
    except KeyError:
        raise ValueError(f"unknown wire dtype {wire!r}; expected one of {', '.join(WIRE_STORAGE)}") from None


def aligned(array: np.ndarray) -> np.ndarray:
    """`array` itself if its data is aligned for its dtype, else an aligned copy.

    Frames received from ZeroMQ can start at any byte address.
    """
    if array.flags.aligned:  # aligned for its dtype; asking ``array.ctypes`` costs 30 times as much
        return array
    return array.copy()


def as_torch(array: np.ndarray, wire: str = "float32"):
    """A torch tensor sharing `array`'s memory, typed as wire dtype `wire`."""
    import torch

    if array.flags.writeable:  # only a read-only array makes torch warn: no filter to set up (tens of µs)
        tensor = torch.from_numpy(array)
    else:
        with warnings.catch_warnings():
            # Frames received from ZeroMQ are read-only; we only ever read them.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if wire == "bfloat16" else tensor


def _blocks(n: int, block: int = _BLOCK):
    for start in range(0, n, block):
        yield start, min(n, start + block)


# --------------------------------------------------------------------------- numpy codecs


def _decode_np(src: np.ndarray, wire: str, out: np.ndarray) -> np.ndarray:
    """float32 values of a wire buffer, written into `out` (same length)."""
    if wire == "bfloat16":
        np.left_shift(src, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, src, casting="same_kind")
    return out


def _encode_bf16_np(dst: np.ndarray, src: np.ndarray) -> None:
    """Round float32 to bfloat16 bit patterns, to nearest even; NaN stays NaN."""
    bits = src.view(np.uint32)
    for s, e in _blocks(src.size):
        u = bits[s:e]
        rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rounded[nan] = (u[nan] >> 16) | np.uint32(0x40)
        dst[s:e] = rounded.astype(np.uint16)


# --------------------------------------------------------------------------- operations


def encode_(dst: np.ndarray, src: np.ndarray, wire: str = "float32") -> None:
    """dst = src converted to wire dtype `wire` (dst holds that wire dtype's storage)."""
    _check_shapes(dst, src)
    if dst.dtype != storage_dtype(wire) or src.dtype != np.float32:
        raise ValueError(f"encode_ expects float32 -> {wire}, got {src.dtype} -> {dst.dtype}")
    torch, block = _backend(src.size, wire)
    if torch is not None:  # torch copies with all its threads (large buffers); np.copyto with one
        td, ts = as_torch(dst, wire), as_torch(aligned(src))
        if block == SERIAL_BLOCK:
            for s, e in _blocks(src.size, block):
                td[s:e].copy_(ts[s:e])
        else:
            td.copy_(ts)
    elif wire == "float32":
        np.copyto(dst, src)
    elif wire == "bfloat16":
        _encode_bf16_np(dst, src)
    else:
        np.copyto(dst, src, casting="same_kind")


def lerp_(x: np.ndarray, y: np.ndarray, f: float, wire: str = "float32") -> None:
    """x = f * y + (1 - f) * x in place; x is float32, y holds wire dtype `wire`."""
    _check_dest(x)
    _check_source(x, y, wire)
    y = aligned(y)
    f = float(f)
    torch, block = _backend(x.size, wire)
    if torch is not None:
        tx, ty = as_torch(x), as_torch(y, wire)
        if wire == "float32":
            tx.lerp_(ty, f)
            return
        scratch = torch.empty(min(block, x.size), dtype=torch.float32)
        for s, e in _blocks(x.size, block):
            t = scratch[: e - s]
            t.copy_(ty[s:e])
            tx[s:e].lerp_(t, f)
        return
    # Like torch: x + f (y - x) for f < 1/2, y - (1 - f)(y - x) above, so f = 0 and f = 1 are exact.
    scratch = np.empty((1 if wire == "float32" else 2, min(_BLOCK, x.size)), dtype=np.float32)
    for s, e in _blocks(x.size):
        ys = y[s:e] if wire == "float32" else _decode_np(y[s:e], wire, scratch[1, : e - s])
        t = scratch[0, : e - s]
        xs = x[s:e]
        np.subtract(ys, xs, out=t)
        if f < 0.5:
            np.multiply(t, f, out=t)
            np.add(xs, t, out=xs)
        else:
            np.multiply(t, 1.0 - f, out=t)
            np.subtract(ys, t, out=xs)


def add_scaled_diff_(x: np.ndarray, a: np.ndarray, b: np.ndarray, f: float, wire: str = "float32") -> None:
    """x += f * (a - b) in place; x is float32, a and b hold wire dtype `wire`."""
    _check_dest(x)
    _check_source(x, a, wire)
    _check_source(x, b, wire)
    a, b = aligned(a), aligned(b)
    f = float(f)
    torch, block = _backend(x.size, wire)
    if torch is not None:
        tx, ta, tb = as_torch(x), as_torch(a, wire), as_torch(b, wire)
        scratch = torch.empty(min(block, x.size), dtype=torch.float32)
        for s, e in _blocks(x.size, block):
            t = scratch[: e - s]
            t.copy_(ta[s:e])
            t.sub_(tb[s:e])
            tx[s:e].add_(t, alpha=f)
        return
    scratch = np.empty((2, min(_BLOCK, x.size)), dtype=np.float32)
    for s, e in _blocks(x.size):
        ta = scratch[0, : e - s]
        if wire == "float32":  # read in place: one pass fewer per input
            np.subtract(a[s:e], b[s:e], out=ta)
        else:
            np.subtract(_decode_np(a[s:e], wire, ta), _decode_np(b[s:e], wire, scratch[1, : e - s]), out=ta)
        np.multiply(ta, f, out=ta)
        xs = x[s:e]
        np.add(xs, ta, out=xs)


def relative_distance(y: np.ndarray, ours: np.ndarray, wire: str = "float32") -> float:
    """||y - ours|| / ||ours|| for two wire buffers, computed block by block in float32.

    Returns 0.0 when both are zero, and inf when only `ours` is zero.
    """
    diff_sq, ours_sq = _squares(y, ours, wire)
    if ours_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else float("inf")
    return (diff_sq / ours_sq) ** 0.5


def distance(y: np.ndarray, ours: np.ndarray, wire: str = "float32") -> float:
    """||y - ours|| for two wire buffers, computed block by block in float32 (no model-sized temporary)."""
    return _squares(y, ours, wire)[0] ** 0.5


def _squares(y: np.ndarray, ours: np.ndarray, wire: str) -> tuple[float, float]:
    """(||y - ours||^2, ||ours||^2), block by block."""
    _check_shapes(y, ours)
    y, ours = aligned(y), aligned(ours)
    torch, block = _backend(y.size, wire) if wire != "float32" else (None, _BLOCK)
    scratch = np.empty((2, min(block, y.size)), dtype=np.float32)

    def decode(src: np.ndarray, out: np.ndarray) -> np.ndarray:
        if torch is None:
            return _decode_np(src, wire, out)
        as_torch(out).copy_(as_torch(src, wire))  # numpy converts float16 40 times slower
        return out

    diff_sq = ours_sq = 0.0
    for s, e in _blocks(y.size, block):
        a, b = decode(y[s:e], scratch[0, : e - s]), decode(ours[s:e], scratch[1, : e - s])
        ours_sq += float(np.dot(b, b))
        np.subtract(a, b, out=a)
        diff_sq += float(np.dot(a, a))
    return diff_sq, ours_sq


def prepare(wire: str) -> None:
    """Import and start what :func:`within` needs for `wire` now, on the calling thread.

    Half-precision checks run on torch: importing it on first use would stall the thread that meets the
    first half-precision buffer (a node's Rx thread, with a requester waiting) by a second or more.
    """
    if wire != "float32":
        torch = _torch()
        if torch is not None:
            torch.aminmax(torch.zeros(2, dtype=torch.float16))


def within(y: np.ndarray, bound: float, wire: str = "float32") -> bool:
    """True if every element of the wire buffer `y` is finite and lies in [-bound, bound].

    One pass (torch's ``aminmax``, or numpy's min and max for small buffers);
    a NaN anywhere makes the minimum and maximum NaN, so it fails too. Values
    within the bound cannot overflow float32 when blended with f in [0, 1].
    """
    if y.size == 0:
        return True
    # numpy's min and max are fast for float32 (small buffers: no thread pool to wake), but 50 times
    # slower than torch's aminmax for float16, and bfloat16 it cannot read at all
    torch, block = _backend(y.size, wire)
    if torch is None and wire == "float32":
        lo, hi = float(y.min()), float(y.max())
        return math.isfinite(lo) and math.isfinite(hi) and -bound <= lo and hi <= bound
    if torch is not None:
        ty = as_torch(aligned(y), wire)
        lo, hi = math.inf, -math.inf
        for s, e in _blocks(y.size, block if block == SERIAL_BLOCK else y.size):
            lo_t, hi_t = torch.aminmax(ty[s:e])
            block_lo, block_hi = float(lo_t), float(hi_t)
            if math.isnan(block_lo) or math.isnan(block_hi):
                return False
            lo, hi = min(lo, block_lo), max(hi, block_hi)
    else:
        lo, hi = math.inf, -math.inf
        scratch = np.empty(min(_BLOCK, y.size), dtype=np.float32)
        with np.errstate(invalid="ignore"):
            for s, e in _blocks(y.size):
                block = _decode_np(y[s:e], wire, scratch[: e - s])
                block_lo, block_hi = float(block.min()), float(block.max())
                if math.isnan(block_lo) or math.isnan(block_hi):
                    return False
                lo, hi = min(lo, block_lo), max(hi, block_hi)
    return math.isfinite(lo) and math.isfinite(hi) and -bound <= lo and hi <= bound


def _check_shapes(x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"flat 1-D arrays expected, got shapes {x.shape} and {y.shape}")
    if x.shape != y.shape:
        raise ValueError(f"arrays must match: destination has {x.size} elements, source {y.size}")


def _check_dest(x: np.ndarray) -> None:
    if x.dtype != np.float32:
        raise ValueError(f"the destination must be float32, got {x.dtype}")
    if not x.flags.writeable:
        raise ValueError("the destination array is read-only")


def _check_source(x: np.ndarray, y: np.ndarray, wire: str) -> None:
    _check_shapes(x, y)
    if y.dtype != storage_dtype(wire):
        raise ValueError(f"arrays must match: a {wire} source is stored as {storage_dtype(wire)}, got {y.dtype}")
