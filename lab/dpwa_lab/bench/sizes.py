"""The table for each model size: every floor and every dpwa path, sampled in turn, as medians in milliseconds."""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from .exchange import DpwaPair, RawClientOfNode
from .floors import CopyFloor, RawTcpFloor, WorkFloor, ZmqFloor


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def measure_size(size: int, reps: int, wire_dtypes: list[str], warmup: int = 3) -> dict[str, Any]:
    """Every measurement for one model size, interleaved: one sample of each per repetition. The subjects'
    helper processes start side by side; sampling begins once every one serves."""
    from dpwa.gossip.services import BULK_MIN_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        subjects: dict[str, Any] = {}
        try:
            subjects["copy"] = CopyFloor(size)
            subjects["zmq"] = ZmqFloor(size)
            subjects["router"] = ZmqFloor(size, router=True)
            subjects["router_work"] = WorkFloor(size)
            subjects["zmq_curve"] = ZmqFloor(size, curve=True)
            subjects["raw_tcp"] = RawTcpFloor(size)
            subjects["tcp"] = DpwaPair(size, tmp, same_host=False)
            subjects["node_served"] = RawClientOfNode(subjects["tcp"])
            if size * 4 >= BULK_MIN_BYTES:  # smaller models never stream: tcp is already all ZeroMQ
                subjects["tcp_zmq"] = DpwaPair(size, tmp, same_host=False, bulk="off")
            subjects["curve"] = DpwaPair(size, tmp, same_host=False, curve=True)
            if size * 4 >= BULK_MIN_BYTES:  # with keys: the sealed stream above, and all over ZeroMQ here
                subjects["curve_zmq"] = DpwaPair(size, tmp, same_host=False, curve=True, bulk="off")
            subjects["same_host"] = DpwaPair(size, tmp, same_host=True)
            subjects["same_host_symmetric"] = DpwaPair(size, tmp, same_host=True, mode="symmetric")
            # run.sh's default mode between hosts: large snapshots stream both ways, small ones go over ZeroMQ
            subjects["tcp_symmetric"] = DpwaPair(size, tmp, same_host=False, mode="symmetric")
            subjects["curve_symmetric"] = DpwaPair(size, tmp, same_host=False, curve=True, mode="symmetric")
            for dtype in wire_dtypes:
                subjects[f"tcp_{dtype}"] = DpwaPair(size, tmp, same_host=False, wire_dtype=dtype)
            for subject in subjects.values():  # their helper processes started side by side
                subject.ready()
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in subjects}
            for rep in range(warmup + reps):
                for name, subject in subjects.items():
                    sample = subject.sample()
                    if rep >= warmup:
                        samples[name].append(sample)
        finally:
            for subject in subjects.values():
                subject.close()
    row: dict[str, Any] = {"parameters": size, "mbytes": size * 4 / 1e6, "reps": reps}
    row["busy_retries"] = {name: s.busy for name, s in subjects.items() if getattr(s, "busy", 0)}
    for name, rows in samples.items():
        medians = {key: median_ms([r[key] for r in rows]) for key in rows[0]}
        floors = ("copy", "zmq", "router", "router_work", "zmq_curve", "raw_tcp", "node_served")
        row[f"{name}_ms" if name in floors else name] = medians.get("ms", medians)
    return row
