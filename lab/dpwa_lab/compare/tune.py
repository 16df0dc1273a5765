"""Equal tuning: the same number of trials for every system, each over its own settings, the best kept

``python -m dpwa.compare --tune N`` gives every system N trials before the
measured runs. A trial is one run of one system at the tuning seed
(:data:`TUNING_SEED_OFFSET` past ``--seed``, so the seeds measured later are
not the ones tuned on), with settings drawn from that system's grid in
:data:`SPACES`:

* every system: the learning rate, as a multiple of the workload's;
* DiLoCo: its outer learning rate, its outer momentum and H (inner steps
  between synchronisations);
* the gossip systems: the factor f, the period, and the outer step (none,
  Nesterov at two outer learning rates with momentum 0.9, or NoLoCo's at its
  authors' learning rate 0.7 and momentum 0.3), written ``name@lr/momentum``;
* sync-master and async-ps: the learning rate only (their other settings
  are not training knobs).

The first trial of every system is its default settings; the rest are drawn
from its grid without repeats (N trials, or every point of a grid smaller
than N: the learning rate alone has six), by a generator seeded from ``--seed`` and the
system's name, so a tuning run is reproducible. The best trial is the one
with the best final value (validation loss for charlm, test accuracy for
images); a trial that failed or gave no final value loses. The chosen
settings are then what every measured seed runs, and the JSON keeps every
trial (its settings, its final value, and whether it completed).
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .comparison import CompareConfig, run_comparison
from .runner import GOSSIP_SYSTEMS, is_gossip

__all__ = ["SPACES", "TUNING_SEED_OFFSET", "TuningError", "apply", "draw", "load_tuning", "space", "tune"]

TUNING_SEED_OFFSET = 1000  # the tuning runs' seed is --seed + this: never one of the measured seeds

_LR = ("lr_scale", (0.25, 0.5, 1.0, 2.0, 4.0, 8.0))
_GOSSIP = (
    _LR,
    ("f", (0.25, 0.5)),
    ("period", (1, 2, 4, 8)),
    ("outer", ("none", "nesterov@0.5/0.9", "nesterov@0.7/0.9", "noloco@0.7/0.3")),
)
#: per system: its settings and the values each may take (the defaults come first in every draw: _default)
SPACES: dict[str, tuple[tuple[str, tuple[Any, ...]], ...]] = {
    **{system: _GOSSIP for system in GOSSIP_SYSTEMS},
    "sync-master": (_LR,),
    "async-ps": (_LR,),
    "allreduce": (_LR,),
    "diloco": (_LR, ("outer_lr", (0.3, 0.5, 0.7, 1.0)), ("outer_momentum", (0.0, 0.5, 0.9)), ("period", (5, 10, 20))),
}


def space(system: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """`system`'s settings and the values each may take: every gossip system, a variant too, shares one."""
    return _GOSSIP if is_gossip(system) else SPACES[system]


class TuningError(ValueError):
    """An earlier tuning that cannot be used: unreadable, or without a best setting for a system asked for."""


def load_tuning(path: Path, systems: tuple[str, ...]) -> dict[str, Any]:
    """The ``tuning`` an earlier ``--tune`` wrote (a compare.json that holds one, or a map's tuning.json), checked
    to give a best setting in the right terms for every one of `systems`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TuningError(f"--tuned-from {path}: cannot read it ({exc})") from exc
    tuned = data.get("tuning", data) if isinstance(data, dict) else None
    if not isinstance(tuned, dict) or not isinstance(tuned.get("systems"), dict):
        raise TuningError(f"--tuned-from {path}: no tuning in it (expected the compare.json of a run with --tune)")
    for system in systems:
        entry = tuned["systems"].get(system)
        best = entry.get("best") if isinstance(entry, dict) else None
        keys = {k for k, _ in space(system)}
        if not isinstance(best, dict) or set(best) != keys:
            raise TuningError(
                f"--tuned-from {path}: no best setting for {system} (expected one with {', '.join(sorted(keys))}); "
                f"it tuned {', '.join(tuned['systems']) or 'nothing'}"
            )
    return {**tuned, "systems": {s: tuned["systems"][s] for s in systems}, "from": str(path)}


def _default(system: str, config: CompareConfig) -> dict[str, Any]:
    """The settings a system runs with when not tuned, in the terms of its space."""
    if system == "diloco":
        o = config.options
        return {"lr_scale": 1.0, "outer_lr": o.outer_lr, "outer_momentum": o.outer_momentum, "period": o.diloco_period}
    if is_gossip(system):
        return {"lr_scale": 1.0, "f": 0.5, "period": None, "outer": None}  # None: the system's own (a preset's)
    return {"lr_scale": 1.0}


def draw(system: str, n: int, config: CompareConfig, seed: int) -> list[dict[str, Any]]:
    """`n` trials for `system`: its defaults first, then distinct points of its grid in a seeded random order."""
    if n < 1:
        raise ValueError(f"--tune takes at least 1 trial per system, got {n}")
    grid_of = space(system)
    default = _default(system, config)
    grid = [
        dict(zip([k for k, _ in grid_of], values, strict=True))
        for values in itertools.product(*[v for _, v in grid_of])
    ]
    rng = random.Random(seed * 1_000_003 + zlib.crc32(system.encode()))
    rng.shuffle(grid)
    trials = [default] + [point for point in grid if point != default]
    return trials[:n]


def apply(config: CompareConfig, system: str, trial: dict[str, Any], seed: int) -> CompareConfig:
    """`config` narrowed to `system` alone, at `seed`, with `trial`'s settings."""
    spec = replace(config.spec, seed=seed, lr=config.spec.lr * trial.get("lr_scale", 1.0))
    options = config.options
    if system == "diloco":
        options = replace(
            options, outer_lr=trial["outer_lr"], outer_momentum=trial["outer_momentum"], diloco_period=trial["period"]
        )
    elif is_gossip(system):
        settings = dict(options.gossip_settings)
        settings["constant"] = {"value": trial["f"]}
        if trial.get("period") is not None:
            settings["period"] = trial["period"]
        outer = trial.get("outer")
        if outer is not None:
            name, _, rates = outer.partition("@")
            settings["outer"] = name
            if rates:
                lr, _, momentum = rates.partition("/")
                settings["outer_lr"], settings["outer_momentum"] = float(lr), float(momentum)
        options = replace(options, gossip_settings=tuple(settings.items()))
    return replace(config, systems=(system,), spec=spec, options=options)


def _score(summary: dict[str, Any], metric: str) -> float:
    """Lower is better: the final validation loss, or minus the final accuracy; a failed trial is +inf."""
    if not summary.get("completed"):
        return float("inf")
    value = summary.get("final_val_loss" if metric == "loss" else "final_test_acc")
    if value is None:
        return float("inf")
    return float(value) if metric == "loss" else -float(value)


def tune(config: CompareConfig, n: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `n` trials of every system of `config` at the tuning seed; return, per system, its trials and the best."""
    seed = config.spec.seed + TUNING_SEED_OFFSET
    out: dict[str, Any] = {"trials_per_system": n, "seed": seed, "systems": {}}
    for system in config.systems:
        trials = []
        for i, trial in enumerate(draw(system, n, config, config.spec.seed)):
            one = replace(apply(config, system, trial, seed), out_dir=config.out_dir / "tuning" / f"{system}-{i}")
            log(f"tuning {system}, trial {i + 1} of {n}: {trial}")
            summary = run_comparison(one, log=lambda _line: None)["systems"][system]
            score = _score(summary, config.metric)
            trials.append(
                {
                    "settings": trial,
                    "completed": bool(summary.get("completed")),
                    "final": summary.get("final_val_loss" if config.metric == "loss" else "final_test_acc"),
                    "score": score if score != float("inf") else None,
                }
            )
        ranked = [t for t in trials if t["score"] is not None]
        best = min(ranked, key=lambda t: t["score"]) if ranked else trials[0]
        out["systems"][system] = {"trials": trials, "best": best["settings"]}
        log(f"tuning {system}: best {best['settings']} (final {best['final']})")
    return out
