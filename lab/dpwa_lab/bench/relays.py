"""Exchanges direct and through a relay, on one link (``python -m dpwa.bench --relays``), and the digits example's
loss with two of its three nodes behind a relay against none.

The exchange table: nodes in one process on 127.0.0.1, plain TCP (``insecure: true``), open membership through
w0, which can be dialled and relays. Four setups, one after another: w0 asking w1, both dialled; w1 behind w0's
relay (``reachable: false``), only served, then only asking; w1 and w2 behind w0's relay, w0 only serving. None trains; each steps (publish,
exchange) as fast as it can for a while, and every exchange's time, as the requester measured it (the
``peer.X.latency_s`` it keeps), is sampled. By path:

* direct: a dialled node asks a dialled one (one TCP connection);
* to a relayed node: a dialled node asks a relayed one (the request goes to the relay's port for it, and the
  relay splices it to the connection the relayed node dialled out);
* from a relayed node: it asks a dialled node (it dials out, as anyone does: direct);
* relayed to relayed: through the relay.

The loss table runs examples/minimal.py three times with three nodes: all dialled, then w2 and w3 behind the
relay of w1 (the same model, data, epochs and launch), and gives each setup's final test accuracy and training
loss, the mean and a 95% interval over the runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .children import free_port

PATHS = ("direct", "to a relayed node", "from a relayed node", "relayed to relayed")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57}  # Student's t, 95%, by degrees of freedom


def path_of(asker: str, asked: str, relayed: tuple[str, ...]) -> str:
    if asker in relayed and asked in relayed:
        return PATHS[3]
    if asked in relayed:
        return PATHS[1]
    if asker in relayed:
        return PATHS[2]
    return PATHS[0]


def _configs(
    relay_port: int, ports: list[int], relay_ports: str, relayed: tuple[str, ...], serving: str | None
) -> list[dict[str, Any]]:
    out = []
    for i, port in enumerate(ports):
        name = f"w{i}"
        config: dict[str, Any] = {
            "nodes": [{"name": name, "host": "127.0.0.1", "port": port, "reachable": name not in relayed}],
            "bootstrap": [f"127.0.0.1:{ports[0]}"],
            "insecure": True,
            "join": "never",
            "timeout_ms": 4000,
        }
        if name == serving:  # it only serves: the others' requests are the ones timed
            config["fetch_probability"] = 0
        if i == 0:
            config.update(relay_port=relay_port, relay_ports=relay_ports, relay_mbit=0)
        elif name in relayed:
            config["relays"] = [f"127.0.0.1:{relay_port}"]
        out.append(config)
    return out


# (nodes, the relayed ones, the one that only serves): two dialled, w0 asking; one behind the other's relay, asked, then
# asking (two nodes that both ask cross, and the first name gives way: one path would get few samples); two behind
# a third's relay, which only serves
SETUPS = ((2, (), "w1"), (2, ("w1",), "w1"), (2, ("w1",), "w0"), (3, ("w1", "w2"), "w0"))


def bench_relayed_exchanges(size: int, seconds: float) -> dict[str, Any]:
    """Exchange times by path for a model of `size` float32s, each setup stepped for `seconds` (see the module)."""
    samples: dict[str, list[float]] = {path: [] for path in PATHS}
    for count, relayed, serving in SETUPS:
        _sample(size, seconds, count, relayed, serving, samples)
    row: dict[str, Any] = {"size": size, "mb": size * 4 / 1e6}
    for path, values in samples.items():
        row[path] = {"median_ms": 1000 * statistics.median(values) if values else None, "n": len(values)}
    return row


def _sample(
    size: int,
    seconds: float,
    count: int,
    relayed: tuple[str, ...],
    serving: str | None,
    samples: dict[str, list[float]],
) -> None:
    from dpwa.gossip.node import Node
    from dpwa.mixing.params import NumpyParams

    names = [f"w{i}" for i in range(count)]
    ports = [free_port() for _ in names]
    relay_port, first = free_port(), free_port()
    nodes: list[Node] = []
    try:
        for i, config in enumerate(_configs(relay_port, ports, f"{first}-{first + 3}", relayed, serving)):
            nodes.append(Node(config, names[i], NumpyParams(np.full(size, float(i), np.float32))))
        stop = threading.Event()
        seen: dict[tuple[str, str], float] = {}

        def step(node: Node) -> None:
            while not stop.is_set():
                node.update_send()
                node.update_wait()
                counts = node.counters.snapshot()
                for peer in names:
                    latency = counts.get(f"peer.{peer}.latency_s")
                    if peer != node.name and latency is not None and seen.get((node.name, peer)) != latency:
                        seen[(node.name, peer)] = latency
                        samples[path_of(node.name, peer, relayed)].append(float(latency))

        threads = [threading.Thread(target=step, args=(node,), name=f"bench-{node.name}") for node in nodes]
        for thread in threads:
            thread.start()
        time.sleep(seconds)  # the measurement's length, not a synchronization
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        for node in nodes:
            node.close()


def format_relayed(rows: list[dict[str, Any]]) -> str:
    lines = [
        "\nExchange time by path (median ms, samples; nodes in one process on 127.0.0.1, plain TCP, none training):",
        f"{'model':>9}  " + "  ".join(f"{p:>22}" for p in PATHS) + "  to relayed/direct  relayed to relayed/direct",
    ]
    for row in rows:
        cells = []
        for path in PATHS:
            cell = row[path]
            cells.append(f"{cell['median_ms']:>14.1f} ({cell['n']:>4})" if cell["median_ms"] else f"{'-':>22}")
        direct = row[PATHS[0]]["median_ms"]
        ratios = [
            row[p]["median_ms"] / direct if direct and row[p]["median_ms"] else None for p in (PATHS[1], PATHS[3])
        ]
        shown = [f"{r:.2f}" if r is not None else "-" for r in ratios]
        lines.append(f"{row['mb']:>6.1f} MB  " + "  ".join(cells) + f"  {shown[0]:>17}  {shown[1]:>25}")
    return "\n".join(lines)


def _minimal_run(root: Path, relayed: bool, epochs: int) -> list[dict[str, Any]]:
    """examples/minimal.py on three nodes (w1 relays; w2, w3 behind it if `relayed`); each node's result line."""
    ports = [free_port() for _ in range(3)]
    relay_port, first = free_port(), free_port()
    folder = Path(tempfile.mkdtemp(prefix="dpwa-relays-"))
    children = []
    try:
        for i, port in enumerate(ports):
            name = f"w{i + 1}"
            config: dict[str, Any] = {
                "nodes": [{"name": name, "host": "127.0.0.1", "port": port, "reachable": not (relayed and i > 0)}],
                "bootstrap": [f"127.0.0.1:{ports[0]}"],
                "insecure": True,
            }
            if i == 0:
                config.update(relay_port=relay_port, relay_ports=f"{first}-{first + 3}")
            elif relayed:
                config["relays"] = [f"127.0.0.1:{relay_port}"]
            path = folder / f"{name}.yaml"
            path.write_text(json.dumps(config))
            env = {**os.environ, "DPWA_CONFIG": str(path), "DPWA_NAME": name, "DPWA_EPOCHS": str(epochs)}
            children.append(
                subprocess.Popen(
                    [sys.executable, str(root / "examples" / "minimal.py")],
                    cwd=root,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
        results = []
        for child in children:
            out, _ = child.communicate(timeout=600)
            line = next((x for x in out.splitlines() if x.startswith("minimal-result ")), None)
            if line is not None:
                results.append(json.loads(line.removeprefix("minimal-result ")))
        return results
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def bench_relayed_loss(runs: int, epochs: int) -> dict[str, Any]:
    """examples/minimal.py with and without relays, `runs` times each (see the module)."""
    root = Path(__file__).resolve().parents[3]
    out: dict[str, Any] = {"runs": runs, "epochs": epochs}
    for label, relayed in (("all dialled", False), ("w2, w3 behind a relay", True)):
        accuracy, loss, averaged = [], [], []
        for _ in range(runs):
            results = _minimal_run(root, relayed, epochs)
            if len(results) != 3:
                raise RuntimeError(f"{label}: {3 - len(results)} of 3 nodes printed no result")
            accuracy.append(statistics.fmean(r["accuracy"] for r in results))
            loss.append(statistics.fmean(r["last_loss"] for r in results))
            averaged.append(statistics.fmean(r["averaged"] for r in results))
        out[label] = {
            "accuracy": interval(accuracy),
            "last_loss": interval(loss),
            "averaged": interval(averaged),
        }
    return out


def format_loss(table: dict[str, Any]) -> str:
    lines = [
        f"\nexamples/minimal.py, 3 nodes, {table['epochs']} epochs, {table['runs']} runs each (mean ± 95% interval "
        "of the nodes' mean):",
        f"{'setup':<24}{'test accuracy':>20}{'last training loss':>22}{'blends per node':>20}",
    ]
    for label in ("all dialled", "w2, w3 behind a relay"):
        row = table[label]
        cells = [f"{m:.4f} ± {h:.4f}" for m, h in (row["accuracy"], row["last_loss"])]
        lines.append(f"{label:<24}{cells[0]:>20}{cells[1]:>22}{row['averaged'][0]:>14.0f} ± {row['averaged'][1]:.0f}")
    return "\n".join(lines)


def bench_relays(quick: bool) -> dict[str, Any]:
    sizes = [100_000] if quick else [100_000, 1_000_000, 11_200_000]
    rows = []
    for size in sizes:
        row = bench_relayed_exchanges(size, 3.0 if quick else 10.0)
        rows.append(row)
    print(format_relayed(rows), flush=True)
    loss = bench_relayed_loss(1 if quick else 3, 2 if quick else 10)
    print(format_loss(loss), flush=True)
    return {"exchanges": rows, "loss": loss}
