"""The benchmark's outputs: the machine it ran on, and the tables and the summary it prints."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import numpy as np


def machine() -> dict[str, Any]:
    import zmq

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
        "torch": torch_version,
    }


def format_size_row(row: dict[str, Any]) -> str:
    a, b, t = row["copy_ms"], row["zmq_ms"], row["raw_tcp_ms"]
    lines = [
        f"\n{row['parameters']:,} parameters ({row['mbytes']:.1f} MB), medians of {row['reps']} runs",
        f"  {'measurement':<42}{'ms':>9}{'x copy':>9}{'x zmq':>9}{'x tcp':>9}",
        f"  {'(a) numpy copy':<42}{a:>9.2f}{1:>9.2f}{a / b:>9.2f}{a / t:>9.2f}",
        f"  {'(b) raw pyzmq REQ/REP, tcp':<42}{b:>9.2f}{b / a:>9.2f}{1:>9.2f}{b / t:>9.2f}",
        f"  {'(t) raw TCP sendall -> recv_into':<42}{t:>9.2f}{t / a:>9.2f}{t / b:>9.2f}{1:>9.2f}",
    ]
    r = row["router_ms"]
    lines.append(f"  {'(r) raw pyzmq ROUTER, tracked reply, tcp':<42}{r:>9.2f}{r / a:>9.2f}{r / b:>9.2f}{r / t:>9.2f}")
    w = row["router_work_ms"]
    lines.append(f"  {'(w) (r) + publish, check, blend':<42}{w:>9.2f}{w / a:>9.2f}{w / b:>9.2f}{w / t:>9.2f}")
    k = row["zmq_curve_ms"]
    lines.append(f"  {'(k) raw pyzmq REQ/REP, tcp, CURVE':<42}{k:>9.2f}{k / a:>9.2f}{k / b:>9.2f}{k / t:>9.2f}")
    s = row["node_served_ms"]
    lines.append(f"  {'(s) raw REQ client <- dpwa node, tcp':<42}{s:>9.2f}{s / a:>9.2f}{s / b:>9.2f}{s / t:>9.2f}")
    labels = {
        "tcp": "tcp",
        "tcp_zmq": "tcp, bulk: off",
        "curve": "tcp, CURVE",
        "curve_zmq": "tcp, CURVE, bulk: off",
        "same_host": "same-host",
        "same_host_symmetric": "same-host, symmetric",
        "tcp_symmetric": "tcp, symmetric",
        "curve_symmetric": "tcp, CURVE, symmetric",
    }
    for path in [k for k in row if k in labels or k.startswith("tcp_") or k.startswith("curve_")]:
        label = labels.get(path, path.replace("tcp_", "tcp, wire "))
        for key in ("update_send", "update_wait", "exchange"):
            v = row[path][key]
            lines.append(f"  {'(c) dpwa ' + key + ', ' + label:<42}{v:>9.2f}{v / a:>9.2f}{v / b:>9.2f}{v / t:>9.2f}")
    if row.get("busy_retries"):  # see exchange.BUSY_PAUSES_S
        retried = ", ".join(f"{path} {n}" for path, n in row["busy_retries"].items())
        lines.append(f"  samples asked again after a busy refusal (unsent replies not yet released): {retried}")
    return "\n".join(lines)


def format_training(rows: list[dict[str, Any]]) -> str:
    lines = [
        "\nTraining step of the example (small ResNet, one thread per process), exchanging every step;",
        "raw: the same bytes fetched every step over plain ZeroMQ, nothing copied, checked or blended (the floor);",
        "+work: raw, plus what any exchange does on the training thread: publish, check and blend (no protocol);",
        "2 trips: +work and a second small round trip after the blend, as a two-phase exchange's confirm (symmetric)",
        f"  {'workload':<38}{'params':>9}{'plain ms':>10}{'dpwa ms':>10}{'overhead':>10}{'averaged':>10}"
        f"{'plain ms':>10}{'raw ms':>10}{'raw':>8}{'+work':>8}{'2 trips':>9}",
    ]
    for r in rows:
        lines.append(
            f"  {r['workload']:<38}{r['parameters']:>9,}{r['step_ms']:>10.2f}{r['step_with_dpwa_ms']:>10.2f}"
            f"{100 * r['overhead']:>9.1f}%{100 * r['averaged_fraction']:>9.0f}%"
            f"{r['raw_step_ms']:>10.2f}{r['step_with_raw_ms']:>10.2f}{100 * r['raw_overhead']:>7.1f}%"
            f"{100 * r['work_overhead']:>7.1f}%"
            + (f"{100 * r['two_trips_overhead']:>8.1f}%" if "two_trips_overhead" in r else f"{'-':>9}")
        )
    return "\n".join(lines)


def format_scale(rows: list[dict[str, Any]]) -> str:
    lines = [
        "\nScale: nodes as threads in one process, 100,000 parameters, fetch every step, TCP",
        f"  {'nodes':>5}{'exchanges/s':>14}{'CPU ms per exchange':>22}{'failed':>8}",
    ]
    for r in rows:
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(r["failed_by"].items()))
        lines.append(
            f"  {r['nodes']:>5}{r['exchanges_per_s']:>14.0f}{r['cpu_ms_per_exchange']:>22.2f}{r['failed']:>8}"
            + (f"  ({why})" if why else "")
        )
    return "\n".join(lines)


def format_summary(results: dict[str, Any], log_path: Path) -> str:
    """A few lines: what an exchange costs against its floors, how it scales, what it adds to training."""
    lines = ["\nSummary"]
    for row in results["sizes"]:
        tcp, zmq_ms = row["tcp"]["exchange"], row["zmq_ms"]
        # (w) is the floor of an exchange over ZeroMQ; larger snapshots stream instead (dpwa.wire.bulk)
        floor = f" (the floor with the work: {row['router_work_ms'] / zmq_ms:.2f}x)" if "tcp_zmq" not in row else ""
        text = (
            f"  {row['parameters']:,} parameters ({row['mbytes']:.1f} MB): an exchange over TCP takes "
            f"{tcp:.2f} ms, {tcp / zmq_ms:.2f}x a raw ZeroMQ round trip{floor}; "
            f"same-host {row['same_host']['exchange']:.2f} ms"
        )
        if "curve" in row:
            curve = row["curve"]["exchange"]
            text += f"; CURVE {curve / tcp:.2f}x TCP, {curve / row['zmq_curve_ms']:.2f}x a raw CURVE round trip"
        lines.append(text)
    if results["scale"]:
        scale = results["scale"]
        cpu = [r["cpu_ms_per_exchange"] for r in scale]
        lines.append(
            f"  scale: {scale[0]['nodes']} to {scale[-1]['nodes']} nodes, {min(cpu):.2f} to {max(cpu):.2f} CPU ms "
            f"per exchange, {sum(r['failed'] for r in scale)} failed"
        )
    for r in results["training"]:
        lines.append(
            f"  training, {r['workload']}: dpwa adds {100 * r['overhead']:.1f}% to a step "
            f"(the raw floor: {100 * r['raw_overhead']:.1f}%, with the work: {100 * r['work_overhead']:.1f}%"
            + (f", two round trips: {100 * r['two_trips_overhead']:.1f}%" if "two_trips_overhead" in r else "")
            + f"), averaging in {100 * r['averaged_fraction']:.0f}% of steps"
        )
    lines.append(f"  the benchmark's own nodes' log: {log_path} ({_count_lines(log_path)} lines)")
    return "\n".join(lines)


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0
