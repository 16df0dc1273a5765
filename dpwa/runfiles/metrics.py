"""The metrics a node writes into its run folder: the writer any script can call, and its schema.

``RUN_DIR/metrics/NODE.jsonl`` holds one JSON object per line. The live table
(:mod:`.monitor`), ``python -m dpwa status``, the dashboard and ``curves.png``
read it. The launcher (``python -m dpwa run``, ``./run.sh``) gives each node
``$DPWA_RUN_DIR``; :func:`dpwa.gossip_optimizer` and the integrations write
through this module when it is set, so a script of your own shows up with
no code of its own. A script that evaluates can add its own lines::

    from dpwa.runfiles.metrics import MetricsWriter

    with MetricsWriter.from_env(conn.name) as metrics:      # writes nothing outside a run folder
        metrics.write("eval", step=step, test_loss=0.41, test_acc=0.88)

The schema. Every line has ``kind``, ``t`` (Unix time, s) and ``node``, which
the writer adds. :data:`KINDS` names the kinds the tools read and the fields
each must have; ``dpwa.runfiles.lines.check_metrics`` gives every known
field its type (numbers: ``loss``, ``lr``, ``test_acc``, ``test_loss``,
``clock``, ...; counts: ``epoch``, ``step``, ``averaged``, ``failed``, ...;
``peers``: an object of counts). The writer checks each line against both
before writing it and raises :class:`MetricsError` naming the field, so a
mistake in a script fails where it is made, not as a line the tools skip
later. Other kinds and fields may be written; the tools ignore them.

* ``start``: once per process start (``started``: how it started; a text
  beginning "joined the cluster" counts as a rejoin in the live table);
* ``step``: ``step``, with ``loss`` (the mean since the last step line),
  ``averaged`` and ``failed`` (since the run began), ``peers`` (exchanges
  per peer), ``exchanges_per_s``, ``clock``, and ``epoch`` if there are epochs;
* ``eval``: ``step``, with ``test_acc`` and/or ``test_loss``;
* ``linger``: the node only serves peers now; ``end``: ``reason`` ("done",
  or why it stopped), with the counters of ``step`` and ``stats``.

:class:`StepMetrics` turns a node's counters into ``start``, ``step`` and
``end`` lines; the optimizer hook and the example use it.

A full disk loses lines, never the training: a write that fails is counted
(:attr:`MetricsWriter.dropped`) and logged once.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from ..logs import logger
from .lines import check_metrics
from .private import make_private_dir, open_private

__all__ = ["KINDS", "RUN_DIR_ENV", "MetricsError", "MetricsWriter", "StepMetrics"]

RUN_DIR_ENV = "DPWA_RUN_DIR"  # the run folder, as the launcher gives it to each node

#: the kinds the tools read, and the fields each must have (their types: dpwa.runfiles.lines.check_metrics)
KINDS: dict[str, tuple[str, ...]] = {
    "start": (),
    "step": ("step",),
    "eval": ("step",),
    "barrier": ("name",),
    "checkpoint": ("epoch",),
    "checkpoint_failed": ("error",),
    "linger": (),
    "end": ("reason",),
}


class MetricsError(ValueError):
    """A metrics line that does not fit the schema (the message names the field and what was expected)."""


class MetricsWriter:
    """Appends checked JSON lines to ``run_dir/metrics/node.jsonl`` (folder 0700, file 0600), flushed at once.

    With `run_dir` None it writes nothing (a script run outside a run folder), but still checks each line.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None, node: str) -> None:
        self.node = node
        self.dropped = 0  #: lines lost to write errors (a full disk)
        self.path: Path | None = None
        self._fh: IO[str] | None = None
        if run_dir is not None:
            base = Path(run_dir)
            make_private_dir(base / "metrics", base=base)
            self.path = base / "metrics" / f"{node}.jsonl"
            self._fh = open_private(self.path, "a")  # closed by close()

    @classmethod
    def from_env(cls, node: str, environ: Mapping[str, str] | None = None) -> MetricsWriter:
        """A writer into ``$DPWA_RUN_DIR`` (set by the launcher), or one that writes nothing if it is unset."""
        run_dir = (os.environ if environ is None else environ).get(RUN_DIR_ENV) or None
        return cls(run_dir, node)

    @property
    def enabled(self) -> bool:
        """Whether lines go to a file."""
        return self._fh is not None

    def write(self, kind: str, **fields: Any) -> None:
        """Check one line (MetricsError if it does not fit the schema) and append it."""
        record = {"kind": kind, "t": round(time.time(), 3), "node": self.node, **fields}
        missing = [key for key in KINDS.get(kind, ()) if fields.get(key) is None]
        problem = f"{', '.join(missing)} missing (a {kind!r} line needs {', '.join(KINDS[kind])})" if missing else None
        problem = problem or check_metrics(record)
        if problem:
            raise MetricsError(f"{self.node}: a metrics line of kind {kind!r}: {problem}")
        try:
            line = json.dumps(record) + "\n"  # NaN and Infinity are numbers here, as the tools read them
        except (TypeError, ValueError) as exc:
            raise MetricsError(f"{self.node}: a metrics line of kind {kind!r} is not JSON: {exc}") from None
        if self._fh is None:
            return
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as exc:  # a full disk loses metrics lines, never the training
            if not self.dropped:
                logger.warning(
                    "%s: %s: a metrics line was lost (%s); training goes on", self.node, self.path, exc.strerror or exc
                )
            self.dropped += 1

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # the last flush may meet a full disk too
                fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepMetrics:
    """A node's ``start``, ``step`` and ``end`` lines, from its counters.

    Args:
        writer: where the lines go.
        stats: the node's counters (``DpwaPyTorchAdapter.stats``), read when a line is written.
        every: a ``step`` line every this many steps (and whenever :meth:`step` is told ``force``).
        averaged_before, failed_before: what the run had counted before this process (a resumed node's).
    """

    def __init__(
        self,
        writer: MetricsWriter,
        stats: Callable[[], dict[str, Any]],
        every: int = 5,
        *,
        averaged_before: int = 0,
        failed_before: int = 0,
    ) -> None:
        if every < 1:
            raise ValueError(f"a step line every {every} steps: expected 1 or more")
        self.writer, self._stats, self.every = writer, stats, every
        self._averaged_before = averaged_before
        self.failed = failed_before  #: exchanges that failed since the run began
        self._losses: list[float] = []
        self._window_start = time.monotonic()
        self._window_averaged = averaged_before
        self._last_line = -1  # the step of the last step line written

    def exchanges(self, counts: dict[str, Any] | None = None) -> tuple[int, dict[str, int]]:
        """Exchanges that moved this node since the run began, in all and per peer: those it started and, in
        mode symmetric, those a peer started with it."""
        counts = self._stats() if counts is None else counts
        moved = int(counts.get("averaged", 0)) + int(counts.get("mirrored", 0))
        peers = {p: int(row["averaged"]) for p, row in counts.get("peers", {}).items() if row.get("averaged")}
        return self._averaged_before + moved, peers

    def start(self, **fields: Any) -> None:
        self.writer.write("start", pid=os.getpid(), **fields)

    def step(self, step: int, loss: float | None, update: Any = None, *, force: bool = False, **fields: Any) -> None:
        """Count one training step (`update`: what its ``update_wait`` returned, if any); write a line every
        `every` steps, or now with `force`. `fields` (``epoch``, ``lr``, ...) go into the line."""
        if update is not None and not update.averaged and update.outcome != "no_fetch":
            self.failed += 1
        if loss is not None:
            self._losses.append(loss)  # NaN too: a diverging node's line says so
        due = force or step % self.every == 0
        if not due or step == self._last_line or not self.writer.enabled:
            return
        now = time.monotonic()
        averaged, peers = self.exchanges()
        self.writer.write(
            "step",
            step=step,
            loss=sum(self._losses) / len(self._losses) if self._losses else None,
            averaged=averaged,
            failed=self.failed,
            peers=peers,
            exchanges_per_s=(averaged - self._window_averaged) / max(now - self._window_start, 1e-9),
            **({"clock": float(update.clock)} if update is not None else {}),
            **fields,
        )
        self._losses, self._window_start, self._window_averaged = [], now, averaged
        self._last_line = step

    def end(self, reason: str, counts: dict[str, Any] | None = None, **fields: Any) -> None:
        """The last line: `reason`, the counters, and `counts` (the node's stats, as at close) as ``stats``."""
        counts = self._stats() if counts is None else counts
        averaged, peers = self.exchanges(counts)
        stats = json.loads(json.dumps(counts, default=str))
        self.writer.write(
            "end", reason=reason, averaged=averaged, failed=self.failed, peers=peers, stats=stats, **fields
        )
