"""What every role shares: the run description, its workload, a stop flag, timed batches."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ..recorder import Recorder, StepTimer
from ..workload import Workload, WorkloadSpec, load_workload

__all__ = ["ROUND_ENV", "Role", "StopFlag", "load_role", "run_collective", "timed"]

ROUND_ENV = "DPWA_CMP_ROUND"  # set by the runner for a restarted group (--churn)


class StopFlag:
    """Set by SIGTERM or SIGINT: the role finishes its current step, writes its results and exits."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.signal_name is not None


@dataclass
class Role:
    """One process of a run: its name, position, the run description and what it writes."""

    name: str
    index: int
    run: dict[str, Any]
    workdir: Path
    spec: WorkloadSpec
    recorder: Recorder
    timer: StepTimer
    stop: StopFlag

    @cached_property
    def workload(self) -> Workload:
        """The workload, loaded on first use (a launcher that only starts others never loads the data)."""
        return load_workload(self.spec)

    @property
    def options(self) -> dict[str, Any]:
        return self.run["options"]

    @property
    def round(self) -> int:
        """How many times this process's group was restarted before it (--churn: all-reduce's elastic
        restarts, as torchrun's ``TORCHELASTIC_RESTART_COUNT``); 0 for a first start."""
        return int(os.environ.get(ROUND_ENV, "0"))

    @property
    def is_straggler(self) -> bool:
        return self.index == self.spec.workers - 1 and self.spec.straggler > 1


def load_role(run_file: str | Path, name: str, index: int, *, worker: bool) -> Role:
    """Read the run description and build this process's workload, recorder and timer."""
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    run = json.loads(Path(run_file).read_text())
    spec = WorkloadSpec(**run["workload"])
    workdir = Path(run["workdir"])
    stop = StopFlag()
    role = Role(
        name=name,
        index=index,
        run=run,
        workdir=workdir,
        spec=spec,
        recorder=Recorder(workdir, name),
        timer=StepTimer(),
        stop=stop,
    )
    if worker and role.is_straggler:
        role.timer.factor = spec.straggler
    return role


def timed(batches: Iterable[Any], timer: StepTimer) -> Iterator[Any]:
    """Yield from `batches`, counting the time each takes to make (augmentation) as compute."""
    iterator = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        timer.compute_s += time.perf_counter() - t0
        yield batch


def run_collective(role: Role, train: Callable[[Role], None]) -> None:
    """(all-reduce, DiLoCo) Join this rank's process group (NCCL where each rank has a GPU of its own, else
    gloo), run ``train(role)``, and leave with every other rank (this process ends there)."""
    from ...systems import allreduce

    opts, world = role.options, role.spec.workers
    backend = allreduce.backend_for(role.spec.device, world)
    store = opts["store"] + (f".{role.round}" if role.round else "")  # a restarted group meets afresh
    allreduce.run_rank(role.index, lambda *_: train(role), world, store, opts["gloo_timeout_s"], (), backend)
