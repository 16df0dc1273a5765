"""Asynchronous parameter servers: the shard plan, one block's queue and applier, the server over the wire, trainers.

The multi-process test (a trainer killed with SIGKILL while the others go on)
is at the end; it runs the comparison's runner on a small workload.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wait_until
from dpwa.wire.channel import Channel
from dpwa.wire.endpoints import private_dir
from dpwa.wire.schema import encode
from dpwa_lab.systems.layout import ModelLayout, ModuleView
from dpwa_lab.systems.optim import SGDSettings
from dpwa_lab.systems.ps import protocol as m
from dpwa_lab.systems.ps.blocks import BlockApplier, BlockUpdate
from dpwa_lab.systems.ps.server import ParameterServer
from dpwa_lab.systems.ps.sharding import make_plan
from dpwa_lab.systems.ps.trainer import PSTrainer

PLAIN_SGD = SGDSettings(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0)


# --------------------------------------------------------------------------- the plan


def test_plan_is_balanced_by_size_and_covers_every_variable_once():
    rng = random.Random(0)
    for trial in range(50):
        sizes = [rng.randint(1, 5000) for _ in range(rng.randint(3, 40))]
        layout = ModelLayout([(f"v{i}", (s,), "param" if i % 3 else "buffer") for i, s in enumerate(sizes)])
        servers = rng.randint(1, min(6, len(sizes)))
        plan = make_plan(layout, servers)
        names = sorted(b.variable.name for blocks in plan.servers for b in blocks)
        assert names == sorted(f"v{i}" for i in range(len(sizes)))
        loads = [plan.size(k) for k in range(servers)]
        assert max(loads) - min(loads) <= max(sizes), (trial, loads)  # the longest-processing-time bound
        for blocks in plan.servers:  # offsets tile each server's vector, in the layout's order
            assert [b.offset for b in blocks] == list(np.cumsum([0] + [b.size for b in blocks[:-1]]))
        assert make_plan(layout, servers).fingerprint == plan.fingerprint


def test_plan_of_a_known_layout():
    layout = ModelLayout([("a", (6,), "param"), ("b", (4,), "param"), ("c", (3,), "param"), ("d", (2,), "buffer")])
    plan = make_plan(layout, 2)
    # largest first, each to the lighter server: a -> 0 (6), b -> 1 (4), c -> 1 (7), d -> 0 (8)
    assert [[b.variable.name for b in s] for s in plan.servers] == [["a", "d"], ["b", "c"]]
    assert plan.block("c").server == 1 and plan.block("c").offset == 4
    assert list(plan.state_index(0, layout.param_size)) == [0, 1, 2, 3, 4, 5, 13, 14]  # d is a buffer: after 13
    state = np.arange(15, dtype=np.float32)
    assert np.array_equal(plan.join([state[plan.state_index(k, 13)] for k in range(2)], 13), state)
    assert make_plan(layout, 1).fingerprint != plan.fingerprint
    with pytest.raises(ValueError, match="some servers would hold nothing"):
        make_plan(layout, 5)
    with pytest.raises(ValueError, match="must be in 1.."):
        make_plan(layout, 0)


# --------------------------------------------------------------------------- one block


def block_of(size: int, kind: str = "param", depth: int = 8) -> tuple[BlockApplier, np.ndarray]:
    layout = ModelLayout([("w", (size,), kind)] if kind == "param" else [("p", (1,), "param"), ("w", (size,), kind)])
    block = make_plan(layout, 1).block("w")
    values = np.zeros(size, np.float32)
    return BlockApplier(block, values, PLAIN_SGD, None, queue_depth=depth), values


@pytest.mark.io
def test_a_block_applies_updates_one_at_a_time_in_order_and_records_staleness():
    applier, values = block_of(3)
    for k in (1.0, 2.0, 3.0):  # three trainers all computed on version 0
        applier.offer(BlockUpdate(np.full(3, k, np.float32), 0, 16, time.monotonic()))
    applier.start()
    try:
        assert wait_until(lambda: applier.version == 3, 5.0)
    finally:
        assert applier.close()
    assert np.allclose(values, -0.1 * (1 + 2 + 3))
    assert applier.staleness_counts() == {0: 1, 1: 1, 2: 1}  # behind by the updates applied before it
    assert applier.samples == 48


@pytest.mark.io
def test_a_buffer_block_adds_scaled_deltas():
    layout = ModelLayout([("p", (1,), "param"), ("rm", (2,), "buffer")])
    block = make_plan(layout, 1).block("rm")
    values = np.ones(2, np.float32)
    applier = BlockApplier(block, values, PLAIN_SGD, None, scale=0.25).start()
    try:
        applier.offer(BlockUpdate(np.full(2, 4.0, np.float32), 0, 8, time.monotonic()))
        assert wait_until(lambda: applier.version == 1, 5.0)
    finally:
        applier.close()
    assert np.allclose(values, 2.0)


def test_a_full_queue_has_no_room():
    applier, _ = block_of(2, depth=2)  # not started: nothing is taken from the queue
    for _ in range(2):
        assert applier.has_room()
        applier.offer(BlockUpdate(np.zeros(2, np.float32), 0, 1, 0.0))
    assert not applier.has_room() and applier.queued == 2


# --------------------------------------------------------------------------- a server over the wire


@pytest.fixture
def servers():
    made = []
    before = {t.ident for t in threading.enumerate()}

    def make(plan, index, values, **kwargs):
        endpoint = f"ipc://{private_dir()}/test-ps-{uuid.uuid4().hex[:12]}"
        server = ParameterServer(plan, index, values, endpoint, **{"settings": PLAIN_SGD, **kwargs}).start()
        made.append(server)
        return server

    yield make
    for server in made:
        assert server.close()
        path = Path(server.endpoint[len("ipc://") :])
        assert not path.exists() and not Path(f"{path}.lock").exists()  # the endpoint's files are removed
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dpwa-")]
    assert not leftover, f"threads left behind: {leftover}"


def ask(endpoint, frames, accept, rid=7):
    import zmq

    ctx = zmq.Context()
    channel = Channel(ctx, endpoint, max_reply_bytes=1 << 20)
    try:
        return channel.request(frames, rid, time.monotonic() + 5.0, accept=accept)
    finally:
        channel.close()
        ctx.term()


@pytest.mark.io
def test_pull_and_push_with_values_known_in_advance(servers):
    layout = ModelLayout([("a", (3,), "param"), ("b", (2,), "param")])
    plan = make_plan(layout, 1)
    server = servers(plan, 0, np.array([1, 2, 3, 4, 5], np.float32), scale=0.5)
    fields = {"from": "w1", "fp": plan.fingerprint, "server": 0}
    reply = ask(server.endpoint, [encode(m.PULL, 7, **fields)], {m.PARAMS.name: m.PARAMS})
    assert reply.header["versions"] == [0, 0]
    assert np.array_equal(np.frombuffer(reply.frames[0].buffer, np.float32), [1, 2, 3, 4, 5])
    push = encode(m.PUSH, 7, **fields, versions=[0, 0], batch=32)
    reply = ask(server.endpoint, [push, np.full(5, 10.0, np.float32)], {m.QUEUED.name: m.QUEUED})
    assert reply.header.kind == "ps_queued"
    assert wait_until(lambda: server.status()["applied"] == 2, 5.0)
    values, versions, samples = server.snapshot()
    assert np.allclose(values, np.array([1, 2, 3, 4, 5]) - 0.1 * 0.5 * 10) and versions == [1, 1] and samples == 32


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"payload": np.array([np.nan, 0, 0, 0, 0], np.float32)}, "bad_values"),
        ({"payload": np.full(5, np.inf, np.float32)}, "bad_values"),
        ({"payload": np.zeros(4, np.float32)}, "bad_size"),
        ({"versions": [0]}, "bad_blocks"),
        ({"versions": [3, 0]}, "bad_version"),
        ({"server": 1}, "bad_server"),
        ({"fp": b"x" * 16}, "bad_fingerprint"),
        ({"from": "intruder"}, "bad_identity"),
    ],
)
@pytest.mark.io
def test_bad_pushes_are_rejected_and_the_server_serves_on(servers, change, reason):
    layout = ModelLayout([("a", (3,), "param"), ("b", (2,), "param")])
    plan = make_plan(layout, 1)
    server = servers(plan, 0, np.zeros(5, np.float32), trainers=["w1"])
    fields = {"from": "w1", "fp": plan.fingerprint, "server": 0, "versions": [0, 0], "batch": 8}
    payload = change.pop("payload", np.ones(5, np.float32))
    fields.update(change)
    reply = ask(server.endpoint, [encode(m.PUSH, 7, **fields), payload], {m.QUEUED.name: m.QUEUED})
    assert reply.header.kind == "error" and reply.header["reason"] == reason
    good = {"from": "w1", "fp": plan.fingerprint, "server": 0, "versions": [0, 0], "batch": 8}
    reply = ask(server.endpoint, [encode(m.PUSH, 8, **good), np.ones(5, np.float32)], {m.QUEUED.name: m.QUEUED}, rid=8)
    assert reply.header.kind == "ps_queued"
    assert wait_until(lambda: server.status()["applied"] == 2, 5.0)
    assert np.allclose(server.snapshot()[0], -0.1)  # only the good push was applied


@pytest.mark.io
def test_curve_keys_admit_the_listed_trainer_only(servers):
    import zmq

    from dpwa.wire.curve import CurveKeys

    server_pub, server_sec = zmq.curve_keypair()
    trainer_pub, trainer_sec = zmq.curve_keypair()
    view = ModuleView(torch.nn.Linear(4, 2))
    plan = make_plan(view.layout, 1)
    server = servers(
        plan, 0, view.state(), curve=CurveKeys(server_pub, server_sec, {zmq.utils.z85.decode(trainer_pub): "w1"})
    )
    good = {0: CurveKeys(trainer_pub, trainer_sec).client_options(server_pub)}
    with PSTrainer(view, plan, [server.endpoint], "w1", socket_options=good, timeout_s=2.0) as trainer:
        assert trainer.fetch() == 1
    stranger_pub, stranger_sec = zmq.curve_keypair()
    bad = {0: CurveKeys(stranger_pub, stranger_sec).client_options(server_pub)}
    with PSTrainer(view, plan, [server.endpoint], "w1", socket_options=bad, timeout_s=0.3) as trainer:
        assert trainer.fetch() == 0 and trainer.stats.pulls_failed == 1
    assert server.server.counters.get("auth_denied") >= 1


# --------------------------------------------------------------------------- trainers


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def shards(plan, layout, state):
    return [state[plan.state_index(k, layout.param_size)] for k in range(plan.count)]


@pytest.mark.io
def test_trainers_fetch_before_the_forward_pass_and_push_gradients(servers):
    view = ModuleView(net())
    plan = make_plan(view.layout, 2)
    state = view.state()
    running = [servers(plan, k, shard, scale=0.5) for k, shard in enumerate(shards(plan, view.layout, state))]
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long()

    def train(name, seed, out):
        mine = ModuleView(net())
        with torch.no_grad():
            for p in mine.module.parameters():
                p.add_(1.0)  # a trainer's own values never matter: it fetches before each forward pass
        g = torch.Generator().manual_seed(seed)
        with PSTrainer(mine, plan, [s.endpoint for s in running], name, timeout_s=2.0) as trainer:
            assert trainer.pool.size == 4  # 2 per server: more IO threads than the one compute thread
            for _ in range(60):
                assert trainer.fetch() == 2
                idx = torch.randint(0, 256, (16,), generator=g)
                mine.module.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(mine.module(x[idx]), y[idx]).backward()
                trainer.push(16)
        out[name] = trainer.stats

    stats: dict = {}
    threads = [threading.Thread(target=train, args=(f"w{i}", i, stats)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # every push (60 steps x 2 servers) was taken, or refused busy when a block's queue was full (its applier
    # behind: CI's load refused 4 and 5 of a trainer's 120 once); none failed or was dropped, no pull failed
    for name, s in stats.items():
        assert s.pushes_ok + s.pushes_refused == 120 and s.pushes_ok >= 100, (name, s)
        assert s.pushes_failed == s.pushes_dropped == s.pulls_failed == 0, (name, s)
    assert wait_until(lambda: all(s.status()["queued"] == 0 for s in running), 5.0)
    taken = 0
    for s in running:
        status = s.status()
        assert set(status["refused"]) <= {"busy"}, status["refused"]
        assert status["samples"] == status["pushes"] * 16
        assert sum(n for _, n in status["staleness"]) == status["applied"] == status["pushes"] * status["blocks"]
        taken += status["pushes"]
    assert taken == sum(s.pushes_ok for s in stats.values())  # each push the trainers counted, applied once
    view.load_state(plan.join([s.snapshot()[0] for s in running], view.layout.param_size))
    view.module.eval()
    with torch.no_grad():
        assert (view.module(x).argmax(1) == y).float().mean().item() > 0.85


@pytest.mark.io
def test_a_dead_server_is_marked_down_and_its_blocks_keep_their_values(servers):
    view = ModuleView(net())
    plan = make_plan(view.layout, 2)
    alive = servers(plan, 0, shards(plan, view.layout, view.state())[0])
    dead = f"ipc://{private_dir()}/test-ps-nobody-{uuid.uuid4().hex[:8]}"
    mine = ModuleView(net())
    before = mine.state()
    with PSTrainer(mine, plan, [alive.endpoint, dead], "w1", timeout_s=0.2) as trainer:
        t0 = time.monotonic()
        for _ in range(6):
            trainer.fetch()
            mine.module.zero_grad()
            mine.module(torch.randn(8, 4)).sum().backward()
            trainer.push(8)
        spent = time.monotonic() - t0
    stats = trainer.stats
    assert stats.pulls_failed == 2 and stats.servers_down == ["ps1"]  # two timeouts, then it is left alone
    assert stats.pushes_dropped == 6 and stats.pushes_ok == 6  # nothing ever fetched from ps1: nothing to push
    assert spent < 2.0  # two timeouts of 0.2 s, not six
    index = plan.state_index(1, view.layout.param_size)
    index = index[index < view.layout.param_size]  # buffers change in every forward pass; parameters must not
    assert np.array_equal(mine.state()[index], before[index])  # ps1's parameters kept their values


# --------------------------------------------------------------------------- a trainer killed


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_trainer_does_not_stop_the_others(tmp_path):
    from dpwa_lab.compare.faults import KillProcess
    from dpwa_lab.compare.runner import RunOptions, run_system
    from dpwa_lab.compare.workload import WorkloadSpec, load_workload

    # 4 epochs, so that the kill at 0.5 s lands mid-run: at 2, a faster machine's w2 had pushed all its steps
    # by then (applied == 3 * local, in 2 of 5 fresh-clone runs on 2026-12-04)
    spec = WorkloadSpec(
        data="digits", data_dir=str(tmp_path), workers=3, epochs=4, batch_size=32, lr=0.05, eval_points=4
    )
    fault = KillProcess("w2", 0.5, "a trainer killed")
    run = run_system(
        "async-ps",
        spec,
        RunOptions(ps_servers=2, time_limit_s=100),
        tmp_path / "run",
        fault=fault,
        log=lambda line: None,
    )
    assert fault.report()["killed_at_s"] > 0
    assert run.completed, run.error
    assert run.exit_codes["w2"] == -9 and run.exit_codes["w0"] == run.exit_codes["w1"] == 0
    local = load_workload(spec).local_steps(0) * spec.batch_size
    for name in ("w0", "w1"):
        assert run.results[name]["samples"] == local  # every step of theirs
        assert run.results[name]["trainer"]["pushes_failed"] == 0
    for server in ("ps0", "ps1"):
        applied = run.results[server]["samples"]
        # the survivors' every step, and what w2 pushed before its kill: part of its steps (none at all on a machine
        # so loaded that w2 had not pushed within its 0.5 s: CI saw exactly 2 * local once)
        assert 2 * local <= applied < 3 * local
