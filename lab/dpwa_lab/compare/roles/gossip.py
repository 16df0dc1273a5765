"""A gossip node: the example's training step with ``DpwaPyTorchAdapter`` around it, as ``train.py`` runs it.

Each node trains its shard with its own SGD at the workload's learning rate
and schedule (by its own steps), and exchanges parameters around every batch
(modes ``pull`` and ``symmetric``, from the run's gossip config). Snapshots
of its state every few steps, and the time and sample count of every step,
let the runner evaluate the mean of all nodes' models as it stood when the
cluster had trained a given number of samples. Each snapshot records the
node's mass (its rule's :meth:`~dpwa.mixing.rules.Rule.mass`: 1, but for
push-sum the node's weight), read on the training thread right after the
state, and the result the mass after lingering (push-sum: what serving the
peers that still trained left it), for the weighted mean of
:mod:`..evaluation`.

A Byzantine node (``role.options["byzantine"]`` names it; :mod:`..byzantine`)
trains the same way, but every snapshot it publishes is wrong: its node's
publication is wrapped in :func:`..byzantine.published_wrong`, which applies
the attack to the parameters for the moment of the copy and restores them
exactly after it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from ...systems.layout import ModuleView
from ..byzantine import published_wrong
from ..recorder import wait_for_go
from .common import Role, timed


def run(role: Role) -> None:
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    w, spec, timer, rec = role.workload, role.spec, role.timer, role.recorder
    net = w.worker_model(role.index)
    view = ModuleView(net)
    optimizer = spec.settings.make(net.parameters())  # SGD or AdamW, as the workload says
    total = w.local_steps(role.index)
    stride = w.snapshot_stride()
    progress: list[list[float]] = []
    step, samples, loss_value = 0, 0, None
    config = role.run.get("gossip_configs", {}).get(role.name, role.run["gossip_config"])
    # --churn: a node that replaces one that left goes on with its shard from where that one was
    skip = int(role.run.get("joiners", {}).get(role.name, {}).get("skip_samples", 0))
    batches = w.train_batches(role.index)
    if skip:
        batches, step = _skipped(batches, skip)
    averaged = failed = 0
    attack = role.options.get("attack") if role.name in role.options.get("byzantine", ()) else None
    published = [0]  # wrong snapshots published (a Byzantine node)
    with DpwaPyTorchAdapter(net, role.name, config) as conn:
        if attack is not None:
            _publish_wrong(conn, net, attack, published)
        go = wait_for_go(role.workdir, role.name)
        rule = conn.node.rule
        # the model before training, for points before its first snapshot
        rec.snapshot(view.state(), 0, mass=rule.mass())
        timer.start()
        for x, y in timed(batches, timer):
            if role.stop:
                break
            for group in optimizer.param_groups:
                group["lr"] = spec.lr_at(step / total)
            conn.update_send(loss_value, batch_size=len(y))
            t0 = time.perf_counter()
            loss = w.loss(net, (x, y))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_value = loss.item()
            timer.computed(time.perf_counter() - t0)
            update = conn.update_wait(loss_value)
            averaged += update.averaged
            failed += not update.averaged and update.outcome != "no_fetch"
            step += 1
            samples += len(y)
            progress.append([time.time(), samples])
            if step % stride == 0:
                rec.snapshot(view.state(), samples, mass=rule.mass())
        timer.stop()
        left_out = rec.spent_s
        stats = conn.stats()  # before lingering: what training cost
        rec.snapshot(view.state(), samples, final=True, mass=rule.mass())
        lingered = 0.0
        if not role.stop:
            # as train.py lingers: until no peer was served for max(2 s, 4 steps, 2 fetch timeouts); in mode
            # symmetric the lingering node publishes a fresh snapshot once its last one served an exchange
            step_s = timer.summary()["run_s"] / max(step, 1)
            timeout_s = config["timeout_ms"] / 1000
            idle_s = max(2.0, 4 * step_s, 2 * timeout_s)
            lingered = conn.linger(idle_s, limit_s=role.options.get("linger_s", 60.0), stop=lambda: bool(role.stop))
        mass_at_end = rule.mass()  # in mode pull lingering moves no parameter, only (push-sum) weight given away
        minted_at_end = float(getattr(rule, "minted", 0.0))  # push-sum: weight added to keep its floor
    rec.result(
        role="gossip",
        go=go,
        samples=samples,
        averaged=averaged,
        failed=failed,
        bytes=int(stats.get("bytes_in", 0)) + int(stats.get("bytes_out", 0)),
        stats={k: v for k, v in stats.items() if isinstance(v, int | float)},
        progress=progress,
        lingered_s=lingered,
        mass_at_end=mass_at_end,
        minted_at_end=minted_at_end,
        stopped=role.stop.signal_name,
        byzantine=attack,
        published_wrong=published[0],
        joined=None if conn.joined is None else conn.joined.donor,
        skipped_samples=skip,
        **timer.summary(left_out),
    )


def _skipped(batches: Iterable[Any], samples: int) -> tuple[Iterator[Any], int]:
    """`batches` past the first `samples` samples (whole batches), and how many batches were passed."""
    iterator = iter(batches)
    passed = seen = 0
    while seen < samples:
        try:
            _, y = next(iterator)
        except StopIteration:
            break
        seen += len(y)
        passed += 1
    return iterator, passed


def _publish_wrong(conn: Any, net: Any, attack: str, count: list[int]) -> None:
    """Make every snapshot `conn`'s node publishes from now on wrong, by `attack` (counted in count[0]).

    Every publication of the node (at update_send, after an exchange it applied in mode symmetric, while
    it lingers) goes through ``node.services.publish``, on the training thread: the parameters are attacked
    for the copy and restored exactly after it, so the node trains and blends on its true parameters.
    """
    parts = conn.node.services
    publish = parts.publish

    def wrong(clock: float, loss: float | None) -> None:
        with published_wrong(net, attack):
            publish(clock, loss)
        count[0] += 1

    setattr(parts, "publish", wrong)  # noqa: B010 (an instance's method replaced, for this node only)
