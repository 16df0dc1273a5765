"""The comparison's outputs: the terminal table, the JSON file and the PNG of accuracy curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["fault_lines", "plot", "table", "write_json"]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if value >= size:
            return f"{value / size:.0f} {unit}" if value >= 100 * size else f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def table(report: dict[str, Any]) -> str:
    """The comparison table, one row per system."""
    target = report["target_acc"]
    head = (
        "system",
        f"time to {100 * target:.0f}%",
        f"samples to {100 * target:.0f}%",
        "final acc",
        "bytes/worker/step",
        "idle",
        "train time",
        "samples/s",
    )
    rows = [head]
    for name, s in report["systems"].items():
        rows.append(
            (
                name + ("" if s["completed"] else " (FAILED)"),
                _seconds(s["time_to_target_s"]),
                "-" if s["samples_to_target"] is None else f"{s['samples_to_target']:,}",
                _pct(s["final_test_acc"]),
                _bytes(s["bytes_per_worker_per_step"]) + ("*" if s.get("bytes_estimated") else ""),
                _pct(s["idle_fraction"]),
                _seconds(s.get("train_time_s")),
                "-" if not s.get("samples_per_s") else f"{s['samples_per_s']:,.0f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def fault_lines(report: dict[str, Any]) -> str:
    """One paragraph per fault scenario: what was killed, and what the system did."""
    out = []
    for scenario, f in report.get("faults", {}).items():
        when = f.get("killed_at_s")
        head = f"{scenario}: {f.get('fault')} ({f.get('killed')} at {when:.1f} s)" if when else f"{scenario}: not run"
        out.append(f"{head}: {f.get('outcome', '')}")
    return "\n".join(out)


def _plain(value: Any) -> Any:
    """`value` with every NaN or infinite float made None: the file stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_plain(report), indent=1, default=str, allow_nan=False) + "\n")
    tmp.replace(path)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Accuracy against wall time and against samples, one line per system. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in report["systems"].items():
        curve = s.get("curve") or []
        if not curve:
            continue
        t = [p[0] for p in curve]
        n = [p[1] for p in curve]
        acc = [100 * p[2] for p in curve]
        by_time.plot(t, acc, marker=".", label=name)
        by_samples.plot(n, acc, marker=".", label=name)
    target = 100 * report["target_acc"]
    for ax, xlabel in ((by_time, "wall time from the start (s)"), (by_samples, "samples trained (whole cluster)")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(max(0.0, min(target - 30, 60)), 100)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    w = report["workload"]
    title = f"{w['data']}, {w['workers']} workers, batch {w['batch_size']}, {w['epochs']} epochs"
    if w.get("straggler", 1) > 1:
        title += f", last worker {w['straggler']:g}x slower"
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
