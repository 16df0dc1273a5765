"""The blends table (``python -m dpwa.bench --blends``): how often two nodes average, against size and step time.

Each row is a row of the memory table's harness (:mod:`.memory`): two
training nodes in processes of their own, the PyTorch adapter over a model
of the row's size, 16 steps, each ``update_send``, the parameters' update and
the row's stand-in compute, then ``update_wait``. A row reports the
exchanges each node applied (``averaged`` + ``mirrored``: in mode symmetric
both sides of an exchange blend; the smaller of the two nodes, counted once
both have made their 16 steps), the ``busy`` answers met on the way, and the
median step time. Rows: every size of :data:`SIZES` (and ``--largest``) at
every step time of :data:`STEPS_S`, in both modes, on one host; the
defaults over TCP at the ResNet-18 size.

Its last row is issue 50's flaky link (:func:`.flaky.flaky_run`; alone:
``--flaky``, three seeds): three nodes in the default mode, every link
delayed 150 to 450 ms per chunk around a 300 ms deadline, a connection cut
about every 6 s on each; it reports the exchanges applied per node-step,
the drift of the sum of the models, and the longest time a node went
without starting an exchange or applying one it served, and without
applying any.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .flaky import flaky_run
from .memory import MemoryRow, bench_memory

__all__ = ["SIZES", "STEPS_S", "bench_blends", "bench_flaky", "blend_rows", "format_blends", "format_flaky"]

SIZES = (100_000, 11_173_962, 50_000_000)  # parameters: a small model, a ResNet-18 (44.7 MB), 200 MB
STEPS_S = (0.01, 0.05, 0.2, 1.0)  # each step's stand-in compute


def blend_rows(sizes: tuple[int, ...], steps_s: tuple[float, ...], quick: bool = False) -> list[MemoryRow]:
    """Both modes at every size and step time, on one host; the defaults over TCP at 44.7 MB. `quick`: the
    default mode's rows alone."""
    same_host, tcp = {"same_host": "auto"}, {"same_host": "off", "insecure": True}
    modes: list[tuple[str, dict[str, Any]]] = [("symmetric (default)", {})]
    if not quick:
        modes.append(("pull", {"mode": "pull"}))
    rows = [
        MemoryRow(f"{mode}, same host", size, {**same_host, **settings}, step_s=step_s)
        for size in sizes
        for step_s in steps_s
        for mode, settings in modes
    ]
    if not quick:
        rows += [
            MemoryRow(f"{mode}, TCP", 11_173_962, {**tcp, **settings}, step_s=step_s)
            for step_s in (0.02, 0.05)
            for mode, settings in modes
        ]
    return rows


def bench_blends(rows: list[MemoryRow], flaky_steps: int) -> dict[str, Any]:
    """Run the rows (printed as they finish), then the flaky link for `flaky_steps` steps (0: not)."""
    results = bench_memory(rows, format_blends)
    return {"blends": results, "flaky": bench_flaky(flaky_steps, seeds=(0,)) if flaky_steps else []}


def bench_flaky(steps: int, seeds: tuple[int, ...] = (0, 1, 2)) -> list[dict[str, Any]]:
    """The flaky link (:func:`.flaky.flaky_run`) once per seed, each printed as it ends."""
    runs = []
    for seed in seeds:
        runs.append({"seed": seed, "steps": steps, **dataclasses.asdict(flaky_run(seed=seed, steps=steps))})
        print(format_flaky(runs[-1]), flush=True)
    return runs


def format_blends(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "\nBlends: two nodes on this machine, 16 steps each; exchanges each applied (the smaller of the two)",
            f"  {'row':<32}{'params':>13}{'compute ms':>12}{'step ms':>9}{'blends':>8}{'busy':>6}",
        ]
    for r in rows:
        head = f"  {r['label']:<32}{r['parameters']:>13,}{r['step_s'] * 1e3:>12.0f}"
        if "error" in r:
            lines.append(f"{head}  failed: {r['error']}")
            continue
        busy = sum(n["busy"] for n in r["nodes"])
        lines.append(f"{head}{r['step_ms']:>9.0f}{r['blends']:>5}/{r['steps']:<2}{busy:>6}")
    return "\n".join(lines)


def format_flaky(run: dict[str, Any]) -> str:
    node_steps = 3 * run["steps"]
    return (
        f"\nA flaky link, seed {run['seed']} (3 nodes, the defaults, timeout_ms 300, replies delayed 150-450 ms, "
        f"{run['cuts']} cuts, {run['steps']} steps of 20 ms each, all made in {run['took_s']:.0f} s):\n"
        f"  exchanges applied {run['applied']} in {node_steps} node-steps ({run['applied'] / node_steps:.1%}), "
        f"{run['in_doubt']} in doubt on the way, {run['timeouts']} timeouts ({run['slow']} of peers heard from "
        f"meanwhile: slow, not rested); the sum of the models moved by {run['drift']:.1e}; the longest a node "
        f"went without starting an exchange or applying one it served: {run['silent_s']:.1f} s, without applying "
        f"any: {run['unblended_s']:.1f} s"
    )
