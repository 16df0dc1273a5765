"""Follow a run's metrics files: the live view while nodes train, and the summary table at the end.

Each node appends JSON lines to ``RUN_DIR/metrics/<node>.jsonl``. The fields
read here (any others are kept but ignored):

* ``{"kind": "start", "epochs": 20, "steps_per_epoch": 22, ...}`` once, at start;
* ``{"kind": "step", "epoch", "step", "loss", "exchanges_per_s", "averaged", "failed", "peers": {peer: n}}``
  per logged step (``averaged``, ``failed`` and ``peers`` count since start; ``averaged`` and ``peers``
  count the exchanges that moved the node, those a peer started included);
* ``{"kind": "eval", "epoch", "step", "test_acc", "test_loss"}`` per evaluation;
* ``{"kind": "linger"}`` when the node has finished training and only serves peers;
* ``{"kind": "end", "reason", "averaged", "failed", "peers", "stats": {...}}`` once, at the end.

Every line has ``t`` (Unix time, s) and ``node``.

    python -m dpwa status runs/latest      # this module's table for a run, once

Lines are read and checked by :mod:`.events` (:class:`~.events.JsonlFollower`,
:func:`~.events.check_metrics`), as the dashboard and ``python -m dpwa plot``
read them: a bad line (too long, not UTF-8, not JSON, a field of the wrong
type) is skipped, counted, and reported with its file and line number
(:attr:`NodeState.problems`; the live view prints them above its table).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..runfiles.lines import number
from .events import READ_CHUNK_BYTES, BadLine, JsonlFollower, check_metrics

__all__ = ["NodeState", "MetricsTail", "LiveView", "table", "summarize", "format_summary"]


@dataclass
class NodeState:
    """The latest of each kind of metrics line of one node, and its process's fate."""

    name: str
    start: dict[str, Any] | None = None
    step: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    lingering: bool = False
    exit_code: int | None = None  # set by the launcher once the process is gone
    bad_lines: int = 0  # lines of its metrics file skipped as bad
    problems: list[BadLine] = field(default_factory=list)  # bad lines reported, not yet shown
    starts: int = 0  # start lines seen: more than one when the node was started again
    rejoins: int = 0  # starts that took the cluster's state from a peer
    restarts: int = 0  # set by the launcher
    restarted_at: float = 0.0  # time.time() of the last restart, set by the launcher
    kills: int = 0  # chaos mode's kills, set by the launcher

    @property
    def trained_since_start(self) -> bool:
        """A step line since the last start line, and that start after the last restart (if any)."""
        if self.start is None or self.step is None:
            return False
        return self.step.get("t", 0) >= self.start.get("t", 0) >= self.restarted_at

    @property
    def state(self) -> str:
        if self.end is not None:
            return "done" if self.end.get("reason") == "done" else "stopped"
        if self.exit_code is not None:
            return "exited" if self.exit_code == 0 else f"failed ({self.exit_code})"
        if self.lingering:
            return "serving"
        return "training" if self.start is not None else "starting"


class MetricsTail:
    """Reads the lines nodes append to ``metrics/<node>.jsonl``, keeping the latest per kind.

    Each file is read with a :class:`~.events.JsonlFollower` (checked by
    :func:`~.events.check_metrics`): one poll reads at most `max_bytes` of a
    file (the rest comes at the next polls), and a bad line is skipped, counted
    in :attr:`NodeState.bad_lines`, and reported in :attr:`NodeState.problems`.
    """

    def __init__(self, run_dir: str | Path, names: list[str], max_bytes: int = 64 << 20) -> None:
        self.dir = Path(run_dir) / "metrics"
        self.nodes = {name: NodeState(name) for name in names}
        self._followers = {name: JsonlFollower(self.dir / f"{name}.jsonl", check=check_metrics) for name in names}
        self._max_chunks = max(1, max_bytes // READ_CHUNK_BYTES)

    def poll(self, final: bool = False) -> dict[str, NodeState]:
        """Read what was appended since the last call (complete lines only; with `final`, the file is read
        to its end once, and a last line without its newline counts too)."""
        for name, node in self.nodes.items():
            follower = self._followers[name]
            records = follower.poll_all(1 << 40 if final else self._max_chunks)
            if final:
                records += follower.finish()
            for record in records:
                self._apply(node, record)
            node.bad_lines = follower.bad_lines
            node.problems += follower.take_problems()
        return self.nodes

    @staticmethod
    def _apply(node: NodeState, record: dict[str, Any]) -> None:
        kind = record["kind"]  # checked: a string
        if kind in ("start", "step", "eval", "end"):
            setattr(node, kind, record)
        if kind == "start":
            node.starts += 1
            node.lingering = False
            node.end = None
            node.rejoins += (record.get("started") or "").startswith("joined the cluster")
        elif kind == "linger":
            node.lingering = True


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _fmt(value: Any, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.2f}%"


def table(nodes: list[NodeState]) -> list[str]:
    """The live view's rows: one header, one line per node."""
    rows = [("node", "state", "epoch", "step", "loss", "exch/s", "failed", "test acc")]
    for node in nodes:
        start, step, ev = node.start or {}, node.step or {}, node.eval or {}
        epochs = start.get("epochs")
        epoch = f"{step.get('epoch', 0)}/{epochs}" if epochs else "-"
        acc = ev.get("test_acc")
        rows.append(
            (
                node.name,
                node.state,
                epoch,
                _fmt(step.get("step"), "d"),
                _fmt(step.get("loss"), ".4f"),
                _fmt(step.get("exchanges_per_s"), ".1f"),
                _fmt(step.get("failed"), "d"),
                _percent(acc),
            )
        )
    minimum = (0, 10, 7, 6, 7, 6, 6, 8)  # steady columns while values grow
    widths = [max(minimum[i], *(len(r[i]) for r in rows)) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


class LiveView:
    """Shows the table: redrawn in place on a terminal, or as plain lines every `every_s` seconds otherwise."""

    def __init__(self, out: TextIO, tty: bool | None = None, every_s: float = 10.0) -> None:
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.every_s = every_s
        self.started = time.monotonic()
        self._drawn = 0  # table lines on screen (terminal only)
        self._last_print = self.started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def message(self, text: str) -> None:
        """A line that stays (above the table on a terminal)."""
        self._erase()
        self.out.write(text + "\n")
        self.out.flush()

    def update(self, nodes: list[NodeState], force: bool = False, final: bool = False) -> None:
        """Show the table: always on a terminal, when due (or `force`) otherwise. `final`: the last one."""
        for node in nodes:  # bad lines of the metrics files: said once each, above the table
            problems, node.problems = node.problems, []
            for problem in problems:
                self.message(f"dpwa: {problem}")
        lines = table(nodes)
        if self.tty:
            self._erase()
            lines.append(f"elapsed {self.elapsed():.0f} s" + ("" if final else "; Ctrl-C stops every node"))
            self.out.write("".join(line + "\n" for line in lines))
            self._drawn = len(lines)
        elif force or time.monotonic() - self._last_print >= self.every_s:
            self._last_print = time.monotonic()
            stamp = f"[{self.elapsed():6.0f} s]"
            self.out.write("".join(f"{stamp} {line}\n" for line in lines[1:]))
        self.out.flush()

    def close(self) -> None:
        """Leave the last table on screen; later output goes below it."""
        self._drawn = 0

    def _erase(self) -> None:
        if self.tty and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")  # up to the table's first line, clear to the end
            self._drawn = 0


# --------------------------------------------------------------------------- summary


def summarize(
    nodes: list[NodeState], average: dict[str, Any] | None, elapsed_s: float, run_dir: str | Path
) -> dict[str, Any]:
    """Everything the summary table shows, as plain data (saved as summary.json)."""
    rows = []
    for node in nodes:
        end, step, ev = node.end or {}, node.step or {}, node.eval or {}
        stats = end.get("stats") or {}
        rows.append(
            {
                "node": node.name,
                "state": node.state,
                "exit_code": node.exit_code,
                "epochs": ev.get("epoch"),  # None: the node evaluated nothing (a script of the user's own)
                "steps": end.get("step", step.get("step", 0)),
                "test_acc": ev.get("test_acc"),
                "test_loss": ev.get("test_loss"),
                "loss": number(step.get("loss")),  # the training loss of its last metrics line
                "averaged": end.get("averaged", step.get("averaged", 0)),
                "failed": end.get("failed", step.get("failed", 0)),
                "served": _count(stats.get("requests_served")) if isinstance(stats, dict) else None,
                "peers": end.get("peers", step.get("peers", {})),
                "kills": node.kills,
                "restarts": node.restarts,
                "rejoins": node.rejoins,
            }
        )
    return {
        "run_dir": str(run_dir),
        "elapsed_s": round(elapsed_s, 1),
        "nodes": rows,
        "average": average,
        "exchanges": sum(r["averaged"] or 0 for r in rows),
        "failed": sum(r["failed"] or 0 for r in rows),
        "kills": sum(r["kills"] for r in rows),
        "restarts": sum(r["restarts"] for r in rows),
        "rejoins": sum(r["rejoins"] for r in rows),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary table, as printed at the end of a run and saved as summary.txt."""
    head = ("node", "state", "test acc", "test loss", "epochs", "steps", "averaged", "failed", "served")
    rows = [head]
    for r in summary["nodes"]:
        acc = r["test_acc"]
        rows.append(
            (
                r["node"],
                r["state"],
                _percent(acc),
                _fmt(r["test_loss"], ".4f"),
                "n/a" if r["epochs"] is None else str(r["epochs"]),
                str(r["steps"]),
                str(r["averaged"]),
                str(r["failed"]),
                _fmt(r["served"], "d"),
            )
        )
    average = summary.get("average") or {}
    if "test_acc" in average:
        rows.append(
            (
                "average",
                f"{average.get('models', '?')} nodes",
                f"{100 * average['test_acc']:.2f}%",
                f"{average['test_loss']:.4f}",
                "",
                "",
                "",
                "",
                "",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes = [
        f"run folder {summary['run_dir']}, {summary['elapsed_s']:.0f} s; "
        f"averaged: {summary['exchanges']} in all (each node's count: a symmetric exchange moves both its nodes), "
        f"{summary['failed']} failed"
    ]
    if summary.get("kills") or summary.get("restarts"):
        notes.append(
            f"chaos and restarts: {summary.get('kills', 0)} killed, {summary.get('restarts', 0)} started again, "
            f"{summary.get('rejoins', 0)} rejoined from their peers"
        )
    unevaluated = [r for r in summary["nodes"] if r["epochs"] is None and r.get("loss") is not None]
    if unevaluated:  # a script of the user's own (a callback, the optimizer hook): what it logged instead
        losses = ", ".join(f"{r['node']} {r['loss']:.4g}" for r in unevaluated)
        notes.append(f"no evaluation from {', '.join(r['node'] for r in unevaluated)}; last training loss: {losses}")
    if "test_acc" in average:
        notes.append("'average': one model whose weights are the mean of every node's final weights")
    elif average.get("error"):
        notes.append(f"parameter average not evaluated: {average['error']}")
    pairs = [
        f"{r['node']} <- " + ", ".join(f"{p} {n}" for p, n in sorted(r["peers"].items()))
        for r in summary["nodes"]
        if r["peers"]
    ]
    if pairs:
        notes.append("averaged with: " + "; ".join(pairs))
    return "\n".join(lines + [""] + notes)
