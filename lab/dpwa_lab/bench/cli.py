"""Benchmark: dpwa's exchange against the raw floors it is built on, measured in one run.

Commands (they run as written from the repository root)::

    python -m dpwa.bench                         # the full table (about two minutes on 2 cores)
    python -m dpwa.bench --json bench.json       # the same, also written as JSON
    python -m dpwa.bench --quick                 # small sizes and one that streams, few repetitions: a smoke test
    python -m dpwa.bench --log bench.log         # the benchmark's own nodes' log lines go here
    python -m dpwa.bench --training              # only the digits model's training-step rows (about a minute)
    python -m dpwa.bench --memory                # what a node holds beyond its model: 10M, 50M and 100M parameters
    python -m dpwa.bench --memory --largest 500000000   # and the defaults at 500M (8 GB of models and gradients)
    python -m dpwa.bench --memory --device cuda  # on a GPU: 100M and the largest that fits (scripts/gpu-check.sh)
    python -m dpwa.bench --blends                # how often two nodes average, by size and step time (~10 min)
    python -m dpwa.bench --blends --quick        # the default mode's rows, and a short flaky link (~3 min)
    python -m dpwa.bench --flaky                 # only the flaky link, seeds 0, 1 and 2 (~3 min)

The benchmark's own nodes log what any node logs (its configurations are
deliberately odd: ``fetch_probability: 0`` for a node that only serves, plain
TCP with ``insecure: true`` on 127.0.0.1). Those lines, and the helper
processes' error output, go to a log file that the benchmark names at its
start and in its summary (default: ``dpwa-bench-PID.log`` in the temporary
folder), so that standard output holds only the tables and a short summary.

For each model size it measures, in the same run and on the same machine:

(a) ``copy``: ``np.copyto`` of the model's bytes (a memory-copy floor);
(b) ``zmq``: a raw pyzmq REQ/REP round trip over tcp://127.0.0.1 between two
    processes, the reply carrying the model's bytes (``copy=False`` on both
    sides): the ZeroMQ floor;
(t) ``tcp``: the same round trip over a raw TCP socket, the reply written with
    ``sendall`` and read with ``recv_into`` a preallocated buffer: the socket floor;
(r) ``router``: (b) from a ROUTER socket on a thread, its reply tracked, as a
    node's server must answer: the floor of the serving socket;
(w) ``router_work``: (r) plus the work any exchange does on the requesting side,
    with dpwa's own kernels and no protocol: copy its parameters into a snapshot,
    check the reply's values, blend them in: the floor of an exchange;
(k) ``zmq_curve``: (b) under CURVE keys: the floor of a keyed exchange over ZeroMQ;
(s) ``node_served``: a raw pyzmq REQ client sending a dpwa node the fetch a node
    sends, and reading the reply: the serving side's share of an exchange
    (what it adds to (b)); the rest of (c) is the requesting side's;
(c) dpwa between two processes: ``update_send`` alone, ``update_wait`` alone
    and the full exchange, over TCP (large models by stream, dpwa.wire.bulk;
    and all over ZeroMQ, ``bulk: off``), under CURVE keys (large models by a
    stream sealed per transfer; and all over ZeroMQ, ``bulk: off``), and over
    the same-host path, in mode pull and in mode symmetric (``run.sh``'s default; also over TCP, with and
    without keys, where a large model's two snapshots stream both ways).

It also times a training step of the example (``examples/pytorch-cifar``,
the small ResNet, one torch thread per process as ``run.sh`` runs it) with
dpwa exchanging every step against a second training node, and the same loop
without dpwa, alternating one step of each so both see the same machine; then
the same against two floors: the peer's bytes fetched every step over plain
ZeroMQ, with nothing copied, checked or blended; and that plus the work any
exchange does on the training thread (publish, check, blend), without a protocol.

Every figure is a median over repetitions, and the ratios to (a), (b) and (t) are
printed beside it. Machines are shared and noisy: compare ratios taken in one
run, not absolute times across runs. A second table scales the number of
nodes (threads in one process, small model) and reports exchanges per second
and per-node cost.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .blends import SIZES, STEPS_S, bench_blends, bench_flaky, blend_rows
from .children import LOG_ENV, log_to
from .exchange import serve_node
from .floors import serve_raw, serve_raw_tcp
from .memory import bench_memory, gpu_rows, memory_rows, serve_memory_node
from .report import format_scale, format_size_row, format_summary, format_training, machine
from .scale import bench_scale
from .sizes import measure_size
from .training import WORKLOADS, bench_training, serve_training

SMALL = 100_000  # parameters of the small model
STREAMED = 1 << 20  # parameters of the smallest model that streams (4 MiB in float32: BULK_MIN_BYTES), for --quick
RESNET18 = 11_173_962  # parameters of torchvision's ResNet-18 (44.7 MB in float32)


def run(
    sizes: list[int],
    reps_small: int,
    reps_large: int,
    scale_sizes: list[int],
    scale_steps: int,
    wire_dtypes: list[str],
    training_steps: float = 1.0,
    workloads: tuple = WORKLOADS,
) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "sizes": [], "scale": [], "training": []}
    for size in sizes:
        row = measure_size(size, reps_small if size <= 1_000_000 else reps_large, wire_dtypes)
        results["sizes"].append(row)
        print(format_size_row(row), flush=True)
    for n in scale_sizes:
        results["scale"].append(bench_scale(n, SMALL, scale_steps))
    for label, shape, batch, steps, mode in workloads:
        trained = bench_training(shape, batch, max(2, int(steps * training_steps)), mode)
        if trained is not None:
            results["training"].append({"workload": label, **trained})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--log",
        metavar="FILE",
        type=Path,
        help="where the benchmark's own nodes log (default: dpwa-bench-PID.log in the temporary folder)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions for large models (default 30)")
    parser.add_argument(
        "--training",
        action="store_true",
        help="only the training-step rows of the digits model (run.sh's default mode, and mode pull)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="only the memory table: two nodes per row, what each holds beyond its model and gradients",
    )
    parser.add_argument(
        "--blends",
        action="store_true",
        help="only the blends table: exchanges per step by model size and step time, both modes, and a flaky link",
    )
    parser.add_argument(
        "--relays",
        action="store_true",
        help="only the relay tables: exchange time direct and through a relay, and the digits example's loss with "
        "two of three nodes behind a relay (--quick: one size, one run)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --memory: cuda runs the GPU rows instead (100M float32 parameters, and --largest or the "
        "largest bfloat16 model two nodes hold on this GPU and host), each with its step time without dpwa",
    )
    parser.add_argument(
        "--flaky",
        action="store_true",
        help="only the flaky link (3 nodes, delays around the deadline, cuts), seeds 0, 1 and 2 (--quick: seed 0)",
    )
    parser.add_argument(
        "--largest",
        type=int,
        metavar="PARAMETERS",
        help="with --memory: last rows at this many parameters (the defaults, on one host and over TCP); "
        "with --blends: a size more",
    )
    parser.add_argument(
        "--memory-node",
        nargs=7,
        metavar=("CONFIG", "NAME", "SIZE", "DTYPE", "STEPS", "STEP_S", "DEVICE"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--serve-raw", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw-router", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw-tcp", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-node", nargs=2, metavar=("CONFIG", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-training", nargs=3, metavar=("CONFIG", "SHAPE", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--raw", metavar="SERVE_AT,FETCH_FROM", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    helper = (
        args.serve_raw
        or args.serve_raw_router
        or args.serve_raw_tcp
        or args.serve_node
        or args.serve_training
        or args.memory_node
    )
    if helper and os.environ.get(LOG_ENV):
        log_to(Path(os.environ[LOG_ENV]))
    if not helper:
        log_path = (args.log or Path(tempfile.gettempdir()) / f"dpwa-bench-{os.getpid()}.log").resolve()
        log_to(log_path)
        os.environ[LOG_ENV] = str(log_path)  # the helper processes log there too
        print(f"dpwa_lab.bench: the benchmark's own nodes log to {log_path}", flush=True)
    if args.serve_raw:
        serve_raw(int(args.serve_raw[0]), int(args.serve_raw[1]))
        return 0
    if args.serve_raw_router:
        serve_raw(int(args.serve_raw_router[0]), int(args.serve_raw_router[1]), router=True)
        return 0
    if args.serve_raw_tcp:
        serve_raw_tcp(int(args.serve_raw_tcp[0]), int(args.serve_raw_tcp[1]))
        return 0
    if args.serve_node:
        serve_node(args.serve_node[0], int(args.serve_node[1]))
        return 0
    if args.serve_training:
        serve_training(args.serve_training[0], args.serve_training[1], int(args.serve_training[2]), args.raw)
        return 0
    if args.memory_node:
        config, name, size, dtype, steps, step_s, device = args.memory_node
        serve_memory_node(config, name, int(size), dtype, int(steps), float(step_s), device)
        return 0
    if args.memory:  # --quick: the default mode's two rows at 10M parameters (blended chunk by chunk; 40 MB,
        # above glibc's largest mmap threshold, so a buffer freed is given back to the system)
        sizes = [10_000_000] if args.quick else [10_000_000, 50_000_000, 100_000_000]
        wanted = gpu_rows(args.largest) if args.device == "cuda" else memory_rows(sizes, args.largest, args.quick)
        rows = bench_memory(wanted)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "memory": rows}, indent=2))
            print(f"\nwrote {args.json}")
        return 0 if all("error" not in row for row in rows) else 1
    if args.relays:
        from .relays import bench_relays

        relayed = bench_relays(args.quick)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "relays": relayed}, indent=2))
            print(f"\nwrote {args.json}")
        return 0
    if args.flaky:
        runs = bench_flaky(40 if args.quick else 250, seeds=(0,) if args.quick else (0, 1, 2))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "flaky": runs}, indent=2))
            print(f"\nwrote {args.json}")
        return 0
    if args.blends:  # --quick: the default mode at two sizes and step times, and 40 steps of the flaky link
        blend_sizes = SIZES[:2] if args.quick else SIZES + ((args.largest,) if args.largest else ())
        steps_s = (0.02, 0.05) if args.quick else STEPS_S
        blends = bench_blends(blend_rows(blend_sizes, steps_s, quick=args.quick), flaky_steps=40 if args.quick else 250)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), **blends}, indent=2))
            print(f"\nwrote {args.json}")
        return 0 if all("error" not in row for row in blends["blends"]) else 1
    if args.training:  # the digits rows alone, with their floors (--quick: a few steps)
        results = run([], 0, 0, [], 0, [], training_steps=0.02 if args.quick else 1.0, workloads=WORKLOADS[:2])
    elif args.quick:  # STREAMED runs the bulk rows (plain and sealed), with few repetitions
        results = run(
            [1_000, SMALL, STREAMED], 5, 3, [2, 4], 5, ["float16"], training_steps=0.02, workloads=WORKLOADS[:2]
        )
    else:
        results = run([SMALL, RESNET18], 200, args.reps or 30, [2, 4, 8, 16], 200, ["float16", "bfloat16"])
    if results["scale"]:
        print(format_scale(results["scale"]))
    if results["training"]:
        print(format_training(results["training"]))
    print(format_summary(results, log_path))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return 0
