"""python -m dpwa.compare --systems gossip-pushsum: push-sum as a compared system, its mass-weighted mean, a short run.

Unit tests on the system table, the arguments and hand-made snapshots; one
short end-to-end run (2 push-sum workers training the tiny charlm model for
40 steps each, about 20 s on two cores).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CHECKOUT_PATH, ROOT
from dpwa.config import parse_config
from dpwa_lab.compare.__main__ import config_from, main, parse_args
from dpwa_lab.compare.comparison import EVALUATED_MODEL, fault_scenarios, weighted_by_mass
from dpwa_lab.compare.evaluation import states
from dpwa_lab.compare.report import mass_lines
from dpwa_lab.compare.runner import (
    GOSSIP_SYSTEMS,
    KNOWN_SYSTEMS,
    OPT_IN_SYSTEMS,
    SYSTEMS,
    RunOptions,
    SystemRun,
    plan_processes,
)
from dpwa_lab.compare.workload import WorkloadSpec

pytestmark = pytest.mark.timeout(120)


def test_pushsum_is_a_gossip_system_that_the_default_run_leaves_out():
    assert GOSSIP_SYSTEMS["gossip-pushsum"] == {"mode": "pull", "rule": "pushsum"}
    assert OPT_IN_SYSTEMS == ("gossip-pushsum", "gossip-noloco")
    assert "gossip-pushsum" not in SYSTEMS and "gossip-pushsum" in KNOWN_SYSTEMS
    assert SYSTEMS == ("gossip", "gossip-lowbw", "gossip-original", "sync-master", "async-ps", "allreduce", "diloco")
    assert parse_args([]).systems == SYSTEMS  # the default run is unchanged
    assert parse_args(["--systems", "gossip,gossip-pushsum"]).systems == ("gossip", "gossip-pushsum")
    assert fault_scenarios(("gossip-pushsum", "allreduce")) == ["gossip-pushsum", "allreduce"]
    assert "push-sum weight" in EVALUATED_MODEL["gossip-pushsum"]


@pytest.mark.io
def test_its_nodes_run_pull_and_pushsum_and_otherwise_the_defaults():
    spec = WorkloadSpec(data="digits", data_dir="", workers=4, epochs=1, batch_size=32, lr=0.05)
    system_options, starts, ready = plan_processes("gossip-pushsum", spec, RunOptions(), "t", Path("/nonexistent"))
    config = parse_config(system_options["gossip_config"], source="gossip-pushsum")
    default = parse_config(plan_processes("gossip", spec, RunOptions(), "t", Path("/x"))[0]["gossip_config"])
    assert (config.mode, config.rule) == ("pull", "pushsum")
    assert (default.mode, default.rule) == ("symmetric", "delta")
    for key in ("pairing", "period", "wire_dtype", "interpolation", "timeout_ms", "outer"):
        assert getattr(config, key) == getattr(default, key), key
    assert [s[:2] for s in starts] == [(n, "gossip") for n in ready] == [(f"w{i}", "gossip") for i in range(4)]


def test_a_gossip_set_its_rule_cannot_run_with_is_refused_before_anything_runs(capsys):
    assert main(["--systems", "gossip,gossip-pushsum", "--gossip-set", "mode=symmetric"]) == 2
    err = capsys.readouterr().err
    assert "gossip-pushsum with --gossip-set" in err and "rule 'pushsum' needs mode pull" in err
    args = parse_args(["--systems", "gossip,gossip-pushsum", "--gossip-set", "period=2"])
    assert dict(config_from(args).options.gossip_settings) == {"period": 2}


def _snapshots(workdir: Path, name: str, rows: list[tuple[float, int, float, float, bool]]) -> list[dict]:
    """Snapshot lines of node `name`: (t, samples, value of every element, mass, final)."""
    (workdir / "snapshots").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (t, samples, value, mass, final) in enumerate(rows):
        np.save(workdir / "snapshots" / f"{name}-{k}.npy", np.full(3, value, np.float32))
        line = {"k": k, "t": t, "samples": samples, "file": f"{name}-{k}.npy", "mass": mass}
        lines.append({**line, **({"final": True} if final else {})})
    return lines


def test_the_pushsum_mean_weights_each_node_by_its_mass(tmp_path):
    """Two nodes; the cluster passes 100, 200, 300 samples at t = 1.5, 2.5, 3.5. w0 served more pulls than it
    made (its weight fell to 0.5, w1's rose to 1.5); after training w1 lingered and served w0 once more."""
    snapshots = {
        "w0": _snapshots(
            tmp_path, "w0", [(0.0, 0, 0.0, 1.0, False), (2.0, 100, 1.0, 0.5, False), (3.0, 150, 3.0, 0.5, True)]
        ),
        "w1": _snapshots(
            tmp_path, "w1", [(0.0, 0, 0.0, 1.0, False), (2.5, 100, 5.0, 1.5, False), (3.5, 150, 7.0, 1.0, True)]
        ),
    }
    results = {
        "w0": {"progress": [[1.0, 50], [2.0, 100], [3.0, 150]], "mass_at_end": 0.25},
        "w1": {"progress": [[1.5, 50], [2.5, 100], [3.5, 150]], "mass_at_end": 1.0},
    }
    run = SystemRun("gossip-pushsum", tmp_path, 0.0, True, None, results, snapshots, {}, ["w0", "w1"])
    points = [(t, n, float(load()[0])) for t, n, load in states(run, every=100)]
    assert points == [
        (1.5, 100, 0.0),
        (2.5, 200, pytest.approx((0.5 * 1.0 + 1.5 * 5.0) / 2.0)),  # 4.0; the plain mean would be 3.0
        (3.5, 300, pytest.approx((0.5 * 3.0 + 1.0 * 7.0) / 1.5)),  # both final snapshots, at their masses then
        (3.5, 300, pytest.approx((0.25 * 3.0 + 1.0 * 7.0) / 1.25)),  # the final point: the masses after lingering
    ]
    assert weighted_by_mass(run)
    # with every mass 1 (every other rule) the mean is the plain mean, bit for bit
    for shots in snapshots.values():
        for line in shots:
            line["mass"] = 1.0
    for result in results.values():
        result["mass_at_end"] = 1.0
    plain = [(t, n, float(load()[0])) for t, n, load in states(run, every=100)]
    assert plain == [(1.5, 100, 0.0), (2.5, 200, 3.0), (3.5, 300, 5.0), (3.5, 300, 5.0)]
    assert not weighted_by_mass(run)


def test_snapshots_without_masses_give_the_plain_mean(tmp_path):
    snapshots = {
        "w0": _snapshots(tmp_path, "w0", [(0.0, 0, 2.0, 1.0, False), (1.0, 100, 2.0, 1.0, True)]),
        "w1": _snapshots(tmp_path, "w1", [(0.0, 0, 4.0, 1.0, False), (1.0, 100, 4.0, 1.0, True)]),
    }
    for shots in snapshots.values():
        for line in shots:
            del line["mass"]
    results = {"w0": {"progress": [[1.0, 100]]}, "w1": {"progress": [[1.0, 100]]}}
    run = SystemRun("gossip", tmp_path, 0.0, True, None, results, snapshots, {}, ["w0", "w1"])
    assert [float(load()[0]) for _, _, load in states(run, every=100)] == [3.0, 3.0, 3.0]  # 100, 200, the final


def test_the_weights_at_the_end_are_printed_for_pushsum_only():
    report = {
        "systems": {
            "gossip": {"mass_at_end": None},
            "gossip-pushsum": {"mass_at_end": {"w0": 1.75, "w1": 0.25, "w2": None}, "mass_sum_at_end": 2.0},
        }
    }
    assert mass_lines(report) == "gossip-pushsum: push-sum weights at the end w0 1.75, w1 0.25, w2 - (sum 2 of 3)"
    assert mass_lines({"systems": {"gossip": {}}}) == ""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_short_pushsum_run_exchanges_weight_and_learns(tmp_path):
    json_path = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--quick",
        "--workload",
        "charlm",
        "--model",
        "tiny",
        "--systems",
        "gossip-pushsum",
        "--workers",
        "2",
        "--keep-snapshots",
        "--json",
        str(json_path),
        "--out",
        str(tmp_path / "run"),
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\ngossip-pushsum " in proc.stdout.split("system ", 1)[1]  # its row of the table
    assert "gossip-pushsum: push-sum weights at the end w0 " in proc.stdout
    report = json.loads(json_path.read_text())
    assert list(report["systems"]) == ["gossip-pushsum"]
    pushsum = report["systems"]["gossip-pushsum"]
    assert pushsum["completed"] and pushsum["workers_finished"] == 2 and pushsum["steps_per_worker"] == 40
    assert pushsum["exchanges_averaged"] > 0  # the nodes did exchange
    assert "push-sum weight" in pushsum["evaluated_model"]
    untrained, final = pushsum["curve"][0][3], pushsum["final_val_loss"]
    assert math.isfinite(untrained) and final is not None and math.isfinite(final)
    assert final < untrained - 0.2, (final, untrained)  # it learned
    assert pushsum["nonfinite_points"] == 0
    # the weights moved (a served snapshot carries half the server's weight) and no mass was made beyond what
    # the floor minted (a node that serves 20 times without a blend reaches it: CI's run minted 2.7e-7)
    masses = pushsum["mass_at_end"]
    assert set(masses) == {"w0", "w1"} and all(m > 0 for m in masses.values())
    assert 0 <= pushsum["minted_at_end"] < 1e-4
    assert 0 < pushsum["mass_sum_at_end"] <= 2 + pushsum["minted_at_end"] + 1e-9
    work = tmp_path / "run" / "work" / "gossip-pushsum"
    run = json.loads((work / "run.json").read_text())
    assert run["gossip_config"]["mode"] == "pull" and run["gossip_config"]["rule"] == "pushsum"
    lines = [json.loads(line) for n in ("w0", "w1") for line in (work / "snapshots" / f"{n}.jsonl").open()]
    assert all(line["mass"] > 0 for line in lines) and any(line["mass"] != 1.0 for line in lines)
    for n in ("w0", "w1"):
        stats = json.loads((work / "results" / f"{n}.json").read_text())["stats"]
        assert stats["averaged"] > 0 and stats.get("rule.weight") is not None
