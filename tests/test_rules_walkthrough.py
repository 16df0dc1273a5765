"""docs/rules.md's worked example, run as written: a heavy-ball rule of one's own, from its file to a table.

The section "A worked example: a heavy-ball rule of your own" holds the rule's file, its config and the
commands, each after a ``<!-- rules-walkthrough: STEP -->`` line. This test writes the file (and the page's
ScaledDelta, its "Your own rule" example, as myrules.py) into a folder of its own, loads the config, and runs
each ```bash block there with ``bash -e``, changing only ``python`` to this interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from dpwa.config import parse_config
from dpwa_lab.compare.tune import TUNING_SEED_OFFSET
from dpwa_lab.sim.simulate import Gossip

DOC = ROOT / "docs" / "rules.md"
STEPS = ["heavyball.py", "config", "simulate", "compare"]


def walkthrough() -> dict[str, str]:
    """The worked example's blocks, by step."""
    text = DOC.read_text(encoding="utf-8")
    return dict(re.findall(r"^<!-- rules-walkthrough: ([^>]+?) -->\n```[a-z]+\n(.*?)^```\n", text, re.M | re.S))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder with the example's two rule files, importable here as from the commands (PYTHONPATH=.)."""
    text = DOC.read_text(encoding="utf-8")
    example = re.search(r"<!-- rules-example -->\n```python\n(.*?)```", text, flags=re.DOTALL)
    assert example, "docs/rules.md shows no rules-example block"
    (tmp_path / "myrules.py").write_text(example.group(1))
    (tmp_path / "heavyball.py").write_text(walkthrough()["heavyball.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_worked_example_is_last_and_has_every_step_in_order():
    assert list(walkthrough()) == STEPS
    text = DOC.read_text(encoding="utf-8")
    assert text.rindex("\n## ") == text.index("\n## A worked example: a heavy-ball rule of your own")


def test_its_config_loads_and_its_momentum_leaves_running_statistics_where_delta_would(folder):
    """The config block names the rule (mode pull: it has no mirror). In the simulator with running statistics
    (as the rules' helper test sets them up), HeavyBall keeps four nodes' identical statistics at 1, as delta
    does, and moves the parameters as a heavy ball: at beta 0 exactly as delta, at beta 0.5 otherwise."""
    config = yaml_config(walkthrough()["config"])
    assert (config.mode, config.rule, dict(config.rule_options)) == ("pull", "heavyball:HeavyBall", {"beta": 0.5})

    def after(rule: str, **options: float) -> np.ndarray:
        rng = np.random.default_rng(0)
        arrays = [np.concatenate([rng.normal(size=8), np.ones(4)]).astype(np.float32) for _ in range(4)]
        gossip = Gossip(arrays, mode="pull", rule=rule, seed=1, statistics=[(8, 12)], rule_options=options)
        for _ in range(40):
            i = gossip.rng.randrange(4)
            gossip.exchange_now(i, gossip.choose(i))
        return np.stack(gossip.arrays)

    heavy, delta = after("heavyball:HeavyBall", beta=0.5), after("delta")
    assert np.allclose(heavy[:, 8:], 1.0) and np.allclose(delta[:, 8:], 1.0)
    assert np.allclose(after("heavyball:HeavyBall", beta=0.0, clamp=100.0), delta, atol=1e-6)
    assert not np.allclose(heavy[:, :8], delta[:, :8], atol=1e-3)


def yaml_config(block: str):
    import yaml

    nodes = [{"name": f"w{i}", "host": "127.0.0.1", "port": 7001 + i} for i in range(2)]
    return parse_config({"nodes": nodes, **yaml.safe_load(block)}, source="docs/rules.md (worked example)")


def run_block(step: str, cwd) -> str:
    script = re.sub(r"(?m)(^|\s)python -m ", rf"\g<1>{sys.executable} -m ", walkthrough()[step])
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{step}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_simulator_and_the_comparison_run_as_written_with_two_rules_of_ones_own_in_one_table(folder):
    """The simulator command prints the rule's line. The comparison (--seeds 2 --tune 2) puts the default gossip
    and both rules of one's own (gossip-heavy, gossip-scaled) in one table, each run complete, each node running
    the rule its variant names. It is also the comparison's end-to-end run of paired seeds and tuning: each
    seed's folder, one JSON with both runs and the intervals, a plot; within a seed every system started from
    the same model (equal first evaluations), and the two seeds from different ones; every system got two
    trials, its defaults first, and both seeds ran at its best."""
    simulated = run_block("simulate", folder)
    assert "8 nodes, pull/heavyball:HeavyBall, f = 0.5: mean D'/D per exchange" in simulated, simulated
    assert "8 nodes, pull/delta, f = 0.5" in simulated, simulated
    compared = run_block("compare", folder)
    systems = ["gossip", "gossip-heavy", "gossip-scaled"]
    table = compared[compared.rindex("final - gossip (paired)") :]
    assert [line.split()[0] for line in table.splitlines()[2:5]] == systems, compared[-2000:]
    assert "2 seeds (0, 1), paired" in compared and "tuning: 2 trials per system" in compared
    out = folder / "runs" / "two-rules"
    report = json.loads((out / "compare.json").read_text())
    assert (out / "seed-0" / "compare.json").is_file() and (out / "seed-1" / "compare.json").is_file()
    assert (out / "compare.png").stat().st_size > 0
    assert report["seeds"] == [0, 1] and len(report["runs"]) == 2
    for run in report["runs"]:
        done = run["systems"]
        assert all(done[s]["completed"] for s in systems), {s: done[s].get("error") for s in systems}
    variants = dict(report["runs"][0]["options"]["variants"])
    assert variants["gossip-heavy"] == [["rule", "heavyball:HeavyBall"], ["mode", "pull"]]
    assert variants["gossip-scaled"] == [["rule", "myrules:ScaledDelta"]]
    firsts = [[run["systems"][s]["curve"][0][2] for s in systems] for run in report["runs"]]
    assert len(set(firsts[0])) == 1 and len(set(firsts[1])) == 1  # paired: one initial model per seed
    assert firsts[0][0] != firsts[1][0]  # and another one for the other seed
    agg = report["aggregate"]["systems"]
    assert list(agg) == systems
    assert agg["gossip"]["final_test_acc"]["n"] == 2 and agg["gossip"]["final_test_acc"]["half_width"] is not None
    assert "paired_final_difference" in agg["gossip-heavy"] and "paired_final_difference" in agg["gossip-scaled"]
    tuning = report["tuning"]
    assert tuning["seed"] == TUNING_SEED_OFFSET and tuning["trials_per_system"] == 2
    for system in systems:
        trials = tuning["systems"][system]["trials"]
        assert len(trials) == 2 and trials[0]["settings"]["lr_scale"] == 1.0
        best = tuning["systems"][system]["best"]
        assert best in [t["settings"] for t in trials]
        assert all(run["systems"][system]["tuned_settings"] == best for run in report["runs"])
