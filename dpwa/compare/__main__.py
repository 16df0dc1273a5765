"""Compare gossip with synchronous SGD with a master, asynchronous parameter servers and all-reduce.

Every system trains the same model on the same data shards, with the same
batch size, learning-rate schedule and seed, on this machine; each is then
evaluated by the same rule (see dpwa/compare/evaluation.py). Commands (from
the repository root)::

    python -m dpwa.compare                                  # every system, 4 workers (a few minutes)
    python -m dpwa.compare --straggler 4                    # the last worker 4x slower per step
    python -m dpwa.compare --faults --json compare.json     # and kill a process of each system
    python -m dpwa.compare --quick --systems gossip,allreduce   # a short smoke run

It prints a table (time and samples to the target accuracy, final accuracy,
bytes per worker per step, the fraction of time workers sat idle), writes
OUT/compare.png (accuracy against wall time and against samples) and
OUT/compare.json, and with --json FILE the same JSON there too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .comparison import CompareConfig, run_comparison
from .report import fault_lines, plot, table, write_json
from .runner import SYSTEMS, RunOptions
from .workload import DATA_DEFAULTS, EXAMPLE, ExampleMissing, WorkloadSpec, example_available

TARGETS = {"digits": 0.97, "cifar10": 0.70}  # default target test accuracy per dataset


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown system {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}"
        )
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dpwa.compare", description=__doc__.split("\n")[0])
    p.add_argument("--systems", type=_systems, default=SYSTEMS, help=f"comma-separated (default: {','.join(SYSTEMS)})")
    p.add_argument("--workers", type=_positive_int, default=4, help="workers per system (default: %(default)s)")
    p.add_argument("--epochs", type=_positive_int, help="passes over the training set (default: 30; --quick: 6)")
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
        "--data",
        choices=("auto", *DATA_DEFAULTS),
        default="auto",
        help="auto (default): cifar10 when prepared, else the embedded digits",
    )
    p.add_argument("--data-dir", type=Path, default=EXAMPLE / "data" / "cifar-10-batches-py")
    p.add_argument("--batch-size", type=_positive_int, help="per worker and step (default: 32 digits, 128 cifar10)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.05 digits, 0.1 cifar10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-acc", type=float, help="target test accuracy (default: 0.97 digits, 0.70 cifar10)")
    p.add_argument(
        "--faults",
        action="store_true",
        help="also kill a sync worker mid-task, a parameter server, a trainer, a gossip node and a rank",
    )
    p.add_argument("--ps-servers", type=_positive_int, default=2, help="parameter servers (default: %(default)s)")
    p.add_argument("--lease-s", type=float, default=5.0, help="sync master's task lease (default: %(default)s)")
    p.add_argument(
        "--num-gradients-sufficient",
        type=_positive_int,
        help="sync master: gradients per step (default: the number of live workers)",
    )
    p.add_argument("--time-limit-s", type=float, default=600.0, help="per run (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a short run (6 epochs, fewer curve points): a smoke test")
    p.add_argument("--keep-snapshots", action="store_true", help="keep every evaluated model state in OUT/work")
    args = p.parse_args(argv)
    if not 1 <= args.straggler <= 100:
        p.error(f"--straggler must be in [1, 100], got {args.straggler}")
    if args.target_acc is not None and not 0 < args.target_acc <= 1:
        p.error(f"--target-acc must be in (0, 1], got {args.target_acc}")
    if args.lease_s <= 0 or args.time_limit_s <= 0:
        p.error("--lease-s and --time-limit-s must be positive")
    return args


def config_from(args: argparse.Namespace) -> CompareConfig:
    data = args.data
    if data == "auto":
        from_dir = (args.data_dir / "data_batch_1").is_file() and (args.data_dir / "test_batch").is_file()
        data = "cifar10" if from_dir else "digits"
    batch, lr, epochs = DATA_DEFAULTS[data]
    spec = WorkloadSpec(
        data=data,
        data_dir=str(args.data_dir),
        workers=args.workers,
        epochs=args.epochs or (6 if args.quick else epochs),
        batch_size=args.batch_size or batch,
        lr=args.lr if args.lr is not None else lr,
        seed=args.seed,
        straggler=args.straggler,
        eval_points=12 if args.quick else 80,
    )
    options = RunOptions(
        lease_s=args.lease_s,
        sufficient=args.num_gradients_sufficient,
        ps_servers=args.ps_servers,
        time_limit_s=args.time_limit_s,
    )
    out = args.out or Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    target = args.target_acc if args.target_acc is not None else TARGETS[data]
    return CompareConfig(
        args.systems, spec, options, target, out, faults=args.faults, keep_snapshots=args.keep_snapshots
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not example_available():
        print(f"dpwa.compare: {ExampleMissing.__doc__} ({EXAMPLE})", file=sys.stderr)
        return 2
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"dpwa.compare: {exc}", file=sys.stderr)
        return 2
    if config.out_dir.exists() and any(config.out_dir.iterdir()):
        print(f"dpwa.compare: {config.out_dir} exists and is not empty; choose another --out", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        report = run_comparison(config)
    except (FileNotFoundError, ValueError, ExampleMissing) as exc:
        print(f"dpwa.compare: {exc}", file=sys.stderr)
        return 2
    report["command"] = "python -m dpwa.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    report["wall_s"] = time.monotonic() - started
    print()
    print(table(report))
    spec = config.spec
    print(f"\nmodel evaluated: {'; '.join(f'{s}: {m}' for s, m in report['evaluated_model'].items())}")
    print(
        f"{report['evaluation_rule']}. {spec.data}, {spec.workers} workers, batch {spec.batch_size} per worker, "
        f"{spec.epochs} epochs"
        + (f", worker w{spec.workers - 1} {spec.straggler:g}x slower" if spec.straggler > 1 else "")
    )
    if any(s.get("bytes_estimated") for s in report["systems"].values()):
        print("* all-reduce bytes are computed (ring all-reduce), not counted")
    for name, system in report["systems"].items():
        if system.get("nonfinite_points"):
            print(
                f"! {name}: {system['nonfinite_points']} evaluated models gave a NaN test loss (a BatchNorm "
                "running variance below zero?); they count as misses"
            )
    if report.get("faults"):
        print("\nfaults:\n" + fault_lines(report))
    write_json(report, config.out_dir / "compare.json")
    if args.json is not None:
        write_json(report, args.json)
    drawn = plot(report, config.out_dir / "compare.png")
    print(
        f"\n{config.out_dir / 'compare.json'}"
        + (f", {config.out_dir / 'compare.png'}" if drawn else "")
        + (f", {args.json}" if args.json else "")
        + f"; {report['wall_s']:.0f} s in all"
    )
    failed = [s for s, r in report["systems"].items() if not r["completed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
