"""The comparison: run each system on the same workload, evaluate each by the same rule, inject the faults.

:func:`run_comparison` returns the report (the JSON's content); the command
(:mod:`.__main__`) prints it as a table and draws it.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..systems.layout import ModelLayout, ModuleView
from ..systems.ps.sharding import make_plan
from .evaluation import Point, build_curve, summarize
from .faults import fault_for
from .runner import SYSTEMS, RunOptions, SystemRun, run_system
from .workload import Workload, WorkloadSpec

__all__ = ["CompareConfig", "EVALUATED_MODEL", "FAULT_SCENARIOS", "run_comparison"]

EVALUATED_MODEL = {
    "gossip": "the mean of every node's parameters and buffers (each node's latest snapshot)",
    "symmetric": "the mean of every node's parameters and buffers (each node's latest snapshot)",
    "sync-master": "the master's global model",
    "async-ps": "the parameter servers' model (each server's shard)",
    "allreduce": "rank 0's model (every rank holds the same)",
}
FAULT_SCENARIOS = ("sync-master", "async-ps", "async-ps/trainer", "gossip", "symmetric", "allreduce")


@dataclass(frozen=True)
class CompareConfig:
    systems: tuple[str, ...]
    spec: WorkloadSpec
    options: RunOptions
    target_acc: float
    out_dir: Path
    faults: bool = False
    keep_snapshots: bool = False

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"unknown systems {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}")
        if len(set(self.systems)) != len(self.systems):
            raise ValueError(f"a system is listed twice: {', '.join(self.systems)}")
        if not 0 < self.target_acc <= 1:
            raise ValueError(f"the target accuracy must be in (0, 1], got {self.target_acc}")


def _ps_order(layout: ModelLayout, servers: int) -> np.ndarray:
    """For the servers' shards concatenated in server order: each element's index in the full state."""
    plan = make_plan(layout, servers)
    return np.concatenate([plan.state_index(k, layout.param_size) for k in range(servers)])


def _extras(run: SystemRun, options: RunOptions) -> dict[str, Any]:
    """What only one system has: the master's tasks, the servers' staleness, the gossip exchanges."""
    workers = [run.results[n] for n in run.workers if n in run.results]
    out: dict[str, Any] = {"processes_exited": {n: c for n, c in run.exit_codes.items()}}
    if run.system == "sync-master":
        master = run.results.get("master", {})
        out["tasks"] = master.get("tasks")
        out["num_gradients_sufficient"] = options.sufficient or "the live workers"
        out["reports_refused"] = sum(w["worker"]["reports_refused"] for w in workers)
        out["reports_accepted"] = sum(w["worker"]["reports_accepted"] for w in workers)
        out["tasks_failed_by_workers"] = sum(w["worker"]["tasks_failed"] for w in workers)
        computed = sum(w.get("computed_samples", 0) for w in workers)
        out["wasted_compute_fraction"] = 1 - sum(w["samples"] for w in workers) / computed if computed else None
        out["master_steps"] = master.get("steps")
    elif run.system == "async-ps":
        histogram: Counter[int] = Counter()
        for name, result in run.results.items():
            if name.startswith("ps"):
                histogram.update({int(k): int(n) for k, n in result["status"]["staleness"]})
        applied = sum(histogram.values())
        out["staleness"] = {
            "mean": sum(k * n for k, n in histogram.items()) / applied if applied else None,
            "max": max(histogram, default=None),
            "histogram": {str(k): n for k, n in sorted(histogram.items())},
            "unit": "block versions behind at apply time (updates applied to the block meanwhile)",
        }
        for key in ("pushes_dropped", "pushes_refused", "pushes_failed", "pulls_failed"):
            out[key] = sum(w["trainer"][key] for w in workers)
        out["io_threads_per_trainer"] = workers[0].get("io_threads") if workers else None
    elif run.system in ("gossip", "symmetric"):
        out["exchanges_averaged"] = sum(w.get("averaged", 0) for w in workers)
        out["exchanges_failed"] = sum(w.get("failed", 0) for w in workers)
        out["fetches_timed_out"] = {  # by worker that finished: each waited out timeout_ms (a dead peer's, say)
            n: int(run.results[n].get("stats", {}).get("fetches_timed_out", 0)) for n in run.workers if n in run.results
        }
    elif run.system == "allreduce":
        out["bytes_estimated"] = True
        out["bytes_note"] = "gloo counts no bytes: ring all-reduce of the gradients plus the buffer broadcast, computed"
        out["allreduce_s_per_worker"] = float(np.mean([w["comm_s"] for w in workers])) if workers else None
    return out


def _outcome(scenario: str, fault: dict[str, Any], summary: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    acc = summary.get("final_test_acc")
    base = baseline.get("final_test_acc") if baseline else None
    acc_text = "-" if acc is None else f"{100 * acc:.1f}%"
    if base is not None:
        acc_text += f" (without the fault: {100 * base:.1f}%)"
    done = "completed" if summary["completed"] else f"did not complete ({(summary.get('error') or '').splitlines()[0]})"
    if scenario == "sync-master":
        tasks = summary.get("tasks") or {}
        held = fault.get("held_task") or {}
        requeued = fault.get("requeued_after_s")
        back = "never went back to todo" if requeued is None else f"went back to todo {requeued:.1f} s after the kill"
        return (
            f"task {held.get('task')} ({held.get('reports_accepted')} reports accepted) {back}; the run {done}; "
            f"tasks done {tasks.get('done')}/{tasks.get('total')}, retried {tasks.get('retried')} "
            f"({tasks.get('expired')} after a lease expired, {tasks.get('failed')} failed after too many refused "
            f"reports), done twice {tasks.get('done_twice')}; final accuracy {acc_text}"
        )
    if scenario == "async-ps":
        return (
            f"trainers marked it down ({summary.get('pulls_failed')} pulls failed, {summary.get('pushes_dropped')} "
            f"pushes dropped, {summary.get('pushes_failed')} failed); its blocks kept their last values while the "
            f"other shards trained on; the run {done}; final accuracy {acc_text}"
        )
    if scenario in ("gossip", "symmetric"):
        timeouts = ", ".join(f"{n} {k}" for n, k in (summary.get("fetches_timed_out") or {}).items()) or "-"
        return (
            f"the other nodes trained on ({summary.get('exchanges_failed')} exchanges failed, "
            f"{summary.get('exchanges_averaged')} averaged; fetch timeouts per survivor: {timeouts}); the run "
            f"{done}; final accuracy of the survivors' mean {acc_text}"
        )
    if scenario == "allreduce":
        failed, killed = summary.get("failed_at_s"), fault.get("killed_at_s")
        after = f", {failed - killed:.1f} s after the kill" if failed is not None and killed else ""
        return f"the other ranks could not all-reduce: the run {done}{after}"
    return f"the run {done}; final accuracy {acc_text}"


def run_comparison(config: CompareConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every system of `config` (and the faults), evaluate them, return the report."""
    spec, options = config.spec, config.options
    work = config.out_dir / "work"
    workload = Workload(spec)
    evaluate = workload.evaluator()
    initial_view = ModuleView(workload.build_model())
    acc0, loss0 = evaluate(initial_view.state())
    initial = Point(0.0, 0, acc0, loss0)
    ps_order = _ps_order(initial_view.layout, options.ps_servers)
    every = workload.eval_every_samples
    report: dict[str, Any] = {
        "target_acc": config.target_acc,
        "workload": {
            **spec.as_dict(),
            "parameters": initial_view.layout.param_size,
            "buffer_values": initial_view.layout.buffer_size,
            "model_bytes": 4 * (initial_view.layout.param_size + initial_view.layout.buffer_size),
            "train_images": len(workload.data.train_y),
            "test_images": len(workload.data.test_y),
            "sample_budget": workload.total_samples,
            "eval_every_samples": every,
        },
        "options": asdict(options),
        "evaluated_model": {s: EVALUATED_MODEL[s] for s in config.systems},
        "evaluation_rule": (
            f"every system's model is evaluated on all {len(workload.data.test_y)} test images about every "
            f"{every} samples the cluster trained, after the run (see dpwa/compare/evaluation.py); times count "
            "from the moment every process was ready"
        ),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "systems": {},
    }

    def one(system: str, folder: str, run_spec: WorkloadSpec, fault: Any = None) -> tuple[SystemRun, dict[str, Any]]:
        t0 = time.monotonic()
        run = run_system(system, run_spec, options, work / folder, fault=fault, log=log)
        run.extra["ps_order"] = ps_order
        curve = build_curve(run, every, evaluate, initial)
        summary = summarize(run, curve, config.target_acc)
        summary.update(_extras(run, options))
        summary["evaluated_model"] = EVALUATED_MODEL[system]
        summary["run_wall_s"] = time.monotonic() - t0
        if not config.keep_snapshots:
            shutil.rmtree(run.workdir / "snapshots", ignore_errors=True)
        if run.error:
            log(f"  {system}: {run.error.splitlines()[0]}")
        return run, summary

    for system in config.systems:
        log(f"{system}: {spec.workers} workers, {spec.epochs} epochs of {workload.spec.data}")
        _, summary = one(system, system, spec)
        report["systems"][system] = summary
        acc = summary["final_test_acc"]
        log(
            f"  {system}: final accuracy {'-' if acc is None else f'{100 * acc:.1f}%'}, "
            f"trained {summary.get('train_time_s') or 0:.1f} s"
        )
    if config.faults:
        report["faults"] = {}
        plain = replace(spec, straggler=1.0)
        scenarios = [s for s in FAULT_SCENARIOS if s.split("/")[0] in config.systems]
        if "gossip" in scenarios and "symmetric" in scenarios:
            scenarios.remove("symmetric")  # one gossip node killed is enough
        for scenario in scenarios:
            system = scenario.split("/")[0]
            baseline = report["systems"].get(system)
            reference = (baseline or {}).get("train_time_s") or 5.0
            fault = fault_for(scenario, spec.workers, options.ps_servers, 0.4 * reference, initial_view.layout)
            log(f"fault: {fault.what}")
            _, summary = one(system, "fault-" + scenario.replace("/", "-"), plain, fault)
            entry = {**fault.report(), **{k: summary.get(k) for k in ("completed", "error", "final_test_acc")}}
            entry["train_time_s"] = summary.get("train_time_s")
            entry["summary"] = {k: v for k, v in summary.items() if k != "curve"}
            entry["outcome"] = _outcome(scenario, entry, summary, baseline if spec.straggler == 1 else None)
            report["faults"][scenario] = entry
            log(f"  {entry['outcome']}")
    return report
