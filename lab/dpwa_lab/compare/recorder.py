"""What a process of a comparison run writes, and how it starts: the start gate, snapshots, timings, results.

A run's work folder::

    ready/NAME         each process, once set up (imports, data, sockets)
    go                 the runner, once every process is ready: the start time (Unix seconds)
    snapshots/NAME.jsonl, snapshots/NAME-K.npy
                       model states (parameters then buffers, float32, np.save without pickle)
                       with the time and sample count they stand for
    results/NAME.json  each process's counters at its end
    logs/NAME.log      its output

Every process waits at the gate, so start-up (imports, a process group, a
dataset) is not counted as training time, and every system's clock starts
at ``go``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GateTimeout", "Recorder", "StepTimer", "wait_for_go"]

GATE_POLL_S = 0.01


class GateTimeout(RuntimeError):
    """The runner did not open the gate in time."""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for_go(workdir: Path, name: str, timeout_s: float = 300.0) -> float:
    """Say this process is ready, and wait until the runner says go; return the start time it wrote."""
    (workdir / "ready").mkdir(exist_ok=True)
    _write_atomic(workdir / "ready" / name, str(os.getpid()))
    go = workdir / "go"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return float(go.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(GATE_POLL_S)
    raise GateTimeout(f"{name}: no go from the runner within {timeout_s:.0f} s ({go} missing)")


def open_gate(workdir: Path) -> float:
    """The runner's side: write the start time; return it."""
    start = time.time()
    _write_atomic(workdir / "go", repr(start))
    return start


class Recorder:
    """Writes one process's snapshots and results into the run's work folder."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = Path(workdir)
        self.name = name
        (self.workdir / "snapshots").mkdir(exist_ok=True)
        (self.workdir / "results").mkdir(exist_ok=True)
        self._index = self.workdir / "snapshots" / f"{name}.jsonl"
        # a process restarted under the same name (--churn: all-reduce's elastic restart) numbers on
        self._count = len(self._index.read_text(encoding="utf-8").splitlines()) if self._index.exists() else 0
        self.spent_s = 0.0  # time spent writing, which the caller may leave out of its timings

    def snapshot(self, state: np.ndarray, samples: int, **extra: Any) -> None:
        """Save a model state that stands for `samples` samples trained, now."""
        t0 = time.perf_counter()
        path = self.workdir / "snapshots" / f"{self.name}-{self._count}.npy"
        np.save(path, np.asarray(state, np.float32), allow_pickle=False)
        line = {"k": self._count, "t": time.time(), "samples": int(samples), "file": path.name, **extra}
        with open(self._index, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
        self._count += 1
        self.spent_s += time.perf_counter() - t0

    def result(self, **fields: Any) -> None:
        """Write this process's results (counters, timings) as JSON, atomically."""
        _write_atomic(self.workdir / "results" / f"{self.name}.json", json.dumps(fields, default=str))


@dataclass
class StepTimer:
    """A worker's time, split into compute (forward, backward, a straggler's extra delay) and everything else.

    Args:
        factor: this worker is `factor` times slower per step: after each compute
            it sleeps (factor - 1) times what the compute took. Sleeping leaves
            the core to others, as a slower machine would.
    """

    factor: float = 1.0
    compute_s: float = 0.0
    steps: int = 0
    started: float = 0.0
    ended: float = 0.0

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        self.ended = time.monotonic()

    def computed(self, seconds: float) -> None:
        """Count one step's compute of `seconds`; a straggler then sleeps its extra share."""
        extra = (self.factor - 1.0) * seconds
        if extra > 0:
            time.sleep(extra)
        self.compute_s += seconds + extra
        self.steps += 1

    def summary(self, left_out_s: float = 0.0) -> dict[str, float]:
        """run_s (minus `left_out_s`, bookkeeping), compute_s, and idle_fraction = 1 - compute / run."""
        run = max(1e-9, (self.ended or time.monotonic()) - self.started - left_out_s)
        return {
            "run_s": run,
            "compute_s": self.compute_s,
            "steps": self.steps,
            "idle_fraction": max(0.0, 1.0 - self.compute_s / run),
        }
