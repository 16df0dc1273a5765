"""In-place blend kernels: torch and numpy paths agree, inputs may be unaligned, nothing is replaced."""

from __future__ import annotations

import numpy as np
import pytest

from dpwa.mixing import kernels


@pytest.fixture(params=["torch", "torch-serial", "numpy"])
def backend(request, monkeypatch):
    monkeypatch.setattr(kernels, "use_torch", request.param != "numpy")
    if request.param == "torch-serial":  # below TORCH_MIN_ELEMENTS: half precision in blocks, float32 on numpy
        monkeypatch.setattr(kernels, "TORCH_MIN_ELEMENTS", 1 << 40)
    else:
        monkeypatch.setattr(kernels, "TORCH_MIN_ELEMENTS", 0)  # whatever the size, use the backend under test
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


def test_lerp_is_exact_at_both_ends(backend):
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal(10_000).astype(np.float32) * 1e-8
    y = rng.standard_normal(10_000).astype(np.float32)
    x = x0.copy()
    kernels.lerp_(x, y, 1.0)
    assert x.tobytes() == y.tobytes()
    x = x0.copy()
    kernels.lerp_(x, y, 0.0)
    assert x.tobytes() == x0.tobytes()


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


@pytest.mark.parametrize("where", [0, 1234, 9999])  # first, middle, last: a NaN anywhere is seen
def test_within_refuses_nan_inf_and_values_beyond_the_bound(backend, where):
    x = np.ones(10_000, np.float32)
    assert kernels.within(x, 1e18)
    for bad in (np.nan, np.inf, -np.inf, 2e18, -2e18):
        x[where] = bad
        assert not kernels.within(x, 1e18), bad
    x[where] = -1e18
    assert kernels.within(x, 1e18)  # the bound itself is allowed
    assert kernels.within(np.zeros(0, np.float32), 1e18)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_half_precision_wire_round_trips_and_blends_in_float32(backend, wire):
    from dpwa.mixing.kernels import encode_, storage_dtype

    rng = np.random.default_rng(2)
    src = rng.standard_normal(300_001).astype(np.float32)
    wire_buf = np.empty(src.size, storage_dtype(wire))
    encode_(wire_buf, src, wire)
    decoded = np.zeros(src.size, np.float32)
    kernels.lerp_(decoded, wire_buf, 1.0, wire)  # f = 1 takes the peer whole: decoded = wire value
    rel = 2.0**-11 if wire == "float16" else 2.0**-8  # half an ulp of the format's significand
    np.testing.assert_allclose(decoded, src, rtol=rel, atol=1e-4 if wire == "float16" else 0)
    # blending keeps float32 precision on our side: x + f * (y - x) with x exact in float32
    x = np.full(src.size, 1.0 + 2.0**-20, np.float32)  # not representable in either half format
    kernels.lerp_(x, wire_buf, 0.0, wire)
    assert np.all(x == np.float32(1.0 + 2.0**-20))


def test_bfloat16_encoding_rounds_to_nearest_even_and_keeps_specials(monkeypatch):
    from dpwa.mixing.kernels import encode_

    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, np.inf, -np.inf, np.nan, 3e38, -0.0], np.float32)
    monkeypatch.setattr(kernels, "TORCH_MIN_ELEMENTS", 0)
    for use in (True, False):
        monkeypatch.setattr(kernels, "use_torch", use)
        out = np.empty(values.size, np.uint16)
        encode_(out, values, "bfloat16")
        back = (out.astype(np.uint32) << 16).view(np.float32)
        assert back[0] == 1.0
        assert back[1] == 1.0  # a tie rounds to the even significand
        assert back[2] == 1.0 + 2**-6  # a tie rounds up to the even one
        assert np.isposinf(back[3]) and np.isneginf(back[4]) and np.isnan(back[5])
        assert np.isfinite(back[6]) and np.signbit(back[7])


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_within_on_half_precision(backend, wire):
    from dpwa.mixing.kernels import encode_, storage_dtype

    y = np.ones(1000, np.float32)
    buf = np.empty(1000, storage_dtype(wire))
    encode_(buf, y, wire)
    assert kernels.within(buf, 1e18, wire)
    y[500] = np.nan
    encode_(buf, y, wire)
    assert not kernels.within(buf, 1e18, wire)
    if wire == "bfloat16":  # bfloat16 reaches 3e38: beyond the bound is refused
        y[500] = 3e38
        encode_(buf, y, wire)
        assert not kernels.within(buf, 1e18, wire)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_small_half_precision_buffers_run_torch_in_blocks_that_match_numpy(monkeypatch, wire):
    """Below TORCH_MIN_ELEMENTS a half-precision buffer goes through torch a SERIAL_BLOCK at a time (on the
    calling thread); every block, the last short one too, gives numpy's values."""
    from dpwa.mixing.kernels import SERIAL_BLOCK, encode_, storage_dtype

    rng = np.random.default_rng(7)
    n = 3 * SERIAL_BLOCK + 123
    src = rng.standard_normal(n).astype(np.float32)
    x0, a = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    results = {}
    for use in (True, False):
        monkeypatch.setattr(kernels, "use_torch", use)
        assert (kernels._backend(n, wire)[1] == SERIAL_BLOCK) is use
        wire_buf, other = np.empty(n, storage_dtype(wire)), np.empty(n, storage_dtype(wire))
        encode_(wire_buf, src, wire)
        encode_(other, a, wire)
        lerped, diffed = x0.copy(), x0.copy()
        kernels.lerp_(lerped, wire_buf, 0.3, wire)
        kernels.add_scaled_diff_(diffed, wire_buf, other, 0.5, wire)
        results[use] = (wire_buf, lerped, diffed)
        assert kernels.within(wire_buf, 1e18, wire)
        for where in (0, SERIAL_BLOCK, n - 1):  # the first block, a later one, the short last one
            bad = wire_buf.copy()
            bad[where] = 0x7FC0 if wire == "bfloat16" else np.nan  # 0x7FC0: a bfloat16 NaN
            assert not kernels.within(bad, 1e18, wire), where
    (torch_wire, torch_lerped, torch_diffed), (numpy_wire, numpy_lerped, numpy_diffed) = results[True], results[False]
    assert torch_wire.tobytes() == numpy_wire.tobytes()  # both round to nearest even
    # the blends round differently in their last bit (torch's lerp has its own formula)
    np.testing.assert_allclose(torch_lerped, numpy_lerped, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(torch_diffed, numpy_diffed, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_relative_distance(backend, wire):
    from dpwa.mixing.kernels import encode_, storage_dtype

    rng = np.random.default_rng(3)
    ours32 = rng.standard_normal(50_001).astype(np.float32)
    y32 = ours32 + 0.1 * rng.standard_normal(ours32.size).astype(np.float32)
    y, ours = np.empty(ours32.size, storage_dtype(wire)), np.empty(ours32.size, storage_dtype(wire))
    encode_(y, y32, wire)
    encode_(ours, ours32, wire)
    decoded = {}
    for name, buf in (("y", y), ("ours", ours)):
        out = np.zeros(buf.size, np.float32)
        kernels.lerp_(out, buf, 1.0, wire)  # the values as the wire holds them
        decoded[name] = out.astype(np.float64)
    expected = np.linalg.norm(decoded["y"] - decoded["ours"]) / np.linalg.norm(decoded["ours"])
    assert kernels.relative_distance(y, ours, wire) == pytest.approx(expected, rel=1e-5)
    assert kernels.relative_distance(ours, ours, wire) == 0.0
    zero = np.zeros(ours.size, storage_dtype(wire))
    assert kernels.relative_distance(zero, zero, wire) == 0.0
    assert kernels.relative_distance(y, zero, wire) == float("inf")
