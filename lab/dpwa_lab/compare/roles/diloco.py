"""DiLoCo: one process per rank, as all-reduce's, training with :class:`dpwa_lab.systems.diloco.DiLoCo`.

Every rank takes the workload's optimizer steps on its shard (the inner
optimizer: AdamW for charlm, as in the paper; learning rate and schedule by
its steps, as gossip's workers do), and every H steps all ranks all-reduce
the pseudo-gradient and take the outer Nesterov step. After the
last step a final synchronisation averages the last partial period. Rank 0
snapshots the shared model (the anchor) after each synchronisation that
passes another point of the curve: between synchronisations no rank holds
a model the others share.
"""

from __future__ import annotations

import time

from dpwa.mixing.outer import OuterSettings

from ...systems import allreduce
from ...systems.diloco import DiLoCo
from ...systems.layout import ModuleView
from ..recorder import wait_for_go
from .common import Role, run_collective, timed


def run_rank(role: Role) -> None:
    """Join the group, train, write the results, and leave with every other rank (this process ends here)."""
    run_collective(role, train)


def train(role: Role) -> None:
    rank, world, opts = role.index, role.spec.workers, role.options
    w, spec, timer, rec = role.workload, role.spec, role.timer, role.recorder
    net = w.worker_model(role.index)
    view = ModuleView(net)
    optimizer = spec.settings.make(net.parameters())  # SGD or AdamW, as the workload says
    comm = allreduce.CommTimer()
    outer = OuterSettings(lr=opts["outer_lr"], momentum=opts["outer_momentum"])
    diloco = DiLoCo(net, period=opts["period"], settings=outer, timer=comm)
    total = w.lockstep_steps()
    every = w.eval_every_samples
    next_point = every
    samples = 0
    go = wait_for_go(role.workdir, role.name)
    timer.start()
    for step, (x, y) in enumerate(timed(w.train_batches(rank, total), timer)):
        if role.stop:
            break
        for group in optimizer.param_groups:
            group["lr"] = spec.lr_at(step / total)
        t0 = time.perf_counter()
        loss = w.loss(net, (x, y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        timer.computed(time.perf_counter() - t0)
        samples += len(y) * world  # every rank trains a batch per step
        if diloco.step() and rank == 0 and samples >= next_point:
            rec.snapshot(view.state(), samples, sync=diloco.syncs)
            next_point = (samples // every + 1) * every
    if not role.stop and diloco.inner_steps:
        diloco.sync()  # the last partial period: every rank ends with the same model
    timer.stop()
    left_out = rec.spent_s
    if rank == 0:
        rec.snapshot(view.state(), samples, final=True, sync=diloco.syncs)
    rec.result(
        role="diloco",
        go=go,
        samples=samples,
        local_samples=samples // world,
        bytes=diloco.bytes_per_sync * diloco.syncs,
        bytes_estimated=True,
        comm_s=comm.seconds,
        allreduce_calls=comm.calls,
        reduced_bytes=comm.nbytes,
        syncs=diloco.syncs,
        period=diloco.period,
        stopped=role.stop.signal_name,
        **timer.summary(left_out),
    )
