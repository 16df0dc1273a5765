"""Run the example as a cluster on this machine: what ./run.sh does once .venv is ready.

    ./run.sh                                  # one node per core (at least 2), until done
    ./run.sh --nodes 3 --epochs 5             # three nodes, five epochs
    ./run.sh --detach                         # in the background; ./stop.sh stops it
    ./run.sh --dashboard                      # and a live web page of it (prints its URL)
    ./run.sh --config samples/local-2.yaml    # a config of your own (here: two nodes, fixed ports)
    ./run.sh --workload charlm                # a character-level transformer on Python's own source
    ./run.sh --help

Writes a config for the nodes (127.0.0.1, free ports) into a new run folder
under runs/, starts examples/pytorch-cifar/train.py once per node, shows a
live table, and at the end prints a summary (each node's test accuracy, and
that of the average of their weights) and draws curves.png. With
``--workload charlm`` the test accuracy is the next-character accuracy, the
test loss is the validation loss (nats per character), and curves.png shows
the validation loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import data as datasets  # noqa: E402
import models  # noqa: E402
import schedule as training_schedule  # noqa: E402
import text as texts  # noqa: E402

from dpwa import ConfigError  # noqa: E402
from dpwa.cluster import launch, runner  # noqa: E402
from dpwa.runfiles import checkpoints  # noqa: E402

# Options passed through to every train.py unchanged (None: train.py's default).
TRAIN_OPTIONS = (
    "model",
    "width",
    "epochs",
    "steps_per_epoch",
    "batch_size",
    "lr",
    "shard",
    "device",
    "seed",
    "log_every",
    "linger_s",
    "barrier_timeout_s",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="./run.sh",
        usage="./run.sh [options]  (the example)  |  ./run.sh [options] -- COMMAND [ARG ...]  (your own script)",
        description="Start a local dpwa training cluster of the pytorch-cifar example. To run a script of your "
        "own on the cluster instead, give it after '--': ./run.sh --nodes 4 -- python my_train.py (python -m dpwa "
        "run --help).",
        epilog="Every node's own options: .venv/bin/python examples/pytorch-cifar/train.py --help",
    )
    runner.add_launch_options(p)  # the cluster, failures, the dashboard, the processes: as python -m dpwa run
    g = p.add_argument_group("this example's run")
    g.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR (its config and options) from its latest complete checkpoint",
    )
    g.add_argument(
        "--barrier-timeout-s", type=float, help="how long nodes wait for missing ones at a barrier (default: 300)"
    )
    g = p.add_argument_group("training (passed to every train.py)")
    g.add_argument(
        "--workload",
        choices=texts.WORKLOADS,
        help="digits or cifar10 (a ResNet on images), or charlm (a character-level transformer on the "
        "Python standard library's source); default: as --data says",
    )
    g.add_argument(
        "--data",
        default="auto",
        type=texts.data_source,
        help="images: auto: cifar10 if prepare.sh has run, else the embedded digits (default: "
        "%(default)s), digits, cifar10; charlm: stdlib (default) or text:PATH",
    )
    g.add_argument(
        "--data-dir",
        type=Path,
        default=datasets.DEFAULT_CIFAR_DIR,
        help="CIFAR-10 batches folder (default: examples/pytorch-cifar/data/cifar-10-batches-py)",
    )
    g.add_argument(
        "--epochs", type=int, help="default: 20 on digits (more if needed for 100 steps per node), 30 on cifar10"
    )
    g.add_argument("--steps-per-epoch", type=int, help="cap on batches per epoch (quick trials)")
    g.add_argument(
        "--model",
        choices=("auto",) + models.MODELS + ("tiny",),
        help="images: auto (default): resnet18 on a GPU, small on a CPU; charlm: small (auto) or tiny",
    )
    g.add_argument("--width", type=int, help="channels of the small model's first stage (default: 16)")
    g.add_argument("--batch-size", type=int, help="default: 32 on digits, 128 on cifar10, 32 on charlm")
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate of every node (default: 0.1 on cifar10, 0.01 on charlm; on digits "
        "0.05 x nodes / 2, at most 0.4, after a warm-up: examples/pytorch-cifar/schedule.py)",
    )
    g.add_argument(
        "--shard",
        choices=("auto", "none"),
        help="auto (default): a disjoint part of the data per node; none: all of it",
    )
    g.add_argument("--device", help="auto (default: a GPU when there is one), cpu, cuda or cuda:N")
    g.add_argument("--seed", type=int, help="initial weights, equal on every node (default: 0)")
    g.add_argument("--log-every", type=int, help="steps between metrics lines (default: 5)")
    g.add_argument(
        "--linger-s", type=float, help="how long a finished node may keep serving slower peers (default: 60)"
    )
    args = p.parse_args(argv)
    runner.check_launch_options(p, args)
    args.auto_data = args.data == "auto" and args.workload is None
    try:
        args.workload, args.data = texts.resolve_workload(args.workload, args.data, args.data_dir)
    except ValueError as exc:
        p.error(str(exc))
    if args.resume is not None and (args.config or args.nodes or args.base_port):
        p.error("--resume continues a run with its own config: leave out --config, --nodes and --base-port")
    if args.resume is not None:
        changed = [f"--{o.replace('_', '-')}" for o in TRAIN_OPTIONS if o != "epochs" and getattr(args, o) is not None]
        if changed:
            p.error(
                f"--resume continues a run with its own training options; only --epochs may change "
                f"(got {', '.join(changed)})"
            )
    return args


def resume(args: argparse.Namespace) -> int:
    """Run RUN_DIR again, every node continuing from the run's latest complete checkpoint.

    ``--epochs N`` changes how many epochs the run trains in all (more, or fewer than it was started
    with, but more than it has trained); the learning rate's cosine then spans the N epochs.
    """
    try:
        spec = launch.LaunchSpec.load(args.resume)
        names = spec.local_names
        epoch = checkpoints.latest_complete(args.resume, [n["name"] for n in spec.config["nodes"]])
        if epoch is None:
            raise ConfigError(
                f"{args.resume}: no complete checkpoint of every node ({', '.join(names)}) to resume from"
            )
        command = spec.command if "--resume" in spec.command else spec.command + ["--resume"]
        if args.epochs is not None:
            command = with_epochs(args.resume, spec, command, epoch, args.epochs)
        spec = launch.prepare(
            dataclasses.replace(
                spec,
                command=command,
                **runner.supervision(args),
            )
        )
    except (ConfigError, OSError, ValueError, checkpoints.CheckpointError) as exc:
        print(f"./run.sh: {exc}", file=sys.stderr)
        return 2
    what = (
        "the state every node saved when it was stopped"
        if epoch == checkpoints.LAST
        else (f"the checkpoint of epoch {epoch}")
    )
    print(f"dpwa: resuming {args.resume} from {what}", flush=True)
    return launch.detach(spec) if args.detach else launch.run(spec)


def with_epochs(run_dir: Path, spec: launch.LaunchSpec, command: list[str], epoch: int | str, epochs: int) -> list[str]:
    """The node command with --epochs `epochs`; a ValueError unless that is more than the run has trained."""
    if epoch == checkpoints.LAST:  # each node saved how far it got when it was stopped
        done = max(int(checkpoints.load(run_dir, epoch, name)["progress"]["epoch"]) for name in spec.local_names)
    else:
        done = int(epoch)
    before = command[command.index("--epochs") + 1] if "--epochs" in command[:-1] else "its default"
    if epochs <= done:
        raise ValueError(
            f"{run_dir} has trained {done} epochs; --epochs {epochs} must be more than that to train on "
            f"(leave --epochs out to train to {before})"
        )
    kept = []
    skip = False
    for i, word in enumerate(command):  # drop the old --epochs N
        if skip:
            skip = False
        elif word == "--epochs" and i + 1 < len(command):
            skip = True
        else:
            kept.append(word)
    print(
        f"dpwa: --epochs {epochs}: the run trains {epochs} epochs in all (it was started with {before}); "
        f"the learning rate's cosine now spans the {epochs} epochs",
        flush=True,
    )
    return kept + ["--epochs", str(epochs)]


def warn_few_steps(args: argparse.Namespace, data: str, nodes: int) -> None:
    """Say so when --epochs gives each node fewer steps than the data needs (schedule.py), naming the numbers."""
    if args.epochs is None or data not in training_schedule.DEFAULTS or args.workload == "charlm":
        return  # charlm needs no minimum of steps (its data is no image set)
    try:
        train_images = len(datasets.load(data, args.data_dir).train_y)
    except (FileNotFoundError, ValueError):
        return  # the nodes will say what is wrong with the data
    shard = train_images // nodes if args.shard != "none" else train_images  # the smallest shard
    batch_size = args.batch_size or training_schedule.DEFAULTS[data]["batch_size"]
    steps = min(shard // batch_size, args.steps_per_epoch or shard // batch_size)
    warning = training_schedule.few_steps_warning(data, nodes, shard, batch_size, steps, args.epochs)
    if warning:
        print(f"dpwa: warning: {warning}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resume is not None:
        return resume(args)
    data = args.data
    try:
        config, local = runner.cluster_config(args, source="./run.sh options")
        print(
            f"dpwa: training the example ({HERE.relative_to(HERE.parent.parent)}/train.py) on "
            f"{len(local) or len(config['nodes'])} nodes; a script of your own: ./run.sh [options] -- python SCRIPT",
            flush=True,
        )
        if args.auto_data and args.workload == "digits":
            print(
                "dpwa: CIFAR-10 is not prepared (examples/pytorch-cifar/prepare.sh), so the nodes train on the "
                "embedded handwritten digits (1,797 8x8 images shipped with dpwa)",
                flush=True,
            )
        warn_few_steps(args, data, len(config["nodes"]))
        run_dir = launch.new_run_dir(args.runs_dir)
        runner.key_run(args, config, run_dir)
        # The CIFAR-10 folder only where the nodes read it: hints built from these commands name the data used.
        data_dir = ["--data-dir", str(args.data_dir.resolve())] if data == "cifar10" else []
        command = [
            sys.executable,
            str(HERE / "train.py"),
            "--config",
            "{config}",
            "--name",
            "{name}",
            "--run-dir",
            "{run_dir}",
            "--workload",
            args.workload,
            "--data",
            data,
            *data_dir,
        ]
        for option in TRAIN_OPTIONS:
            value = getattr(args, option)
            if value is not None:
                command += [f"--{option.replace('_', '-')}", str(value)]
        spec = launch.prepare(
            launch.LaunchSpec(
                run_dir=str(run_dir),
                config=config,
                command=command,
                local=local,
                finish_command=[sys.executable, str(HERE / "evaluate.py"), "{run_dir}", *data_dir],
                pin=not args.no_pin,
                **runner.supervision(args),
            )
        )
    except (ConfigError, OSError) as exc:
        print(f"./run.sh: {exc}", file=sys.stderr)
        return 2
    return launch.detach(spec) if args.detach else launch.run(spec)


if __name__ == "__main__":
    sys.exit(main())
