"""All-reduce: one process per rank, each joining the gloo group itself (:func:`dpwa_lab.systems.allreduce.join_group`).

Every rank trains its shard through ``DistributedDataParallel`` (gloo), with
the workload's learning rate and schedule by its steps; rank 0 snapshots its
model (every rank holds the same). The runner starts each rank as a process of
its own, as torchrun would, so that with slow links each sits in its own
network namespace; the rendezvous is a file in the run's folder (no network
needed), and gloo talks over the interface the runner names in
``GLOO_SOCKET_IFNAME`` (``lo``, or the namespace's link).

With ``--churn`` (``options["elastic"]``) the runner plays torchrun under
``--max-restarts``: a rank killed stops the group, and every rank is started
again in a new round (a new rendezvous file). Rank 0 writes a checkpoint
every tenth of the run, as ``train.py`` does every epoch, and a restarted
group resumes from it: the work since is lost and done again.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import torch

from ...systems import allreduce
from ...systems.layout import ModuleView
from ..recorder import wait_for_go
from .common import Role, run_collective, timed

CHECKPOINT = "allreduce-checkpoint.pt"  # in the run's folder: rank 0's state (--churn)
CHECKPOINTS = 10  # checkpoints in a run with --churn: one every tenth of its steps (train.py: one per epoch)


def run_rank(role: Role) -> None:
    """Join the group, train, write the results, and leave with every other rank (this process ends here)."""
    run_collective(role, train)


def train(role: Role) -> None:
    rank, world = role.index, role.spec.workers
    w, spec, timer, rec = role.workload, role.spec, role.timer, role.recorder
    net = w.worker_model(role.index)
    view = ModuleView(net)
    comm = allreduce.CommTimer()
    model = allreduce.wrap(net, comm)
    optimizer = spec.settings.make(model.parameters())  # SGD or AdamW, as the workload says
    total = w.lockstep_steps()
    stride = w.snapshot_stride()
    step = samples = 0
    elastic = bool(role.options.get("elastic"))
    every = max(1, total // CHECKPOINTS)
    if elastic and role.round:  # torchrun restarted the group: every rank resumes from rank 0's last checkpoint
        step, samples = _resume(role.workdir / CHECKPOINT, net, optimizer)
    go = wait_for_go(role.workdir, role.name)
    timer.start()
    batches = itertools.islice(w.train_batches(rank, total), step, None)  # a resumed rank's data goes on
    for x, y in timed(batches, timer):
        if role.stop:
            break
        for group in optimizer.param_groups:
            group["lr"] = spec.lr_at(step / total)
        t0 = time.perf_counter()
        comm0 = comm.seconds
        loss = w.loss(model, (x, y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timer.computed(time.perf_counter() - t0 - (comm.seconds - comm0))
        step += 1
        samples += len(y) * world  # every rank trains a batch per step
        if rank == 0 and step % stride == 0:
            rec.snapshot(view.state(), samples)
        if elastic and rank == 0 and step % every == 0:
            _checkpoint(role.workdir / CHECKPOINT, net, optimizer, step, samples)
    timer.stop()
    left_out = rec.spent_s
    if rank == 0:
        rec.snapshot(view.state(), samples, final=True)
    layout = view.layout
    per_step = allreduce.ring_allreduce_bytes(4 * layout.param_size, world)
    per_step += 2.0 * (world - 1) / world * 4 * layout.buffer_size  # buffers broadcast from rank 0
    rec.result(
        role="allreduce",
        go=go,
        samples=samples,
        local_samples=samples // world,
        bytes=per_step * step,
        bytes_estimated=True,
        comm_s=comm.seconds,
        allreduce_calls=comm.calls,
        reduced_bytes=comm.nbytes,  # bytes of the tensors all-reduced (a ring sends 2 (n-1)/n of them)
        stopped=role.stop.signal_name,
        round=role.round,
        # a restarted round's end (its timer counts from the round's own start, not the run's)
        **({"ended_at": time.time()} if role.round else {}),
        **timer.summary(left_out),
    )


def _checkpoint(path: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, samples: int) -> None:
    """Rank 0's state after `step` steps, written atomically: what a restarted group resumes from (every rank
    holds the same model and optimizer state under DDP)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "samples": samples}, tmp)
    os.replace(tmp, path)


def _resume(path: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load the last checkpoint into `net` and `optimizer`; (step, samples) it was taken at. None yet: (0, 0),
    a restart from the beginning, as a torchrun job without a checkpoint does."""
    if not path.exists():
        return 0, 0
    saved = torch.load(path, weights_only=True)
    net.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"]), int(saved["samples"])
