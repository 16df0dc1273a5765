"""Curves (accuracy, or validation loss): which model of a run is evaluated, and when; time and samples to a target.

**The rule, the same for every system.** A curve's points sit about every
``eval_every_samples`` samples trained by the whole cluster (accepted or
applied samples: a refused gradient trains nothing). At each point the
evaluated model is the one the system would hand a user at that moment:

* ``sync-master``: the master's global model, the first time its applied
  samples reach the point;
* ``async-ps``: the servers' model, each server's shard taken the first time
  every block it holds has applied the point's samples (a dead server's
  last shard stands in for it);
* ``allreduce``: rank 0's model (every rank holds the same), after the step
  that reaches the point;
* ``diloco``: rank 0's model right after the first synchronisation that
  reaches the point (the anchor every rank shares; between synchronisations
  each rank holds its own), and after the final synchronisation;
* ``gossip``, ``gossip-lowbw``, ``gossip-original``, ``gossip-noloco``, ``gossip-pushsum``: the mean of every
  node's parameters and buffers, each node's latest snapshot at the moment the nodes' trained samples summed
  to the point (a node snapshots every few steps, so its snapshot is at most
  that old; a killed node counts until it was killed), each node weighted by
  its rule's mass (see *Push-sum* below: 1, so a plain mean, for every rule
  but push-sum). With Byzantine workers
  (``--byzantine K``) the mean is the honest nodes' only: the Byzantine
  nodes' snapshots are left out, while the samples they trained still count
  towards the points (every node trains; the Byzantine ones publish wrong
  snapshots).

**Push-sum.** A push-sum node (``rule: pushsum``) keeps its parameters
de-biased: it holds x_i, the estimate it trains and publishes, and its weight
w_i only as a number beside it (it never holds the biased w_i x_i). A pull
moves mass, ``x_i = (w_i x_i + g s_j) / (w_i + g)``, ``w_i += g``, while the
server keeps its parameters and halves its weight: what every exchange keeps
is ``sum w x`` and ``sum w``, so the quantity the nodes agree on is the
weighted mean ``sum w_i x_i / sum w_i``. The plain mean is not kept: one pull
moves ``x_i`` towards ``s_j`` and leaves ``x_j`` where it was, so
``sum x`` shifts by ``f (s_j - x_i)`` (a node whose weight was halved by
serving many pulls has its parameters counted in full). So the gossip mean
weights each node by the mass recorded with its snapshot (read right after
the state, on the node's training thread), and the final point by each node's
mass after it lingered: in mode pull a lingering node's parameters no longer
move, but serving the nodes still training halves its weight each time, mass
that the final snapshots of those nodes already hold (weighted by the masses at
their final snapshots, it would be counted twice). What these weights do not
hold is mass in flight (served, not yet blended) and mass lost with a reply
that never arrived; both only change which convex combination of the
nodes' models is taken. For every other rule the mass is 1, and the mean is
the plain mean, exactly as before (the same sum, divided by the count). This
is the mean the simulator keeps (``dpwa_lab.sim``, ``Gossip.mean``).

Every model is evaluated after its run, in the runner's process, so
evaluation never competes with training: on the whole test set (images), or
on fixed windows of the validation text (charlm). The time of a
point is measured from the start gate, so start-up is not counted. The last
point of each curve is the system's final model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .runner import SystemRun, is_gossip

__all__ = ["LearningCurve", "Point", "build_curve", "summarize"]

Evaluate = Callable[[np.ndarray], tuple[float, float]]


@dataclass
class Point:
    t_s: float  # from the start gate
    samples: int
    acc: float = 0.0
    loss: float = 0.0


@dataclass
class LearningCurve:
    points: list[Point] = field(default_factory=list)

    def first_reaching(self, target: float, metric: str = "acc") -> Point | None:
        """The first point whose accuracy is at least `target` (metric "acc"), or whose loss is at most it ("loss")."""
        if metric not in ("acc", "loss"):
            raise ValueError(f"metric must be acc or loss, got {metric!r}")
        for p in self.points:
            if (p.acc >= target) if metric == "acc" else (math.isfinite(p.loss) and p.loss <= target):
                return p
        return None

    @property
    def final(self) -> Point | None:
        return self.points[-1] if self.points else None


def _load(run: SystemRun, line: dict[str, Any]) -> np.ndarray:
    return np.load(run.workdir / "snapshots" / line["file"], allow_pickle=False)


def _states_gossip(run: SystemRun, every: int) -> list[tuple[float, int, Callable[[], np.ndarray]]]:
    """(time, samples, state) per point: the mean of each honest node's latest snapshot when the nodes' samples
    (every node's, the Byzantine ones' too) sum to it."""
    nodes = [n for n in run.workers if run.snapshots.get(n)]
    honest = [n for n in nodes if n not in run.byzantine]
    if not honest:
        return []
    events: list[tuple[float, int, str]] = []  # (time, samples of that node so far, node)
    for n in nodes:
        progress = run.results.get(n, {}).get("progress")
        if progress:
            events += [(t, int(s), n) for t, s in progress]
        else:  # killed before it wrote its results: its snapshots say how far it got
            events += [(line["t"], int(line["samples"]), n) for line in run.snapshots[n]]
    events.sort()
    shots = {n: sorted(run.snapshots[n], key=lambda line: line["t"]) for n in nodes}
    times = {n: [line["t"] for line in shots[n]] for n in nodes}
    finished = {n for n in nodes if n in run.results}
    out: list[tuple[float, int, Callable[[], np.ndarray]]] = []
    current = dict.fromkeys(nodes, 0)
    total, point = 0, 1
    for t, s, n in events:
        total += s - current[n]
        current[n] = s
        if total < point * every:
            continue
        chosen = []
        for m in honest:
            i = bisect.bisect_right(times[m], t) - 1
            alive = m in finished or times[m][-1] >= t  # a killed node counts until its last snapshot
            if i >= 0 and alive:
                chosen.append(shots[m][i])
        if chosen:
            out.append((t, total, _mean_of(run, chosen)))
        point = total // every + 1
    ended = [n for n in honest if n in finished and shots[n][-1].get("final")]
    if ended:
        t_end = max(shots[n][-1]["t"] for n in ended)
        # each node's final state, weighted by its mass after it lingered (push-sum: less what it gave away)
        finals = [{**shots[n][-1], **_mass_at_end(run.results[n])} for n in ended]
        out.append((t_end, total, _mean_of(run, finals)))  # every node's samples, a killed one's until it died
    return out


def _mass_at_end(result: dict[str, Any]) -> dict[str, Any]:
    """{"mass": the node's mass after it lingered}, or {} when its result has none."""
    mass = result.get("mass_at_end")
    return {} if mass is None else {"mass": mass}


def _mass(line: dict[str, Any]) -> float:
    """The mass a gossip snapshot was recorded with (1 when it has none: written before masses were recorded)."""
    mass = line.get("mass", 1.0)
    return float(mass) if isinstance(mass, int | float) and math.isfinite(mass) and mass >= 0 else 1.0


def _mean_of(run: SystemRun, lines: list[dict[str, Any]]) -> Callable[[], np.ndarray]:
    """The mean of the snapshots in `lines`, each weighted by its node's mass (module docstring: *Push-sum*);
    with every mass 1 (every rule but push-sum), exactly the plain mean. Should the masses sum to 0, the plain
    mean."""

    def load() -> np.ndarray:
        masses = [_mass(line) for line in lines]
        if not sum(masses) > 0:
            masses = [1.0] * len(lines)
        total = None
        for line, mass in zip(lines, masses, strict=True):
            state = _load(run, line).astype(np.float64)
            if mass != 1.0:
                state *= mass
            total = state if total is None else total + state
        assert total is not None
        return (total / sum(masses)).astype(np.float32)

    return load


def _states_single(run: SystemRun, name: str) -> list[tuple[float, int, Callable[[], np.ndarray]]]:
    lines = sorted(run.snapshots.get(name, []), key=lambda line: line["t"])
    return [(line["t"], int(line["samples"]), _loader(run, line)) for line in lines]


def _loader(run: SystemRun, line: dict[str, Any]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        return _load(run, line)

    return load


def _states_ps(run: SystemRun, every: int) -> list[tuple[float, int, Callable[[], np.ndarray]]]:
    servers = sorted((n for n in run.snapshots if n.startswith("ps")), key=lambda n: int(n[2:]))
    shots = {n: sorted(run.snapshots[n], key=lambda line: line["samples"]) for n in servers}
    shots = {n: s for n, s in shots.items() if s}
    if len(shots) != len(servers) or not servers:
        return []
    top = max(int(line["samples"]) for s in shots.values() for line in s)
    out: list[tuple[float, int, Callable[[], np.ndarray]]] = []
    for target in range(every, top + 1, every):
        chosen = []
        for n in servers:
            reached = [line for line in shots[n] if line["samples"] >= target]
            chosen.append(reached[0] if reached else shots[n][-1])  # a dead server: its last shard
        live = [line for line in chosen if line["samples"] >= target]
        if not live:
            continue
        out.append((max(line["t"] for line in live), min(int(line["samples"]) for line in live), _join(run, chosen)))
    finals = [shots[n][-1] for n in servers]
    ends = [r["go"] + r["run_s"] for n, r in run.results.items() if n in run.workers and "run_s" in r]
    t_end = max(ends) if ends else max(line["t"] for line in finals)  # the servers stop later, when told
    out.append((t_end, max(int(line["samples"]) for line in finals), _join(run, finals)))
    return out


def _join(run: SystemRun, lines: list[dict[str, Any]]) -> Callable[[], np.ndarray]:
    """The servers' shards (in server order) put back in the layout's order, by the plan."""

    def load() -> np.ndarray:
        order = run.extra["ps_order"]  # state index of each element of the servers' shards, concatenated
        shards = np.concatenate([_load(run, line) for line in lines])
        state = np.empty_like(shards)
        state[order] = shards
        return state

    return load


def states(run: SystemRun, every: int) -> list[tuple[float, int, Callable[[], np.ndarray]]]:
    """(Unix time, samples, state loader) of every point of `run`'s curve, by the module's rule."""
    if is_gossip(run.system):
        return _states_gossip(run, every)
    if run.system == "sync-master":
        return _states_single(run, "master")
    if run.system in ("allreduce", "diloco"):
        return _states_single(run, "rank0")
    if run.system == "async-ps":
        return _states_ps(run, every)
    raise ValueError(f"unknown system {run.system!r}")


def build_curve(run: SystemRun, every: int, evaluate: Evaluate, initial: Point | None = None) -> LearningCurve:
    """Evaluate every point of `run` (the initial model's point first, if given)."""
    curve = LearningCurve([initial] if initial is not None else [])
    for t, samples, load in states(run, every):
        acc, loss = evaluate(load())
        curve.points.append(Point(max(0.0, t - run.go), samples, acc, loss))
    return curve


def _finite(value: float) -> float | None:
    """`value` rounded, or None when it is NaN or infinite (JSON has no such numbers)."""
    return round(value, 5) if math.isfinite(value) else None


def summarize(run: SystemRun, curve: LearningCurve, target: float, metric: str = "acc") -> dict[str, Any]:
    """The comparison's numbers for one run: accuracy or loss, time and samples to target, bytes, idle time.

    With metric "acc" (images) the final point gives ``final_test_acc`` and
    ``final_test_loss``; with "loss" (charlm) ``final_val_loss`` (nats per
    character), ``final_bits_per_char`` and ``final_next_char_acc``.
    """
    workers = [run.results[n] for n in run.workers if n in run.results]
    hit = curve.first_reaching(target, metric)
    final = curve.final
    steps = [w.get("steps", 0) for w in workers]
    per_step = [w["bytes"] / w["steps"] for w in workers if w.get("steps") and "bytes" in w]
    ends = [w.get("ended_at") or w["go"] + w["run_s"] for w in workers if "run_s" in w]
    out: dict[str, Any] = {
        "completed": run.completed,
        "error": run.error,
        "failed_at_s": run.failed_at_s,
    }
    if metric == "acc":
        out["final_test_acc"] = final.acc if final else None
        out["final_test_loss"] = _finite(final.loss) if final else None
    else:
        out["final_val_loss"] = _finite(final.loss) if final else None
        out["final_bits_per_char"] = _finite(final.loss / math.log(2)) if final else None
        out["final_next_char_acc"] = final.acc if final else None
    out.update(
        {
            "time_to_target_s": hit.t_s if hit else None,
            "samples_to_target": hit.samples if hit else None,
            "bytes_per_worker_per_step": float(np.mean(per_step)) if per_step else None,
            "idle_fraction": float(np.mean([w["idle_fraction"] for w in workers])) if workers else None,
            "train_time_s": max(ends) - run.go if ends and run.go else None,
            "samples": final.samples if final else 0,
            "steps_per_worker": float(np.mean(steps)) if steps else 0.0,
            "workers_finished": len(workers),
            # [seconds from the start, samples, accuracy (charlm: next character), loss (charlm: validation, nats/char)]
            "curve": [[round(p.t_s, 3), p.samples, round(p.acc, 5), _finite(p.loss)] for p in curve.points],
            # points whose model gave a NaN loss (a BatchNorm running variance gone negative, say): 0 expected
            "nonfinite_points": sum(1 for p in curve.points if not math.isfinite(p.loss)),
        }
    )
    if out["train_time_s"]:
        out["samples_per_s"] = out["samples"] / out["train_time_s"]
        if out["steps_per_worker"]:
            out["s_per_step"] = out["train_time_s"] / out["steps_per_worker"]
    return out
