"""The memory table (``python -m dpwa.bench --memory``): what a node holds beyond its model and its gradients.

Each row starts two training nodes in processes of their own
(``python -m dpwa.bench --memory-node``), on this machine, with the
PyTorch adapter over a model of the row's size (a few large tensors, as a
transformer's are) and gradients for every parameter. Each node measures,
from ``/proc/self``:

* its **baseline**: anonymous memory once the model and its gradients exist
  and every page of them is written, with dpwa imported but no node made;
* **anon**: anonymous memory since (the adapter's work buffers, receive
  buffers, heap snapshots, ZeroMQ's frames, the library's own state);
* **shm**: its own shared-memory slots, mapped or not, retired ones still
  mapped included (a slot file is allocated whole: ``posix_fallocate``);
  a peer's slots this node reads in place are that peer's and not counted;
* **steady**: anon + shm between exchanges: once both nodes made their last step (the end barrier), the
  last exchanges blended; **peak**:
  the largest anon + shm seen by a sampler thread every few milliseconds
  from the adapter's creation to its close.

Both are printed as copies of the model's bytes (its parameters in their
own dtype). Each row also reports the blends per node and the median time
from ``update_send`` to the end of ``update_wait`` (``step ms``: the
parameters' update and 50 ms of stand-in compute between them), so the same
rows give a step's time against size.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .children import Child, free_port

__all__ = [
    "MemoryRow",
    "bench_memory",
    "format_memory",
    "gpu_rows",
    "largest_on_gpu",
    "memory_rows",
    "serve_memory_node",
]

TENSOR_MAX = 16 << 20  # elements per tensor of the bench's model at most (a large layer's weight)
SAMPLE_S = 0.005  # the peak sampler's interval
STEP_S = 0.05  # a step's compute besides the parameters' update (a stand-in)


@dataclass(frozen=True)
class MemoryRow:
    """One row: a model size and the settings both nodes run with (config keys)."""

    label: str
    parameters: int
    settings: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # the model's own dtype
    steps: int = 16
    step_s: float = STEP_S  # each step's stand-in compute
    device: str = "cpu"  # where both nodes' models live ("cuda": scripts/gpu-check.sh's rows)


def memory_rows(sizes: list[int], largest: int | None, quick: bool = False) -> list[MemoryRow]:
    """The table: every path and codec at the first size; the defaults, one slot over TCP and mode pull at
    the others; at `largest` (the biggest model two nodes hold on this machine; None: no such row) the
    defaults on one host and over TCP. `quick`: the default mode's two rows at each size, nothing else."""
    same_host, tcp = {"same_host": "auto"}, {"same_host": "off", "insecure": True}
    rows: list[MemoryRow] = []
    for i, size in enumerate(sizes):
        rows += [
            MemoryRow("symmetric (default), same host", size, {**same_host}),
            MemoryRow("symmetric (default), TCP", size, {**tcp}),
        ]
        if quick:
            continue
        rows += [
            MemoryRow("symmetric, TCP, snapshot_slots: 1", size, {**tcp, "snapshot_slots": 1}),
            MemoryRow("pull, same host", size, {**same_host, "mode": "pull"}),
            MemoryRow("pull, TCP", size, {**tcp, "mode": "pull"}),
        ]
        if i == 0:
            rows += [
                MemoryRow("pull, TCP, int8", size, {**tcp, "mode": "pull", "wire_dtype": "int8"}),
                MemoryRow("pull, TCP, topk", size, {**tcp, "mode": "pull", "wire_dtype": "topk"}),
                MemoryRow("symmetric, TCP, bfloat16 wire", size, {**tcp, "wire_dtype": "bfloat16"}),
                MemoryRow("symmetric, same host, outer nesterov", size, {**same_host, "outer": "nesterov"}),
                MemoryRow("symmetric, TCP, keys (sealed streams)", size, {"same_host": "off", "keys": True}),
                MemoryRow("symmetric, same host, bfloat16 model", size, {**same_host}, dtype="bfloat16"),
            ]
    if largest is not None:
        rows += [
            MemoryRow("symmetric (default), same host", largest, {**same_host}, steps=16),
            # over TCP the defaults hold 2 copies, 3 at the peak: at 500M, two nodes need 20 GB with their models
            MemoryRow("symmetric (default), TCP", largest, {**tcp}, steps=16),
        ]
    return rows


GPU_MAX_PARAMETERS = 4_000_000_000  # the largest GPU row at most (bfloat16: 8 GB a model)


def largest_on_gpu(free_device: int, free_shm: int, available: int) -> int:
    """The parameters of the largest bfloat16 model two nodes hold on one GPU and host, in steps of 100M: each
    node holds its model and gradients on the device (4 bytes a parameter), two snapshot slots in /dev/shm
    (4 bytes), and a little more on the host; a margin of 30% is left everywhere."""
    by_device = 0.7 * free_device / (2 * 4)
    by_shm = 0.7 * free_shm / (2 * 4)
    by_memory = 0.7 * available / (2 * 5)
    step = 100_000_000
    return int(min(by_device, by_shm, by_memory, GPU_MAX_PARAMETERS) // step * step)


def gpu_rows(largest: int | None) -> list[MemoryRow]:
    """scripts/gpu-check.sh's rows: the defaults on one GPU, two nodes, at 100M float32 parameters and at
    `largest` bfloat16 ones (None: :func:`largest_on_gpu` of this machine's free memory)."""
    if largest is None:
        import torch

        free_device = torch.cuda.mem_get_info()[0]
        shm = os.statvfs("/dev/shm")
        largest = largest_on_gpu(free_device, shm.f_bavail * shm.f_frsize, _meminfo_bytes("MemAvailable"))
    rows = [MemoryRow("GPU, symmetric (default), same host", 100_000_000, {"same_host": "auto"}, device="cuda")]
    if largest > 100_000_000:
        label = "GPU, symmetric (default), same host, bfloat16"
        rows.append(MemoryRow(label, largest, {"same_host": "auto"}, dtype="bfloat16", device="cuda"))
    return rows


def _meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key}")


# --------------------------------------------------------------------------- one node (a helper process)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _own_shm_bytes(directory: str | None) -> int:
    """The bytes of this node's own slot files: those mapped (retired ones too: deleted, still mapped) and
    those in its directory."""
    if directory is None:
        return 0
    sizes: dict[str, int] = {}
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(directory + "/slot-"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                sizes[parts[4]] = max(sizes.get(parts[4], 0), end - start)  # by inode: a file mapped twice
    try:
        for entry in os.scandir(directory):
            if entry.name.startswith("slot-"):
                inode = str(entry.inode())
                sizes.setdefault(inode, entry.stat().st_blocks * 512)
    except FileNotFoundError:
        pass
    return sum(sizes.values())


class _Sampler:
    """Samples anon + own shm every SAMPLE_S on a thread of its own, keeping the peak; stopped by stop()."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.peak = (0, 0)  # (anon bytes, shm bytes) at the largest sum
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> tuple[int, int]:
        now = (_status_kib("RssAnon") * 1024, _own_shm_bytes(self.directory))
        if sum(now) > sum(self.peak):
            self.peak = now
        return now

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):  # bounded: stop() ends it
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _model(parameters: int, dtype: str, fill: float, device: str = "cpu"):
    """A module of `parameters` elements in tensors of at most TENSOR_MAX, with gradients, every page written."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    net = torch.nn.Module()
    sizes = [TENSOR_MAX] * (parameters // TENSOR_MAX) + ([parameters % TENSOR_MAX] if parameters % TENSOR_MAX else [])
    net.weights = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.full((n,), fill, dtype=torch_dtype, device=device)) for n in sizes]
    )
    for p in net.parameters():
        p.grad = torch.full_like(p, 1e-3)
    return net


def serve_memory_node(
    config_path: str,
    name: str,
    parameters: int,
    dtype: str,
    steps: int,
    step_s: float = STEP_S,
    device: str = "cpu",
) -> None:
    """One node of a row: train `steps` steps of `step_s` stand-in compute each, exchanging every step, and print
    what it measured as JSON. On a GPU it first times the same steps without dpwa (the step's floor), and
    reports the device memory the adapter added at its peak."""
    import torch

    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    torch.set_num_threads(1)
    net = _model(parameters, dtype, fill=1.0 if name == "a" else 3.0, device=device)
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    cuda = device.startswith("cuda")

    def step() -> None:
        with torch.no_grad():  # a step: every parameter written, as an optimizer writes it
            for p in net.parameters():
                p.add_(p.grad, alpha=-0.1)
        if cuda:
            torch.cuda.synchronize()  # the step's kernels are part of its time, as a loss.item() would make them
        time.sleep(step_s)  # the rest of a step's compute (a stand-in: what is measured is memory)

    plain_times: list[float] = []
    if cuda:  # the same loop without dpwa, for the overhead; then the device memory dpwa adds is counted
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            plain_times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        device_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    baseline = _status_kib("RssAnon") * 1024
    adapter = DpwaPyTorchAdapter(net, name, config_path)
    shared = adapter.node.services.shared
    sampler = _Sampler(str(shared.dir) if shared is not None else None)
    step_times: list[float] = []
    try:
        loss = 1.0
        adapter.node.barrier("memory-start", timeout_s=120)  # both train at once: every step may exchange
        for _ in range(steps):
            t0 = time.perf_counter()
            adapter.update_send(loss)
            step()
            adapter.update_wait(loss)
            step_times.append(time.perf_counter() - t0)
        adapter.node.barrier("memory-end", timeout_s=120)  # neither closes while the other still steps
        # between exchanges: both have stopped stepping, and what the last ones received has been blended
        steady = sampler.sample()
        stats = adapter.node.stats()  # with the halves it applied while it waited for the other's last steps
    finally:
        sampler.stop()
        adapter.close()
    result: dict[str, Any] = {
        "name": name,
        "model_bytes": model_bytes,
        "baseline": baseline,
        "steady": [steady[0] - baseline, steady[1]],
        "peak": [sampler.peak[0] - baseline, sampler.peak[1]],
        "step_ms": statistics.median(step_times) * 1e3,
        "blends": stats.get("averaged", 0) + stats.get("mirrored", 0),
        "busy": stats.get("busy_answers", 0),
    }
    if cuda:
        result["plain_step_ms"] = statistics.median(plain_times) * 1e3
        result["device_peak"] = torch.cuda.max_memory_allocated() - device_base
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------- the table


def _write_config(directory: str, row: MemoryRow) -> str:
    import yaml

    from dpwa.wire.curve import generate

    settings = dict(row.settings)
    keys = settings.pop("keys", False)
    nodes: list[dict[str, Any]] = [{"name": n, "host": "127.0.0.1", "port": free_port()} for n in ("a", "b")]
    if keys:
        for node in nodes:
            _, secret, pair = generate(f"{node['name']}-{node['port']}", Path(directory) / "keys")
            node["public_key"], node["secret_key_file"] = pair.public.decode(), str(secret)
    # the deadline grows with the model (loopback moves about 1 GB/s here): 2.5 s, the default, up to 500 MB
    timeout_ms = max(2500, row.parameters * 4 // 200_000)
    config = {"nodes": nodes, "timeout_ms": timeout_ms, "join": "never", **settings}
    path = os.path.join(directory, f"memory-{nodes[0]['port']}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    return path


def bench_memory(
    rows: list[MemoryRow], fmt: Callable[[list[dict[str, Any]], bool], str] | None = None
) -> list[dict[str, Any]]:
    """Each row's two nodes, side by side; a row whose nodes fail is reported as failed, and the rest run.
    Each row is printed as it finishes, by `fmt` (default :func:`format_memory`)."""
    results: list[dict[str, Any]] = []
    for row in rows:
        with tempfile.TemporaryDirectory() as tmp:
            path = _write_config(tmp, row)
            args = [str(row.parameters), row.dtype, str(row.steps), str(row.step_s), row.device]
            children = [Child("--memory-node", path, name, *args, wait=False) for name in ("a", "b")]
            nodes, error = [], ""
            try:
                for child in children:
                    assert child.proc.stdout is not None
                    line = child.proc.stdout.readline()  # bounded: the node prints its result, or exits
                    if not line.strip():
                        error = f"a node exited ({child.proc.wait(30)}); see the log"
                        break
                    nodes.append(json.loads(line))
            finally:
                for child in children:
                    child.stop()
        result: dict[str, Any] = {
            "label": row.label,
            "parameters": row.parameters,
            "dtype": row.dtype,
            "step_s": row.step_s,
        }
        if error:
            result["error"] = error
        else:
            model = nodes[0]["model_bytes"]
            result.update(
                model_mbytes=model / 1e6,
                steady_copies=max(sum(n["steady"]) for n in nodes) / model,
                peak_copies=max(sum(n["peak"]) for n in nodes) / model,
                anon_copies=max(n["steady"][0] for n in nodes) / model,
                shm_copies=max(n["steady"][1] for n in nodes) / model,
                step_ms=statistics.median(n["step_ms"] for n in nodes),
                blends=min(n["blends"] for n in nodes),
                steps=row.steps,
                nodes=nodes,
            )
            if all("device_peak" in n for n in nodes):
                result.update(
                    device_peak_copies=max(n["device_peak"] for n in nodes) / model,
                    plain_step_ms=statistics.median(n["plain_step_ms"] for n in nodes),
                )
        print((fmt or format_memory)([result], not results), flush=True)
        results.append(result)
    return results


def format_memory(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "\nMemory: two nodes on this machine, each beyond its model and gradients, in copies of the model's bytes",
            "(steady: between exchanges, after both made their last step; peak: the most seen while the node ran;"
            " the larger node of the two)",
            f"  {'row':<40}{'params':>13}{'MB':>8}{'steady':>8}{'peak':>7}{'anon':>7}{'shm':>6}"
            f"{'step ms':>9}{'blends':>8}",
        ]
    for r in rows:
        head = f"  {r['label']:<40}{r['parameters']:>13,}"  # a row of another dtype names it in its label
        if "error" in r:
            lines.append(f"{head}  failed: {r['error']}")
            continue
        line = (
            f"{head}{r['model_mbytes']:>8.0f}{r['steady_copies']:>8.2f}{r['peak_copies']:>7.2f}"
            f"{r['anon_copies']:>7.2f}{r['shm_copies']:>6.2f}{r['step_ms']:>9.0f}"
            f"{r['blends']:>5}/{r['steps']:<2}"
        )
        if "device_peak_copies" in r:  # a GPU row: the device memory dpwa added, and the step without dpwa
            line += f"  GPU peak {r['device_peak_copies']:.2f}, step without dpwa {r['plain_step_ms']:.0f} ms"
        lines.append(line)
    return "\n".join(lines)
