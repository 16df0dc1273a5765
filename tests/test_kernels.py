"""In-place blend kernels: torch and numpy paths agree, inputs may be unaligned, nothing is replaced."""

from __future__ import annotations

import numpy as np
import pytest

from dpwa import kernels


@pytest.fixture(params=["torch", "numpy"])
def backend(request, monkeypatch):
    monkeypatch.setattr(kernels, "use_torch", request.param == "torch")
    return request.param


def test_lerp_matches_the_formula_in_place(backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_003).astype(np.float32)  # not a multiple of any block size
    y = rng.standard_normal(x.size).astype(np.float32)
    expected = 0.3 * y.astype(np.float64) + 0.7 * x.astype(np.float64)
    address = x.ctypes.data
    kernels.lerp_(x, y, 0.3)
    assert x.ctypes.data == address  # same storage
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)


def test_lerp_of_filled_arrays_is_exact(backend):
    x, y = np.full(1000, 2.0, np.float32), np.full(1000, 6.0, np.float32)
    kernels.lerp_(x, y, 0.25)
    assert np.all(x == 3.0)


def test_add_scaled_diff(backend):
    rng = np.random.default_rng(1)
    x, a, b = (rng.standard_normal(3_000_001).astype(np.float32) for _ in range(3))
    expected = x.astype(np.float64) + 0.5 * (a.astype(np.float64) - b)
    kernels.add_scaled_diff_(x, a, b, 0.5)
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)


def test_unaligned_source_is_read_correctly(backend):
    # ZeroMQ frames can start at any address; the kernel must still read them right.
    raw = bytearray(1 + 4 * 100)
    raw[1:] = np.full(100, 4.0, np.float32).tobytes()
    y = np.frombuffer(memoryview(raw)[1:], dtype=np.float32)
    assert y.ctypes.data % 4 != 0
    x = np.zeros(100, np.float32)
    kernels.lerp_(x, y, 0.5)
    assert np.all(x == 2.0)


def test_mismatches_are_refused():
    with pytest.raises(ValueError, match="arrays must match"):
        kernels.lerp_(np.zeros(3, np.float32), np.zeros(4, np.float32), 0.5)
    with pytest.raises(ValueError, match="arrays must match"):
        kernels.lerp_(np.zeros(3, np.float32), np.zeros(3, np.float64), 0.5)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(3, np.float32)
        ro.flags.writeable = False
        kernels.lerp_(ro, np.zeros(3, np.float32), 0.5)


def test_all_finite():
    x = np.ones(10_000, np.float32)
    assert kernels.all_finite(x)
    x[1234] = np.nan
    assert not kernels.all_finite(x)
    x[1234] = np.inf
    assert not kernels.all_finite(x)
    huge = np.full(10, 3e38, np.float32)  # the fast sum overflows, the exact check clears it
    assert kernels.all_finite(huge)
    assert kernels.all_finite(np.zeros(0, np.float32))
