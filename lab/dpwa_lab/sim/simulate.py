"""Simulate gossip mixing without sockets, with the node's own blending code.

Commands (they run as written from the repository root)::

    python -m dpwa.sim consensus --nodes 8 --mode symmetric --rule delta
    python -m dpwa.sim consensus --nodes 16 --mode pull --exchanges 2000
    python -m dpwa.sim study                  # the convergence study in docs/design.md (about a minute)
    python -m dpwa.sim study --seeds 2 --json study.json
    python -m dpwa.sim rounds --nodes 8      # random against hypercube pairing, round by round

:class:`Gossip` holds n flat models as :class:`~dpwa.mixing.params.NumpyParams` and
applies exchanges exactly as :class:`~dpwa.gossip.node.Node` does: the requester's
half through its rule's :meth:`~dpwa.mixing.rules.Rule.blend`, the server's half (mode
symmetric) through :meth:`~dpwa.mixing.rules.Rule.mirror`, and the peer chosen by the same
:class:`~dpwa.gossip.membership.flow.PeerSelector`. What it leaves out is the network: every
exchange succeeds, and a round is synchronous (everyone publishes, trains,
then blends), which is how a cluster of equally fast nodes behaves.

``consensus`` mixes random models with no training, one exchange at a time,
and compares the decay of the disagreement with randomized-gossip theory.
``study`` trains softmax regression on the embedded digits with 4 nodes and
counts the steps each mixing rule needs to reach a training-loss threshold,
against exact all-reduce averaging.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpwa.gossip.membership.flow import PeerSelector
from dpwa.mixing import pairing as pairings
from dpwa.mixing import rules as mixing
from dpwa.mixing.admission import Admission
from dpwa.mixing.interpolation import Constant
from dpwa.mixing.outer import GossipOuter, OuterSettings
from dpwa.mixing.params import NumpyParams
from dpwa.mixing.rules import Side

__all__ = ["Gossip", "disagreement", "symmetric_decay", "study"]


def disagreement(arrays: Sequence[np.ndarray]) -> float:
    """Sum over nodes of the squared distance to the nodes' mean, in float64."""
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    return float(((stacked - stacked.mean(axis=0)) ** 2).sum())


def symmetric_decay(n: int, f: float) -> float:
    """Expected D'/D of one symmetric exchange on the complete graph.

    A uniformly random pair (i, j) moves towards each other by f: with
    d = e_j - e_i (errors to the mean, which the exchange keeps),
    D' = D - 2 f (1 - f) ||d||^2, and over all pairs E||d||^2 = 2 D / (n - 1).
    So E[D'] = D (1 - 4 f (1 - f) / (n - 1)); f = 1/2 gives (n - 2) / (n - 1)
    (Boyd et al. 2006, randomized gossip on the complete graph).
    """
    return 1.0 - 4.0 * f * (1.0 - f) / (n - 1)


class Gossip:
    """n nodes' flat float32 models, mixed by the node's rules, without sockets.

    Args:
        arrays: one flat float32 array per node; updated in place.
        mode: "pull" or "symmetric".
        rule: the rule's name (dpwa.mixing.rules: "state", "delta", "clipped", ...), with `rule_options`;
            "state" when not given.
        f: the constant interpolation factor.
        fetch_probability: chance that a node exchanges in a round.
        seed: seeds the decisions to exchange and the peer choices.
        pairing: "random" (a peer by score, as a node draws it), "hypercube" or "auto" (dpwa.mixing.pairing).
        period: exchange every `period` rounds (the nodes train alone in between), as ``period:`` does.
        outer: "none", "nesterov" or "noloco": the outer step each node takes after each blend, with
            `outer_settings`, as ``outer:`` does (:meth:`dpwa.mixing.outer.GossipOuter.apply`).
        statistics: [start, end) ranges of each model that stand for running statistics (a BatchNorm's
            buffers), which the rules' helpers treat as the PyTorch adapter treats a model's buffers
            (:class:`~dpwa.mixing.params.NumpyParams`): a rule that would break them on a real model
            breaks them here too.
        blend: the older name of `rule`, still taken (a DeprecationWarning says to write ``rule=``).
    """

    def __init__(
        self,
        arrays: Sequence[np.ndarray],
        *,
        mode: str = "pull",
        rule: str | None = None,
        f: float = 0.5,
        fetch_probability: float = 1.0,
        seed: int = 0,
        pairing: str = "random",
        period: int = 1,
        outer: str = "none",
        outer_settings: OuterSettings | None = None,
        rule_options: dict | None = None,
        statistics: Sequence[tuple[int, int]] = (),
        blend: str | None = None,
    ) -> None:
        if blend is not None:
            if rule is not None:
                raise TypeError(
                    f"Gossip: give rule= alone, not with its older name blend= (rule={rule!r}, blend={blend!r})"
                )
            warnings.warn(
                f"Gossip(blend={blend!r}): blend= is the older name of rule=; write rule={blend!r}",
                DeprecationWarning,
                stacklevel=2,
            )
            rule = blend
        if mode not in ("pull", "symmetric"):
            raise ValueError(f"mode must be pull or symmetric, got {mode!r}")
        kind = mixing.rule_class("state" if rule is None else rule)  # RuleError (a ValueError) names what is wrong
        mixing.check_mode(kind, mode, kind.checked_options(rule_options or {}))  # as a config's rule is checked
        self.arrays = list(arrays)
        self.params = [NumpyParams(a, statistics=statistics) for a in self.arrays]
        self.n = len(self.arrays)
        self.mode, self.f, self.fetch_probability = mode, f, fetch_probability
        self.rules = [kind(Constant(f), **(rule_options or {})) for _ in self.arrays]  # one per node: its state
        for each in self.rules:
            each.cluster(len(self.arrays))
        self.version = 0  # of the snapshots published last (one number for all: each node's own would do)
        self.rng = random.Random(seed)
        self.selectors = [PeerSelector([f"{j}" for j in range(self.n) if j != i], rng=self.rng) for i in range(self.n)]
        self.exchanges = 0
        self.refused = 0  # symmetric requests a busy server turned away
        if pairing not in pairings.PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(pairings.PAIRINGS)}, got {pairing!r}")
        self.pairing, self.rounds = pairings.resolve(pairing, self.n), 0
        if not (isinstance(period, int) and period >= 1):
            raise ValueError(f"period must be a whole number >= 1, got {period!r}")
        self.period = period
        settings = outer_settings or OuterSettings()
        self.outers = None if outer == "none" else [GossipOuter(outer, a, settings) for a in self.arrays]

    def mean(self) -> np.ndarray:
        """The nodes' mean, each weighted by its rule's :meth:`~dpwa.mixing.rules.Rule.mass` (1 but for push-sum):
        what the rules keep."""
        masses = np.array([rule.mass() for rule in self.rules], dtype=np.float64)
        stacked = np.stack(self.arrays).astype(np.float64)
        return (masses[:, None] * stacked).sum(axis=0) / masses.sum()

    def choose(self, i: int) -> int:
        chosen = self.selectors[i].choose()
        assert chosen is not None, "every node has peers"
        return int(chosen)

    def publish(self) -> list[np.ndarray]:
        """Every node publishes a snapshot of its parameters as they are now (a version each: their rules learn
        it, as a node's rule does, dpwa.mixing.rules.Rule.published)."""
        self.version += 1
        for rule in self.rules:
            rule.published(self.version)
        return [a.copy() for a in self.arrays]

    def exchange(self, i: int, j: int, snapshots: Sequence[np.ndarray]) -> None:
        """Node i exchanges with node j, given the snapshots both published (the latest :meth:`publish`)."""
        requester, server = self.rules[i], self.rules[j]
        served = server.served(self.version)  # what a reply would carry
        carried = requester.checked_carried(list(served.values()) or None)
        symmetric = self.mode == "symmetric"
        f = requester.factor(Side(0.0, None), Side(0.0, None, carried), symmetric=symmetric)
        mixing.weight(requester, "blend", requester.blend(self.params[i], snapshots[i], snapshots[j], f, "float32"))
        self._blended(i)
        if symmetric:
            mixing.weight(server, "mirror", server.mirror(self.params[j], snapshots[j], snapshots[i], f, "float32"))
        self.exchanges += 1

    def _blended(self, i: int) -> None:
        if self.outers is not None:
            self.outers[i].apply(self.params[i])

    def exchange_now(self, i: int, j: int) -> None:
        """One exchange on the current values (nothing trains in between)."""
        self.exchange(i, j, self.publish())

    def round(self, train: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Every node publishes, maybe picks a peer, trains one step, then the exchanges apply.

        Requests reach their servers in random order; in symmetric mode a node takes part in one exchange
        per round (dpwa.mixing.admission), as on a real node.
        """
        snapshots = self.publish()
        if self.rounds % self.period:  # a round of local steps only
            self.rounds += 1
            if train is not None:
                for i, array in enumerate(self.arrays):
                    train(i, array)
            return
        if self.pairing == "hypercube":  # the schedule, as the nodes follow it (dpwa.gossip.settings.pairing_of)
            partners = [(i, pairings.hypercube_partner(i, self.n, self.rounds)) for i in range(self.n)]
            pairs = [(i, j) for i, j in partners if pairings.initiates(i, j, self.mode)]
        elif self.mode == "pull":  # a peer by score, as a node draws it
            pairs = [(i, self.choose(i)) for i in range(self.n) if self.rng.random() < self.fetch_probability]
        else:  # symmetric, random: a node starts with its coin and asks peers by score until one is free
            share = self.fetch_probability * pairings.SYMMETRIC_START_SHARE
            starters = [i for i in range(self.n) if self.rng.random() < share]
            self.rng.shuffle(starters)
            taken = set(starters)  # a node in its own exchange serves none (dpwa.mixing.admission)
            pairs = []
            for i in starters:
                for name in self.selectors[i].ranked():
                    j = int(name)
                    if j not in taken:
                        taken.add(j)
                        pairs.append((i, j))
                        break
                    self.refused += 1
        self.rounds += 1
        self.rng.shuffle(pairs)
        if train is not None:
            for i, array in enumerate(self.arrays):
                train(i, array)
        # mode symmetric: one exchange per node and snapshot (dpwa.mixing.admission), as on a real node
        admissions = [Admission() for _ in range(self.n)] if self.mode == "symmetric" else None
        for i, j in pairs:
            if admissions is not None:
                if not admissions[i].take(1, "own"):
                    continue
                if not admissions[j].take(1, "served"):
                    admissions[i].give_back()
                    self.refused += 1
                    continue
            self.exchange(i, j, snapshots)


# --------------------------------------------------------------------------- the convergence study


@dataclass
class Digits:
    """Softmax regression on the embedded digits, with node shards and a fixed test split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    shards: list[np.ndarray]  # indices into the training set, one disjoint shard per node

    @classmethod
    def load(cls, nodes: int, split_seed: int = 0) -> Digits:
        from ..workloads.digits import load_digits

        images, labels = load_digits()
        x = np.concatenate([images.reshape(len(images), -1) / 16.0, np.ones((len(images), 1))], axis=1)
        x = x.astype(np.float32)
        order = np.random.default_rng(split_seed).permutation(len(x))
        cut = int(0.8 * len(x))
        train, test = order[:cut], order[cut:]
        shards = np.array_split(np.random.default_rng(split_seed + 1).permutation(cut), nodes)
        return cls(x[train], labels[train], x[test], labels[test], shards)

    @property
    def size(self) -> int:
        return self.x_train.shape[1] * 10

    def loss(self, w: np.ndarray, x: np.ndarray | None = None, y: np.ndarray | None = None) -> float:
        x = self.x_train if x is None else x
        y = self.y_train if y is None else y
        logits = x @ w.reshape(-1, 10)
        logits -= logits.max(axis=1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return float(-log_p[np.arange(len(y)), y].mean())

    def accuracy(self, w: np.ndarray) -> float:
        return float(((self.x_test @ w.reshape(-1, 10)).argmax(axis=1) == self.y_test).mean())

    def gradient(self, w: np.ndarray, idx: np.ndarray) -> np.ndarray:
        x, y = self.x_train[idx], self.y_train[idx]
        logits = x @ w.reshape(-1, 10)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        return (x.T @ p / len(y)).astype(np.float32).reshape(-1)


@dataclass(frozen=True)
class Rule:
    label: str
    mode: str  # "exact" for all-reduce averaging
    rule: str = "state"  # the mixing rule's name (dpwa.mixing.rules), or module.path:ClassName
    p: float = 1.0
    pairing: str = "random"
    period: int = 1
    outer: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    rule_options: Mapping[str, Any] | None = None  # the rule's own settings (a config's rule_options)


RULES = (
    Rule("exact all-reduce averaging", "exact"),
    Rule("pull, state, p = 1 (the original)", "pull", "state", 1.0),
    Rule("pull, state, p = 0.5", "pull", "state", 0.5),
    Rule("pull, state, p = 0.1", "pull", "state", 0.1),
    Rule("pull, delta, p = 1", "pull", "delta", 1.0),
    Rule("symmetric, delta, p = 1", "symmetric", "delta", 1.0),
    Rule("symmetric, state, p = 1", "symmetric", "state", 1.0),
    Rule("pull, delta, hypercube", "pull", "delta", 1.0, "hypercube"),
    Rule("symmetric, delta, hypercube", "symmetric", "delta", 1.0, "hypercube"),
    Rule("pull, state, every 8 steps", "pull", "state", period=8),
    Rule("pull, state, every 8 steps, noloco", "pull", "state", period=8, outer="noloco"),
    Rule("symmetric, delta, every 8 steps, noloco", "symmetric", "delta", period=8, outer="noloco"),
    Rule("symmetric, delta, every 8 steps, nesterov", "symmetric", "delta", period=8, outer="nesterov"),
)


def train_run(
    data: Digits,
    rule: Rule,
    seed: int,
    *,
    nodes: int,
    lr: float,
    batch: int,
    threshold: float,
    max_steps: int,
    final_steps: int,
) -> dict:
    """One training run: steps until the mean node training loss is below `threshold`,
    and the mean node test accuracy after `final_steps` steps."""
    rng = np.random.default_rng(seed)
    arrays = [np.zeros(data.size, np.float32) for _ in range(nodes)]
    gossip = (
        None
        if rule.mode == "exact"
        else Gossip(
            arrays,
            mode=rule.mode,
            rule=rule.rule,
            fetch_probability=rule.p,
            seed=seed,
            pairing=rule.pairing,
            period=rule.period,
            outer=rule.outer,
            outer_settings=OuterSettings(rule.outer_lr, rule.outer_momentum),
            rule_options=dict(rule.rule_options or {}),
        )
    )

    def local_step(i: int, w: np.ndarray) -> None:
        idx = rng.choice(data.shards[i], size=batch, replace=False)
        w -= np.float32(lr) * data.gradient(w, idx)

    reached = None
    for step in range(1, max(max_steps, final_steps) + 1):
        if gossip is None:  # every node takes its step, then all average exactly
            for i, w in enumerate(arrays):
                local_step(i, w)
            mean = np.mean(arrays, axis=0)
            for w in arrays:
                w[:] = mean
        else:
            gossip.round(local_step)
        if reached is None and step <= max_steps and statistics.fmean(data.loss(w) for w in arrays) < threshold:
            reached = step
        if step >= final_steps and (reached is not None or step >= max_steps):
            break
    return {"steps": reached, "accuracy": statistics.fmean(data.accuracy(w) for w in arrays)}


def study(
    seeds: int = 5,
    nodes: int = 4,
    lr: float = 0.5,
    batch: int = 16,
    threshold: float = 0.25,
    max_steps: int = 3000,
    final_steps: int = 600,
    rules: Sequence[Rule] = RULES,
) -> dict:
    data = Digits.load(nodes)
    rows: list[dict[str, Any]] = []
    for rule in rules:
        runs = [
            train_run(
                data,
                rule,
                seed,
                nodes=nodes,
                lr=lr,
                batch=batch,
                threshold=threshold,
                max_steps=max_steps,
                final_steps=final_steps,
            )
            for seed in range(seeds)
        ]
        steps = [r["steps"] for r in runs]
        reached = [s for s in steps if s is not None]
        rows.append(
            {
                "label": rule.label,
                "mode": rule.mode,
                "rule": rule.rule,
                "p": rule.p,
                "steps": steps,
                "steps_mean": statistics.fmean(reached) if len(reached) == len(steps) else None,
                "steps_sd": statistics.stdev(reached) if len(reached) == len(steps) and len(reached) > 1 else 0.0,
                "accuracy_mean": statistics.fmean(r["accuracy"] for r in runs),
            }
        )
    exact = rows[0]["steps_mean"]
    for row in rows:
        mean = row["steps_mean"]
        row["steps_vs_exact"] = mean / exact if isinstance(mean, float) and isinstance(exact, float) else None
        row["accuracy_vs_exact_points"] = 100 * (row["accuracy_mean"] - rows[0]["accuracy_mean"])
    return {
        "setup": {
            "nodes": nodes,
            "seeds": seeds,
            "lr": lr,
            "batch": batch,
            "threshold": threshold,
            "max_steps": max_steps,
            "final_steps": final_steps,
            "model": "softmax regression on the embedded digits (64 pixels + bias, 10 classes)",
        },
        "rows": rows,
    }


def format_study(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"{s['nodes']} nodes, {s['model']}; batch {s['batch']} per node, learning rate {s['lr']}, "
        f"{s['seeds']} seeds; steps until the mean node training loss < {s['threshold']}; "
        f"test accuracy after {s['final_steps']} steps",
        "",
        "| mixing rule | steps to threshold (mean ± sd) | vs exact | final test accuracy | vs exact |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        steps = f"{r['steps_mean']:.0f} ± {r['steps_sd']:.0f}" if r["steps_mean"] else f"not reached: {r['steps']}"
        ratio = f"{r['steps_vs_exact']:.2f}x" if r["steps_vs_exact"] else "-"
        lines.append(
            f"| {r['label']} | {steps} | {ratio} | {100 * r['accuracy_mean']:.1f}% | "
            f"{r['accuracy_vs_exact_points']:+.1f} pt |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- consensus


def consensus(
    nodes: int,
    mode: str,
    rule: str,
    f: float,
    exchanges: int,
    seed: int,
    size: int = 64,
    restart_every: int = 10,
    rule_options: Mapping[str, Any] | None = None,
) -> dict:
    """Mix random models with no training, one exchange at a time; measure D'/D per exchange.

    The state is re-drawn every `restart_every` exchanges, and whenever the nodes
    agree to 1e-6 of where they started (pairs of averages can meet exactly), so the
    disagreement stays far above float32 rounding; E[D'/D] does not depend on the state.
    """
    rng = np.random.default_rng(seed)
    ratios, drifts = [], []
    before, start = 0.0, 0.0
    arrays = [rng.standard_normal(size).astype(np.float32) for _ in range(nodes)]
    options = dict(rule_options or {})
    gossip = Gossip(arrays, mode=mode, rule=rule, f=f, seed=seed, rule_options=options)
    start_mean = np.mean(np.stack(arrays).astype(np.float64), axis=0)
    for k in range(exchanges):
        if k % restart_every == 0 or before <= 1e-6 * start:
            arrays = [rng.standard_normal(size).astype(np.float32) for _ in range(nodes)]
            gossip = Gossip(arrays, mode=mode, rule=rule, f=f, seed=seed + k, rule_options=options)
            start_mean = np.mean(np.stack(arrays).astype(np.float64), axis=0)
            start = disagreement(gossip.arrays)
        before = disagreement(gossip.arrays)
        i = gossip.rng.randrange(nodes)
        gossip.exchange_now(i, gossip.choose(i))
        after = disagreement(gossip.arrays)
        ratios.append(after / before)
        before = after
        drifts.append(float(np.abs(gossip.mean() - start_mean).max()))
    mean = statistics.fmean(ratios)
    return {
        "nodes": nodes,
        "mode": mode,
        "rule": rule,
        "f": f,
        "exchanges": exchanges,
        "mean_ratio": mean,
        "standard_error": statistics.stdev(ratios) / math.sqrt(len(ratios)),
        "theory_symmetric": symmetric_decay(nodes, f),
        "max_mean_drift": max(drifts),
    }


def rounds(
    nodes: int,
    mode: str,
    rule: str,
    pairing: str,
    rounds: int,
    seed: int,
    size: int = 64,
    rule_options: Mapping[str, Any] | None = None,
) -> dict:
    """Mix random models by whole rounds, no training: every node publishes, the round's pairs
    exchange (f = 1/2), and the disagreement (sum of squared distances to the mean) is recorded
    after each round, relative to the start. With hypercube pairing and n = 2^k nodes it reaches
    float32 rounding after k rounds; with random pairing it only decays geometrically."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(size).astype(np.float32) for _ in range(nodes)]
    gossip = Gossip(
        arrays, mode=mode, rule=rule, f=0.5, seed=seed, pairing=pairing, rule_options=dict(rule_options or {})
    )
    start = disagreement(gossip.arrays)
    relative = []
    for _ in range(rounds):
        gossip.round()
        relative.append(disagreement(gossip.arrays) / start)
    return {"nodes": nodes, "mode": mode, "rule": rule, "pairing": pairing, "relative_disagreement": relative}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa.sim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consensus", help="mix random models without training; compare with theory")
    c.add_argument("--nodes", type=int, default=8)
    c.add_argument("--mode", choices=("pull", "symmetric"), default="symmetric")
    _rule_arguments(c)
    c.add_argument("--f", type=float, default=0.5, help="the constant interpolation factor")
    c.add_argument("--exchanges", type=int, default=3000)
    c.add_argument("--seed", type=int, default=0)
    w = sub.add_parser("rounds", help="mix random models by whole rounds: random against hypercube pairing")
    w.add_argument("--nodes", type=int, default=8)
    w.add_argument("--mode", choices=("pull", "symmetric"), default="symmetric")
    _rule_arguments(w)
    w.add_argument("--rounds", type=int, default=6)
    w.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("study", help="steps to a training-loss threshold on digits, per mixing rule")
    s.add_argument("--seeds", type=int, default=5)
    s.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    s.add_argument(
        "--rule",
        dest="rules",
        action="append",
        default=[],
        metavar="SPEC",
        help="also study this rule (a built-in name, or module.path:ClassName), in --rule-mode, beside the "
        "built-in rows; repeat for several",
    )
    s.add_argument("--rule-mode", choices=("pull", "symmetric"), default="symmetric")
    s.add_argument("--rule-options", type=_options, default={}, metavar="YAML", help="the --rule rows' options")
    s.add_argument("--only", action="store_true", help="only exact averaging and the --rule rows")
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except mixing.RuleError as exc:
        parser.error(str(exc))
    return 2


def _options(text: str) -> dict[str, Any]:
    """--rule-options: a YAML (or JSON) map, as a config's rule_options."""
    import yaml

    value = yaml.safe_load(text) if text.strip() else {}
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a map such as '{{beta: 0.5}}', got {text!r}")
    return value


def _rule_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rule",
        default="delta",
        help="a rule: a built-in name (delta, state, clipped, pushsum) or module.path:ClassName of your own",
    )
    # --blend: the older name of --rule, still taken, not shown
    parser.add_argument("--blend", dest="rule", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--rule-options", type=_options, default={}, metavar="YAML", help="the rule's options")


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "consensus":
        if args.nodes < 2:
            parser.error(f"--nodes must be at least 2, got {args.nodes}")
        r = consensus(
            args.nodes, args.mode, args.rule, args.f, args.exchanges, args.seed, rule_options=args.rule_options
        )
        print(
            f"{r['nodes']} nodes, {r['mode']}/{r['rule']}, f = {r['f']}: mean D'/D per exchange "
            f"{r['mean_ratio']:.4f} ± {r['standard_error']:.4f} (symmetric theory "
            f"{r['theory_symmetric']:.4f}); largest drift of the mean {r['max_mean_drift']:.2e}"
        )
        return 0
    if args.command == "rounds":
        if args.nodes < 2:
            parser.error(f"--nodes must be at least 2, got {args.nodes}")
        kinds = ["random"] + (["hypercube"] if args.nodes & (args.nodes - 1) == 0 else [])
        print(
            f"{args.nodes} nodes, {args.mode}/{args.rule}, f = 0.5: disagreement after each round, "
            "relative to the start"
        )
        print("  round  " + "  ".join(f"{k:>10}" for k in kinds))
        runs = [
            rounds(args.nodes, args.mode, args.rule, k, args.rounds, args.seed, rule_options=args.rule_options)
            for k in kinds
        ]
        for t in range(args.rounds):
            print(f"  {t + 1:>5}  " + "  ".join(f"{run['relative_disagreement'][t]:>10.2e}" for run in runs))
        return 0
    given = [
        Rule(f"{args.rule_mode}, {spec}", args.rule_mode, spec, rule_options=args.rule_options) for spec in args.rules
    ]
    result = study(seeds=args.seeds, rules=[RULES[0], *given] if args.only else [*RULES, *given])
    print(format_study(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
