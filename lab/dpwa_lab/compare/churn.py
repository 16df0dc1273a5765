"""--churn: workers leave while a run trains, and others take their place, as each system's users would see it.

Event k of N (k = 1..N) comes when the run has trained k/(N + 1) of its samples, read from the snapshots its
processes write, so each system is hit at the same fraction of its training, whatever its speed:

* **gossip** (open membership: every node's config lists only itself, with the first workers' addresses as
  ``bootstrap:``; ``pairing: auto`` is ``random`` there): a worker is SIGKILLed (the last one first, never one
  of the bootstrap nodes) and at once a new node, the next name (``w4`` after ``w0``..``w3``), starts with
  the victim's shard from where the victim's last snapshot was, joins through the bootstrap addresses and
  takes a member's state (``join: auto``). Nobody else stops; the victim leaves the views within
  ``suspect_after_ms`` + ``dead_after_ms``.
* **allreduce**, as under ``torchrun --max-restarts``: a rank is SIGKILLed, every other rank is stopped
  (SIGTERM, SIGKILL after :data:`STOP_GRACE_S`: a rank stuck in a collective never sees the signal), and
  every rank starts again in a new round, resuming from rank 0's last checkpoint (one every tenth of the
  run: :mod:`.roles.allreduce`). The new processes import, meet and load before they train on.

The report lists each event: when (seconds from the start), the victim, and what replaced it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dpwa.cluster.processes import free_ports

from .roles.common import ROUND_ENV
from .runner import BOOTSTRAP_NODES, LiveRun, is_gossip, open_config

__all__ = ["CHURN_SYSTEMS", "Churn", "STOP_GRACE_S", "churns", "trained_samples"]

CHURN_SYSTEMS = ("gossip", "gossip-*", "allreduce")  # the systems --churn runs (a variant too: gossip-NAME)


def churns(system: str) -> bool:
    """Whether --churn runs `system`: every gossip system (a variant too) and allreduce."""
    return is_gossip(system) or system == "allreduce"


STOP_GRACE_S = 2.0  # all-reduce's elastic restart: between SIGTERM and SIGKILL of the surviving ranks
_READ_EVERY_S = 0.25  # the snapshots are read at most this often


def _last_line(path: Path) -> dict[str, Any] | None:
    """The last complete line of a snapshot index (a line being written is skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return dict(json.loads(line))
        except ValueError:
            continue
    return None


def trained_samples(workdir: Path, system: str, names: list[str]) -> int:
    """The samples the run has trained so far, by its snapshots: every gossip node's own (a killed one's until
    its last snapshot), or all-reduce rank 0's (the cluster's samples, every rank training one batch a step)."""
    names = ["rank0"] if system == "allreduce" else names
    total = 0
    for name in names:
        line = _last_line(workdir / "snapshots" / f"{name}.jsonl")
        total += int(line["samples"]) if line is not None else 0
    return total


class Churn:
    """The fault of a ``--churn N`` run of `system` (polled by the runner: see the module docstring).

    Args:
        system: a gossip system or ``allreduce``.
        events: N, the workers that leave (and are replaced).
        workers: the run's workers at the start.
        total_samples: what the whole run trains (the workload's), for the events' fractions.
    """

    def __init__(self, system: str, events: int, workers: int, total_samples: int) -> None:
        if not churns(system):
            raise ValueError(f"--churn runs {', '.join(CHURN_SYSTEMS)}; not {system}")
        if events < 1:
            raise ValueError(f"--churn takes at least 1 event, got {events}")
        if workers < 2:
            raise ValueError(f"--churn needs at least 2 workers, got {workers}")
        self.system, self.events, self.workers = system, events, workers
        self.thresholds = [total_samples * k // (events + 1) for k in range(1, events + 1)]
        self.done: list[dict[str, Any]] = []
        self._read_at = 0.0

    def _victim(self, live: LiveRun, k: int) -> str:
        if self.system == "allreduce":
            return f"rank{self.workers - 1 - k % self.workers}"
        alive = [n for n in live.workers if live.procs.running(n) and n not in live.procs.killed]
        keep = {f"w{i}" for i in range(min(BOOTSTRAP_NODES, self.workers - 1))}  # joining goes through them
        candidates = [n for n in alive if n not in keep] or [n for n in alive if n != "w0"]
        return max(candidates, key=lambda n: int(n[1:]))

    def poll(self, live: LiveRun) -> None:
        k = len(self.done)
        if k == self.events or time.monotonic() - self._read_at < _READ_EVERY_S:
            return
        self._read_at = time.monotonic()
        if trained_samples(live.workdir, self.system, live.workers) < self.thresholds[k]:
            return
        victim = self._victim(live, k)
        at_s = live.elapsed_s
        if self.system == "allreduce":
            self.done.append({"at_s": round(at_s, 3), "killed": victim, **self._restart(live, victim, k + 1)})
        else:
            self.done.append({"at_s": round(at_s, 3), "killed": victim, **self._replace(live, victim)})

    def _replace(self, live: LiveRun, victim: str) -> dict[str, Any]:
        """SIGKILL `victim`; start a newcomer with its shard from where its last snapshot was."""
        procs = live.procs
        line = _last_line(live.workdir / "snapshots" / f"{victim}.jsonl")
        procs.kill(victim)
        index = int(live.run["joiners"].get(victim, {}).get("index", victim[1:]))  # its shard
        name = f"w{self.workers + len(self.done)}"
        entry = dict(live.run["gossip_configs"][victim]["nodes"][0], name=name, port=free_ports(1)[0])
        live.run["gossip_configs"][name] = open_config(live.run["gossip_config"], name, entry)
        # where the victim was in its shard: a newcomer counts its samples from where it began
        done = int(live.run["joiners"].get(victim, {}).get("skip_samples", 0)) + (int(line["samples"]) if line else 0)
        live.run["joiners"][name] = {"skip_samples": done, "index": index}
        run_file = Path(live.run["run_file"])
        tmp = run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(live.run, indent=1))
        tmp.replace(run_file)  # the newcomer reads its config from it
        procs.start(name, "gossip", run_file, index)
        live.workers.append(name)
        return {"joined": name, "shard": index, "skip_samples": live.run["joiners"][name]["skip_samples"]}

    def _restart(self, live: LiveRun, victim: str, round_: int) -> dict[str, Any]:
        """SIGKILL `victim`, stop the other ranks, start every rank again in round `round_`."""
        procs = live.procs
        procs.kill(victim)
        ranks = [f"rank{i}" for i in range(self.workers)]
        others = [r for r in ranks if r != victim]
        t0 = time.monotonic()
        procs.stop(others, STOP_GRACE_S)  # started again below: their exit codes are not the run's
        run_file = Path(live.run["run_file"])
        env = {**live.env, ROUND_ENV: str(round_)}
        for i, rank in enumerate(ranks):
            procs.start(rank, "allreduce", run_file, i, env=env)
        return {"restarted": ranks, "round": round_, "stop_s": round(time.monotonic() - t0, 3)}

    def report(self) -> dict[str, Any]:
        return {"fault": f"churn: {self.events} leaving", "events": self.done, "planned_at_samples": self.thresholds}
