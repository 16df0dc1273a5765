"""`python -m dpwa.compare --variant NAME=MAP`: gossip systems of one's own, side by side in one table (issue 49).

Before, ``--gossip-set rule=...`` took one rule for every gossip system, so two rules took two runs and two
tables. A variant is a gossip system of its own, gossip-NAME, with its dpwa keys over the --gossip-set ones;
it runs with the same seeds, tuning and workload as the rest. The end-to-end run (two rules of one's own and
the default, in one table) is docs/rules.md's walkthrough, run by tests/test_rules_walkthrough.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dpwa.config import parse_config
from dpwa_lab.compare.__main__ import config_from, main, parse_args
from dpwa_lab.compare.comparison import evaluated_model, fault_scenarios
from dpwa_lab.compare.runner import RunOptions, gossip_keys, plan_processes
from dpwa_lab.compare.tune import draw, space
from dpwa_lab.compare.workload import WorkloadSpec


@pytest.mark.io  # plan_processes picks free ports
def test_each_variant_is_a_gossip_system_of_its_own_with_its_keys_over_the_gossip_set_ones():
    args = parse_args(
        [
            "--systems",
            "gossip,allreduce",
            "--gossip-set",
            "period=4",
            "--gossip-set",
            "mode=pull",
            "--variant",
            "slow={period: 2, rule_options: {}}",
            "--variant",
            "sym={mode: symmetric}",
        ]
    )
    assert args.systems == ("gossip", "allreduce", "gossip-slow", "gossip-sym")
    config = config_from(args)
    options = config.options
    assert dict(options.variants) == {
        "gossip-slow": (("period", 2), ("rule_options", {})),
        "gossip-sym": (("mode", "symmetric"),),
    }
    assert gossip_keys("gossip", options) == {"period": 4, "mode": "pull"}  # the built-in: --gossip-set over its own
    assert gossip_keys("gossip-slow", options) == {"period": 2, "mode": "pull", "rule_options": {}}
    assert gossip_keys("gossip-sym", options) == {"period": 4, "mode": "symmetric"}
    spec = WorkloadSpec(data="digits", data_dir="", workers=3, epochs=1, batch_size=32, lr=0.05)
    described, starts, ready = plan_processes("gossip-sym", spec, options, "t", Path("/nonexistent"))
    node = parse_config(described["gossip_config"], source="gossip-sym")
    assert (node.mode, node.period) == ("symmetric", 4) and ready == ["w0", "w1", "w2"]
    assert [s[1] for s in starts] == ["gossip"] * 3
    # the same tuning space, fault and evaluated model as every gossip system
    assert space("gossip-slow") == space("gossip")
    assert draw("gossip-slow", 3, config, 0)[0] == draw("gossip", 3, config, 0)[0]
    assert evaluated_model("gossip-slow") == evaluated_model("gossip")
    assert fault_scenarios(("allreduce", "gossip-slow", "gossip-sym")) == ["gossip-slow", "allreduce"]
    assert fault_scenarios(("gossip-sym", "gossip")) == ["gossip"]  # one gossip node killed is enough


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--variant", "Heavy={rule: delta}"], "--variant 'Heavy={rule: delta}': expected NAME=MAP"),
        (["--variant", "heavy"], "--variant 'heavy': expected NAME=MAP"),
        (["--variant", "heavy=[1, 2]"], "--variant heavy: expected a map of dpwa config keys"),
        (["--variant", "heavy={rule: delta", "--systems", "gossip"], "--variant heavy: its MAP is not YAML"),
        (["--variant", "a={period: 2}", "--variant", "a={period: 3}"], "--variant a: gossip-a is already a system"),
        (["--variant", "lowbw={period: 2}"], "--variant lowbw: gossip-lowbw is already a system"),
        (["--variant", "n={nodes: []}"], "--variant n: nodes: the comparison places the nodes itself"),
        (["--systems", "gossip,gossip-heavy"], "--systems gossip-heavy: no such system, and no --variant names it"),
    ],
)
def test_a_variant_that_cannot_be_read_is_named_before_anything_runs(argv, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_variants_keys_are_checked_as_dpwas_config_checks_them_naming_the_variant(capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["--systems", "gossip", "--variant", "mine={rule: nosuchmodule:Rule}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--variant mine" in err and "nosuchmodule" in err, err
    assert main(["--variant", "ps={rule: pushsum, mode: symmetric}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--variant ps" in err and "rule 'pushsum' needs mode pull" in err, err
    assert not out.exists()  # nothing ran


def test_run_options_refuse_a_variant_that_is_not_named_as_one():
    with pytest.raises(ValueError, match="a variant's system is gossip-NAME, not a built-in one"):
        RunOptions(variants=(("gossip-lowbw", (("period", 2),)),))
    with pytest.raises(ValueError, match="not a built-in one; got 'heavy'"):
        RunOptions(variants=(("heavy", ()),))
