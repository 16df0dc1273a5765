"""The scale table: n nodes as threads in one process, exchanges per second and CPU time per exchange."""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import Any

import numpy as np

from .children import free_port


def bench_scale(n: int, size: int, steps: int) -> dict[str, Any]:
    """n nodes as threads in one process, each running `steps` exchanges as fast as it can."""
    from dpwa.config import parse_config
    from dpwa.gossip.node import Node
    from dpwa.mixing.params import NumpyParams

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    config = parse_config(
        {
            "nodes": [{"name": f"n{i}", "host": "127.0.0.1", "port": p} for i, p in enumerate(sorted(ports))],
            "fetch_probability": 1,
            "timeout_ms": 10_000,
            "same_host": "off",
            "insecure": True,  # TCP, as the table in docs/performance.md says
            "join": "never",
            "mode": "pull",  # the fetch path, as in the pair rows (the table was measured so)
            "pairing": "random",
        }
    )
    arrays = [np.full(size, float(i), np.float32) for i in range(n)]
    nodes = [Node(config, f"n{i}", NumpyParams(arrays[i]), rng=random.Random(i)) for i in range(n)]
    try:
        for node in nodes:  # first snapshots, so no fetch finds a peer "not ready"
            node.update_send()
        for node in nodes:
            node.update_wait()
        barrier = threading.Barrier(n + 1)
        failures: list[collections.Counter[str]] = [collections.Counter() for _ in range(n)]

        def run(i: int) -> None:
            barrier.wait()
            for _ in range(steps):
                nodes[i].update_send()
                update = nodes[i].update_wait()
                if not update.averaged:
                    refused = update.outcome == "refused"
                    failures[i][f"refused {update.reason.split(':')[0]}" if refused else update.outcome] += 1

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        t0, cpu0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.join(600)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"scale benchmark with {n} nodes did not finish: deadlock?")
    finally:
        for node in nodes:
            node.close()
    why = sum(failures, collections.Counter())
    exchanges = n * steps - why.total()
    return {
        "nodes": n,
        "exchanges_per_s": exchanges / elapsed,
        "failed": why.total(),
        "failed_by": dict(why),  # outcome (or the peer's refusal) -> count
        # CPU time of this process per exchange: both sides' work (publish, serve, fetch, blend).
        # Pairwise gossip costs O(1) per exchange, so this stays flat as the cluster grows.
        "cpu_ms_per_exchange": cpu / max(1, exchanges) * 1e3,
    }
