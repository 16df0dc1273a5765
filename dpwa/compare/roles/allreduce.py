"""All-reduce: one launcher process starts the ranks with torch's own machinery (:func:`dpwa.systems.allreduce.launch`).

Every rank trains its shard through ``DistributedDataParallel`` (gloo), with
the workload's learning rate and schedule by its steps; rank 0 snapshots its
model (every rank holds the same). Each rank writes a PID file (``pids/rankI.pid``)
so the runner can stop, or kill, any one of them by PID.
"""

from __future__ import annotations

import os
import time

from ...cluster.processes import write_pid_file
from ...systems import allreduce
from ...systems.layout import ModuleView
from ..recorder import wait_for_go
from .common import Role, load_role, timed


def run_launcher(role: Role) -> None:
    opts = role.options
    allreduce.launch(
        rank_main,
        (role.run["run_file"],),
        role.spec.workers,
        workdir=role.workdir,
        timeout_s=opts.get("gloo_timeout_s", 30.0),
    )


def rank_main(rank: int, world: int, run_file: str) -> None:
    import torch

    role = load_role(run_file, f"rank{rank}", rank, worker=True)
    write_pid_file(role.workdir / "pids" / f"{role.name}.pid", os.getpid())
    w, spec, timer, rec = role.workload, role.spec, role.timer, role.recorder
    net = w.build_model()
    view = ModuleView(net)
    comm = allreduce.CommTimer()
    model = allreduce.wrap(net, comm)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=spec.lr, momentum=spec.momentum, nesterov=True, weight_decay=spec.weight_decay
    )
    total = w.local_steps(rank)
    stride = w.snapshot_stride()
    step = samples = 0
    go = wait_for_go(role.workdir, role.name)
    timer.start()
    for epoch in range(spec.epochs):
        for x, y in timed(w.batches(rank, epoch), timer):
            if role.stop:
                break
            for group in optimizer.param_groups:
                group["lr"] = spec.lr_at(step / total)
            t0 = time.perf_counter()
            comm0 = comm.seconds
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            timer.computed(time.perf_counter() - t0 - (comm.seconds - comm0))
            step += 1
            samples += len(y) * world  # every rank trains a batch per step
            if rank == 0 and step % stride == 0:
                rec.snapshot(view.state(), samples)
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
        stopped=role.stop.signal_name,
        **timer.summary(left_out),
    )
