"""Compare gossip with synchronous SGD with a master, asynchronous parameter servers, all-reduce and DiLoCo.

Every system trains the same model on the same data shards, with the same
batch size, learning-rate schedule and seed, on this machine; each is then
evaluated by the same rule (see lab/dpwa_lab/compare/evaluation.py). Commands (from
the repository root)::

    python -m dpwa.compare                                  # every system, 4 workers, digits (a few minutes)
    python -m dpwa.compare --straggler 4                    # the last worker 4x slower per step
    python -m dpwa.compare --faults --json compare.json     # and kill a process of each system
    python -m dpwa.compare --quick --systems gossip,allreduce   # a short smoke run
    python -m dpwa.compare --workload charlm --systems gossip,gossip-lowbw,diloco,allreduce   # a character-level LM
    python -m dpwa.compare --workload charlm --link-mbit 20 --systems gossip,gossip-lowbw,diloco,allreduce  # (root)
    python -m dpwa.compare --gossip-set mode=pull --gossip-set period=4    # try other dpwa settings
    python -m dpwa.compare --systems gossip --variant 'heavy={rule: heavyball:HeavyBall, mode: pull}'  # your rule
    python -m dpwa.compare --workload charlm --systems gossip,gossip-original,gossip-pushsum   # push-sum (opt-in)
    python -m dpwa.compare --workload charlm --systems gossip,gossip-noloco,diloco --seeds 3   # NoLoCo (opt-in)
    python -m dpwa.compare --map --quick --tune 4 --seeds 2 --systems gossip,gossip-lowbw,allreduce,diloco  # (root)
    python -m dpwa.compare --workload charlm --systems gossip --byzantine 1 --attack offset \
        --gossip-set rule=clipped --gossip-set 'rule_options={radius: auto}' --gossip-set mode=pull  # ClippedGossip

It prints a table (time and samples to the target, the final accuracy or
validation loss, bytes per worker per step, seconds per step, the fraction of
time workers sat idle), writes OUT/compare.png (accuracy or validation loss
against wall time and against samples) and OUT/compare.json, and with --json
FILE the same JSON there too. docs/comparison.md describes the charlm workload,
DiLoCo and the slow links.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from dpwa.config import parse_config

from ..systems.diloco import DEFAULT_PERIOD
from .byzantine import ATTACKS
from .comparison import CompareConfig, run_comparison
from .links import LinksUnavailable, check_delay, check_root
from .regimes import (
    DEFAULT_DELAYS,
    DEFAULT_RATES,
    DEFAULT_STRAGGLERS,
    MapError,
    cells,
    collect,
    decide_grid,
    map_table,
    plot_map,
)
from .report import fault_lines, link_lines, mass_lines, plot, table, write_json
from .runner import KNOWN_SYSTEMS, SYSTEMS, VARIANT_PREFIX, RunOptions, gossip_keys, is_gossip
from .seeds import aggregate, plot_seeds, seeds_table
from .tune import apply, load_tuning, tune
from .workload import CHARLM_DEFAULTS, CHECKOUT_CIFAR_DIR, DATA_DEFAULTS, DEVICES, WorkloadSpec

TARGETS = {"digits": 0.97, "cifar10": 0.70}  # default target test accuracy per dataset
WORKLOADS = ("digits", "cifar10", "charlm")
CHARLM_MODELS = ("small", "tiny", "medium")  # dpwa_lab.workloads.charlm.SIZES


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    # gossip-NAME may be a --variant's (checked once the variants are read)
    unknown = [s for s in names if s not in KNOWN_SYSTEMS and not s.startswith(VARIANT_PREFIX)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown system {', '.join(unknown) or '(none)'}; choose from {', '.join(KNOWN_SYSTEMS)}"
        )
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _data(text: str) -> str:
    if text in ("auto", "stdlib", *DATA_DEFAULTS) or (text.startswith("text:") and len(text) > len("text:")):
        return text
    raise argparse.ArgumentTypeError(f"choose auto, {', '.join(DATA_DEFAULTS)}, stdlib or text:PATH; got {text!r}")


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


# Named sets of flags (--profile NAME): defaults that the command line's own flags override.
PROFILES: dict[str, dict[str, Any]] = {
    # charlm long enough for DiLoCo to take 100 outer steps at every H its tuning grid tries (5, 10, 20), sized
    # to end within about two hours on a 2-core machine for the four systems (docs/comparison.md, "A long run")
    "long": {
        "workload": "charlm",
        "steps": 2000,
        "workers": 4,
        "systems": ("gossip", "gossip-lowbw", "allreduce", "diloco"),
        "time_limit_s": 3600.0,
    },
}


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _grid(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dpwa.compare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        help="a named set of flags, which flags given override: long = --workload charlm --steps 2000 --workers 4 "
        "--systems gossip,gossip-lowbw,allreduce,diloco --time-limit-s 3600 (DiLoCo takes 100 outer steps at H "
        "up to 20)",
    )
    p.add_argument(
        "--systems",
        type=_systems,
        default=SYSTEMS,
        help=f"comma-separated (default: {','.join(SYSTEMS)}; also, run only when named: gossip-pushsum "
        "(mode pull, rule pushsum) and gossip-noloco (NoLoCo: an exchange every 10 steps, outer: noloco at its "
        "authors' lr 0.7 and momentum 0.3)",
    )
    p.add_argument("--workers", type=_positive_int, default=4, help="workers per system (default: %(default)s)")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="digits or cifar10 (the example's ResNet), or charlm (a character-level transformer on the Python "
        "standard library's source; docs/comparison.md); default: as --data says",
    )
    p.add_argument(
        "--data",
        type=_data,
        default="auto",
        help="images: auto (default: cifar10 when prepared, else the embedded digits), digits, cifar10; "
        "charlm: stdlib (default) or text:PATH (a text file of yours; its last 10%% is validation)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=CHECKOUT_CIFAR_DIR,
        help="the CIFAR-10 batches (default: the checkout's examples/pytorch-cifar/data/cifar-10-batches-py)",
    )
    p.add_argument(
        "--epochs", type=_positive_int, help="images: passes over the training set (default: 30; --quick: 6)"
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        help=f"steps per worker (charlm default: {CHARLM_DEFAULTS.steps}; --quick: 40); images: instead of --epochs",
    )
    p.add_argument(
        "--model", help="images: small (default) or resnet18; charlm: small (default), tiny, or medium (for a GPU)"
    )
    p.add_argument(
        "--straggler",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="the last worker is FACTOR times slower per step (default: 1, none)",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report here")
    p.add_argument("--out", type=Path, help="output folder (default: runs/compare-DATE-TIME)")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        help=f"per worker and step (default: 32 digits, 128 cifar10, {CHARLM_DEFAULTS.batch_size} charlm)",
    )
    p.add_argument(
        "--lr", type=float, help=f"peak learning rate (default: 0.05 digits, 0.1 cifar10, {CHARLM_DEFAULTS.lr} charlm)"
    )
    p.add_argument("--seed", type=int, default=0, help="the first seed: initial model and data order (default: 0)")
    p.add_argument(
        "--tune",
        type=_positive_int,
        metavar="N",
        help="first give every system N trials of its own settings (learning rate; DiLoCo's outer step and H; "
        "gossip's factor, period and outer step) at a tuning seed, and measure each at its best "
        "(lab/dpwa_lab/compare/tune.py)",
    )
    p.add_argument(
        "--seeds",
        type=_positive_int,
        default=1,
        help="run the comparison once per seed (--seed, --seed + 1, ...), paired: within a seed every system starts "
        "from the same model and reads the same data; the table gives means with 95%% intervals (default: 1)",
    )
    p.add_argument(
        "--tuned-from",
        type=Path,
        metavar="FILE",
        help="measure each system at the best settings an earlier --tune found (its compare.json, or a map's "
        "tuning.json) instead of tuning again",
    )
    p.add_argument(
        "--map",
        action="store_true",
        help="the regime map: the comparison in every cell of a grid of link rates, delays and stragglers "
        "(needs root), each cell's winner by time to the target with its margin; OUT/map.md, map.png, map.json; "
        "run again with the same --out to finish a map that was stopped (lab/dpwa_lab/compare/regimes.py)",
    )
    p.add_argument(
        "--also-target",
        type=_positive_float,
        action="append",
        default=[],
        metavar="T",
        help="--map: also judge every cell at this target (accuracy, or charlm's loss), read from the same runs' "
        "curves (OUT/map-T.md, map-T.png); repeatable",
    )
    p.add_argument(
        "--map-rates",
        type=_floats,
        default=DEFAULT_RATES,
        metavar="R,R,...",
        help=f"--map: link rates in Mbit/s (default: {_grid(DEFAULT_RATES)})",
    )
    p.add_argument(
        "--map-delays",
        type=_floats,
        default=DEFAULT_DELAYS,
        metavar="D,D,...",
        help=f"--map: one-way delays in ms, 0 for none (default: {_grid(DEFAULT_DELAYS)})",
    )
    p.add_argument(
        "--map-stragglers",
        type=_floats,
        default=DEFAULT_STRAGGLERS,
        metavar="F,F,...",
        help=f"--map: straggler factors, 1 for none (default: {_grid(DEFAULT_STRAGGLERS)})",
    )
    p.add_argument("--target-acc", type=float, help="images: target test accuracy (default: 0.97 digits, 0.70 cifar10)")
    p.add_argument(
        "--target-loss",
        type=_positive_float,
        help=f"charlm: target validation loss, nats per character (default: {CHARLM_DEFAULTS.target_loss})",
    )
    p.add_argument(
        "--diloco-period",
        type=_positive_int,
        default=DEFAULT_PERIOD,
        metavar="H",
        help="DiLoCo: inner steps between two synchronisations (default: %(default)s; outer Nesterov, lr 0.7, "
        "momentum 0.9)",
    )
    p.add_argument(
        "--outer-lr", type=_positive_float, default=0.7, help="DiLoCo: the outer learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.9,
        help="DiLoCo: the outer Nesterov momentum (default: %(default)s; 0 with --outer-lr 1: plain averaging)",
    )
    p.add_argument(
        "--link-mbit",
        type=_positive_float,
        metavar="R",
        help="run every process in its own network namespace, its link shaped to R Mbit/s each way (needs root)",
    )
    p.add_argument(
        "--link-delay-ms",
        type=_positive_float,
        metavar="D",
        help="with --link-mbit: every packet between two hosts is held D ms (a round trip: 2 D) by a userspace delay "
        "line in the hub (no netem needed; /dev/net/tun)",
    )
    p.add_argument(
        "--faults",
        action="store_true",
        help="also kill a sync worker mid-task, a parameter server, a trainer, a gossip node and a rank",
    )
    p.add_argument(
        "--churn",
        type=_positive_int,
        metavar="N",
        help="N workers leave (SIGKILL) while each run trains, at 1/(N+1) of its samples and every such fraction "
        "after: gossip runs with open membership and replaces each at once by a newcomer that joins through "
        "bootstrap addresses; all-reduce restarts every rank from its last checkpoint, as under torchrun "
        "--max-restarts (systems: the gossip ones and allreduce)",
    )
    p.add_argument(
        "--gossip-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dpwa config key for every gossip system (its value read as YAML), over the system's own: "
        "--gossip-set mode=pull --gossip-set period=4; repeatable",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=MAP",
        help="a gossip system of your own, gossip-NAME: dpwa config keys (a YAML map) over the --gossip-set ones, "
        "run beside the --systems with the same seeds, tuning and workload: --variant "
        "'heavy={rule: \"heavyball:HeavyBall\", mode: pull}'; repeatable (docs/rules.md's worked example)",
    )
    p.add_argument(
        "--byzantine",
        type=_count,
        default=0,
        metavar="K",
        help="gossip systems only: the last K workers publish wrong snapshots (--attack); fewer than half the "
        "workers; the curves evaluate the honest nodes' mean (default: %(default)s)",
    )
    p.add_argument(
        "--attack",
        choices=tuple(ATTACKS),
        default="offset",
        help="with --byzantine: offset (each parameter tensor p published as p + 10 std(p)) or flip (-p) "
        "(default: %(default)s)",
    )
    p.add_argument("--ps-servers", type=_positive_int, default=2, help="parameter servers (default: %(default)s)")
    p.add_argument("--lease-s", type=float, default=5.0, help="sync master's task lease (default: %(default)s)")
    p.add_argument(
        "--num-gradients-sufficient",
        type=_positive_int,
        help="sync master: gradients per step (default: the number of live workers)",
    )
    p.add_argument("--time-limit-s", type=float, default=600.0, help="per run (default: %(default)s)")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the workers train: cpu (default), or cuda: worker i on GPU i modulo the GPUs there are; "
        "all-reduce and DiLoCo reduce over NCCL where each rank has a GPU of its own, else over gloo",
    )
    p.add_argument("--quick", action="store_true", help="a short run (6 epochs or 40 steps, fewer curve points)")
    p.add_argument("--keep-snapshots", action="store_true", help="keep every evaluated model state in OUT/work")
    profile = p.parse_known_args(argv)[0].profile
    if profile is not None:
        p.set_defaults(**PROFILES[profile])
    args = p.parse_args(argv)
    if not 1 <= args.straggler <= 100:
        p.error(f"--straggler must be in [1, 100], got {args.straggler}")
    if args.target_acc is not None and not 0 < args.target_acc <= 1:
        p.error(f"--target-acc must be in (0, 1], got {args.target_acc}")
    if args.lease_s <= 0 or args.time_limit_s <= 0:
        p.error("--lease-s and --time-limit-s must be positive")
    if not 0 <= args.outer_momentum < 1:
        p.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    try:
        args.variants = variants(args.variant)
    except ValueError as exc:
        p.error(str(exc))
    named = [s for s in args.systems if s not in KNOWN_SYSTEMS and s not in dict(args.variants)]
    if named:
        p.error(f"--systems {', '.join(named)}: no such system, and no --variant names it")
    args.systems = (*args.systems, *(s for s, _ in args.variants if s not in args.systems))
    if args.byzantine:
        others = [s for s in args.systems if not is_gossip(s)]
        if others:
            p.error(f"--byzantine is for the gossip systems only (gossip, gossip-*), not {', '.join(others)}")
        if 2 * args.byzantine >= args.workers:
            p.error(
                f"--byzantine {args.byzantine} of --workers {args.workers}: Byzantine workers must be fewer than half"
            )
        if args.faults:
            p.error("--faults with --byzantine is not supported (a fault would kill a Byzantine node)")
    if args.churn and (args.tune or args.map or args.link_mbit or args.byzantine or args.faults):
        p.error(
            "--churn runs a plain comparison over loopback: not with --tune, --map, --link-mbit, --byzantine or "
            "--faults (tune first, then give --tuned-from)"
        )
    if args.tune and (args.faults or args.byzantine):
        p.error("--tune with --faults or --byzantine: tune a plain comparison, then run those at its settings")
    if args.seeds > 1 and args.faults:
        p.error("--faults with --seeds: run the faults with one seed (they are scenarios, not samples)")
    if args.tune and args.tuned_from:
        p.error("--tune and --tuned-from: tune again, or take an earlier tuning, not both")
    if args.map:
        given = [
            flag
            for flag, value in (
                ("--link-mbit", args.link_mbit),
                ("--link-delay-ms", args.link_delay_ms),
                ("--straggler", args.straggler != 1.0),
                ("--faults", args.faults),
                ("--byzantine", args.byzantine),
            )
            if value
        ]
        if given:
            p.error(
                f"--map sets the links and the straggler per cell (--map-rates, --map-delays, --map-stragglers); "
                f"drop {', '.join(given)}"
            )
        try:
            args.grid = cells(args.map_rates, args.map_delays, args.map_stragglers)
        except MapError as exc:
            p.error(str(exc))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error(
                f"--device cuda: torch {torch.__version__} sees no GPU here (built with CUDA "
                f"{torch.version.cuda or 'none'}); use --device cpu"
            )
    if args.link_delay_ms is not None and args.link_mbit is None:
        p.error("--link-delay-ms needs --link-mbit (a delay is a property of the shaped links)")
    charlm_data = args.data == "stdlib" or args.data.startswith("text:")
    if args.workload is None:
        if charlm_data:
            args.workload = "charlm"
        elif args.data == "auto":
            prepared = (args.data_dir / "data_batch_1").is_file() and (args.data_dir / "test_batch").is_file()
            args.workload = "cifar10" if prepared else "digits"
        else:
            args.workload = args.data
    if args.workload == "charlm":
        if args.data == "auto":
            args.data = "stdlib"
        elif not charlm_data:
            p.error(f"--workload charlm trains on text: --data must be stdlib or text:PATH, got {args.data}")
        for option, value in (("--epochs", args.epochs), ("--target-acc", args.target_acc)):
            if value is not None:
                p.error(f"{option} is for the image workloads; charlm counts --steps and aims at --target-loss")
        if args.model is not None and args.model not in CHARLM_MODELS:
            p.error(f"--model for charlm must be one of {', '.join(CHARLM_MODELS)}, got {args.model}")
    else:
        if args.data == "auto":
            args.data = args.workload
        elif args.data != args.workload:
            p.error(f"--workload {args.workload} and --data {args.data} disagree")
        if args.target_loss is not None:
            p.error("--target-loss is for --workload charlm; the image workloads aim at --target-acc")
        if args.model is not None and args.model not in ("small", "resnet18"):
            p.error(f"--model for images must be small or resnet18, got {args.model}")
    if args.also_target and not args.map:
        p.error("--also-target is for --map (one grid of runs judged at several targets)")
    if args.workload != "charlm" and any(t > 1 for t in args.also_target):
        p.error(f"--also-target for images is an accuracy in (0, 1], got {', '.join(map(str, args.also_target))}")
    return args


def config_from(args: argparse.Namespace) -> CompareConfig:
    if args.workload == "charlm":
        d = CHARLM_DEFAULTS
        spec = WorkloadSpec(
            data=args.data,
            data_dir=str(args.data_dir),
            workers=args.workers,
            epochs=1,
            steps=args.steps or (40 if args.quick else d.steps),
            batch_size=args.batch_size or d.batch_size,
            lr=args.lr if args.lr is not None else d.lr,
            optimizer=d.optimizer,
            weight_decay=d.weight_decay,
            seed=args.seed,
            model=args.model or "small",
            straggler=args.straggler,
            eval_points=12 if args.quick else d.eval_points,
            eval_windows=d.eval_windows,
            warmup=d.warmup,
            workload="charlm",
            device=args.device,
        )
        target = args.target_loss if args.target_loss is not None else d.target_loss
    else:
        batch, lr, epochs = DATA_DEFAULTS[args.data]
        spec = WorkloadSpec(
            data=args.data,
            data_dir=str(args.data_dir),
            workers=args.workers,
            epochs=args.epochs or (6 if args.quick else epochs),
            steps=args.steps or 0,
            batch_size=args.batch_size or batch,
            lr=args.lr if args.lr is not None else lr,
            seed=args.seed,
            model=args.model or "small",
            straggler=args.straggler,
            eval_points=12 if args.quick else 80,
            device=args.device,
        )
        target = args.target_acc if args.target_acc is not None else TARGETS[args.data]
    options = RunOptions(
        lease_s=args.lease_s,
        sufficient=args.num_gradients_sufficient,
        ps_servers=args.ps_servers,
        time_limit_s=args.time_limit_s,
        diloco_period=args.diloco_period,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        link_mbit=args.link_mbit or 0.0,
        link_delay_ms=args.link_delay_ms or 0.0,
        gossip_settings=gossip_settings(args.gossip_set),
        variants=args.variants,
        byzantine=args.byzantine,
        attack=args.attack,
        churn=args.churn or 0,
    )
    check_gossip_systems(args.systems, options)
    out = args.out or Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    return CompareConfig(
        args.systems, spec, options, target, out, faults=args.faults, keep_snapshots=args.keep_snapshots
    )


def gossip_settings(pairs: list[str]) -> tuple[tuple[str, Any], ...]:
    """--gossip-set KEY=VALUE pairs, each value read as YAML, checked as dpwa's config checks them."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--gossip-set {pair!r}: expected KEY=VALUE")
        settings[key.strip()] = yaml.safe_load(text)
    if "nodes" in settings:
        raise ValueError("--gossip-set nodes=...: the comparison places the nodes itself")
    probe = {"nodes": [{"name": f"w{i}", "host": "127.0.0.1", "port": 1 + i} for i in range(2)], **settings}
    parse_config(probe, source="--gossip-set")  # a bad key or value is named here, before anything runs
    return tuple(settings.items())


def variants(given: list[str]) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """--variant NAME=MAP arguments: (gossip-NAME, the map's items), each NAME once, none a built-in system's."""
    out: dict[str, tuple[tuple[str, Any], ...]] = {}
    for text in given:
        name, sep, body = text.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9_]{0,31}", name):
            raise ValueError(
                f"--variant {text!r}: expected NAME=MAP, NAME of lower-case letters, digits and _ (at most 32), "
                "as in heavy='{rule: \"heavyball:HeavyBall\", mode: pull}'"
            )
        system = VARIANT_PREFIX + name
        if system in KNOWN_SYSTEMS or system in out:
            raise ValueError(f"--variant {name}: {system} is already a system; choose another NAME")
        try:
            keys = yaml.safe_load(body)
        except yaml.YAMLError as exc:
            raise ValueError(f"--variant {name}: its MAP is not YAML ({exc})") from exc
        if not isinstance(keys, dict) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError(
                f"--variant {name}: expected a map of dpwa config keys, like {{rule: delta}}; got {body!r}"
            )
        if "nodes" in keys:
            raise ValueError(f"--variant {name}: nodes: the comparison places the nodes itself")
        out[system] = tuple(keys.items())
    return tuple(out.items())


def check_gossip_systems(systems: tuple[str, ...], options: RunOptions) -> None:
    """Each gossip system's keys (a built-in one's own with the --gossip-set ones over them, a variant's over
    those) checked as dpwa's config checks them: ``--gossip-set mode=symmetric`` with gossip-pushsum, whose rule
    needs mode pull, or a variant's rule that cannot be imported, is named here, before anything runs."""
    nodes = [{"name": f"w{i}", "host": "127.0.0.1", "port": 1 + i} for i in range(2)]
    variants = dict(options.variants)
    for system in systems:
        if is_gossip(system):
            probe = {"nodes": nodes, **gossip_keys(system, options)}
            given = " with --gossip-set" if options.gossip_settings else ""
            parse_config(
                probe, source=f"--variant {system[len(VARIANT_PREFIX) :]}" if system in variants else system + given
            )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def outputs_line(out_dir: Path, drawn: bool, json_path: Path | None, report: dict[str, Any]) -> str:
    """The last line: the files written, and how long the whole command took."""
    return (
        f"\n{out_dir / 'compare.json'}"
        + (f", {out_dir / 'compare.png'}" if drawn else "")
        + (f", {json_path}" if json_path else "")
        + f"; {report['wall_s']:.0f} s in all"
    )


def tuning_lines(tuned: dict[str, Any]) -> str:
    """Each system's trials, best first, and what it will be measured with."""
    lines = [f"tuning: {tuned['trials_per_system']} trials per system at seed {tuned['seed']}"]
    for system, entry in tuned["systems"].items():
        lines.append(f"  {system}: best {entry['best']}")
        ranked = sorted(entry["trials"], key=lambda t: float("inf") if t["score"] is None else t["score"])
        for t in ranked:
            final = "failed" if t["final"] is None else f"{t['final']:.4f}"
            lines.append(f"    {final:>8}  {t['settings']}")
    return "\n".join(lines)


def run_once(config: CompareConfig, tuned: dict[str, Any] | None) -> dict[str, Any]:
    """One comparison at `config`'s seed: every system at the shared settings, or (tuned) each at its best
    settings, system by system, merged into one report (each system's own settings in ``tuned_settings``)."""
    if tuned is None:
        return run_comparison(config)
    report: dict[str, Any] | None = None
    for system in config.systems:
        best = tuned["systems"][system]["best"]
        one = replace(apply(config, system, best, config.spec.seed), out_dir=config.out_dir / system)
        part = run_comparison(one)
        part["systems"][system]["tuned_settings"] = best
        if report is None:
            report = part
        else:
            report["systems"].update(part["systems"])
            report["evaluated_model"].update(part["evaluated_model"])
    assert report is not None
    report["tuning"] = tuned
    return report


def run_seeds(
    config: CompareConfig,
    args: argparse.Namespace,
    argv: list[str] | None,
    started: float,
    tuned: dict[str, Any] | None = None,
) -> int:
    """--seeds K: the comparison once per seed, each in OUT/seed-S; then the means with their intervals, a plot
    with bands (OUT/compare.png) and one JSON with every seed's report (OUT/compare.json)."""
    seeds = [args.seed + i for i in range(args.seeds)]
    reports: list[dict[str, Any]] = []
    for seed in seeds:
        print(f"== seed {seed} ({len(reports) + 1} of {len(seeds)})", flush=True)
        one = replace(config, spec=replace(config.spec, seed=seed), out_dir=config.out_dir / f"seed-{seed}")
        report = run_once(one, tuned)
        write_json(report, one.out_dir / "compare.json")
        print(table(report), flush=True)
        reports.append(report)
    agg = aggregate(reports, seeds)
    by_loss = "target_loss" in reports[0]
    target = f"loss {reports[0]['target_loss']:g}" if by_loss else f"{100 * reports[0]['target_acc']:.0f}%"
    print("\n" + seeds_table(agg, target, by_loss))
    combined = {
        "command": "python -m dpwa.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": seeds,
        "aggregate": agg,
        "tuning": tuned,
        "runs": reports,
        "wall_s": time.monotonic() - started,
    }
    write_json(combined, config.out_dir / "compare.json")
    if args.json is not None:
        write_json(combined, args.json)
    print(outputs_line(config.out_dir, plot_seeds(reports, config.out_dir / "compare.png"), args.json, combined))
    failed = [name for name, e in agg["systems"].items() if e["completed"] < len(seeds)]
    return 1 if failed else 0


def run_regimes(
    config: CompareConfig,
    args: argparse.Namespace,
    argv: list[str] | None,
    started: float,
    tuned: dict[str, Any] | None,
) -> int:
    """--map: tune once at full speed (or reuse OUT/tuning.json, or --tuned-from), then every cell of the grid at
    every seed; OUT/map.md, OUT/map.png and OUT/map.json."""
    if args.tune:
        saved = config.out_dir / "tuning.json"
        if saved.is_file():
            tuned = load_tuning(saved, config.systems)
            if tuned.get("trials_per_system") != args.tune:
                raise MapError(
                    f"{saved} holds {tuned.get('trials_per_system')} trials per system, not --tune {args.tune}; "
                    "use another --out"
                )
            print(f"tuned before, read from {saved}:\n" + tuning_lines(tuned) + "\n", flush=True)
        else:
            tuned = tune(config, args.tune)
            write_json({"tuning": tuned}, saved)
            print("\n" + tuning_lines(tuned) + "\n", flush=True)
    seeds = [args.seed + i for i in range(args.seeds)]
    by_cell = collect(config, args.grid, seeds, lambda one: run_once(one, tuned), tuned)
    spec = config.spec
    budget = f"{spec.steps} steps" if spec.steps else f"{spec.epochs} epochs"
    result: dict[str, Any] = {
        "command": "python -m dpwa.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": seeds,
        "tuning": tuned,
        "maps": {},
    }
    written = []
    for target in (config.target, *args.also_target):
        goal = f"loss {target:g}" if config.metric == "loss" else f"{100 * target:g}%"
        print(f"\nfirst to {goal}:", flush=True)
        found = {"target": target, "cells": decide_grid(by_cell, seeds, None if target == config.target else target)}
        result["maps"][f"{target:g}"] = found
        title = f"{spec.data}, {spec.workers} workers, {budget}: first to {goal}, {len(seeds)} seed(s) per cell"
        text = map_table(found)
        stem = "map" if target == config.target else f"map-{target:g}"
        (config.out_dir / f"{stem}.md").write_text(f"{title}\n\n{text}\n")
        written.append(config.out_dir / f"{stem}.md")
        if plot_map(found, config.out_dir / f"{stem}.png", title):
            written.append(config.out_dir / f"{stem}.png")
        print(f"\n{title}\n{text}")
    result["wall_s"] = time.monotonic() - started
    write_json(result, config.out_dir / "map.json")
    print(
        "\n" + ", ".join(str(p) for p in [*written, config.out_dir / "map.json"]) + f"; {result['wall_s']:.0f} s in all"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from(args)
        if args.link_mbit:
            check_root()
            check_delay(args.link_delay_ms or 0.0)
        if args.map:
            check_root()
            check_delay(max(args.map_delays))
    except (ValueError, LinksUnavailable) as exc:
        print(f"dpwa.compare: {exc}", file=sys.stderr)
        return 2
    if not args.map and config.out_dir.exists() and any(config.out_dir.iterdir()):
        print(f"dpwa.compare: {config.out_dir} exists and is not empty; choose another --out", file=sys.stderr)
        return 2
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: every process stopped
    tuned = None
    try:
        if args.tuned_from is not None:
            tuned = load_tuning(args.tuned_from, config.systems)
            print(f"measuring at the settings tuned in {args.tuned_from}:\n" + tuning_lines(tuned) + "\n", flush=True)
        if args.map:
            return run_regimes(config, args, argv, started, tuned)
        if args.seeds > 1 or args.tune or tuned is not None:
            if args.tune:
                tuned = tune(config, args.tune)
                print("\n" + tuning_lines(tuned) + "\n", flush=True)
            return run_seeds(config, args, argv, started, tuned)
        report = run_comparison(config)
    except (FileNotFoundError, ValueError, LinksUnavailable) as exc:
        print(f"dpwa.compare: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"dpwa.compare: stopped ({exc or 'SIGINT'}); every process of the run was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report["command"] = "python -m dpwa.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    report["wall_s"] = time.monotonic() - started
    print()
    print(table(report))
    spec = config.spec
    links = link_lines(report)
    if links:
        print("\n" + links)
    masses = mass_lines(report)
    if masses:
        print("\n" + masses)
    print(f"\nmodel evaluated: {'; '.join(f'{s}: {m}' for s, m in report['evaluated_model'].items())}")
    budget = f"{spec.steps} steps per worker" if spec.steps else f"{spec.epochs} epochs"
    print(
        f"{report['evaluation_rule']}. {spec.data}, {spec.workers} workers, batch {spec.batch_size} per worker, "
        f"{budget}"
        + (f", worker w{spec.workers - 1} {spec.straggler:g}x slower" if spec.straggler > 1 else "")
        + (f"; DiLoCo every {config.options.diloco_period} steps" if "diloco" in config.systems else "")
        + (f"; {args.byzantine} Byzantine worker(s) per gossip system, attack {args.attack}" if args.byzantine else "")
    )
    if any(s.get("bytes_estimated") for s in report["systems"].values()):
        print("* all-reduce and DiLoCo bytes are computed (ring all-reduce), not counted")
    for name, system in report["systems"].items():
        if system.get("nonfinite_points"):
            print(
                f"! {name}: {system['nonfinite_points']} evaluated models gave a NaN loss (a BatchNorm "
                "running variance below zero? a diverged run?); they count as misses"
            )
    if report.get("faults"):
        print("\nfaults:\n" + fault_lines(report))
    write_json(report, config.out_dir / "compare.json")
    if args.json is not None:
        write_json(report, args.json)
    print(outputs_line(config.out_dir, plot(report, config.out_dir / "compare.png"), args.json, report))
    failed = [s for s, r in report["systems"].items() if not r["completed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
