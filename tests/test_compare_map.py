"""python -m dpwa.compare --map: the grid, each cell's winner and margin (known values), resuming, and a real cell.

The pure parts run on reports made up here, whose times to the target follow a
known rule per system, so each cell's winner is known in advance. One test runs
a real one-cell map through namespaces and a delay line (root only).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_links import needs_namespaces

from conftest import CHECKOUT_PATH, ROOT
from dpwa_lab.compare.__main__ import config_from, main, parse_args
from dpwa_lab.compare.comparison import CompareConfig
from dpwa_lab.compare.regimes import (
    Cell,
    MapError,
    cell_config,
    cells,
    collect,
    decide,
    decide_grid,
    map_table,
    plot_map,
    retarget,
)
from dpwa_lab.compare.seeds import aggregate
from dpwa_lab.compare.tune import TuningError, load_tuning


def _report(times: dict[str, float | None]) -> dict[str, Any]:
    """A comparison's report with these times to the target (None: missed it)."""
    return {
        "target_acc": 0.9,
        "systems": {
            name: {
                "completed": True,
                "time_to_target_s": t,
                "samples_to_target": None if t is None else 1000,
                "final_test_acc": 0.95,
                "bytes_per_worker_per_step": 1.0,
                "s_per_step": 0.1,
            }
            for name, t in times.items()
        },
    }


def _rule(config: CompareConfig) -> dict[str, Any]:
    """All-reduce pays for the link (100 / rate) and 2 D per step; gossip a tenth of that; seeds add 0.1 s each."""
    rate, delay, seed = config.options.link_mbit, config.options.link_delay_ms, config.spec.seed
    straggler = config.spec.straggler
    return _report(
        {
            "gossip": 2.0 + 10 / rate + delay / 100 + 0.1 * seed,
            "allreduce": straggler * (1.0 + 100 / rate + delay / 10) + 0.13 * seed,
        }
    )


def run_map(config: CompareConfig, grid, seeds, run_one, log=lambda _line: None) -> dict[str, Any]:
    """What the command does with a grid: collect its runs, then judge every cell."""
    return {"cells": decide_grid(collect(config, grid, seeds, run_one, log=log), seeds, log=log)}


def _config(tmp_path: Path, *extra: str) -> CompareConfig:
    return config_from(parse_args(["--workers", "2", "--systems", "gossip,allreduce", "--out", str(tmp_path), *extra]))


def test_the_grid_is_every_cell_and_bad_values_are_named():
    grid = cells((5, 1000), (0, 25), (1, 4))
    assert len(grid) == 8 and grid[0] == Cell(5, 0, 1) and grid[-1] == Cell(1000, 25, 4)
    assert Cell(20, 0, 1).label == "rate-20_delay-0_straggler-1"
    assert Cell(20, 25, 4).describe() == "20 Mbit/s, 25 ms each way, a 4x straggler"
    with pytest.raises(MapError, match="--map-rates lists a value twice: 5, 5"):
        cells((5, 5), (0,), (1,))
    with pytest.raises(MapError, match="--map-delays: every value must be >= 0"):
        cells((5,), (-1,), (1,))
    with pytest.raises(MapError, match="--map-rates: every value must be > 0"):
        cells((0,), (0,), (1,))
    with pytest.raises(MapError, match="--map-stragglers: a factor is 1"):
        cells((5,), (0,), (0.5,))
    with pytest.raises(MapError, match="--map-stragglers: give at least one value"):
        cells((5,), (0,), ())


def test_the_gossip_deadline_grows_with_the_rate_and_the_delay():
    """charlm's 765 KB model at 20 Mbit/s: four transfers (4 x 306 ms) and a second; each ms of delay adds 20."""
    from dpwa_lab.compare.comparison import gossip_timeout_ms
    from dpwa_lab.compare.runner import RunOptions

    model = 765_184
    assert gossip_timeout_ms(RunOptions(link_mbit=20), model) == 2224
    assert gossip_timeout_ms(RunOptions(link_mbit=20, link_delay_ms=100), model) == 4224
    assert gossip_timeout_ms(RunOptions(link_mbit=1000, gossip_timeout_ms=5000), model) == 5000


def test_a_cell_shapes_the_links_and_slows_the_last_worker(tmp_path):
    config = _config(tmp_path)
    one = cell_config(config, Cell(20, 25, 4), tmp_path / "c")
    assert (one.options.link_mbit, one.options.link_delay_ms, one.spec.straggler) == (20, 25, 4)
    assert one.out_dir == tmp_path / "c" and one.systems == config.systems and one.spec.seed == config.spec.seed


def test_the_winner_is_fastest_at_every_seed_and_its_margin_is_paired():
    seeds = [0, 1, 2]
    reports = [_report({"a": 10.0 + s, "b": 12.0 + s, "c": 5.0 if s else None}) for s in seeds]
    result = decide(aggregate(reports, seeds))
    # c was fastest where it reached the target, but missed it once: it cannot win
    assert result["winner"] == "a" and result["runner_up"] == "b"
    assert result["margin_s"]["values"] == [2.0, 2.0, 2.0] and result["margin_s"]["half_width"] == 0.0
    assert result["tie"] is False and math.isclose(result["ratio"], 13.0 / 11.0)
    assert result["reached"] == {"a": 3, "b": 3, "c": 2}
    # paired: b is 1 s behind a at each seed, though each system's time spreads over 10 s
    noisy = [_report({"a": 10.0 * s, "b": 10.0 * s + 1.0 + 0.1 * s}) for s in seeds]
    margin = decide(aggregate(noisy, seeds))["margin_s"]
    assert margin["low"] > 0
    # a margin whose interval holds 0 is a tie
    mixed = [_report({"a": 10.0, "b": 10.0 + d}) for d in (1.0, -0.8, 0.5)]
    assert decide(aggregate(mixed, seeds))["tie"] is True
    # nobody reached it everywhere; one system alone did
    assert decide(aggregate([_report({"a": None, "b": 1.0}), _report({"a": 2.0, "b": None})], [0, 1]))["winner"] is None
    alone = decide(aggregate([_report({"a": 3.0, "b": None})], [0]))
    assert alone["winner"] == "a" and alone["runner_up"] is None and "the others missed" in alone["note"]


@pytest.mark.io
def test_the_map_runs_every_cell_at_every_seed_and_finds_the_known_winners(tmp_path):
    config = _config(tmp_path)
    ran: list[tuple[float, float, float, int]] = []

    def run_one(one: CompareConfig) -> dict[str, Any]:
        ran.append((one.options.link_mbit, one.options.link_delay_ms, one.spec.straggler, one.spec.seed))
        return _rule(one)

    grid = cells((5, 1000), (0, 100), (1, 4))
    result = run_map(config, grid, [0, 1, 2], run_one)
    # seeds outermost: the whole grid at seed 0 first
    assert [r[3] for r in ran] == [0] * 8 + [1] * 8 + [2] * 8
    assert sorted(ran) == sorted((c.rate_mbit, c.delay_ms, c.straggler, s) for s in (0, 1, 2) for c in grid)
    winners = {(c["rate_mbit"], c["delay_ms"], c["straggler"]): c["winner"] for c in result["cells"]}
    # all-reduce wins only on a fast link without delay or straggler: 2.1 s against gossip's 2.01 + ...
    assert winners[(1000, 0, 1)] == "allreduce"
    assert {k: v for k, v in winners.items() if v != "gossip"} == {(1000, 0, 1): "allreduce"}
    fast = next(c for c in result["cells"] if (c["rate_mbit"], c["delay_ms"], c["straggler"]) == (1000, 0, 1))
    # gossip 2.01 + 0.1 s, all-reduce 1.1 + 0.13 s per seed: margin 0.91 - 0.03 s * seed, paired
    assert [round(v, 6) for v in fast["margin_s"]["values"]] == [0.91, 0.88, 0.85] and fast["tie"] is False
    table = map_table(result)
    assert "| 1000 | 0 | none | allreduce | 0.9 ± 0.1 | gossip |" in table
    assert "| 5 | 100 | 4x | gossip |" in table
    assert plot_map(result, tmp_path / "map.png", "a title")
    assert (tmp_path / "map.png").stat().st_size > 0


def test_a_stopped_map_resumes_adds_seeds_and_refuses_other_settings(tmp_path):
    config = _config(tmp_path)
    grid = cells((20,), (0, 25), (1,))
    calls: list[int] = []

    def run_one(one: CompareConfig) -> dict[str, Any]:
        calls.append(one.spec.seed)
        (one.out_dir / "work" / "gossip").mkdir(parents=True)  # as a run does: never into a folder that exists
        if len(calls) == 3:
            raise KeyboardInterrupt  # stopped in the middle of seed 1, its work folder left behind
        return _rule(one)

    with pytest.raises(KeyboardInterrupt):
        run_map(config, grid, [0, 1], run_one, log=lambda _line: None)
    assert calls == [0, 0, 1]
    lines: list[str] = []
    result = run_map(config, grid, [0, 1], run_one, log=lines.append)
    assert calls == [0, 0, 1, 1, 1]  # the two seed-0 cells were read back, not run again
    assert sum("done before" in line for line in lines) == 2
    assert [c["seeds"] for c in result["cells"]] == [2, 2]
    run_map(config, grid, [0, 1, 2], run_one, log=lambda _line: None)
    assert calls == [0, 0, 1, 1, 1, 2, 2]  # a third seed adds two runs
    other = replace(config, target=0.5)
    with pytest.raises(MapError, match=r"seed-0\.json was run with other settings .* use another --out"):
        run_map(other, grid, [0], run_one, log=lambda _line: None)
    (tmp_path / "cells" / grid[0].label / "seed-0.json").write_text("{not json")
    with pytest.raises(MapError, match="not a seed of this map"):
        run_map(config, grid, [0], run_one, log=lambda _line: None)


def test_one_grid_of_runs_is_judged_again_at_another_target_from_its_curves(tmp_path):
    """The curves hold (t, samples, acc, loss): at 90% a system that crawls to 95% can win the cell."""
    curves = {
        "fast-start": [[1.0, 100, 0.91, 0.3], [2.0, 200, 0.93, 0.2], [9.0, 900, 0.96, 0.1]],
        "late": [[1.5, 150, 0.5, 0.9], [3.0, 300, 0.95, 0.2], [4.0, 400, 0.97, 0.1]],
    }
    report = _report({"fast-start": 9.0, "late": 3.0})
    for name, curve in curves.items():
        report["systems"][name]["curve"] = curve
    again = retarget(report, 0.9)
    assert again["target_acc"] == 0.9 and report["target_acc"] == 0.9  # the original is not changed
    assert again["systems"]["fast-start"]["time_to_target_s"] == 1.0
    assert again["systems"]["late"]["samples_to_target"] == 300
    assert retarget(report, 0.99)["systems"]["late"]["time_to_target_s"] is None
    by_cell = {Cell(5, 0, 1): [report]}
    assert decide_grid(by_cell, [0], log=lambda _line: None)[0]["winner"] == "late"
    assert decide_grid(by_cell, [0], 0.9, log=lambda _line: None)[0]["winner"] == "fast-start"
    grid = cells((5,), (0,), (1,))
    assert list(collect(_config(tmp_path), grid, [0], _rule, log=lambda _line: None)) == grid


def test_an_earlier_tuning_is_read_checked_and_named_when_it_lacks_a_system(tmp_path):
    best = {"lr_scale": 2.0, "f": 0.25, "period": 4, "outer": "none"}
    tuning = {"trials_per_system": 2, "seed": 1000, "systems": {"gossip": {"trials": [], "best": best}}}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"aggregate": {}, "tuning": tuning}))
    loaded = load_tuning(path, ("gossip",))
    assert loaded["systems"]["gossip"]["best"] == best and loaded["from"] == str(path)
    with pytest.raises(TuningError, match=r"no best setting for allreduce \(expected one with lr_scale\).*gossip"):
        load_tuning(path, ("gossip", "allreduce"))
    path.write_text(json.dumps({"tuning": {"systems": {"gossip": {"best": {"lr_scale": 1.0}}}}}))
    with pytest.raises(TuningError, match="no best setting for gossip .*f, lr_scale, outer, period"):
        load_tuning(path, ("gossip",))
    path.write_text(json.dumps({"systems": 3}))
    with pytest.raises(TuningError, match="no tuning in it"):
        load_tuning(path, ("gossip",))
    with pytest.raises(TuningError, match="cannot read it"):
        load_tuning(tmp_path / "missing.json", ("gossip",))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--map", "--link-mbit", "20"], "drop --link-mbit"),
        (["--map", "--straggler", "4"], "drop --straggler"),
        (["--map", "--faults"], "drop --faults"),
        (["--map", "--map-rates", "5,x"], "expected comma-separated numbers"),
        (["--map", "--map-delays", "0,0"], "--map-delays lists a value twice"),
        (["--tune", "2", "--tuned-from", "x.json"], "--tune and --tuned-from"),
        (["--also-target", "0.9"], "--also-target is for --map"),
        (["--map", "--also-target", "90"], "--also-target for images is an accuracy in (0, 1], got 90.0"),
    ],
)
def test_the_command_refuses_what_the_map_sets_itself(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_without_root_the_map_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--map", "--out", str(tmp_path / "m")]) == 2
    assert "--link-mbit needs root" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_one_cell_map_through_a_delay_line(tmp_path):
    """One cell (1,000 Mbit/s, 25 ms each way), gossip and all-reduce, two workers, one epoch, an easy target:
    the map's files, its cell's link check (all-reduce's time per step holds the ring's 2 (n-1) D), and a second
    run of the same command that reads the cell back instead of training."""
    out = tmp_path / "map"
    argv = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--map",
        "--map-rates",
        "1000",
        "--map-delays",
        "25",
        "--map-stragglers",
        "1",
        "--workers",
        "2",
        "--epochs",
        "1",
        "--quick",
        "--target-acc",
        "0.3",
        "--also-target",
        "0.2",
        "--systems",
        "gossip,allreduce",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "map.json").read_text())
    assert sorted(result["maps"]) == ["0.2", "0.3"] and (out / "map-0.2.md").is_file()
    (cell,) = result["maps"]["0.3"]["cells"]
    assert (cell["rate_mbit"], cell["delay_ms"], cell["straggler"]) == (1000, 25, 1)
    assert cell["winner"] in ("gossip", "allreduce") and cell["reached"] == {"gossip": 1, "allreduce": 1}
    assert (out / "map.png").stat().st_size > 0 and "| 1000 | 25 | none |" in (out / "map.md").read_text()
    seed = json.loads((out / "cells" / "rate-1000_delay-25_straggler-1" / "seed-0.json").read_text())
    check = seed["report"]["link_check"]["allreduce"]
    assert check["delay_ms"] == 25 and math.isclose(check["latency_s"], 2 * (2 - 1) * 0.025)
    again = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0 and "done before" in again.stdout, again.stdout + again.stderr
