"""The exact reference: ``DistributedDataParallel`` over gloo, ranks started together or one process at a time.

Every rank computes gradients on its own batch; DDP averages them with an
all-reduce after the backward pass, so every rank applies the same mean
gradient and the models stay equal. Nothing here is dpwa's own transport:
this is torch's machinery, as a user would run it.

* :func:`launch` starts `nprocs` ranks with ``torch.multiprocessing.start_processes``
  (spawn), each in a gloo process group rendezvoused through a file (no port is
  opened for the rendezvous; gloo's own connections stay on the loopback
  interface when ``GLOO_SOCKET_IFNAME`` is unset, as :func:`launch` sets it to
  ``lo`` where that interface exists).
* :func:`join_group` and :func:`leave_group` do the same for a rank started
  as a process of its own (``python -m dpwa.compare`` starts each rank in its
  own network namespace that way), and :func:`run_rank` runs a function between them.
  With models on GPUs, :func:`backend_for` picks NCCL where each rank has a GPU
  of its own (``NCCL_SOCKET_IFNAME`` names its interface), and gloo otherwise.
* :func:`wrap` wraps a module in DDP with a communication hook that measures the
  time each rank spends in the all-reduce (waiting for the slowest rank, and
  moving bytes), which is what "idle" means for this system.

Example (the function must be importable: a module-level function)::

    def train(rank, world, epochs):
        comm = CommTimer()
        model = wrap(build_model(), comm)
        ...

    launch(train, (10,), nprocs=4, workdir="/tmp/run")

A rank that dies stops every other at its next all-reduce: gloo raises after
``timeout_s``, and ``launch`` raises ``torch.multiprocessing.ProcessRaisedException``
or ``ProcessExitedException``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CommTimer",
    "join_group",
    "launch",
    "leave_group",
    "ring_allreduce_bytes",
    "run_rank",
    "timed_allreduce",
    "wrap",
]


def ring_allreduce_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends plus receives in a ring all-reduce of `nbytes`: 2 (n-1)/n each way."""
    return 4.0 * (world - 1) / world * nbytes if world > 1 else 0.0


def launch(
    fn: Callable[..., Any],
    args: Sequence[Any],
    nprocs: int,
    *,
    workdir: str | os.PathLike[str],
    timeout_s: float = 60.0,
) -> None:
    """Run ``fn(rank, world, *args)`` in `nprocs` spawned processes, each in one gloo process group.

    The rendezvous is a file in `workdir` (which must not hold one from an
    earlier run). Returns when every rank returned; raises if one failed.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    store = Path(workdir) / "allreduce.rendezvous"
    if store.exists():
        raise FileExistsError(f"{store} exists: an earlier run's rendezvous; use a fresh workdir")
    store.parent.mkdir(parents=True, exist_ok=True)
    if "GLOO_SOCKET_IFNAME" not in os.environ and Path("/sys/class/net/lo").exists():
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # ranks on this machine talk over loopback only
    import torch.multiprocessing as mp

    mp.start_processes(
        run_rank,
        args=(fn, nprocs, str(store), timeout_s, tuple(args)),
        nprocs=nprocs,
        start_method="spawn",
        join=True,
    )


def backend_for(device: str, world: int) -> str:
    """The process group's backend for `world` ranks training on `device` (``cpu`` or ``cuda``): NCCL where
    each rank has a GPU of its own, gloo otherwise (gloo reduces CUDA tensors too, through host memory)."""
    if device == "cuda" and dist.is_nccl_available() and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def join_group(
    rank: int, world: int, store: str | os.PathLike[str], timeout_s: float = 60.0, backend: str = "gloo"
) -> None:
    """Join the process group (`backend`: gloo, or nccl) of `world` ranks as `rank`, rendezvoused through the
    file `store`.

    For ranks started one by one (each in its own network namespace, say): the
    file needs no network, and gloo connects the ranks over the interface named
    by ``GLOO_SOCKET_IFNAME`` (the caller sets it; unset, gloo picks one by the
    host name). Sets torch to one thread.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    torch.set_num_threads(1)
    if backend == "nccl":  # each rank its own GPU (backend_for), made current before NCCL binds to one
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{Path(store).resolve()}",  # a relative path would read as file://HOST/PATH
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def leave_group() -> NoReturn:
    """Leave the process group together with every other rank, and end this process (status 0).

    Every rank waits at a barrier, then skips the interpreter's teardown: there,
    gloo's threads may still hold tensors whose release needs the GIL, and the
    rank aborts ("terminate called without an active exception", SIGABRT),
    failing a run that trained to the end (seen once in four test runs).
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(
    rank: int, fn: Callable[..., Any], world: int, store: str, timeout_s: float, args: tuple, backend: str = "gloo"
) -> None:
    """Join the group, run ``fn(rank, world, *args)``, leave together (see :func:`leave_group`)."""
    join_group(rank, world, store, timeout_s, backend)
    try:
        fn(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


@dataclass
class CommTimer:
    """What the all-reduces cost this rank: seconds inside them (waiting included), calls, and bytes reduced."""

    seconds: float = 0.0
    calls: int = 0
    nbytes: int = 0


def timed_allreduce(tensor: torch.Tensor, timer: CommTimer) -> torch.Tensor:
    """Replace `tensor` (in place) by its mean over every rank, timing the all-reduce into `timer`."""
    t0 = time.perf_counter()
    dist.all_reduce(tensor)  # waits for every rank: the time includes waiting for the slowest
    tensor.div_(dist.get_world_size())
    if tensor.is_cuda:  # NCCL only queues the reduction on the stream: time it to its end
        torch.cuda.synchronize(tensor.device)
    timer.seconds += time.perf_counter() - t0
    timer.calls += 1
    timer.nbytes += tensor.numel() * tensor.element_size()
    return tensor


def _timed_allreduce(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    tensor = timed_allreduce(bucket.buffer(), state)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


# DDP checks the hook's annotations as objects, and this module's are strings (postponed evaluation).
_timed_allreduce.__annotations__ = {
    "state": CommTimer,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def wrap(module: nn.Module, timer: CommTimer) -> nn.parallel.DistributedDataParallel:
    """`module` in DDP (buffers broadcast from rank 0 every forward), its all-reduce timed into `timer`.

    The hook reduces each bucket synchronously, so the time it measures is
    exactly the time the rank spent communicating or waiting; DDP's overlap of
    communication with the rest of the backward pass is lost for models of
    several buckets (a model under 25 MB is one bucket, reduced at the end anyway).
    """
    device = next(module.parameters()).device
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=True)
    ddp.register_comm_hook(timer, _timed_allreduce)
    return ddp
