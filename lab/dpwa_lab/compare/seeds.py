"""Several seeds, paired: every system runs once per seed on the same data; means and 95% intervals

``python -m dpwa.compare --seeds K`` runs the whole comparison K times, with
seeds ``--seed``, ``--seed`` + 1, ... Within one seed every system starts
from the same initial model and reads the same data in the same order
(:class:`~.workload.WorkloadSpec`'s ``seed``), so two systems' results of one
seed are a pair: the difference of their final losses, seed by seed, has
less spread than either loss alone, and its interval says whether one
system beats the other on this machine more reliably than two intervals
side by side do.

Every interval here is a 95% confidence interval of a mean over seeds,
Student's t with n - 1 degrees of freedom (n < 2: no interval). A seed that
never reached the target has no time or samples to it: those means are over
the seeds that reached it, and the table says how many did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["T95", "aggregate", "interval", "plot_seeds", "seeds_table", "t95"]

#: Student's t, two-sided 95%, by degrees of freedom (a df between two rows takes the smaller one's: wider)
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
    60: 2.000,
}
Z95 = 1.960  # beyond the table


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    rows = [d for d in T95 if d <= df]
    return T95[max(rows)] if df <= max(T95) else Z95


def interval(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and 95% interval of the values that are not None (nor NaN): n, mean, half_width, low, high, missing."""
    kept = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(kept)
    out: dict[str, Any] = {"n": n, "missing": len(values) - n, "values": list(values)}
    if n == 0:
        return {**out, "mean": None, "half_width": None, "low": None, "high": None}
    mean = sum(kept) / n
    if n < 2:
        return {**out, "mean": mean, "half_width": None, "low": None, "high": None}
    sd = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1))
    half = t95(n - 1) * sd / math.sqrt(n)
    return {**out, "mean": mean, "half_width": half, "low": mean - half, "high": mean + half}


def _final_key(report: dict[str, Any]) -> str:
    return "final_val_loss" if "target_loss" in report else "final_test_acc"


def aggregate(reports: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per system: intervals of time and samples to the target, of the final metric, of bytes and seconds per step;
    and, for every system after the first, the paired difference of its final metric from the first's."""
    if len(reports) != len(seeds) or not reports:
        raise ValueError(f"{len(reports)} reports for {len(seeds)} seeds")
    final = _final_key(reports[0])
    names = list(reports[0]["systems"])
    out: dict[str, Any] = {"seeds": seeds, "final_key": final, "reference": names[0], "systems": {}}
    for name in names:
        runs = [r["systems"][name] for r in reports]
        entry: dict[str, Any] = {
            key: interval([s.get(key) for s in runs])
            for key in ("time_to_target_s", "samples_to_target", final, "bytes_per_worker_per_step", "s_per_step")
        }
        entry["completed"] = sum(bool(s.get("completed")) for s in runs)
        out["systems"][name] = entry
    reference = names[0]
    for name in names[1:]:
        diffs = []
        for r in reports:
            a, b = r["systems"][name].get(final), r["systems"][reference].get(final)
            diffs.append(None if a is None or b is None else a - b)
        out["systems"][name]["paired_final_difference"] = interval(diffs)
    return out


def _pm(entry: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    """'mean ± half' (or the mean alone), with how many seeds counted when some did not."""
    if entry["mean"] is None:
        return "-"
    text = format(entry["mean"] * scale, fmt)
    if entry["half_width"] is not None:
        text += " ± " + format(entry["half_width"] * scale, fmt.replace("+", ""))
    if entry["missing"]:
        text += f" ({entry['n']}/{entry['n'] + entry['missing']})"
    return text


def seeds_table(agg: dict[str, Any], target_text: str, by_loss: bool) -> str:
    """One row per system: means ± 95% half-widths over the seeds, and the paired difference from the first."""
    final = agg["final_key"]
    ref = agg["reference"]
    head = (
        "system",
        f"time to {target_text} (s)",
        f"samples to {target_text}",
        "final val loss" if by_loss else "final acc (%)",
        f"final - {ref} (paired)",
        "s/step",
    )
    rows = [head]
    for name, e in agg["systems"].items():
        diff = e.get("paired_final_difference")
        scale = 1.0 if by_loss else 100.0
        rows.append(
            (
                name + ("" if e["completed"] == len(agg["seeds"]) else f" ({e['completed']}/{len(agg['seeds'])} done)"),
                _pm(e["time_to_target_s"], ".1f"),
                _pm(e["samples_to_target"], ",.0f"),
                _pm(e[final], ".3f" if by_loss else ".2f", scale),
                "-" if diff is None else _pm(diff, "+.3f" if by_loss else "+.2f", scale),
                _pm(e["s_per_step"], ".4f"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    seeds = agg["seeds"]
    lines.append(
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), paired: within a seed every system starts from the same "
        "model and reads the same data in the same order; ± is a 95% interval of the mean (Student's t); (k/K): "
        "the mean is over the k seeds that reached the target"
    )
    return "\n".join(lines)


def _mean_curve(
    curves: list[list[list[Any]]], column: int, scale: float
) -> tuple[list[float], list[float], list[float]]:
    """Each seed's curve (points [t, samples, acc, loss]) on the first seed's sample counts, by linear interpolation:
    the samples, the mean, and the 95% half-width (0 with one seed)."""
    import numpy as np

    usable = [c for c in curves if c]
    if not usable:
        return [], [], []
    grid = np.array([p[1] for p in usable[0]], dtype=float)
    rows = []
    for curve in usable:
        x = np.array([p[1] for p in curve], dtype=float)
        y = np.array([math.nan if p[column] is None else scale * p[column] for p in curve], dtype=float)
        rows.append(np.interp(grid, x, y, right=math.nan))
    values = np.vstack(rows)
    mean = np.nanmean(values, axis=0)
    n = np.sum(np.isfinite(values), axis=0)
    sd = np.nanstd(values, axis=0, ddof=1) if len(rows) > 1 else np.zeros_like(mean)
    half = np.array([t95(int(k) - 1) * s / math.sqrt(k) if k > 1 else 0.0 for k, s in zip(n, sd, strict=True)])
    return grid.tolist(), mean.tolist(), half.tolist()


def plot_seeds(reports: list[dict[str, Any]], path: Path) -> bool:
    """Each system's mean curve over the seeds against samples, with its 95% band; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_loss = "target_loss" in reports[0]
    column, scale = (3, 1.0) if by_loss else (2, 100.0)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name in reports[0]["systems"]:
        grid, mean, half = _mean_curve([r["systems"][name].get("curve") or [] for r in reports], column, scale)
        if not grid:
            continue
        (line,) = ax.plot(grid, mean, label=name)
        ax.fill_between(
            grid,
            [m - h for m, h in zip(mean, half, strict=True)],
            [m + h for m, h in zip(mean, half, strict=True)],
            color=line.get_color(),
            alpha=0.2,
        )
    target = reports[0]["target_loss"] if by_loss else 100 * reports[0]["target_acc"]
    ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("samples trained (whole cluster)")
    ax.set_ylabel("validation loss (nats per character)" if by_loss else "test accuracy (%)")
    ax.legend(loc="upper right" if by_loss else "lower right")
    ax.grid(alpha=0.3)
    w = reports[0]["workload"]
    ax.set_title(f"{w['data']}, {w['workers']} workers: mean of {len(reports)} seeds, 95% band")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
