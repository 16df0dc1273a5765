"""A map of where each system wins: the comparison over a grid of link rates, delays and stragglers

``python -m dpwa.compare --map`` runs the same comparison (the same systems,
each at its tuned settings when ``--tune`` or ``--tuned-from`` gives them) in
every cell of a grid:

* the link rate of every host, in Mbit/s each way (``--map-rates``, default
  5, 20, 100 and 1,000);
* the one-way delay between two hosts, in ms (``--map-delays``, default 0, 25
  and 100; 0 runs no delay line);
* the straggler factor of the last worker (``--map-stragglers``, default 1
  and 4: none, and one worker four times slower).

Each cell runs ``--seeds`` paired seeds. Its **winner** is the system with the
lowest mean time to the target among those that reached it at every seed;
its **margin** is the runner-up's time less the winner's, paired by seed, with
a 95% interval (:func:`.seeds.interval`). A margin whose interval holds 0 is
a tie at this many seeds, and the map says so. A system that missed the
target at some seed cannot win the cell, and counts as the runner-up only
when no other system reached the target everywhere (its margin is then
unbounded: "the others missed").

The whole grid runs at the first seed, then at the next: a map stopped early
holds whole grids. Each cell's seed is written as it finishes
(``OUT/cells/CELL/seed-S.json``), so the same command with the same ``--out``
skips what is done, and with a larger ``--seeds`` adds seeds to a finished
map. A cell written with other settings is refused, not mixed in.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .comparison import GOSSIP_TIMEOUT_RULE, CompareConfig
from .report import write_json
from .seeds import aggregate, interval

__all__ = [
    "DEFAULT_DELAYS",
    "DEFAULT_RATES",
    "DEFAULT_STRAGGLERS",
    "Cell",
    "MapError",
    "cell_config",
    "cells",
    "collect",
    "decide",
    "decide_grid",
    "map_table",
    "plot_map",
    "retarget",
]

DEFAULT_RATES = (5.0, 20.0, 100.0, 1000.0)
DEFAULT_DELAYS = (0.0, 25.0, 100.0)
DEFAULT_STRAGGLERS = (1.0, 4.0)


class MapError(ValueError):
    """A map folder that holds runs of other settings, or a grid that cannot be run."""


@dataclass(frozen=True)
class Cell:
    rate_mbit: float
    delay_ms: float
    straggler: float

    @property
    def label(self) -> str:
        return f"rate-{self.rate_mbit:g}_delay-{self.delay_ms:g}_straggler-{self.straggler:g}"

    def describe(self) -> str:
        delay = f", {self.delay_ms:g} ms each way" if self.delay_ms else ""
        straggler = f", a {self.straggler:g}x straggler" if self.straggler > 1 else ""
        return f"{self.rate_mbit:g} Mbit/s{delay}{straggler}"


def cells(rates: Sequence[float], delays: Sequence[float], stragglers: Sequence[float]) -> list[Cell]:
    """Every cell of the grid, stragglers outermost, then delays, then rates (the map's panel, row and column)."""
    for name, values, low in (("rates", rates, 0.0), ("delays", delays, -1.0), ("stragglers", stragglers, 0.0)):
        if not values:
            raise MapError(f"--map-{name}: give at least one value")
        if len(set(values)) != len(values):
            raise MapError(f"--map-{name} lists a value twice: {', '.join(f'{v:g}' for v in values)}")
        if any(not math.isfinite(v) or v <= low for v in values):
            raise MapError(f"--map-{name}: every value must be {'>= 0' if low < 0 else '> 0'}, got {list(values)}")
    if any(s < 1 for s in stragglers):
        raise MapError(f"--map-stragglers: a factor is 1 (none) or more, got {list(stragglers)}")
    return [Cell(r, d, s) for s in stragglers for d in delays for r in rates]


def cell_config(config: CompareConfig, cell: Cell, out_dir: Path) -> CompareConfig:
    """`config` in `cell`: its links shaped to the cell's rate and delay, its last worker the cell's straggler."""
    options = replace(config.options, link_mbit=cell.rate_mbit, link_delay_ms=cell.delay_ms)
    spec = replace(config.spec, straggler=cell.straggler)
    return replace(config, spec=spec, options=options, out_dir=out_dir)


def _settings_key(config: CompareConfig, tuned: dict[str, Any] | None) -> dict[str, Any]:
    """What a cell's runs must share to be pooled: the systems, the workload less its seed, the options less the
    links, the target, each system's tuned settings, and how the gossip deadline follows the links."""
    spec = {k: v for k, v in config.spec.as_dict().items() if k not in ("seed", "straggler")}
    # churn is never part of a map (refused with --map): left out, so cells written before it existed still pool
    options = {
        k: v
        for k, v in vars(config.options).items()
        if k not in ("link_mbit", "link_delay_ms", "gossip_timeout_ms", "churn")
    }
    best = None if tuned is None else {s: e["best"] for s, e in tuned["systems"].items()}
    return json.loads(
        json.dumps(
            {
                "systems": list(config.systems),
                "spec": spec,
                "options": options,
                "target": config.target,
                "best": best,
                "gossip_timeout": GOSSIP_TIMEOUT_RULE,
            },
            default=str,
        )
    )


def decide(agg: dict[str, Any]) -> dict[str, Any]:
    """A cell's winner and margin from its seeds' aggregate (:func:`.seeds.aggregate`) and their runs.

    The winner has the lowest mean time to the target among the systems that reached it at every seed; the
    margin is the runner-up's time less the winner's, seed by seed, as an interval (``tie`` when it holds 0)."""
    seeds = agg["seeds"]
    times = {name: e["time_to_target_s"]["values"] for name, e in agg["systems"].items()}
    full = {name: v for name, v in times.items() if all(x is not None for x in v)}
    out: dict[str, Any] = {"winner": None, "runner_up": None, "margin_s": None, "ratio": None, "tie": None}
    out["mean_time_s"] = {name: agg["systems"][name]["time_to_target_s"]["mean"] for name in times}
    out["reached"] = {name: sum(x is not None for x in v) for name, v in times.items()}
    out["seeds"] = len(seeds)
    if not full:
        out["note"] = "no system reached the target at every seed"
        return out
    ranked = sorted(full, key=lambda name: sum(full[name]) / len(seeds))
    winner = ranked[0]
    out["winner"] = winner
    if len(ranked) < 2:
        others = [n for n in times if n != winner]
        out["note"] = f"the others missed the target at some seed ({', '.join(others)})" if others else "one system"
        return out
    runner_up = ranked[1]
    diffs = [b - a for a, b in zip(full[winner], full[runner_up], strict=True)]
    margin = interval(diffs)
    out["runner_up"] = runner_up
    out["margin_s"] = margin
    mean_w = sum(full[winner]) / len(seeds)
    out["ratio"] = (sum(full[runner_up]) / len(seeds)) / mean_w if mean_w > 0 else None
    out["tie"] = None if margin["low"] is None else bool(margin["low"] <= 0)
    return out


def _load(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """A cell's seed already run with the same settings; None if not run; MapError if run with others."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MapError(f"{path}: not a seed of this map ({exc}); remove it to run that seed again") from exc
    if stored.get("map_settings") != key:
        raise MapError(
            f"{path} was run with other settings (systems, workload, options, target or tuning); use another --out"
        )
    report = stored.get("report")
    if not isinstance(report, dict):
        raise MapError(f"{path}: no report in it; remove it to run that seed again")
    return report


def collect(
    config: CompareConfig,
    grid: Sequence[Cell],
    seeds: Sequence[int],
    run_one: Callable[[CompareConfig], dict[str, Any]],
    tuned: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[Cell, list[dict[str, Any]]]:
    """Every cell of `grid` at every seed (skipping those written already): each cell's reports, in seed order.

    `run_one` runs one comparison (every system of the config it is given, at its tuned settings) and returns
    its report."""
    key = _settings_key(config, tuned)
    by_cell: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in grid}
    for k, seed in enumerate(seeds, 1):  # seeds outermost: a map stopped early has whole grids at its first seeds
        for n, cell in enumerate(grid, 1):
            where = f"seed {seed} ({k} of {len(seeds)}), cell {n} of {len(grid)} ({cell.describe()})"
            cell_dir = config.out_dir / "cells" / cell.label
            path = cell_dir / f"seed-{seed}.json"
            report = _load(path, key)
            if report is None:
                log(f"== {where}")
                partial = cell_dir / f"seed-{seed}"
                if partial.exists():  # a run stopped before its report was written: run it again, from nothing
                    shutil.rmtree(partial)
                    log(f"   (removed {partial}, left by a run that was stopped)")
                one = cell_config(config, cell, partial)
                report = run_one(replace(one, spec=replace(one.spec, seed=seed)))
                write_json({"map_settings": key, "report": report}, path)
            else:
                log(f"== {where}: done before, read from {path}")
            by_cell[cell].append(report)
    return by_cell


def retarget(report: dict[str, Any], target: float) -> dict[str, Any]:
    """`report` with every system's time and samples to `target` read again from its curve (the first evaluated
    point at or past it, as the comparison reads them), so one grid of runs is judged at several targets."""
    by_loss = "target_loss" in report
    key = "target_loss" if by_loss else "target_acc"
    systems = {}
    for name, summary in report["systems"].items():
        hit = None
        for t_s, samples, acc, loss in summary.get("curve") or []:
            if (loss is not None and loss <= target) if by_loss else acc >= target:
                hit = (t_s, samples)
                break
        systems[name] = {
            **summary,
            "time_to_target_s": hit[0] if hit else None,
            "samples_to_target": hit[1] if hit else None,
        }
    return {**report, key: target, "systems": systems}


def decide_grid(
    by_cell: dict[Cell, list[dict[str, Any]]],
    seeds: Sequence[int],
    target: float | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Each cell's winner and margin (:func:`decide`) at the runs' own target, or at `target` (:func:`retarget`)."""
    found = []
    for cell, reports in by_cell.items():
        if target is not None:
            reports = [retarget(r, target) for r in reports]
        agg = aggregate(reports, list(seeds))
        result = decide(agg)
        found.append(
            {
                "rate_mbit": cell.rate_mbit,
                "delay_ms": cell.delay_ms,
                "straggler": cell.straggler,
                **result,
                "aggregate": agg,
            }
        )
        log(f"   {cell.describe()}: {_verdict(result)}")
    return found


def _verdict(result: dict[str, Any]) -> str:
    if result["winner"] is None:
        return result.get("note", "no winner")
    if result["runner_up"] is None:
        return f"{result['winner']} ({result.get('note', '')})"
    m = result["margin_s"]
    half = "" if m["half_width"] is None else f" ± {m['half_width']:.1f}"
    tie = ", a tie at these seeds" if result["tie"] else ""
    return f"{result['winner']}, {m['mean']:.1f}{half} s before {result['runner_up']} ({result['ratio']:.2f}x){tie}"


def map_table(result: dict[str, Any]) -> str:
    """A Markdown table: one row per cell, its winner, runner-up, margin and every system's mean time."""
    systems = list(result["cells"][0]["mean_time_s"]) if result["cells"] else []
    head = ["rate (Mbit/s)", "delay (ms)", "straggler", "winner", "margin (s, 95%)", "runner-up", *systems]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in result["cells"]:
        m = c["margin_s"]
        if c["winner"] is None:
            margin = "-"
        elif m is None:
            margin = "others missed"
        else:
            margin = f"{m['mean']:.1f}" + ("" if m["half_width"] is None else f" ± {m['half_width']:.1f}")
            margin += " (tie)" if c["tie"] else ""
        times = []
        for s in systems:
            t, reached = c["mean_time_s"][s], c["reached"][s]
            text = "-" if t is None else f"{t:.1f}"
            times.append(text + ("" if reached == c["seeds"] else f" ({reached}/{c['seeds']})"))
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{c['rate_mbit']:g}",
                    f"{c['delay_ms']:g}",
                    f"{c['straggler']:g}x" if c["straggler"] > 1 else "none",
                    c["winner"] or "none reached",
                    margin,
                    c["runner_up"] or "-",
                    *times,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def plot_map(result: dict[str, Any], path: Path, title: str = "") -> bool:
    """One panel per straggler factor: rates across, delays down, each cell coloured by its winner and labelled
    with the runner-up's time over the winner's; hatched where the margin's interval holds 0 (a tie).
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        return False
    found = result["cells"]
    rates = sorted({c["rate_mbit"] for c in found})
    delays = sorted({c["delay_ms"] for c in found})
    stragglers = sorted({c["straggler"] for c in found})
    systems = list(found[0]["mean_time_s"]) if found else []
    palette = plt.get_cmap("tab10")
    colours = {s: palette(i % 10) for i, s in enumerate(systems)}
    fig, axes = plt.subplots(
        1, len(stragglers), figsize=(1.6 + 1.7 * len(rates) * len(stragglers), 1.4 + 0.9 * len(delays)), squeeze=False
    )
    for ax, straggler in zip(axes[0], stragglers, strict=True):
        for c in (c for c in found if c["straggler"] == straggler):
            x, y = rates.index(c["rate_mbit"]), delays.index(c["delay_ms"])
            winner = c["winner"]
            face = colours[winner] if winner else (0.85, 0.85, 0.85, 1.0)
            ax.add_patch(
                Rectangle((x, y), 1, 1, facecolor=face, alpha=0.55, hatch="//" if c["tie"] else None, edgecolor="w")
            )
            if winner is None:
                text = "none\nreached"
            elif c["ratio"] is None:
                text = f"{winner}\n(others missed)"
            else:
                text = f"{winner}\n{c['ratio']:.2f}x" + (" (tie)" if c["tie"] else "")
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(rates))
        ax.set_ylim(len(delays), 0)
        ax.set_xticks([i + 0.5 for i in range(len(rates))], [f"{r:g}" for r in rates])
        ax.set_yticks([i + 0.5 for i in range(len(delays))], [f"{d:g}" for d in delays])
        ax.set_xlabel("link rate (Mbit/s each way)")
        ax.set_ylabel("delay (ms each way)")
        ax.set_title("no straggler" if straggler == 1 else f"a {straggler:g}x straggler", fontsize=9)
    handles = [Patch(facecolor=colours[s], alpha=0.55, label=s) for s in systems]
    fig.legend(handles=handles, loc="lower center", ncol=len(systems), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
