"""Synchronous SGD with a master: the master's process and a worker's.

The master keeps the global model and steps it at the workload's learning
rate, scheduled by the samples it has applied over the sync run's budget
(every segment of every epoch). It snapshots the global model each time the
applied samples pass another point of the curve. Workers compute gradients
on the segments the master hands out; the last worker is the straggler.
"""

from __future__ import annotations

import time

from ...systems.layout import ModuleView
from ...systems.sync.client import MasterClient, MasterUnreachable
from ...systems.sync.master import Master, Segment, make_tasks
from ...systems.sync.model import GlobalModel
from ...systems.sync.service import MasterService
from ...systems.sync.worker import SyncWorker
from ..recorder import wait_for_go
from .common import Role

OBSERVER = "observer"  # the runner's name when it asks the master for its status


def run_master(role: Role) -> None:
    w, spec, rec, opts = role.workload, role.spec, role.recorder, role.options
    view = ModuleView(w.build_model())
    epochs, segments = w.sync_segments()
    budget = epochs * segments * w.segment_size
    model = GlobalModel(
        view.layout, view.params(), view.buffers(), spec.settings, schedule=lambda s: spec.lr_at(s / budget)
    )
    master = Master(make_tasks(epochs, segments), model, lease_s=opts["lease_s"], sufficient=opts.get("sufficient"))
    every = w.eval_every_samples
    next_point = [every]

    def on_step(version: int, samples: int, model: GlobalModel) -> None:
        if samples >= next_point[0]:
            rec.snapshot(model.state(), samples, version=version)
            while next_point[0] <= samples:
                next_point[0] += every

    workers = [f"w{i}" for i in range(spec.workers)]
    with MasterService(master, model, opts["endpoint"], workers=[*workers, OBSERVER], on_step=on_step) as service:
        go = wait_for_go(role.workdir, role.name)
        limit = opts.get("time_limit_s", 600.0)
        while not service.wait_complete(0.2) and not role.stop and time.time() - go < limit:
            pass
        rec.snapshot(model.state(), model.samples, version=master.version, final=True)
        # Keep answering until every worker was told there is no more task (or a lease passed).
        deadline = time.monotonic() + opts["lease_s"] + 2.0
        while service.status()["live"] and time.monotonic() < deadline and not role.stop:
            time.sleep(0.05)
        status = service.status()
    rec.result(
        role="sync-master",
        go=go,
        complete=status["complete"],
        status=status,
        tasks={
            "total": status["total"],
            "done": status["done"],
            "retried": status["retried"],
            "done_twice": status["done_twice"],
            "expired": status["expired"],
            "failed": status["failed"],
        },
        samples=model.samples,
        steps=master.steps,
    )


def run_worker(role: Role) -> None:
    w, timer, rec, opts = role.workload, role.timer, role.recorder, role.options
    net = w.worker_model(role.index)
    view = ModuleView(net)

    def compute(batch: tuple) -> tuple[float, int]:
        t0 = time.perf_counter()
        loss = w.loss(net, batch)
        loss.backward()
        timer.computed(time.perf_counter() - t0)
        return loss.item(), len(batch[1])

    def batches(task: Segment) -> list:
        t0 = time.perf_counter()
        out = w.segment_batches(task.epoch, task.segment)
        timer.compute_s += time.perf_counter() - t0
        return out

    error = None
    with MasterClient(
        opts["endpoint"], role.name, view.layout, unreachable_s=opts.get("unreachable_s", 30.0)
    ) as client:
        go = wait_for_go(role.workdir, role.name)
        timer.start()
        worker = SyncWorker(
            client, view, compute, batches, max_retries=opts.get("max_retries", 3), stop=lambda: bool(role.stop)
        )
        try:
            stats = worker.run()
        except MasterUnreachable as exc:
            stats, error = worker.stats, str(exc)
        timer.stop()
        sent, received = client.bytes_sent, client.bytes_received
    rec.result(
        role="sync-worker",
        go=go,
        samples=stats.samples,
        computed_samples=stats.computed_samples,
        bytes=sent + received,
        worker=stats.as_dict(),
        error=error,
        stopped=role.stop.signal_name,
        **timer.summary(),
    )
