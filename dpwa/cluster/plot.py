"""Draw a run's curves.png: training loss and test accuracy (or validation loss) of every node over time.

    python -m dpwa plot runs/latest                 # writes runs/latest/curves.png
    python -m dpwa plot runs/latest --out /tmp/c.png

Reads ``RUN_DIR/metrics/<node>.jsonl`` (step lines for the loss, eval lines
for the accuracy; see :mod:`dpwa.cluster.monitor`) and, if present,
``RUN_DIR/summary.json`` for the accuracy of the nodes' parameter average.
A run whose eval lines carry ``val_loss`` (``--workload charlm``) gets its
validation loss (nats per character) on the right instead of the accuracy.
Time is in seconds since the first node started. matplotlib is imported here
only, with the file-only Agg backend.

The files are read and checked as every tool reads them
(:func:`dpwa.cluster.events.read_jsonl`, :func:`~dpwa.cluster.events.check_metrics`):
a bad line (cut short, not UTF-8, too long, a loss that is not a number, ...)
is skipped and reported with its file and line number, and the good lines are
drawn.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .events import BadLine, check_metrics, read_jsonl

__all__ = ["load_metrics", "draw"]

Report = Callable[[BadLine], None]


def _to_stderr(problem: BadLine) -> None:
    print(f"dpwa plot: {problem}", file=sys.stderr)


def load_metrics(run_dir: str | Path, report: Report | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every node's metrics lines, by node name. A bad line is skipped and given to `report` (default: a
    line on stderr); after the first few of a file, bad lines are counted and the count reported."""
    report = report or _to_stderr
    folder = Path(run_dir) / "metrics"
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{folder}: no metrics files (*.jsonl); did any node start?")
    out: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        records, reader = read_jsonl(path, check_metrics)
        for problem in reader.take_problems():
            report(problem)
        if reader.bad_lines > reader.max_reports:
            report(BadLine(path, reader.line, f"{reader.bad_lines} bad lines in all, through the last line"))
        out[path.stem] = records
    return out


def _finite(value: Any) -> bool:
    """A number matplotlib can place: finite, and far enough from overflow that differences stay finite."""
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and abs(value) < 1e300
    )


def draw(run_dir: str | Path, out: str | Path | None = None, report: Report | None = None) -> Path:
    """Draw loss and accuracy per node over time into `out` (default RUN_DIR/curves.png); returns the path.

    Bad lines of the metrics files are skipped and given to `report` (default: a line each on stderr).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir, report)
    t0 = min((r["t"] for records in metrics.values() for r in records), default=0.0)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_loss = any(r.get("kind") == "eval" and "val_loss" in r for records in metrics.values() for r in records)
    key = "val_loss" if by_loss else "test_acc"
    scale = 1.0 if by_loss else 100.0
    for node, records in metrics.items():
        steps = [r for r in records if r.get("kind") == "step" and _finite(r.get("loss"))]
        evals = [r for r in records if r.get("kind") == "eval" and _finite(r.get(key))]
        (line,) = ax_loss.plot([r["t"] - t0 for r in steps], [r["loss"] for r in steps], label=node, linewidth=1)
        ax_acc.plot(
            [r["t"] - t0 for r in evals],
            [scale * r[key] for r in evals],
            marker="o",
            markersize=3,
            color=line.get_color(),
            label=node,
        )
    average = _average(run_dir, key)
    if average is not None:
        text = f"{average:.3f} nats/char" if by_loss else f"{100 * average:.2f}%"
        ax_acc.axhline(scale * average, color="black", linestyle="--", linewidth=1, label=f"parameter average {text}")
    ax_loss.set(title="training loss", xlabel="time (s)", ylabel="cross-entropy")
    if by_loss:
        ax_acc.set(title="validation loss", xlabel="time (s)", ylabel="nats per character")
    else:
        ax_acc.set(title="test accuracy", xlabel="time (s)", ylabel="accuracy (%)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    losses = [
        r["loss"] for records in metrics.values() for r in records if r.get("kind") == "step" and _finite(r.get("loss"))
    ]
    if losses and min(losses) > 0:
        ax_loss.set_yscale("log")
    fig.suptitle(f"dpwa run {run_dir.resolve().name}: {len(metrics)} nodes")
    fig.tight_layout()
    target = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def _average(run_dir: Path, key: str = "test_acc") -> float | None:
    """The parameter average's `key` (test_acc, val_loss) from summary.json, if there is one."""
    try:
        summary = json.loads((run_dir / "summary.json").read_bytes()[: 1 << 20])
        value = summary["average"][key]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None
    return float(value) if _finite(value) and abs(value) < 1e12 else None
