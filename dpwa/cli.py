"""The dpwa command line: ``python -m dpwa SUBCOMMAND`` (also installed as ``dpwa``).

    python -m dpwa --help
    python -m dpwa plot runs/latest        # redraw runs/latest/curves.png from its metrics
    python -m dpwa status runs/latest      # the progress table of a (detached) run, once
    python -m dpwa average runs/latest -o mean.pt   # the mean of the nodes' weights (latest complete checkpoint)
    python -m dpwa keygen w1 --dir keys    # a CURVE key pair: keys/w1.key and keys/w1.key_secret
    python -m dpwa keygen --cluster-key --dir admin   # a cluster key: admin/cluster.pub, admin/cluster.secret
    python -m dpwa keygen w2 --dir keys --sign-with admin/cluster.secret   # also keys/w2.cert, valid 30 days
    python -m dpwa keygen w2 --dir keys --sign-with admin/cluster.secret --renew   # a new keys/w2.cert
    python -m dpwa dashboard runs/latest   # a live web page of the run (prints its URL)
    python -m dpwa run --nodes 4 -- python train.py   # a script of your own, once per node (./run.sh -- ...)

A subcommand is one function decorated with :func:`subcommand`: its name is
the command, the first line of its docstring the help, and the decorator's
arguments its options. It returns the exit status; a ``ValueError`` or
``OSError`` it raises is printed as ``dpwa NAME: message`` with status 1.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "subcommand", "arg"]

Handler = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Handler, tuple[tuple[tuple[str, ...], dict[str, Any]], ...]]] = {}


def arg(*flags: str, **kwargs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """One argument of a subcommand, as given to ``argparse.ArgumentParser.add_argument``."""
    return flags, kwargs


def subcommand(*arguments: tuple[tuple[str, ...], dict[str, Any]]) -> Callable[[Handler], Handler]:
    """Register the decorated function as a subcommand named after it (underscores become dashes)."""

    def register(fn: Handler) -> Handler:
        _COMMANDS[fn.__name__.replace("_", "-")] = (fn, arguments)
        return fn

    return register


@subcommand(
    arg("run_dir", type=Path, help="a run folder, such as runs/latest"),
    arg("--out", type=Path, help="where to write the PNG (default: RUN_DIR/curves.png)"),
)
def plot(args: argparse.Namespace) -> int:
    """Draw a run's loss and accuracy curves per node (RUN_DIR/curves.png)."""
    from .cluster.plot import draw

    print(draw(args.run_dir, args.out))
    return 0


@subcommand(
    arg("name", nargs="?", help="the node's name, as in the config (or give --config, or --cluster-key)"),
    arg("--config", type=Path, help="key every node of this config, and write their keys into it"),
    arg("--dir", type=Path, help="where to write the key files (default: . for NAME, keys/ beside --config)"),
    arg(
        "--cluster-key",
        action="store_true",
        help="write a cluster key pair instead: DIR/cluster.pub (every node gets it) and DIR/cluster.secret "
        "(mode 0600; it signs the members' certificates: keep it off the nodes)",
    ),
    arg(
        "--sign-with",
        type=Path,
        metavar="SECRET",
        help="with NAME: also write DIR/NAME.cert, NAME's key signed by this cluster secret key (cluster.secret)",
    ),
    arg("--valid-days", type=int, metavar="N", help="with --sign-with: the certificate's validity (default: 30)"),
    arg(
        "--renew",
        action="store_true",
        help="with --sign-with: sign NAME's existing public key (DIR/NAME.key) again, replacing DIR/NAME.cert",
    ),
)
def keygen(args: argparse.Namespace) -> int:
    """Write CURVE key pairs: one node's (NAME), or every node's of a config (--config); or a cluster key."""
    from .wire.curve import generate

    if args.cluster_key:
        return _cluster_key(args)
    if (args.name is None) == (args.config is None):
        raise ValueError("give a node NAME, or --config FILE to key every node of a config (or --cluster-key)")
    if args.sign_with is None and (args.valid_days is not None or args.renew):
        raise ValueError("--valid-days and --renew need --sign-with CLUSTER_SECRET")
    if args.config is not None:
        if args.sign_with is not None:
            raise ValueError("--sign-with signs one node's key: give a NAME, not --config")
        from .cluster.keys import key_config

        written = key_config(args.config, args.dir)
        print(f"wrote keys for {len(written)} nodes: " + ", ".join(str(p) for p in written))
        print(f"{args.config} now lists every node's public_key and secret_key_file (the original: {args.config}.bak)")
        print("copy each NAME.key_secret to NAME's machine only; the config (public keys) goes everywhere")
        return 0
    if args.sign_with is not None:
        return _certify(args)
    public, secret, pair = generate(args.name, args.dir or Path("."))
    print(f"wrote {public} (public: share it) and {secret} (secret: mode 0600, keep it on {args.name}'s machine)")
    print("in the config's nodes list, for this node:")
    print(f'  public_key: "{pair.public.decode()}"')
    print(f"  secret_key_file: {secret}")
    return 0


def _cluster_key(args: argparse.Namespace) -> int:
    """keygen --cluster-key: a new cluster key pair in DIR."""
    from .wire.certs import generate_cluster_key, key_id, load_cluster_public

    given = [flag for flag, value in (("NAME", args.name), ("--config", args.config), ("--sign-with", args.sign_with),
             ("--valid-days", args.valid_days), ("--renew", args.renew)) if value]  # fmt: skip
    if given:
        raise ValueError(f"--cluster-key takes --dir only, not {', '.join(given)}")
    public, secret = generate_cluster_key(args.dir or Path("."))
    ident = key_id(load_cluster_public(public)).hex()
    print(f"wrote {public} (the cluster's public key, id {ident}: every node gets it)")
    print(f"and {secret} (secret: mode 0600; it signs members' certificates: keep it off the nodes)")
    print(f"sign a member: python -m dpwa keygen NAME --dir keys --sign-with {secret}")
    return 0


def _certify(args: argparse.Namespace) -> int:
    """keygen NAME --sign-with SECRET: NAME's CURVE key pair (or, --renew, its existing public key) and
    its certificate, DIR/NAME.cert."""
    import datetime

    import zmq.auth

    from .wire.certs import MAX_VALID_S, NAME_RE, decode, load_cluster_secret, sign, write_cert
    from .wire.curve import generate

    days = 30 if args.valid_days is None else args.valid_days
    if not 0 < days <= MAX_VALID_S // 86400:
        raise ValueError(f"--valid-days takes 1 to {MAX_VALID_S // 86400} days, got {days}")
    if not NAME_RE.fullmatch(args.name):  # checked before a file is read or made
        raise ValueError(f"a member's NAME must be 1 to 64 letters, digits, '_', '.', '-', got {args.name!r}")
    cluster = load_cluster_secret(args.sign_with)  # before anything is written: a bad secret file writes nothing
    directory = args.dir or Path(".")
    cert_path = directory / f"{args.name}.cert"
    if args.renew:
        public_path = directory / f"{args.name}.key"
        expected = f"{args.name}'s CURVE public key file, as python -m dpwa keygen {args.name} wrote it"
        if not public_path.is_file():
            raise FileNotFoundError(f"{public_path}: no such file; --renew signs {expected}")
        try:
            curve_public = zmq.auth.load_certificate(public_path)[0].decode("ascii")
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{public_path}: expected {expected}: {exc}") from None
        cert = sign(cluster, args.name, curve_public, days * 86400)
        write_cert(cert_path, cert, replace=True)
        written = f"wrote {cert_path}"
    else:
        if cert_path.exists():
            raise FileExistsError(f"{cert_path} exists; give --renew to sign {args.name}'s existing key again")
        public, secret, pair = generate(args.name, directory)
        cert = sign(cluster, args.name, pair.public.decode(), days * 86400)
        write_cert(cert_path, cert)
        written = f"wrote {public} (public: share it), {secret} (secret: mode 0600, keep it on {args.name}'s machine)"
        written += f" and {cert_path}"
        entry = [f'  public_key: "{pair.public.decode()}"', f"  secret_key_file: {secret}", f"  cert_file: {cert_path}"]
    until = datetime.datetime.fromtimestamp(decode(cert).not_after, datetime.timezone.utc)
    print(f"{written} (the cluster's consent to {args.name}'s key, valid until {until:%Y-%m-%d %H:%M} UTC)")
    if not args.renew:
        print("in the config's nodes list, for this node (and cluster_key: the cluster's .pub file):")
        print("\n".join(entry))
    print(cert)
    return 0


@subcommand(
    arg(
        "target",
        type=Path,
        metavar="CONFIG|RUN_DIR",
        help="a cluster config (YAML): ask every node over its socket; exit status 0 if every node answered, "
        "1 if some did not (or on an error), 130 on Ctrl-C. Or a run folder, such as runs/latest: its "
        "progress table from the metrics files, once",
    ),
    arg("--json", action="store_true", help='CONFIG: print {"nodes": [{"name": ..., "state": ..., ...}, ...]}'),
    arg(
        "--watch",
        nargs="?",
        const=2.0,
        type=float,
        metavar="SECONDS",
        help="CONFIG: ask again every SECONDS (default 2), redrawing the table in place, until Ctrl-C",
    ),
    arg("--count", type=int, metavar="N", help="with --watch: stop after N rounds"),
    arg("--timeout-ms", type=int, metavar="MS", help="CONFIG: how long to wait for each node (default: timeout_ms)"),
    arg(
        "--key",
        metavar="NAME",
        help="CONFIG: ask as node NAME, with its key pair under CURVE (default: the first "
        "node whose secret key file is readable here)",
    ),
)
def status(args: argparse.Namespace) -> int:
    """Show every node's status (CONFIG: asked over the wire), or a run folder's progress table (RUN_DIR)."""
    target = Path(args.target)
    options: dict[str, Any] = {"--json": args.json, "--watch": args.watch, "--count": args.count}
    options.update({"--timeout-ms": args.timeout_ms, "--key": args.key})
    if not target.is_dir():
        from .cluster.status import watch
        from .config import load_config

        if not target.exists():
            raise FileNotFoundError(f"{target}: no such config file or run folder")
        if args.watch is not None and args.watch < 0.1:
            raise ValueError(f"--watch takes at least 0.1 seconds, got {args.watch:g}")
        if args.count is not None and (args.watch is None or args.count < 1):
            raise ValueError(f"--count needs --watch, and N >= 1 (got --count {args.count})")
        if args.timeout_ms is not None and args.timeout_ms < 1:
            raise ValueError(f"--timeout-ms must be a positive number of milliseconds, got {args.timeout_ms}")
        config = load_config(target)
        timeout_s = None if args.timeout_ms is None else args.timeout_ms / 1000
        return watch(config, key=args.key, timeout_s=timeout_s, as_json=args.json, every_s=args.watch, count=args.count)
    given = [flag for flag, value in options.items() if value is not None and value is not False]
    if given:
        raise ValueError(f"{target} is a run folder; {', '.join(given)}: only for a CONFIG file")
    from .cluster.launch import LaunchSpec
    from .cluster.monitor import MetricsTail, table
    from .cluster.processes import process_start, read_pid_file

    pids = target / "pids"
    if not pids.is_dir():
        raise FileNotFoundError(f"{target}: not a run folder (no pids/ in it)")
    if (target / "launch.json").exists():
        names = LaunchSpec.load(target).local_names
    else:  # a PID file per node, besides the launcher's own processes
        names = sorted(p.stem for p in pids.glob("*.pid") if p.stem not in ("launcher", "finish"))
    nodes = MetricsTail(target, names).poll(final=True)
    for line in table(list(nodes.values())):
        print(line)
    for node in nodes.values():  # bad lines of the metrics files, with their file and line number
        for problem in node.problems:
            print(f"dpwa status: {problem}", file=sys.stderr)
    alive = []
    for path in sorted(pids.glob("*.pid")):
        try:
            pid, start = read_pid_file(path)
        except (OSError, ValueError) as exc:  # a PID file cut short or spoiled: say so, go on
            print(f"dpwa status: {exc}; skipped", file=sys.stderr)
            continue
        if process_start(pid) == start:
            alive.append(f"{path.stem} (pid {pid})")
    print("running: " + (", ".join(alive) if alive else "nothing"))
    summary = target / "summary.txt"
    if summary.exists() and not alive:
        print("\n" + summary.read_text(encoding="utf-8", errors="replace").rstrip())
    return 0


@subcommand(
    arg("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="a run folder, such as runs/latest"),
    arg(
        "-o",
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help="where to write the mean state_dict (mode 0600; torch.load(FILE, weights_only=True) reads it)",
    ),
    arg(
        "--epoch",
        metavar="K|last",
        help="RUN_DIR: the checkpoint of epoch K, or 'last' (the states saved when the nodes were stopped); "
        "default: the latest complete checkpoint, as train.py --resume picks it",
    ),
    arg(
        "--allow-missing",
        action="store_true",
        help="RUN_DIR: average the nodes that saved a state, and name the others (default: refuse, naming them)",
    ),
    arg(
        "--config",
        type=Path,
        help="instead of RUN_DIR: a live cluster's config: fetch every node's current snapshot (needs --model)",
    ),
    arg(
        "--model",
        metavar="MODULE:FUNCTION",
        help="--config: a function that builds a model like the nodes' (called with no arguments), "
        "such as mynets:make_net; the current folder is importable",
    ),
    arg("--no-buffers", action="store_true", help="--config: the nodes' adapters say include_buffers=False"),
    arg("--timeout-ms", type=int, metavar="MS", help="--config: how long to wait for the nodes (default: timeout_ms)"),
    arg("--key", metavar="NAME", help="--config: under CURVE, ask as node NAME (as python -m dpwa status --key)"),
)
def average(args: argparse.Namespace) -> int:
    """Write the mean of every node's weights: of a run folder's checkpoints, or of a live cluster (--config)."""
    from .cluster import average as averaging
    from .runfiles.checkpoints import LAST
    from .runfiles.private import write_private

    if (args.run_dir is None) == (args.config is None):
        raise ValueError("give a RUN_DIR, or --config FILE (and --model) for a live cluster")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out}: no folder {out.parent} to write it in")
    if args.run_dir is not None:
        given = [f for f, v in (("--model", args.model), ("--timeout-ms", args.timeout_ms), ("--key", args.key)) if v]
        if args.no_buffers:
            given.append("--no-buffers")
        if given:
            raise ValueError(f"{', '.join(given)}: only with --config (a live cluster)")
        epoch: int | str | None = args.epoch
        if epoch is not None and epoch != LAST:
            if not args.epoch.isdigit():
                raise ValueError(f"--epoch takes an epoch number or 'last', got {args.epoch!r}")
            epoch = int(args.epoch)
        result = averaging.average_run(args.run_dir, epoch=epoch, allow_missing=args.allow_missing)
    else:
        if args.epoch is not None or args.allow_missing:
            raise ValueError("--epoch and --allow-missing are for a RUN_DIR, not --config")
        if args.model is None:
            raise ValueError(
                "--config needs --model MODULE:FUNCTION: a snapshot is one flat vector, the model names its tensors"
            )
        if args.timeout_ms is not None and args.timeout_ms < 1:
            raise ValueError(f"--timeout-ms must be a positive number of milliseconds, got {args.timeout_ms}")
        result = averaging.average_live(
            args.config,
            _build_model(args.model),
            include_buffers=not args.no_buffers,
            key=args.key,
            timeout_s=None if args.timeout_ms is None else args.timeout_ms / 1000,
        )
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(result.state_dict, buffer)
    write_private(out, buffer.getvalue())  # atomically: the old file or the new one, never half of one
    width = max(len(node) for node in result.sources)
    for node, source in result.sources.items():
        weight = "" if result.weights is None else f"  (weight {result.weights[node]:g})"
        print(f"{node.ljust(width)}  {source}{weight}")
    for note in result.notes:
        print(f"dpwa average: {note}", file=sys.stderr)
    if result.checkpoint is None:
        what = "current snapshots"
    else:
        what = "states saved when stopped" if result.checkpoint == LAST else f"checkpoints of epoch {result.checkpoint}"
    print(f"wrote {out}: the mean of {len(result.sources)} nodes' {what}")
    return 0


def _build_model(spec: str) -> Any:
    """The model MODULE:FUNCTION builds (FUNCTION called with no arguments); ValueError saying what failed."""
    import importlib
    import os

    from torch import nn

    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"--model takes MODULE:FUNCTION, such as mynets:make_net, got {spec!r}")
    here = os.getcwd() if os.getcwd() not in sys.path and "" not in sys.path else None  # the dpwa script's case
    if here is not None:
        sys.path.insert(0, here)
    try:
        factory = getattr(importlib.import_module(module_name), function)
        model = factory()
    except Exception as exc:  # an import error, a missing name, whatever the user's function raises
        raise ValueError(f"--model {spec}: {type(exc).__name__}: {exc}") from None
    finally:
        if here is not None:
            sys.path.remove(here)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model


@subcommand(
    arg(
        "target",
        type=Path,
        metavar="CONFIG|RUN_DIR",
        help="a run folder, such as runs/latest (status, curves, mixing graph, events, logs), or a cluster "
        "config (status and the mixing graph)",
    ),
    arg("--port", type=int, default=0, help="TCP port (default: a free one; the URL is printed)"),
    arg("--host", default="127.0.0.1", help="address to serve on (default: %(default)s: this machine only)"),
    arg(
        "--allow-kill",
        action="store_true",
        help="RUN_DIR on 127.0.0.1 only: show a kill button per node (SIGKILL by recorded PID, as --chaos does); "
        "it needs the secret token in the printed URL",
    ),
    arg("--every", type=float, default=1.0, metavar="SECONDS", help="seconds between updates (default: 1)"),
    arg(
        "--timeout-ms",
        type=int,
        metavar="MS",
        help="how long to wait for each node's status (default: the config's timeout_ms, at most 2000)",
    ),
    arg("--key", metavar="NAME", help="under CURVE: ask status as node NAME (as python -m dpwa status --key)"),
)
def dashboard(args: argparse.Namespace) -> int:
    """Serve a live web page of a cluster: per-node status, curves, the mixing graph and events."""
    from .cluster.dashboard import Dashboard

    if args.every < 0.1:
        raise ValueError(f"--every takes at least 0.1 seconds, got {args.every:g}")
    if args.timeout_ms is not None and args.timeout_ms < 1:
        raise ValueError(f"--timeout-ms must be a positive number of milliseconds, got {args.timeout_ms}")
    timeout_s = None if args.timeout_ms is None else args.timeout_ms / 1000
    with Dashboard(
        args.target,
        host=args.host,
        port=args.port,
        allow_kill=args.allow_kill,
        key=args.key,
        timeout_s=timeout_s,
        every_s=args.every,
    ) as board:
        print(f"dpwa dashboard: {board.url}", flush=True)
        if board.token:
            print("  the kill button is on: the token in this URL lets its holder SIGKILL nodes; keep it private")
        print("  Ctrl-C stops it", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpwa", description="dpwa: decentralized training by gossip averaging.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (fn, arguments) in _COMMANDS.items():
        summary = (fn.__doc__ or "").strip().split("\n")[0]
        command = sub.add_parser(name, help=summary, description=summary)
        for flags, kwargs in arguments:
            command.add_argument(*flags, **kwargs)
    return parser


@subcommand(arg("options", nargs=argparse.REMAINDER, help="[options] -- COMMAND [ARG ...] (see: run --help)"))
def run(args: argparse.Namespace) -> int:
    """Run a command once per node of a local cluster (python -m dpwa run --nodes 4 -- python train.py)."""
    from .cluster.runner import main as run_main

    return run_main(args.options)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its own parser: what follows '--' is the command, options and all
        from .cluster.runner import main as run_main

        return run_main(argv[1:])
    args = build_parser().parse_args(argv)
    fn, _ = _COMMANDS[args.command]
    try:
        return fn(args)
    except (ValueError, OSError) as exc:
        print(f"dpwa {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
