"""All-reduce: one process per rank, each joining the gloo group itself (:func:`dpwa.lab.systems.allreduce.join_group`).

Every rank trains its shard through ``DistributedDataParallel`` (gloo), with
the workload's learning rate and schedule by its steps; rank 0 snapshots its
model (every rank holds the same). The runner starts each rank as a process of
its own, as torchrun would, so that with slow links each sits in its own
network namespace; the rendezvous is a file in the run's folder (no network
needed), and gloo talks over the interface the runner names in
``GLOO_SOCKET_IFNAME`` (``lo``, or the namespace's link).
"""

from __future__ import annotations

import time

from ...systems import allreduce
from ...systems.layout import ModuleView
from ..recorder import wait_for_go
from .common import Role, run_collective, timed


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
    go = wait_for_go(role.workdir, role.name)
    timer.start()
    for x, y in timed(w.train_batches(rank, total), timer):
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
        **timer.summary(left_out),
    )
