"""Asynchronous parameter servers: a server's process and a trainer's.

Servers hold their shard of the plan, apply each update scaled by 1 / workers
(so one update from every trainer moves the model as far as one synchronous
step over their batches), at the workload's learning rate scheduled by the
samples each block has applied over the run's budget. Each server snapshots
its shard whenever the samples every one of its blocks has applied pass
another point of the curve; the runner joins the shards of each point.
Trainers fetch before each forward pass and push from their IO pool; the last
trainer is the straggler. Servers run until the runner stops them (SIGTERM),
once every trainer has finished.
"""

from __future__ import annotations

import time

from ...systems.layout import ModuleView
from ...systems.ps.server import ParameterServer
from ...systems.ps.sharding import make_plan
from ...systems.ps.trainer import PSTrainer
from ..recorder import wait_for_go
from .common import Role, timed

OBSERVER = "observer"
POLL_S = 0.01


def run_server(role: Role) -> None:
    w, spec, rec, opts = role.workload, role.spec, role.recorder, role.options
    view = ModuleView(w.build_model())
    plan = make_plan(view.layout, opts["servers"])
    budget = w.total_samples
    trainers = [f"w{i}" for i in range(spec.workers)]
    server = ParameterServer(
        plan,
        role.index,
        view.state()[plan.state_index(role.index, view.layout.param_size)],
        opts["endpoints"][role.index],
        settings=spec.settings,
        schedule=lambda s: spec.lr_at(s / budget),
        scale=1.0 / spec.workers,
        queue_depth=opts.get("queue_depth", 8),
        trainers=[*trainers, OBSERVER],
    )
    every = w.eval_every_samples
    point = 1
    with server:
        go = wait_for_go(role.workdir, role.name)
        limit = opts.get("time_limit_s", 600.0)
        while not role.stop and time.time() - go < limit:
            time.sleep(POLL_S)
            values, _, samples = server.snapshot()
            if samples >= point * every:
                rec.snapshot(values, samples, point=point)
                point = samples // every + 1
        values, _, samples = server.snapshot()
        rec.snapshot(values, samples, final=True)
        status = server.status()
    rec.result(role="ps-server", go=go, status=status, samples=samples, stopped=role.stop.signal_name)


def run_trainer(role: Role) -> None:
    w, timer, rec, opts = role.workload, role.timer, role.recorder, role.options
    net = w.worker_model(role.index)
    view = ModuleView(net)
    plan = make_plan(view.layout, opts["servers"])
    samples = 0
    with PSTrainer(
        view, plan, opts["endpoints"], role.name, io_threads=opts.get("io_threads"), timeout_s=opts["timeout_s"]
    ) as trainer:
        go = wait_for_go(role.workdir, role.name)
        timer.start()
        for batch in timed(w.train_batches(role.index), timer):
            if role.stop:
                break
            trainer.fetch()
            t0 = time.perf_counter()
            net.zero_grad(set_to_none=True)
            loss = w.loss(net, batch)
            loss.backward()
            timer.computed(time.perf_counter() - t0)
            trainer.push(len(batch[1]))
            samples += len(batch[1])
        timer.stop()
    stats = trainer.stats
    rec.result(
        role="ps-trainer",
        go=go,
        samples=samples,
        bytes=stats.bytes_sent + stats.bytes_received,
        trainer=stats.as_dict(),
        io_threads=trainer.pool.size,
        stopped=role.stop.signal_name,
        **timer.summary(),
    )
