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

from ..systems.allreduce import ring_allreduce_bytes
from ..systems.layout import ModelLayout, ModuleView
from ..systems.ps.sharding import make_plan
from .byzantine import ATTACKS
from .churn import CHURN_SYSTEMS, Churn, churns
from .evaluation import Point, build_curve, summarize
from .faults import fault_for
from .links import BURST_BYTES
from .runner import COLLECTIVE, RunOptions, SystemRun, is_gossip, run_system
from .workload import WorkloadSpec, load_workload

__all__ = [
    "GOSSIP_TIMEOUT_RULE",
    "CompareConfig",
    "EVALUATED_MODEL",
    "FAULT_SCENARIOS",
    "evaluated_model",
    "fault_scenarios",
    "gossip_timeout_ms",
    "link_check",
    "run_comparison",
    "weighted_by_mass",
]

WEIGHTED_MEAN = (
    "the mean of every node's parameters and buffers (each node's latest snapshot), each node weighted by its "
    "push-sum weight (its rule's mass; the final point by the weight it held after lingering)"
)
GOSSIP_MEAN = "the mean of every node's parameters and buffers (each node's latest snapshot)"
EVALUATED_MODEL = {  # every other gossip system's, a variant's too: GOSSIP_MEAN (evaluated_model())
    "gossip": GOSSIP_MEAN,
    "gossip-pushsum": WEIGHTED_MEAN,  # lab/dpwa_lab/compare/evaluation.py, *Push-sum*: what the exchanges keep
    "sync-master": "the master's global model",
    "async-ps": "the parameter servers' model (each server's shard)",
    "allreduce": "rank 0's model (every rank holds the same)",
    "diloco": "rank 0's model after a synchronisation (the anchor every rank shares)",
}
FAULT_SCENARIOS = ("sync-master", "async-ps", "async-ps/trainer", "gossip", "allreduce", "diloco")
LINK_CHECK_HIGH = 1.5  # measured / expected time in the all-reduce per step, at most, at the shaped rate


def evaluated_model(system: str) -> str:
    """What is evaluated of a run of `system` (before what the run shows: push-sum's weights, Byzantine nodes)."""
    return EVALUATED_MODEL.get(system, GOSSIP_MEAN if is_gossip(system) else "")


def fault_scenarios(systems: tuple[str, ...]) -> list[str]:
    """The --faults scenarios for `systems`, in FAULT_SCENARIOS' order. One gossip node killed is enough: in
    the first gossip system run (``gossip`` itself when it runs)."""
    gossips = sorted((s for s in systems if is_gossip(s)), key=lambda s: s != "gossip")
    out = []
    for scenario in FAULT_SCENARIOS:
        if scenario == "gossip":
            out += gossips[:1]
        elif scenario.split("/")[0] in systems:
            out.append(scenario)
    return out


@dataclass(frozen=True)
class CompareConfig:
    systems: tuple[str, ...]
    spec: WorkloadSpec
    options: RunOptions
    target: float  # test accuracy to reach (images), or validation loss in nats per character (charlm)
    out_dir: Path
    faults: bool = False
    keep_snapshots: bool = False

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in self.options.known_systems]
        if unknown or not self.systems:
            known = ", ".join(self.options.known_systems)
            raise ValueError(f"unknown systems {', '.join(unknown) or '(none)'}; choose from {known}")
        if len(set(self.systems)) != len(self.systems):
            raise ValueError(f"a system is listed twice: {', '.join(self.systems)}")
        if self.metric == "acc" and not 0 < self.target <= 1:
            raise ValueError(f"the target accuracy must be in (0, 1], got {self.target}")
        if self.metric == "loss" and not 0 < self.target < 100:
            raise ValueError(f"the target loss must be in (0, 100) nats per character, got {self.target}")
        if self.options.byzantine:
            others = [s for s in self.systems if not is_gossip(s)]
            if others:
                raise ValueError(f"--byzantine is for the gossip systems only, not {', '.join(others)}")
            if 2 * self.options.byzantine >= self.spec.workers:
                raise ValueError(
                    f"--byzantine {self.options.byzantine} of {self.spec.workers} workers: Byzantine workers must "
                    "be fewer than half"
                )
            if self.faults:
                raise ValueError("--faults with --byzantine is not supported: the fault would kill a Byzantine node")
        if self.options.churn:
            others = [s for s in self.systems if not churns(s)]
            if others:
                raise ValueError(
                    f"--churn runs {', '.join(CHURN_SYSTEMS)} (members leave and join; all-reduce restarts as "
                    f"under torchrun --max-restarts), not {', '.join(others)}"
                )
            if self.faults:
                raise ValueError("--churn with --faults: churn kills workers already; give one of them")
        if self.faults and self.options.link_mbit:
            raise ValueError(
                "--faults with --link-mbit is not supported: the sync-master fault asks the master over its socket, "
                "which sits in a namespace of its own"
            )

    @property
    def metric(self) -> str:
        """acc (higher is better: images) or loss (lower is better: charlm)."""
        return "loss" if self.spec.workload == "charlm" else "acc"


#: how the gossip systems' deadline grows on shaped links (recorded with every regime map's cells)
GOSSIP_TIMEOUT_RULE = "max(gossip_timeout_ms, 1000 + 4 transfers of the model at the rate + 20 one-way delays) ms"


def gossip_timeout_ms(options: RunOptions, model_bytes: int) -> int:
    """The gossip systems' fetch deadline on shaped links (:data:`GOSSIP_TIMEOUT_RULE`).

    A fetch moves one model over the server's link: allow four at once, and a second. Over a delay D each
    way a fetch or an exchange on a fresh or idle TCP connection takes about ten round trips: the TCP and
    ZeroMQ handshakes, the request, the model in TCP slow start (a window that doubles each round trip
    from about 14 KB), and the exchange's confirm: 20 D. The first regime map ran without that term, with
    1 s: at D = 100 ms every exchange failed (docs/comparison.md)."""
    transfer_ms = model_bytes * 8 / (options.link_mbit * 1e6) * 1000
    return max(options.gossip_timeout_ms, int(1000 + 4 * transfer_ms + 20 * options.link_delay_ms))


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
    elif is_gossip(run.system):
        out["exchanges_averaged"] = sum(w.get("averaged", 0) for w in workers)
        out["exchanges_failed"] = sum(w.get("failed", 0) for w in workers)
        out["fetches_timed_out"] = {  # by worker that finished: each waited out timeout_ms (a dead peer's, say)
            n: int(run.results[n].get("stats", {}).get("fetches_timed_out", 0)) for n in run.workers if n in run.results
        }
        if weighted_by_mass(run):  # push-sum: each node's weight at the end, and their sum (n less what was lost)
            masses = {n: run.results[n].get("mass_at_end") for n in run.workers if n in run.results}
            out["mass_at_end"] = masses
            # what push-sum minted to keep a node at its floor (FLOOR): the mass beyond the nodes' count
            out["minted_at_end"] = sum(
                run.results[n].get("minted_at_end", 0.0) for n in run.workers if n in run.results
            )
            out["mass_sum_at_end"] = sum(m for m in masses.values() if m is not None)
    elif run.system == "allreduce":
        out["bytes_estimated"] = True
        out["bytes_note"] = "gloo counts no bytes: ring all-reduce of the gradients plus the buffer broadcast, computed"
        out["allreduce_s_per_worker"] = float(np.mean([w["comm_s"] for w in workers])) if workers else None
    elif run.system == "diloco":
        out["bytes_estimated"] = True
        out["bytes_note"] = (
            "gloo counts no bytes: ring all-reduce of the pseudo-gradient and buffers per sync, computed"
        )
        out["allreduce_s_per_worker"] = float(np.mean([w["comm_s"] for w in workers])) if workers else None
        out["period"] = options.diloco_period
        out["outer"] = {"lr": options.outer_lr, "momentum": options.outer_momentum, "nesterov": True}
        out["syncs"] = workers[0].get("syncs") if workers else None
    if "links" in run.extra:
        out["links"] = run.extra["links"]
    return out


def weighted_by_mass(run: SystemRun) -> bool:
    """Whether a gossip run's nodes held masses other than 1 (push-sum's weights), so that its mean was weighted."""
    if not is_gossip(run.system):
        return False
    lines = [line for shots in run.snapshots.values() for line in shots]
    ends = [r.get("mass_at_end") for n, r in run.results.items() if n in run.workers]
    return any(m is not None and m != 1.0 for m in [line.get("mass") for line in lines] + ends)


def link_check(run: SystemRun, rate_mbit: float, delay_ms: float = 0.0) -> dict[str, Any] | None:
    """Is a collective run's time in the all-reduce what its bytes take at `rate_mbit`? (None: nothing to check.)

    A ring all-reduce of B bytes over n ranks has each rank send 2 (n-1)/n B and
    receive as much, at the same time, over its own link: at R bit/s each way
    that takes 2 (n-1)/n B * 8 / R seconds (*expected*), less what the token
    bucket's burst lets through at once (the *floor*: tbf passes up to
    BURST_BYTES without waiting after an idle moment). With a delay D on the
    links (one way between two hosts), a ring all-reduce also waits for its
    2 (n-1) transfers in sequence, each D late: 2 (n-1) D per all-reduce is
    added to both. The measured time inside
    the all-reduce also holds TCP/IP headers (about 4%), the ring's 2 (n-1)
    round trips, and waiting for the slowest rank. For all-reduce (one
    all-reduce per step, after every rank's backward pass) it is *consistent*
    when it lies between the floor and 1.5 times expected, per step. DiLoCo's
    numbers are per synchronisation, with no verdict: there the wait for the
    slowest rank after H steps of its own can be as large as the transfer.
    """
    ranks = [run.results[n] for n in run.workers if n in run.results]
    ranks = [r for r in ranks if r.get("steps") and r.get("reduced_bytes") and r.get("allreduce_calls")]
    if not ranks:
        return None
    world = len(run.workers)
    steps = float(np.mean([r["steps"] for r in ranks]))
    calls = float(np.mean([r["allreduce_calls"] for r in ranks]))
    per_step = run.system == "allreduce"
    units = steps if per_step else calls
    calls_per_unit = calls / units
    reduced = float(np.mean([r["reduced_bytes"] for r in ranks])) / units
    sent = ring_allreduce_bytes(int(reduced), world) / 2  # each way
    bits_per_s = rate_mbit * 1e6
    latency_s = calls_per_unit * 2 * (world - 1) * delay_ms / 1000  # the ring's transfers in sequence, each D late
    expected_s = sent * 8 / bits_per_s + latency_s
    floor_s = max(0.0, sent - calls_per_unit * BURST_BYTES) * 8 / bits_per_s + latency_s
    measured_s = float(np.mean([r["comm_s"] for r in ranks])) / units
    out: dict[str, Any] = {
        "rate_mbit": rate_mbit,
        "delay_ms": delay_ms,
        "latency_s": latency_s,
        "unit": "step" if per_step else "synchronisation",
        "reduced_bytes": reduced,
        "sent_bytes": sent,
        "expected_comm_s": expected_s,
        "floor_comm_s": floor_s,
        "measured_comm_s": measured_s,
        "ratio": measured_s / expected_s if expected_s > 0 else None,
        "compute_s_per_step": float(np.mean([r["compute_s"] for r in ranks])) / steps,
        "step_s": float(np.mean([r["run_s"] for r in ranks])) / steps,
    }
    if per_step:
        out["consistent"] = floor_s <= measured_s <= LINK_CHECK_HIGH * expected_s
        out["rule"] = f"the floor <= measured <= {LINK_CHECK_HIGH} x expected time in the all-reduce per step"
    else:
        out["consistent"] = None
        out["rule"] = "no verdict: the time includes waiting for the slowest rank after a period of its own"
    return out


def _metric_value(summary: dict[str, Any]) -> str | None:
    if summary.get("final_test_acc") is not None:
        return f"{100 * summary['final_test_acc']:.1f}%"
    if summary.get("final_val_loss") is not None:
        return f"{summary['final_val_loss']:.3f} nats/char"
    return None


def _outcome(scenario: str, fault: dict[str, Any], summary: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    name = "validation loss" if "final_val_loss" in summary else "accuracy"
    acc_text = _metric_value(summary) or "-"
    base = _metric_value(baseline) if baseline else None
    if base is not None:
        acc_text += f" (without the fault: {base})"
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
            f"reports), done twice {tasks.get('done_twice')}; final {name} {acc_text}"
        )
    if scenario == "async-ps":
        return (
            f"trainers marked it down ({summary.get('pulls_failed')} pulls failed, {summary.get('pushes_dropped')} "
            f"pushes dropped, {summary.get('pushes_failed')} failed); its blocks kept their last values while the "
            f"other shards trained on; the run {done}; final {name} {acc_text}"
        )
    if is_gossip(scenario):
        timeouts = ", ".join(f"{n} {k}" for n, k in (summary.get("fetches_timed_out") or {}).items()) or "-"
        return (
            f"the other nodes trained on ({summary.get('exchanges_failed')} exchanges failed, "
            f"{summary.get('exchanges_averaged')} averaged; fetch timeouts per survivor: {timeouts}); the run "
            f"{done}; final {name} of the survivors' mean {acc_text}"
        )
    if scenario in ("allreduce", "diloco"):
        failed, killed = summary.get("failed_at_s"), fault.get("killed_at_s")
        after = f", {failed - killed:.1f} s after the kill" if failed is not None and killed else ""
        return f"the other ranks could not all-reduce: the run {done}{after}"
    return f"the run {done}; final {name} {acc_text}"


def run_comparison(config: CompareConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every system of `config` (and the faults), evaluate them, return the report."""
    spec, options = config.spec, config.options
    work = config.out_dir / "work"
    workload = load_workload(spec)
    evaluate = workload.evaluator()
    initial_view = ModuleView(workload.build_model())
    acc0, loss0 = evaluate(initial_view.state())
    initial = Point(0.0, 0, acc0, loss0)
    ps_order = _ps_order(initial_view.layout, options.ps_servers)
    every = workload.eval_every_samples
    model_bytes = 4 * (initial_view.layout.param_size + initial_view.layout.buffer_size)
    if options.link_mbit:
        options = replace(options, gossip_timeout_ms=gossip_timeout_ms(options, model_bytes))
    target_key = "target_acc" if config.metric == "acc" else "target_loss"
    report: dict[str, Any] = {
        target_key: config.target,
        "metric": "test_acc" if config.metric == "acc" else "val_loss",
        "workload": {
            **spec.as_dict(),
            "parameters": initial_view.layout.param_size,
            "buffer_values": initial_view.layout.buffer_size,
            "model_bytes": model_bytes,
            **workload.describe(),
            "sample_budget": workload.total_samples,
            "eval_every_samples": every,
        },
        "options": asdict(options),
        "links": None,
        "evaluated_model": {s: evaluated_model(s) for s in config.systems},
        "evaluation_rule": (
            f"every system's model is evaluated on {workload.evaluated_on} about every "
            f"{every} samples the cluster trained, after the run (see lab/dpwa_lab/compare/evaluation.py); times count "
            "from the moment every process was ready"
        ),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_start": list(os.getloadavg()),
        },
        "systems": {},
    }
    report["byzantine"] = options.byzantine  # Byzantine workers per gossip system (0: none)
    report["attack"] = options.attack if options.byzantine else None
    if options.byzantine:
        report["byzantine_attack"] = (
            f"the last {options.byzantine} of {spec.workers} workers of every gossip system train as the others "
            f"do, but every snapshot they publish is wrong: {ATTACKS[options.attack]}; the curves evaluate the "
            "mean of the honest nodes only (see lab/dpwa_lab/compare/byzantine.py)"
        )
    if options.link_mbit:
        report["links"] = {
            "rate_mbit": options.link_mbit,
            "delay_ms": options.link_delay_ms,
            "what": (
                "every process in its own network namespace, routed through a hub that holds every packet "
                f"{options.link_delay_ms:g} ms in a userspace delay line (a round trip: {2 * options.link_delay_ms:g} "
                "ms more)"
                if options.link_delay_ms
                else "every process in its own network namespace on one bridge"
            )
            + "; each host's link shaped to the rate in each direction by tc tbf (see lab/dpwa_lab/compare/links.py)",
        }
        report["link_check"] = {}

    def one(system: str, folder: str, run_spec: WorkloadSpec, fault: Any = None) -> tuple[SystemRun, dict[str, Any]]:
        t0 = time.monotonic()
        run = run_system(system, run_spec, options, work / folder, fault=fault, log=log)
        run.extra["ps_order"] = ps_order
        curve = build_curve(run, every, evaluate, initial)
        summary = summarize(run, curve, config.target, config.metric)
        summary.update(_extras(run, options))
        weighted = weighted_by_mass(run)  # push-sum, as gossip-pushsum or through --gossip-set
        summary["evaluated_model"] = WEIGHTED_MEAN if weighted else evaluated_model(system)
        if run.byzantine:
            honest = [n for n in run.workers if n not in run.byzantine]
            summary["evaluated_model"] = (
                f"the mean of the honest nodes' parameters and buffers ({', '.join(honest)}; each node's latest "
                f"snapshot), the Byzantine nodes ({', '.join(run.byzantine)}) left out"
                + ("; each honest node weighted by its push-sum weight" if weighted else "")
            )
            summary["byzantine_workers"] = run.byzantine
            summary["wrong_snapshots_published"] = {
                n: run.results[n].get("published_wrong") for n in run.byzantine if n in run.results
            }
        summary["run_wall_s"] = time.monotonic() - t0
        if not config.keep_snapshots:
            shutil.rmtree(run.workdir / "snapshots", ignore_errors=True)
        if run.error:
            log(f"  {system}: {run.error.splitlines()[0]}")
        return run, summary

    if options.churn:
        report["churn"] = {
            "leaving": options.churn,
            "what": (
                f"{options.churn} workers leave (SIGKILL) as the run trains, at 1/{options.churn + 1} of its samples "
                "and every such fraction after; gossip: each replaced at once by a newcomer that joins through "
                "bootstrap addresses and takes a member's state (open membership, pairing random); all-reduce: "
                "every rank restarted from rank 0's last checkpoint, as under torchrun --max-restarts (see "
                "lab/dpwa_lab/compare/churn.py)"
            ),
            "events": {},
        }
    for system in config.systems:
        log(f"{system}: {spec.workers} workers, {_budget(spec)} of {workload.spec.data}")
        churn = Churn(system, options.churn, spec.workers, workload.total_samples) if options.churn else None
        run, summary = one(system, system, spec, churn)
        if churn is not None:
            summary["churn"] = report["churn"]["events"][system] = churn.done
            for event in churn.done:
                log(f"  {system}: at {event['at_s']:.1f} s {event['killed']} left; " + _churn_text(event))
        report["systems"][system] = summary
        report["evaluated_model"][system] = summary["evaluated_model"]
        if options.link_mbit and system in COLLECTIVE:
            report["link_check"][system] = link_check(run, options.link_mbit, options.link_delay_ms)
        log(f"  {system}: {_final_text(summary, config.metric)}, trained {summary.get('train_time_s') or 0:.1f} s")
    if config.faults:
        report["faults"] = {}
        plain = replace(spec, straggler=1.0)
        scenarios = fault_scenarios(config.systems)
        for scenario in scenarios:
            system = scenario.split("/")[0]
            baseline = report["systems"].get(system)
            reference = (baseline or {}).get("train_time_s") or 5.0
            fault = fault_for(scenario, spec.workers, options.ps_servers, 0.4 * reference, initial_view.layout)
            log(f"fault: {fault.what}")
            _, summary = one(system, "fault-" + scenario.replace("/", "-"), plain, fault)
            final_key = "final_test_acc" if config.metric == "acc" else "final_val_loss"
            entry = {**fault.report(), **{k: summary.get(k) for k in ("completed", "error", final_key)}}
            entry["train_time_s"] = summary.get("train_time_s")
            entry["summary"] = {k: v for k, v in summary.items() if k != "curve"}
            entry["outcome"] = _outcome(scenario, entry, summary, baseline if spec.straggler == 1 else None)
            report["faults"][scenario] = entry
            log(f"  {entry['outcome']}")
    return report


def _churn_text(event: dict[str, Any]) -> str:
    if "joined" in event:
        return f"{event['joined']} joined with its shard from sample {event['skip_samples']}"
    return f"every rank restarted (round {event['round']}; the others stopped in {event['stop_s']:.1f} s)"


def _budget(spec: WorkloadSpec) -> str:
    return f"{spec.steps} steps each" if spec.steps else f"{spec.epochs} epochs"


def _final_text(summary: dict[str, Any], metric: str) -> str:
    if metric == "acc":
        acc = summary.get("final_test_acc")
        return f"final accuracy {'-' if acc is None else f'{100 * acc:.1f}%'}"
    loss = summary.get("final_val_loss")
    return f"final validation loss {'-' if loss is None else f'{loss:.3f} nats/char'}"
