"""``python -m dpwa run``: any script as a local cluster, one process per node; and the launcher's options.

    python -m dpwa run --nodes 4 -- python my_train.py --lr 0.1
    ./run.sh --nodes 4 -- python my_train.py --lr 0.1          # the same, after setting up .venv
    python -m dpwa run --nodes 3 --chaos --detach -- python examples/minimal.py

Writes a config for the nodes (127.0.0.1, free ports; or ``--config`` a file
of your own) into a new run folder under ``runs/``, and starts the command
once per node with, in its environment:

* ``DPWA_CONFIG``: the run's config.yaml;
* ``DPWA_NAME``: this node's name in it (``w1``, ``w2``, ...);
* ``DPWA_RUN_DIR``: the run folder.

:func:`dpwa.gossip_optimizer` and the Lightning and Hugging Face callbacks
find all three by themselves, so the script needs no options for dpwa, and
they write the node's metrics lines (:mod:`dpwa.runfiles.metrics`): the live
table, ``python -m dpwa status``, ``--dashboard`` and ``curves.png`` show the
script as they show the example. A script built on the adapter itself reads
``DPWA_CONFIG`` and ``DPWA_NAME`` (``dpwa.adapters.hook.node_from_env``) and
may write its lines with :class:`dpwa.runfiles.metrics.MetricsWriter`.

``--chaos`` kills a random node now and then and starts it again: the new
process joins the cluster (``join: auto``) and takes a live peer's state.
``--resume RUN_DIR`` starts a stopped run's command again in its folder,
with ``DPWA_RESUME=1``: what the script does then (load its own checkpoint,
or join its peers) is up to it. The example (``./run.sh`` with no command)
is built on the same options (``examples/pytorch-cifar/cluster.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ..config import MODES, PRESETS, WIRE_DTYPES, Config, ConfigError, load_config, parse_config
from ..mixing import pairing, rules
from ..runfiles.private import make_private_dir, make_private_file
from ..wire.endpoints import is_loopback
from . import launch, processes
from .keys import key_nodes

__all__ = [
    "DEFAULTS",
    "NODE_ENV",
    "add_launch_options",
    "check_launch_options",
    "cluster_config",
    "default_nodes",
    "key_run",
    "main",
    "supervision",
]

DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}  # dpwa's, shown in --help
PRESET_KEYS = ("mode", "rule", "pairing", "wire_dtype", "period")  # options that leave a preset's keys alone

#: what each node's environment says about it (the placeholders are filled per node: LaunchSpec.environment)
NODE_ENV = {"DPWA_CONFIG": "{config}", "DPWA_NAME": "{name}", "DPWA_RUN_DIR": "{run_dir}"}


def default_nodes() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(2, cores)


def add_launch_options(p: argparse.ArgumentParser) -> None:
    """The options of every local cluster: its nodes and config, failures, the dashboard, the processes."""
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
        "--fetch-probability",
        type=float,
        default=1.0,
        help="config: chance of an exchange per step (default: %(default)s)",
    )
    g.add_argument(
        "--timeout-ms", type=int, default=1000, help="config: the least deadline of one exchange (default: %(default)s)"
    )
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
        choices=MODES,
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
        choices=pairing.PAIRINGS,
        help="config: auto (hypercube for 2, 4, 8, ... nodes, else random), random (a peer by score; in mode "
        "symmetric a node starts in half its steps), or hypercube (a power of two of nodes) "
        f"(default: {DEFAULTS['pairing']})",
    )
    g.add_argument(
        "--wire-dtype",
        default=None,
        choices=("auto", *WIRE_DTYPES),
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
        choices=PRESETS,
        help="config: low_bandwidth (period 8, int8) or original (the 2017 rule: pull, state, random); the "
        "options above given explicitly win (default: %(default)s)",
    )
    g = p.add_argument_group("failures")
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


def check_launch_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``p.error``) what :func:`add_launch_options`' options cannot mean together."""
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
    if (args.allow_kill or args.dashboard_port) and not args.dashboard:
        p.error("--allow-kill and --dashboard-port go with --dashboard")
    if not 0 <= args.dashboard_port <= 65535:
        p.error(f"--dashboard-port must be in 0..65535, got {args.dashboard_port}")


def cluster_config(args: argparse.Namespace, source: str = "launcher options") -> tuple[dict[str, Any], list[str]]:
    """The cluster configuration in mapping form, and the nodes to start here (empty: all)."""
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
    parse_config({**mapping, "insecure": True}, source=source)
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


def key_run(args: argparse.Namespace, config: dict[str, Any], run_dir: Path) -> None:
    """A generated config whose nodes other machines can reach: CURVE keys for every node, in RUN_DIR/keys."""
    if args.config is not None or is_loopback(args.host):
        return
    make_private_dir(run_dir / "keys", base=run_dir)
    for key_file in key_nodes(config["nodes"], run_dir / "keys"):  # the secret ones are 0600 already
        make_private_file(key_file.with_suffix(".key"))  # and the public ones too: a run folder's files
    print(
        f"dpwa: {args.host} can be reached from other machines: CURVE keys for every node are in {run_dir / 'keys'}",
        flush=True,
    )


# --------------------------------------------------------------------------- python -m dpwa run


def parse_args(argv: list[str]) -> argparse.Namespace:
    options, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="python -m dpwa run",
        usage="python -m dpwa run [options] -- COMMAND [ARG ...]",
        description="Run COMMAND once per node of a local dpwa cluster. Each process finds its config, its name "
        "and the run folder in $DPWA_CONFIG, $DPWA_NAME and $DPWA_RUN_DIR.",
        epilog="Example: python -m dpwa run --nodes 4 -- python my_train.py --lr 0.1",
    )
    add_launch_options(p)
    p.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="start a stopped run's command again in its folder, with DPWA_RESUME=1 (leave out the command)",
    )
    args, unknown = p.parse_known_args(options)
    if unknown and command:
        p.error(f"unrecognized arguments: {shlex.join(unknown)}")
    if unknown:  # a command without the '--' before it: python -m dpwa run python train.py
        known = options[: len(options) - len(unknown)] if options[-len(unknown) :] == unknown else []
        p.error(
            f"unrecognized arguments: {shlex.join(unknown)}; the command each node runs goes after '--': "
            + " ".join(["python -m dpwa run", *map(shlex.quote, known), "--", shlex.join(unknown)])
        )
    check_launch_options(p, args)
    args.command = command
    if args.resume is not None:
        if command:
            p.error(f"--resume runs the command {args.resume} was started with; leave out '-- {shlex.join(command)}'")
        if args.config or args.nodes or args.base_port:
            p.error("--resume continues a run with its own config: leave out --config, --nodes and --base-port")
    elif not command:
        p.error("give the command each node runs after '--': python -m dpwa run [options] -- python train.py")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.resume is not None:
            spec = launch.LaunchSpec.load(args.resume)
            spec = launch.prepare(dataclasses.replace(spec, env={**spec.env, "DPWA_RESUME": "1"}, **supervision(args)))
            print(f"dpwa: running {shlex.join(spec.command)} again in {args.resume}", flush=True)
        else:
            config, local = cluster_config(args)
            run_dir = launch.new_run_dir(args.runs_dir)
            key_run(args, config, run_dir)
            spec = launch.prepare(
                launch.LaunchSpec(
                    run_dir=str(run_dir),
                    config=config,
                    command=args.command,
                    local=local,
                    pin=not args.no_pin,
                    env=dict(NODE_ENV),
                    **supervision(args),
                )
            )
    except (ConfigError, OSError, ValueError) as exc:
        print(f"python -m dpwa run: {exc}", file=sys.stderr)
        return 2
    return launch.detach(spec) if args.detach else launch.run(spec)
