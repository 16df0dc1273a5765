"""The comparison's outputs: the terminal table, the JSON file and the PNG of curves (accuracy, or validation loss)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .byzantine import ATTACKS

__all__ = ["byzantine_line", "fault_lines", "link_lines", "mass_lines", "plot", "table", "write_json"]


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


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(report: dict[str, Any]) -> str:
    """The comparison table, one row per system (accuracy for images, validation loss for charlm)."""
    by_loss = "target_loss" in report
    target = report["target_loss"] if by_loss else report["target_acc"]
    goal = f"loss {target:g}" if by_loss else f"{100 * target:.0f}%"
    head: tuple[str, ...] = ("system", f"time to {goal}", f"samples to {goal}")
    head += ("final val loss", "bits/char") if by_loss else ("final acc",)
    head += ("bytes/worker/step", "s/step", "idle", "train time", "samples/s")
    rows = [head]
    for name, s in report["systems"].items():
        row: tuple[str, ...] = (
            name + ("" if s["completed"] else " (FAILED)"),
            _seconds(s["time_to_target_s"]),
            "-" if s["samples_to_target"] is None else f"{s['samples_to_target']:,}",
        )
        if by_loss:
            row += (_loss(s.get("final_val_loss")), _loss(s.get("final_bits_per_char")))
        else:
            row += (_pct(s["final_test_acc"]),)
        row += (
            _bytes(s["bytes_per_worker_per_step"]) + ("*" if s.get("bytes_estimated") else ""),
            "-" if not s.get("s_per_step") else f"{s['s_per_step']:.3f}",
            _pct(s["idle_fraction"]),
            _seconds(s.get("train_time_s")),
            "-" if not s.get("samples_per_s") else f"{s['samples_per_s']:,.0f}",
        )
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    byzantine = byzantine_line(report)
    if byzantine:
        lines.append(byzantine)
    return "\n".join(lines)


def byzantine_line(report: dict[str, Any]) -> str:
    """With Byzantine workers: how many per gossip system, which attack, and what was evaluated ("" without)."""
    count = report.get("byzantine") or 0
    if not count:
        return ""
    workers = report["workload"]["workers"]
    names = ", ".join(f"w{i}" for i in range(workers - count, workers))
    return (
        f"byzantine: {count} of {workers} workers of every gossip system ({names}), attack {report['attack']}: "
        f"{ATTACKS.get(report['attack'], '?')}; the gossip rows evaluate the honest nodes' mean"
    )


def mass_lines(report: dict[str, Any]) -> str:
    """Per push-sum system: each node's weight after it lingered, and their sum (the workers', less what lost
    replies carried); "" when no system kept weights."""
    out = []
    for name, s in report["systems"].items():
        masses = s.get("mass_at_end")
        if not masses:
            continue
        each = ", ".join(f"{n} {'-' if m is None else f'{m:.3g}'}" for n, m in masses.items())
        total = s.get("mass_sum_at_end") or 0.0
        out.append(f"{name}: push-sum weights at the end {each} (sum {total:.4g} of {len(masses)})")
    return "\n".join(out)


def link_lines(report: dict[str, Any]) -> str:
    """The shaped links, and for all-reduce and DiLoCo whether their time in the all-reduce fits their bytes."""
    links = report.get("links")
    if not links:
        return ""
    out = [f"links: {links['rate_mbit']:g} Mbit/s per process, each way ({links['what']})"]
    for system, check in (report.get("link_check") or {}).items():
        if not check:
            out.append(f"{system}: nothing to check (no rank finished)")
            continue
        unit = check["unit"]
        if check["consistent"] is None:
            verdict = check["rule"]
        else:
            verdict = ("consistent" if check["consistent"] else "NOT consistent") + f"; {check['rule']}"
        out.append(
            f"{system}: each rank sends {_bytes(check['sent_bytes'])} per {unit} in the ring all-reduce "
            f"(and receives as much): {check['expected_comm_s']:.3f} s at {check['rate_mbit']:g} Mbit/s "
            f"(floor {check['floor_comm_s']:.3f} s); measured {check['measured_comm_s']:.3f} s per {unit} inside "
            f"the all-reduce ({check['ratio']:.2f}x: {verdict}); {check['compute_s_per_step']:.3f} s of compute "
            f"and {check['step_s']:.3f} s in all per step"
        )
    return "\n".join(out)


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
    """Accuracy (images) or validation loss (charlm) against wall time and against samples, one line per system.

    False without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by_loss = "target_loss" in report
    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5))
    values: list[float] = []
    for name, s in report["systems"].items():
        curve = s.get("curve") or []
        if not curve:
            continue
        t = [p[0] for p in curve]
        n = [p[1] for p in curve]
        y = [p[3] if p[3] is not None else math.nan for p in curve] if by_loss else [100 * p[2] for p in curve]
        values += [v for v in y if math.isfinite(v)]
        by_time.plot(t, y, marker=".", label=name)
        by_samples.plot(n, y, marker=".", label=name)
    target = report["target_loss"] if by_loss else 100 * report["target_acc"]
    for ax, xlabel in ((by_time, "wall time from the start (s)"), (by_samples, "samples trained (whole cluster)")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        if by_loss:
            ax.set_ylabel("validation loss (nats per character)")
            low = min(values, default=target)
            ax.set_ylim(max(0.0, min(low, target) - 0.1), max(target + 1.0, min(low + 2.0, max(values, default=0))))
            ax.legend(loc="upper right")
        else:
            ax.set_ylabel("test accuracy (%)")
            ax.set_ylim(max(0.0, min(target - 30, 60)), 100)
            ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
    w = report["workload"]
    budget = f"{w['steps']} steps per worker" if w.get("steps") else f"{w['epochs']} epochs"
    data = f"charlm ({w['data']}, {w['parameters']:,} parameters)" if w.get("workload") == "charlm" else w["data"]
    title = f"{data}, {w['workers']} workers, batch {w['batch_size']}, {budget}"
    if w.get("straggler", 1) > 1:
        title += f", last worker {w['straggler']:g}x slower"
    if report.get("byzantine"):
        title += f", {report['byzantine']} Byzantine ({report['attack']})"
    links = report.get("links")
    title += f"; links {links['rate_mbit']:g} Mbit/s each way" if links else "; loopback"
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
