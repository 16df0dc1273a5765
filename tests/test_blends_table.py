"""The blends table of the benchmark (``python -m dpwa.bench --blends``) and the memory table's GPU rows: their
rows and their lines, without running them (their harness is the memory table's, tests/test_bench.py; the flaky link's run is
tests/test_flaky_link.py)."""

from __future__ import annotations


def test_the_blends_table_has_both_modes_at_every_size_and_step_and_prints_what_it_measured():
    """`--blends`' rows and its lines, without running them (the rows' harness is the memory table's, run
    above; the flaky link's run is tests/test_flaky_link.py)."""
    from dpwa_lab.bench.blends import blend_rows, format_blends, format_flaky

    rows = blend_rows((100, 200), (0.01, 0.05))
    same_host = [r for r in rows if r.settings.get("same_host") == "auto"]
    assert len(same_host) == 2 * 2 * 2  # sizes x step times x modes
    assert {r.settings.get("mode", "symmetric") for r in same_host} == {"symmetric", "pull"}
    assert {(r.parameters, r.step_s) for r in same_host} == {(100, 0.01), (100, 0.05), (200, 0.01), (200, 0.05)}
    assert all(r.settings.get("insecure") for r in rows if r not in same_host)
    assert all(r.settings.get("mode") is None for r in blend_rows((100,), (0.01,), quick=True))  # the defaults
    node = {"busy": 3}
    row = {"label": "pull, same host", "parameters": 100, "step_s": 0.05, "step_ms": 52.4, "blends": 15, "steps": 16}
    assert "pull, same host" in format_blends([{**row, "nodes": [node, node]}], True)
    assert format_blends([{**row, "nodes": [node, node]}], False).split()[-3:] == ["52", "15/16", "6"]
    flaky = {"steps": 10, "applied": 3, "in_doubt": 1, "timeouts": 4, "slow": 2, "drift": 0.0, "silent_s": 1.5}
    line = format_flaky({**flaky, "seed": 1, "cuts": 2, "took_s": 9.0, "unblended_s": 4.25})
    assert "exchanges applied 3 in 30 node-steps (10.0%)" in line and "2 cuts" in line and "seed 1" in line
    assert line.endswith("1.5 s, without applying any: 4.2 s")


def test_the_gpu_rows_size_the_largest_model_from_free_memory_and_print_the_floor():
    """scripts/gpu-check.sh's memory rows (``--memory --device cuda``), without a GPU: the largest bfloat16
    model two nodes hold is the least of what the device, /dev/shm and the host allow (30% left free), in
    steps of 100M, at most 4B; a GPU row's line adds the device memory dpwa added and the step without it."""
    from dpwa_lab.bench.memory import format_memory, gpu_rows, largest_on_gpu

    gb = 1_000_000_000
    assert largest_on_gpu(80 * gb, 64 * gb, 120 * gb) == 4_000_000_000  # an H100 host: the cap
    assert largest_on_gpu(24 * gb, 12 * gb, 20 * gb) == 1_000_000_000  # /dev/shm decides: 0.7 x 12 GB / 8
    assert largest_on_gpu(80 * gb, 64 * gb, 5 * gb) == 300_000_000  # the host's memory decides
    rows = gpu_rows(2_000_000_000)
    assert [(r.parameters, r.dtype, r.device) for r in rows] == [
        (100_000_000, "float32", "cuda"),
        (2_000_000_000, "bfloat16", "cuda"),
    ]
    row = {"label": "GPU", "parameters": 100, "model_mbytes": 400.0, "steady_copies": 2.0, "peak_copies": 2.1}
    row |= {"anon_copies": 0.1, "shm_copies": 2.0, "step_ms": 60.0, "blends": 16, "steps": 16}
    line = format_memory([{**row, "device_peak_copies": 0.03, "plain_step_ms": 51.0}], header=False)
    assert line.endswith("16/16  GPU peak 0.03, step without dpwa 51 ms")
    assert "GPU peak" not in format_memory([row], header=False)
