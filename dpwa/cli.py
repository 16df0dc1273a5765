"""The dpwa command line: ``python -m dpwa SUBCOMMAND`` (also installed as ``dpwa``).

    python -m dpwa --help
    python -m dpwa plot runs/latest        # redraw runs/latest/curves.png from its metrics
    python -m dpwa status runs/latest      # the progress table of a (detached) run, once
    python -m dpwa keygen w1 --dir keys    # a CURVE key pair: keys/w1.key and keys/w1.key_secret

A subcommand is one function decorated with :func:`subcommand`: its name is
the command, the first line of its docstring the help, and the decorator's
arguments its options. It returns the exit status; a ``ValueError`` or
``OSError`` it raises is printed as ``dpwa NAME: message`` with status 1.
"""

from __future__ import annotations

import argparse
import sys
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
    arg("name", nargs="?", help="the node's name, as in the config (or give --config)"),
    arg("--config", type=Path, help="key every node of this config, and write their keys into it"),
    arg("--dir", type=Path, help="where to write the key files (default: . for NAME, keys/ beside --config)"),
)
def keygen(args: argparse.Namespace) -> int:
    """Write CURVE key pairs: one node's (NAME), or every node's of a config (--config)."""
    from .wire.curve import generate

    if (args.name is None) == (args.config is None):
        raise ValueError("give a node NAME, or --config FILE to key every node of a config")
    if args.config is not None:
        from .cluster.keys import key_config

        written = key_config(args.config, args.dir)
        print(f"wrote keys for {len(written)} nodes: " + ", ".join(str(p) for p in written))
        print(f"{args.config} now lists every node's public_key and secret_key_file (the original: {args.config}.bak)")
        print("copy each NAME.key_secret to NAME's machine only; the config (public keys) goes everywhere")
        return 0
    public, secret, pair = generate(args.name, args.dir or Path("."))
    print(f"wrote {public} (public: share it) and {secret} (secret: mode 0600, keep it on {args.name}'s machine)")
    print("in the config's nodes list, for this node:")
    print(f'  public_key: "{pair.public.decode()}"')
    print(f"  secret_key_file: {secret}")
    return 0


@subcommand(arg("run_dir", type=Path, help="a run folder, such as runs/latest"))
def status(args: argparse.Namespace) -> int:
    """Show a run's progress table once, and which of its processes are alive."""
    from .cluster.launch import LaunchSpec
    from .cluster.monitor import MetricsTail, table
    from .cluster.processes import process_start, read_pid_file

    pids = Path(args.run_dir) / "pids"
    if not pids.is_dir():
        raise FileNotFoundError(f"{args.run_dir}: not a run folder (no pids/ in it)")
    if (Path(args.run_dir) / "launch.json").exists():
        names = LaunchSpec.load(args.run_dir).local_names
    else:  # a PID file per node, besides the launcher's own processes
        names = sorted(p.stem for p in pids.glob("*.pid") if p.stem not in ("launcher", "finish"))
    nodes = MetricsTail(args.run_dir, names).poll()
    for line in table(list(nodes.values())):
        print(line)
    alive = []
    for path in sorted(pids.glob("*.pid")):
        pid, start = read_pid_file(path)
        if process_start(pid) == start:
            alive.append(f"{path.stem} (pid {pid})")
    print("running: " + (", ".join(alive) if alive else "nothing"))
    summary = Path(args.run_dir) / "summary.txt"
    if summary.exists() and not alive:
        print("\n" + summary.read_text().rstrip())
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fn, _ = _COMMANDS[args.command]
    try:
        return fn(args)
    except (ValueError, OSError) as exc:
        print(f"dpwa {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
