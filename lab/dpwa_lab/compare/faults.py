"""Faults injected into a run while it trains, and what each system did about them.

Each fault kills one process with SIGKILL (no goodbye, as a crash or a lost
machine) once the run has trained for a while, and records what followed:

* ``sync-master``: a worker killed while it holds a task with at least one
  accepted report. The master should put the task back in todo when its
  lease expires (measured: how long after the kill), hand it to another
  worker, and finish every task exactly once.
* ``async-ps``: a parameter server killed. Trainers mark it down; its blocks
  keep their last values, pushes to it are dropped; training goes on with
  the other shards. And a trainer killed: nobody waits for it.
* ``gossip``: a node killed. The others' fetches from it fail, flow control
  stops asking it, they finish.
* ``allreduce``, ``diloco``: a rank killed. The others fail at their next
  all-reduce (DiLoCo's: at the next synchronisation).
"""

from __future__ import annotations

import time
from typing import Any

from dpwa.wire.errors import TransportError

from ..systems.layout import ModelLayout
from ..systems.sync.client import MasterClient
from ..systems.sync.master import Refusal
from .roles.sync import OBSERVER
from .runner import LiveRun, is_gossip

__all__ = ["FAULTS", "KillProcess", "KillSyncWorkerMidTask", "fault_for"]


class KillProcess:
    """SIGKILL process `victim` once `after_s` passed since the start (and `ready(run)`, if given, holds)."""

    def __init__(self, victim: str, after_s: float, what: str) -> None:
        self.victim = victim
        self.after_s = after_s
        self.what = what
        self.killed_at_s: float | None = None
        self.notes: dict[str, Any] = {}

    def ready(self, run: LiveRun) -> bool:
        return True

    def poll(self, run: LiveRun) -> None:
        if self.killed_at_s is None and run.elapsed_s >= self.after_s and self.ready(run):
            if run.procs.kill(self.victim):
                self.killed_at_s = run.elapsed_s
            else:
                self.killed_at_s = -1.0  # it had ended already: nothing to measure
                self.notes["victim_had_ended"] = True
        elif self.killed_at_s is not None:
            self.after_kill(run)

    def after_kill(self, run: LiveRun) -> None:
        pass

    def report(self) -> dict[str, Any]:
        return {"fault": self.what, "killed": self.victim, "killed_at_s": self.killed_at_s, **self.notes}


class KillSyncWorkerMidTask(KillProcess):
    """Kill a sync worker while it holds a task with an accepted report; time the task's return to todo."""

    def __init__(self, victim: str, after_s: float, layout: ModelLayout) -> None:
        super().__init__(victim, after_s, "a sync worker killed mid-task")
        self._layout = layout
        self._client: MasterClient | None = None
        self._held: list[int] | None = None
        self._expired_before = 0
        self._last_poll = 0.0

    def _status(self, run: LiveRun) -> dict[str, Any] | None:
        if self._client is None:
            # Patient enough for a master busy with gradients on a loaded machine, and within half a
            # lease: the frozen victim's task must still be held when the second look is answered.
            wait_s = max(0.5, run.run["options"]["lease_s"] / 2)
            self._client = MasterClient(
                run.run["options"]["endpoint"], OBSERVER, self._layout, timeout_s=wait_s, unreachable_s=wait_s
            )
        try:
            return self._client.status()
        except (TransportError, Refusal):
            return None

    def _held_task(self, status: dict[str, Any] | None) -> list[int] | None:
        """The first task the victim holds with at least one accepted report, per `status`."""
        if status is None:
            return None
        return next((t for t in status["holders"].get(self.victim, []) if t[1] >= 1), None)

    def _missed(self, why: str) -> bool:
        """Count a look that found nothing to kill, by why (in the report: a run without a kill says why)."""
        misses = self.notes.setdefault("looks_missed", {})
        misses[why] = misses.get(why, 0) + 1
        return False

    def ready(self, run: LiveRun) -> bool:
        status = self._status(run)
        if status is None:
            return self._missed("no_status")
        if self._held_task(status) is None:
            return self._missed("not_mid_task")
        # The victim may finish that task between our look and the kill: freeze it, look again, and
        # kill only what is still mid-task (else let it go on and try again later).
        if not run.procs.pause(self.victim):
            return self._missed("victim_ended")
        status = self._status(run)
        held = self._held_task(status)
        if held is None or status is None:
            run.procs.resume(self.victim)
            return self._missed("no_status_frozen" if status is None else "moved_on_frozen")
        self._held = held
        self._expired_before = status["expired"]
        self.notes["held_task"] = {"task": held[0], "reports_accepted": held[1]}
        return True

    def after_kill(self, run: LiveRun) -> None:
        if "requeued_after_s" in self.notes or self._held is None or time.monotonic() - self._last_poll < 0.1:
            return
        self._last_poll = time.monotonic()
        status = self._status(run)
        if status is not None and status["expired"] > self._expired_before:
            assert self.killed_at_s is not None
            self.notes["requeued_after_s"] = run.elapsed_s - self.killed_at_s
            self.notes["live_after"] = status["live"]
            self.notes["sufficient_after"] = status["sufficient"]

    def report(self) -> dict[str, Any]:
        if self._client is not None:
            self._client.close()
            self._client = None
        return super().report()


GOSSIP_FAULT = ("w{last}", "a gossip node killed")  # every gossip system's, a variant's too
FAULTS = {  # system -> (victim, description); sync-master's is KillSyncWorkerMidTask
    "gossip": GOSSIP_FAULT,
    "async-ps": ("ps{last_server}", "a parameter server killed"),
    "async-ps/trainer": ("w{last}", "a parameter-server trainer killed"),
    "allreduce": ("rank{last}", "an all-reduce rank killed"),
    "diloco": ("rank{last}", "a DiLoCo rank killed"),
}


def fault_for(scenario: str, workers: int, servers: int, after_s: float, layout: ModelLayout) -> KillProcess:
    """The fault of `scenario` (a system, or ``async-ps/trainer``) for a run of `workers` workers."""
    if scenario == "sync-master":
        return KillSyncWorkerMidTask(f"w{workers - 1}", after_s, layout)
    victim, what = GOSSIP_FAULT if is_gossip(scenario) else FAULTS[scenario]
    return KillProcess(victim.format(last=workers - 1, last_server=servers - 1), after_s, what)
