"""python -m dpwa.compare --seeds K and --tune N: the statistics (known values), the trials, and a short run."""

from __future__ import annotations

import math

import pytest

from dpwa_lab.compare.__main__ import config_from, parse_args
from dpwa_lab.compare.seeds import aggregate, interval, seeds_table, t95
from dpwa_lab.compare.tune import SPACES, apply, draw


def test_t95_is_students_t_and_widens_between_table_rows():
    assert t95(1) == 12.706 and t95(2) == 4.303 and t95(9) == 2.262
    assert t95(11) == t95(10) == 2.228  # between rows: the smaller df's, the wider quantile
    assert t95(1000) == 1.960
    with pytest.raises(ValueError):
        t95(0)


def test_interval_of_known_values():
    got = interval([1.0, 2.0, 3.0, None])
    # mean 2, sd 1, n 3: half-width t(2) * 1 / sqrt(3)
    assert got["n"] == 3 and got["missing"] == 1 and got["mean"] == 2.0
    assert math.isclose(got["half_width"], 4.303 / math.sqrt(3))
    assert math.isclose(got["low"], 2.0 - 4.303 / math.sqrt(3))
    assert interval([5.0])["half_width"] is None and interval([5.0])["mean"] == 5.0
    assert interval([None, float("nan")])["mean"] is None


def report(final: dict[str, float | None], time_s: dict[str, float | None]) -> dict:
    return {
        "target_acc": 0.9,
        "systems": {
            name: {
                "completed": True,
                "final_test_acc": final[name],
                "time_to_target_s": time_s[name],
                "samples_to_target": None if time_s[name] is None else 1000,
                "bytes_per_worker_per_step": 10.0,
                "s_per_step": 0.01,
            }
            for name in final
        },
    }


def test_the_paired_difference_is_taken_seed_by_seed():
    reports = [
        report({"a": 0.90, "b": 0.92}, {"a": 1.0, "b": None}),
        report({"a": 0.80, "b": 0.83}, {"a": 2.0, "b": 3.0}),
        report({"a": 0.85, "b": 0.86}, {"a": 3.0, "b": 2.0}),
    ]
    agg = aggregate(reports, [0, 1, 2])
    diff = agg["systems"]["b"]["paired_final_difference"]
    assert [round(v, 6) for v in diff["values"]] == [0.02, 0.03, 0.01]
    assert math.isclose(diff["mean"], 0.02)
    # the losses alone spread by 0.05 across seeds; their paired difference only by 0.01
    assert diff["half_width"] < agg["systems"]["b"]["final_test_acc"]["half_width"] / 3
    assert agg["systems"]["b"]["time_to_target_s"]["n"] == 2  # one seed never reached the target
    text = seeds_table(agg, "90%", by_loss=False)
    assert "2.5 ± " in text and "(2/3)" in text and "+2.00 ± " in text


def test_every_system_gets_the_same_number_of_trials_its_defaults_first(tmp_path):
    config = config_from(parse_args(["--workers", "2", "--out", str(tmp_path / "o")]))
    for system in config.systems:
        trials = draw(system, 5, config, seed=0)
        assert (
            len(trials) == 5
            or len(trials) == len([1 for _ in __import__("itertools").product(*[v for _, v in SPACES[system]])]) + 1
        )
        assert trials[0]["lr_scale"] == 1.0  # the defaults first
        assert len({repr(t) for t in trials}) == len(trials)  # no trial twice
        assert draw(system, 5, config, seed=0) == trials  # reproducible
    assert draw("diloco", 1, config, seed=0) == [
        {"lr_scale": 1.0, "outer_lr": 0.7, "outer_momentum": 0.9, "period": 10}
    ]


def test_a_trial_sets_what_it_names_and_nothing_else(tmp_path):
    config = config_from(parse_args(["--workers", "2", "--out", str(tmp_path / "o")]))
    one = apply(config, "gossip", {"lr_scale": 2.0, "f": 0.25, "period": 4, "outer": "nesterov@0.5/0.9"}, seed=7)
    assert one.systems == ("gossip",) and one.spec.seed == 7 and one.spec.lr == 2 * config.spec.lr
    assert dict(one.options.gossip_settings) == {
        "constant": {"value": 0.25},
        "period": 4,
        "outer": "nesterov",
        "outer_lr": 0.5,
        "outer_momentum": 0.9,
    }
    # NoLoCo's step at its authors' settings; a trial of gossip-noloco with outer none turns its step off
    noloco = apply(config, "gossip", {"lr_scale": 1.0, "f": 0.5, "period": 10, "outer": "noloco@0.7/0.3"}, seed=7)
    assert {k: v for k, v in noloco.options.gossip_settings if k.startswith("outer")} == {
        "outer": "noloco",
        "outer_lr": 0.7,
        "outer_momentum": 0.3,
    }
    off = apply(config, "gossip-noloco", {"lr_scale": 1.0, "f": 0.5, "period": None, "outer": "none"}, seed=7)
    assert dict(off.options.gossip_settings)["outer"] == "none" and off.systems == ("gossip-noloco",)
    d = apply(config, "diloco", {"lr_scale": 0.5, "outer_lr": 0.3, "outer_momentum": 0.0, "period": 20}, seed=7)
    assert (d.options.outer_lr, d.options.outer_momentum, d.options.diloco_period) == (0.3, 0.0, 20)
    assert d.options.gossip_settings == config.options.gossip_settings


# The end-to-end run of --seeds 2 --tune 2 (paired seeds, intervals, tuning) is docs/rules.md's worked
# example, three gossip systems side by side: tests/test_rules_walkthrough.py.
