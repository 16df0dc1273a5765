"""The blends table of the benchmark (``python -m dpwa.bench --blends``): its rows and its lines, without
running them (their harness is the memory table's, tests/test_bench.py; the flaky link's run is
tests/test_flaky_link.py)."""

from __future__ import annotations


def test_the_blends_table_has_both_modes_at_every_size_and_step_and_prints_what_it_measured():
    """`--blends`' rows and its lines, without running them (the rows' harness is the memory table's, run
    above; the flaky link's run is tests/test_flaky_link.py)."""
    from dpwa.lab.bench.blends import blend_rows, format_blends, format_flaky

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
