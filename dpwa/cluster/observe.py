"""What the dashboard shows, gathered in the background: status over the wire, curves and events from files.

Two watchers, each on its own thread, each publishing an immutable snapshot
(plain data, ready for JSON) that readers take without waiting:

* :class:`StatusPoller` asks every node of a config for its status, as
  ``python -m dpwa status`` does (:class:`~dpwa.cluster.status.StatusClient`:
  replies checked against the wire schema, one deadline for all nodes), and
  turns a node that stops answering, or answers again, into an event;
* :class:`RunWatcher` follows a run folder: each node's metrics file (loss and
  evaluation curves, the latest numbers, rejoins and barrier waits), the
  launcher's ``events.jsonl``, ``summary.json``, and the last lines of each
  node's log.

Events from every source meet on one :class:`EventBoard`. Lines are parsed
and checked as every tool parses them (:mod:`.events`: :func:`~.events.check_metrics`
for metrics files, :func:`~.events.check_event` for ``events.jsonl``); a bad
line is skipped and becomes a ``bad_line`` event naming the file and the line
number (the first :data:`~.events.MAX_REPORTS` of each file; later ones are
counted in the node's ``bad_lines``). Nothing read is
trusted: node names are only those of the config, numbers must be finite,
text is cut to :data:`MAX_TEXT` characters (the page shows it as text, never
as markup), and everything kept is bounded: :data:`MAX_POINTS` points per
curve, :data:`MAX_EVENTS_KEPT` events, :data:`LOG_LINES` lines of log per node,
and at most ``events.READ_CHUNK_BYTES`` read from any file per poll.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..config import Config
from ..runfiles.lines import number
from .events import EVENTS_FILE, BadLine, JsonlFollower, check_event, check_metrics
from .status import UNREACHABLE, StatusClient

__all__ = ["EventBoard", "Series", "StatusPoller", "RunWatcher", "MAX_POINTS", "MAX_EVENTS_KEPT"]

logger = logging.getLogger("dpwa.dashboard")

MAX_POINTS = 600  # points kept per curve (older ones thinned out evenly)
MAX_EVENTS_KEPT = 500  # events kept in memory (the oldest go first)
MAX_TEXT = 300  # characters kept of any text read from a file or a node
LOG_LINES = 12  # lines shown of each node's log
LOG_TAIL_BYTES = 8192  # read from the end of each log per poll
SUMMARY_MAX_BYTES = 1 << 20  # a larger summary.json is not read
AVERAGE_BUCKETS = 200  # the average loss curve: the mean of the nodes' means in this many time slices
BARRIER_EVENT_S = 1.0  # a barrier wait shorter than this (and that left nobody out) is no event
MAX_EPOCHS_KEPT = 10_000  # evaluation epochs remembered for the average accuracy curve
# How a start line of the example's train.py begins when the node came back into a running cluster
REJOINED = ("joined the cluster", "restarted", "started again")


# --------------------------------------------------------------------------- checked values


def count(value: Any) -> int | None:
    """`value` if it is a non-negative int below 2**62, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        return None
    return value


def text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """`value` cut to `limit` characters if it is a string, else None."""
    if not isinstance(value, str):
        return None
    return value if len(value) <= limit else value[: limit - 1] + "…"


def jsonable(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


# --------------------------------------------------------------------------- events


class EventBoard:
    """The events the page lists, from every source, at most `max_events` (the oldest are dropped).

    Thread-safe: the watchers and the HTTP handlers all add to it.
    """

    def __init__(self, max_events: int = MAX_EVENTS_KEPT) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def add(self, t: float, kind: str, node: str | None, message: str) -> None:
        event = {"t": round(t, 3), "kind": kind, "node": node, "text": text(message) or ""}
        with self._lock:
            self._events.append(event)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every event kept, in time order."""
        with self._lock:
            events = list(self._events)
        return sorted(events, key=lambda e: e["t"])


# --------------------------------------------------------------------------- curves


class Series:
    """At most `max_points` (t, value) points: when full, every other point is dropped and from then on
    only every 2nd (4th, ...) new point is kept, so a long run keeps an even sample of its whole curve."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.points: list[tuple[float, float]] = []
        self._stride = 1
        self._seen = 0

    def add(self, t: float, value: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        if len(self.points) >= self.max_points:
            self.points = self.points[::2]
            self._stride *= 2
        self.points.append((round(t, 3), value))


def average_curve(series: list[list[tuple[float, float]]], buckets: int = AVERAGE_BUCKETS) -> list[list[float]]:
    """The mean over nodes of each node's mean value in each of `buckets` equal time slices."""
    points = [p for s in series for p in s]
    if not points:
        return []
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    width = (t1 - t0) / buckets or 1.0
    means: dict[int, list[float]] = {}  # bucket -> each node's mean in it
    for s in series:
        per_bucket: dict[int, list[float]] = {}
        for t, v in s:
            per_bucket.setdefault(min(buckets - 1, int((t - t0) / width)), []).append(v)
        for b, values in per_bucket.items():
            means.setdefault(b, []).append(sum(values) / len(values))
    return [[round(t0 + (b + 0.5) * width, 3), sum(m) / len(m)] for b, m in sorted(means.items())]


# --------------------------------------------------------------------------- status over the wire


class StatusPoller:
    """Asks every node of `config` for its status every `every_s` seconds, on its own thread.

    :meth:`snapshot` returns the latest round at once (never waits for a
    node). A round lasts at most `timeout_s` plus a second, however many nodes
    are down. :meth:`close` stops the thread within that time.
    """

    def __init__(
        self,
        config: Config,
        events: EventBoard,
        *,
        key: str | None = None,
        timeout_s: float | None = None,
        every_s: float = 1.0,
    ) -> None:
        self.config, self.events, self.key = config, events, key
        self.timeout_s = min(config.timeout_s, 2.0) if timeout_s is None else timeout_s
        self.every_s = every_s
        self._snapshot: dict[str, Any] = {"asked_at": None, "asked_as": None, "error": None, "rows": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpwa-dashboard-status", daemon=True)
        self._was: dict[str, str] = {}

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    def _run(self) -> None:
        try:
            client = StatusClient(self.config, self.key)  # made, used and closed on this thread
        except Exception as exc:  # e.g. under CURVE no node's key is here: the curves still show
            self._snapshot = {**self._snapshot, "error": f"status cannot be asked: {exc}"}
            return
        with client:
            while not self._stop.is_set():
                started = time.monotonic()
                rows = client.ask(self.timeout_s)
                self._publish(client.name, rows)
                self._stop.wait(max(0.05, self.every_s - (time.monotonic() - started)))

    def _publish(self, asked_as: str, rows: list[dict[str, Any]]) -> None:
        now = time.time()
        for row in rows:
            name, state = row["name"], row["state"]
            before = self._was.get(name)
            if state == UNREACHABLE and before not in (None, UNREACHABLE):
                self.events.add(now, "unreachable", name, f"does not answer status: {row.get('reason', '')}")
            elif state != UNREACHABLE and before == UNREACHABLE:
                self.events.add(now, "reachable", name, f"answers status again ({state.replace('_', ' ')})")
            self._was[name] = state
        clean = []
        for row in rows:
            if row["state"] == UNREACHABLE:
                clean.append({"name": row["name"], "state": UNREACHABLE, "reason": text(row.get("reason")) or ""})
            else:
                clean.append(jsonable(row))
        self._snapshot = {"asked_at": round(now, 3), "asked_as": asked_as, "error": None, "rows": clean}

    def close(self) -> None:
        """Stop asking; returns once the thread has closed its sockets (within a round's deadline)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s + 5.0)
            if self._thread.is_alive():
                logger.warning("the dashboard's status thread is still running after %.1f s", self.timeout_s + 5)


# --------------------------------------------------------------------------- the run folder


class _Node:
    """What the metrics file of one node said, checked and bounded."""

    def __init__(self, name: str, names: set[str], follower: JsonlFollower) -> None:
        self.name = name
        self.names = names  # every node of the config
        self.follower = follower
        self.latest: dict[str, Any] = {}  # epochs, epoch, step, loss, test_acc, ...: numbers only
        self.state = "starting"
        self.started = ""  # how it started last, in words
        self.starts = 0
        self.peers: dict[str, int] = {}  # successful averages per peer, since its last start
        self.loss = Series()
        self.evals = Series()
        self.log: list[str] = []
        self.exit_code: int | None = None  # the launcher saw its process end with this code (until it starts again)


class RunWatcher:
    """Follows a run folder on its own thread, every `every_s` seconds; :meth:`snapshot` never waits."""

    def __init__(self, run_dir: str | Path, names: list[str], events: EventBoard, every_s: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.names = list(names)
        self.events = events
        self.every_s = every_s
        known = set(self.names)
        self.nodes = {
            n: _Node(n, known, JsonlFollower(self.run_dir / "metrics" / f"{n}.jsonl", check=check_metrics))
            for n in self.names
        }
        self._launcher = JsonlFollower(self.run_dir / EVENTS_FILE, check=check_event)
        self.eval_metric: str | None = None  # test_acc, or val_loss / test_loss when there is no accuracy
        self._epochs: dict[int, dict[str, tuple[float, float]]] = {}  # epoch -> node -> (t, value)
        self._summary: dict[str, Any] | None = None
        self._summary_mtime = 0.0
        self._snapshot: dict[str, Any] = {"nodes": {}, "curves": {}, "summary": None}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpwa-dashboard-files", daemon=True)

    def start(self) -> RunWatcher:
        self.poll()  # the first snapshot before the page asks
        self._thread.start()
        return self

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception:  # a bug here must not end the dashboard: log it, try again next time
                logger.exception("the dashboard failed to read %s", self.run_dir)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    # ----------------------------------------------------------------- reading

    def poll(self) -> None:
        """Read what is new in every file, then publish a new snapshot."""
        for record in self._launcher.poll():
            self._launcher_event(record)
        self._report(None, self._launcher.take_problems())
        for node in self.nodes.values():
            for record in node.follower.poll():
                self._metrics_line(node, record)
            self._report(node.name, node.follower.take_problems())
            node.log = _log_tail(self.run_dir / "logs" / f"{node.name}.log")
        self._read_summary()
        self._publish()

    def _report(self, node: str | None, problems: list[BadLine]) -> None:
        """Each bad line read: an event (the page lists it) and a log line, naming the file and the line."""
        now = time.time()
        for problem in problems:
            try:
                where = str(problem.path.relative_to(self.run_dir))
            except ValueError:
                where = str(problem.path)
            message = f"{where}: line {problem.line}: {problem.reason}; skipped"
            self.events.add(now, "bad_line", node, message)
            logger.warning("dashboard: %s", text(message))

    def _launcher_event(self, record: dict[str, Any]) -> None:
        t, kind = number(record.get("t")), text(record.get("kind"), 32)
        node = record.get("node")
        if t is None or kind is None or (node is not None and not (isinstance(node, str) and node in self.nodes)):
            return
        pid, code = count(record.get("pid")), record.get("code")
        code = code if isinstance(code, int) and not isinstance(code, bool) and abs(code) < 1 << 31 else None
        if kind == "kill":
            self.events.add(t, "kill", node, f"SIGKILL by {text(record.get('by'), 32) or '?'} (pid {pid})")
        elif kind == "exit":
            if node is not None:
                self.nodes[node].exit_code = code
            self.events.add(t, "exit", node, f"exited with code {code}" + (" (SIGKILL)" if code == -9 else ""))
        elif kind == "restart":
            n, of = count(record.get("restart")), count(record.get("of"))
            self.events.add(t, "restart", node, f"started again by the launcher (restart {n} of {of})")
        elif kind == "node_start":
            if node is not None:
                self.nodes[node].exit_code = None
            if not count(record.get("restart")):
                self.events.add(t, "start", node, f"process started (pid {pid})")
        elif kind == "stop":
            self.events.add(t, "stop", None, f"{text(record.get('signal'), 16) or 'a signal'}: stopping every node")
        elif kind == "run_start":
            self.events.add(t, "launcher", None, f"launcher started (pid {pid})")
        elif kind == "run_end":
            self.events.add(t, "launcher", None, f"launcher done (exit status {code})")
        elif kind == "truncated":
            self.events.add(t, "launcher", None, "events.jsonl is full: later events are not recorded")

    def _metrics_line(self, node: _Node, record: dict[str, Any]) -> None:
        t, kind = number(record.get("t")), record.get("kind")
        if t is None:
            return
        latest = node.latest
        if kind == "start":
            node.starts += 1
            node.state = "training"
            node.peers = {}
            node.started = text(record.get("started")) or ""
            for key in ("epochs", "steps_per_epoch", "train_images", "batch_size"):
                latest[key] = count(record.get(key))
            latest["lr"] = number(record.get("lr"))
            latest["data"] = text(record.get("data"), 32)
            if node.started.startswith(REJOINED):
                self.events.add(t, "rejoin", node.name, node.started)
            else:
                self.events.add(t, "start", node.name, f"training: {node.started or 'started'}")
        elif kind == "step":
            for key in ("epoch", "step", "averaged", "failed"):
                latest[key] = count(record.get(key))
            latest["exchanges_per_s"] = number(record.get("exchanges_per_s"))
            loss = number(record.get("loss"))
            latest["loss"] = loss
            if loss is not None:
                node.loss.add(t, loss)
            node.peers = _peer_counts(record.get("peers"), node.names - {node.name}) or node.peers
            node.state = "training"
        elif kind == "eval":
            metric = self.eval_metric or next(
                (m for m in ("test_acc", "val_loss", "test_loss") if number(record.get(m)) is not None), None
            )
            value = number(record.get(metric)) if metric else None
            if metric is None or value is None:
                return
            self.eval_metric = metric
            latest[metric] = value
            epoch = count(record.get("epoch"))
            node.evals.add(t, value)
            if epoch is not None:
                self._epochs.setdefault(epoch, {})[node.name] = (t, value)
                while len(self._epochs) > MAX_EPOCHS_KEPT:
                    del self._epochs[min(self._epochs)]
        elif kind == "barrier":
            waited = number(record.get("waited_s"))
            listed = record.get("skipped")
            skipped = [s for s in listed if isinstance(s, str) and s in node.names] if isinstance(listed, list) else []
            name = text(record.get("name"), 32) or "?"
            if skipped:
                self.events.add(t, "barrier", node.name, f"went on from barrier {name!r} without {', '.join(skipped)}")
            elif waited is not None and waited >= BARRIER_EVENT_S:
                self.events.add(t, "barrier", node.name, f"waited {waited:.1f} s at barrier {name!r}")
        elif kind == "linger":
            node.state = "lingering"
        elif kind == "checkpoint_failed":
            self.events.add(t, "checkpoint", node.name, f"checkpoint not saved: {text(record.get('error')) or '?'}")
        elif kind == "end":
            reason = text(record.get("reason")) or "?"
            node.state = "done" if reason == "done" else "stopped"
            node.peers = _peer_counts(record.get("peers"), node.names - {node.name}) or node.peers
            self.events.add(t, "end", node.name, f"ended: {reason}")

    def _read_summary(self) -> None:
        path = self.run_dir / "summary.json"
        try:
            stat = path.stat()
            if stat.st_mtime == self._summary_mtime or stat.st_size > SUMMARY_MAX_BYTES:
                return
            data = json.loads(path.read_bytes()[:SUMMARY_MAX_BYTES])
        except (OSError, ValueError, RecursionError):  # RecursionError: nesting too deep for the parser
            return
        self._summary_mtime = stat.st_mtime
        average = data.get("average") if isinstance(data, dict) else None
        if isinstance(average, dict):
            self._summary = {
                "models": count(average.get("models")),
                "test_acc": number(average.get("test_acc")),
                "test_loss": number(average.get("test_loss")),
                "error": text(average.get("error")),
            }

    # ----------------------------------------------------------------- the snapshot

    def _publish(self) -> None:
        nodes = {}
        for name, node in self.nodes.items():
            nodes[name] = {
                "state": node.state if node.exit_code in (None, 0) or node.state == "done" else "exited",
                "exit_code": node.exit_code,
                "started": node.started,
                "starts": node.starts,
                "peers": dict(node.peers),
                "log": list(node.log),
                "bad_lines": node.follower.bad_lines,
                **{k: v for k, v in node.latest.items() if v is not None},
            }
        losses = {name: node.loss.points for name, node in self.nodes.items()}
        evals = {name: node.evals.points for name, node in self.nodes.items()}
        evals_average = [
            [max(t for t, _ in by_node.values()), sum(v for _, v in by_node.values()) / len(by_node)]
            for _, by_node in sorted(self._epochs.items())
        ]
        self._snapshot = {
            "nodes": nodes,
            "curves": {
                "loss": {"nodes": losses, "average": average_curve(list(losses.values()))},
                "eval": {"metric": self.eval_metric, "nodes": evals, "average": evals_average},
            },
            "summary": self._summary,
        }


def _peer_counts(value: Any, known: set[str]) -> dict[str, int]:
    """{peer: count} for the peers of the config only (a metrics file may say anything)."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for peer, n in value.items():
        n = count(n)
        if isinstance(peer, str) and peer in known and n is not None:
            out[peer] = n
    return out


def _log_tail(path: Path, lines: int = LOG_LINES, max_bytes: int = LOG_TAIL_BYTES) -> list[str]:
    """The last `lines` lines of a log, read from its last `max_bytes`, each cut to MAX_TEXT characters."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - max_bytes))
            data = fh.read(max_bytes)
    except OSError:
        return []
    tail = data.decode("utf-8", errors="replace").splitlines()
    if len(data) == max_bytes and size > max_bytes:
        tail = tail[1:]  # the first line is cut
    return [text(line) or "" for line in tail[-lines:]]
