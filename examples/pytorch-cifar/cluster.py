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
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import data as datasets  # noqa: E402
import models  # noqa: E402
import schedule as training_schedule  # noqa: E402
import text as texts  # noqa: E402

import dpwa.config  # noqa: E402
import dpwa.mixing.pairing  # noqa: E402
from dpwa import ConfigError, load_config, parse_config  # noqa: E402
from dpwa.cluster import checkpoints, launch, processes  # noqa: E402
from dpwa.cluster.keys import key_nodes  # noqa: E402
from dpwa.cluster.private import make_private_dir, make_private_file  # noqa: E402
from dpwa.mixing import rules  # noqa: E402
from dpwa.wire.endpoints import is_loopback  # noqa: E402

DEFAULTS = {f.name: f.default for f in dataclasses.fields(dpwa.config.Config)}  # dpwa's, shown in --help
PRESET_KEYS = ("mode", "rule", "pairing", "wire_dtype", "period")  # options that leave a preset's keys alone

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


def default_nodes() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cores)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="./run.sh",
        description="Start a local dpwa training cluster of the pytorch-cifar example.",
        epilog="Every node's own options: .venv/bin/python examples/pytorch-cifar/train.py --help",
    )
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--nodes", type=int, help=f"number of nodes (default: one per core, at least 2; here {default_nodes()})"
    )
    g.add_argument(
        "--host", default="127.0.0.1", help="address the nodes listen on and reach each other at (default: %(default)s)"
    )
    g.add_argument("--base-port", type=int, help="ports BASE..BASE+N-1 (default: free ports picked at start)")
    g.add_argument(
        "--config", type=Path, help="use this cluster config (hosts, ports, settings) instead of writing one"
    )
    g.add_argument("--only", help="with --config: the comma-separated nodes to start on this machine (default: all)")
    g.add_argument(
        "--fetch-probability", type=float, default=1.0, help="config: chance of a fetch per step (default: %(default)s)"
    )
    g.add_argument("--timeout-ms", type=int, default=1000, help="config: deadline of one fetch (default: %(default)s)")
    g.add_argument(
        "--interpolation",
        default="constant",
        choices=("constant", "clock", "loss"),
        help="config: how the blend factor is chosen (default: %(default)s)",
    )
    g.add_argument(
        "--factor", type=float, default=0.5, help="config: constant.value, the blend factor f (default: %(default)s)"
    )
    g.add_argument(
        "--mode",
        default=None,
        choices=dpwa.config.MODES,
        help=f"config: symmetric (both sides move) or pull (only the requester; the original's) "
        f"(default: {DEFAULTS['mode']})",
    )
    g.add_argument(
        "--rule",
        "--blend",
        dest="rule",
        default=None,
        help=f"config: the mixing rule: {', '.join(sorted(rules.builtin()))}, or module.path:ClassName "
        f"(docs/rules.md); --blend is its older name (default: {DEFAULTS['rule']})",
    )
    g.add_argument(
        "--pairing",
        default=None,
        choices=dpwa.mixing.pairing.PAIRINGS,
        help="config: auto (hypercube for 2, 4, 8, ... nodes, else random), random (a peer by score; in mode "
        "symmetric a node starts in half its steps), or hypercube (a power of two of nodes) "
        f"(default: {DEFAULTS['pairing']})",
    )
    g.add_argument(
        "--wire-dtype",
        default=None,
        choices=dpwa.config.WIRE_DTYPES,
        help=f"config: dtype of parameters on the wire (default: {DEFAULTS['wire_dtype']})",
    )
    g.add_argument(
        "--period",
        type=int,
        default=None,
        help=f"config: start an exchange every PERIOD steps (default: {DEFAULTS['period']})",
    )
    g.add_argument(
        "--preset",
        default=DEFAULTS["preset"],
        choices=dpwa.config.PRESETS,
        help="config: low_bandwidth (period 8, int8) or original (the 2017 rule: pull, state, random); the "
        "options above given explicitly win (default: %(default)s)",
    )
    g = p.add_argument_group("failures")
    g.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR (its config and options) from its latest complete checkpoint",
    )
    g.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="start a node that dies again, up to this many times each; it rejoins from its peers "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--chaos",
        type=float,
        nargs="?",
        const=8.0,
        metavar="SECONDS",
        help="chaos mode: SIGKILL a random training node every SECONDS on average (default 8), and "
        "start it again (needs --restarts N; default then 3)",
    )
    g.add_argument("--chaos-seed", type=int, help="the randomness of --chaos (default: a new one each run)")
    g.add_argument(
        "--barrier-timeout-s", type=float, help="how long nodes wait for missing ones at a barrier (default: 300)"
    )
    g = p.add_argument_group("dashboard")
    g.add_argument(
        "--dashboard",
        action="store_true",
        help="serve a live web page of the cluster on 127.0.0.1 while it runs (prints its URL; "
        "it stops with the cluster)",
    )
    g.add_argument("--dashboard-port", type=int, default=0, help="the dashboard's port (default: a free one)")
    g.add_argument(
        "--allow-kill",
        action="store_true",
        help="with --dashboard: a kill button per node (SIGKILL, as --chaos does), behind a secret "
        "token in the printed URL",
    )
    g = p.add_argument_group("processes")
    g.add_argument("--detach", action="store_true", help="leave the cluster in the background and return")
    g.add_argument("--no-pin", action="store_true", help="do not pin each node to its own core")
    g.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping (default: %(default)s)",
    )
    g.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where run folders go (default: %(default)s)")
    g.add_argument(
        "--print-every",
        type=float,
        default=10.0,
        help="seconds between progress lines when the output is not a terminal (default: %(default)s)",
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
    if args.config is None and args.only:
        p.error("--only needs --config (without --config every node runs here)")
    if args.config is not None and (args.nodes or args.base_port):
        p.error("--nodes and --base-port describe a generated config; with --config the file says both")
    if args.nodes is not None and args.nodes < 1:
        p.error(f"--nodes must be at least 1, got {args.nodes}")
    if args.base_port is not None and not 1 <= args.base_port <= 65536 - (args.nodes or default_nodes()):
        p.error(f"--base-port must leave room for every node below 65536, got {args.base_port}")
    if args.grace < 0:
        p.error(f"--grace must be >= 0, got {args.grace}")
    if args.chaos is not None and args.chaos <= 0:
        p.error(f"--chaos takes a mean interval in seconds > 0, got {args.chaos}")
    if args.chaos is not None and not args.restarts:
        args.restarts = 3
    if args.restarts < 0:
        p.error(f"--restarts must be >= 0, got {args.restarts}")
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
    if (args.allow_kill or args.dashboard_port) and not args.dashboard:
        p.error("--allow-kill and --dashboard-port go with --dashboard")
    if not 0 <= args.dashboard_port <= 65535:
        p.error(f"--dashboard-port must be in 0..65535, got {args.dashboard_port}")
    return args


def cluster_config(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The cluster configuration in mapping form, and the nodes to start here."""
    if args.config is not None:
        config = load_config(args.config)  # a ConfigError says what is wrong
        mapping = config.to_mapping()  # every setting, keys included, whatever the file's layout
        local = [n.strip() for n in args.only.split(",")] if args.only else []
        for name in local:
            config.node(name)  # a ConfigError names the file and the known nodes
        return mapping, local
    count = args.nodes or default_nodes()
    if args.base_port is not None:
        ports = list(range(args.base_port, args.base_port + count))
        processes.check_ports_free(args.host, ports)
    else:
        ports = processes.free_ports(count, args.host)
    nodes = [{"name": f"w{i + 1}", "host": args.host, "port": port} for i, port in enumerate(ports)]
    mapping = {
        "nodes": nodes,
        "fetch_probability": args.fetch_probability,
        "timeout_ms": args.timeout_ms,
        "interpolation": args.interpolation,
        "constant": {"value": args.factor},
        "preset": args.preset,
        # only the options given: a preset sets the others (and dpwa's defaults the rest)
        **{key: getattr(args, key) for key in PRESET_KEYS if getattr(args, key) is not None},
    }
    # --fetch-probability 2 fails here, before any file is written (keys come later, in the run folder)
    parse_config({**mapping, "insecure": True}, source="./run.sh options")
    return mapping, []


def supervision(args: argparse.Namespace) -> dict[str, Any]:
    """How the launcher watches the nodes (restarts, chaos, stopping, printing, the dashboard): this
    invocation's options, for a new run and a resumed one alike."""
    return {
        "restarts": args.restarts,
        "chaos_s": args.chaos or 0.0,
        "chaos_seed": args.chaos_seed,
        "grace_s": args.grace,
        "print_every_s": args.print_every,
        "dashboard": args.dashboard,
        "dashboard_port": args.dashboard_port,
        "dashboard_kill": args.allow_kill,
    }


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
                **supervision(args),
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
        config, local = cluster_config(args)
        if args.auto_data and args.workload == "digits":
            print(
                "dpwa: CIFAR-10 is not prepared (examples/pytorch-cifar/prepare.sh), so the nodes train on the "
                "embedded handwritten digits (1,797 8x8 images shipped with dpwa)",
                flush=True,
            )
        warn_few_steps(args, data, len(config["nodes"]))
        run_dir = launch.new_run_dir(args.runs_dir)
        if args.config is None and not is_loopback(args.host):
            # Other machines can reach these nodes: they authenticate and encrypt with keys made for this run.
            make_private_dir(run_dir / "keys", base=run_dir)
            for key_file in key_nodes(config["nodes"], run_dir / "keys"):  # the secret ones are 0600 already
                make_private_file(key_file.with_suffix(".key"))  # and the public ones too: a run folder's files
            print(
                f"dpwa: {args.host} can be reached from other machines: CURVE keys for every node are in "
                f"{run_dir / 'keys'}",
                flush=True,
            )
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
                **supervision(args),
            )
        )
    except (ConfigError, OSError) as exc:
        print(f"./run.sh: {exc}", file=sys.stderr)
        return 2
    return launch.detach(spec) if args.detach else launch.run(spec)


if __name__ == "__main__":
    sys.exit(main())
