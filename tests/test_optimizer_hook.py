"""dpwa.gossip_optimizer: an unchanged loop (backward, step) gossips through a step post-hook on the optimizer.

Two nodes in this process, on loopback. With learning rate 0 the parameters move only by blends, so the
values are exact: nets at 0 and 10, f = 1/2, blend to 5.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402
from torch.optim import Optimizer  # noqa: E402

import dpwa  # noqa: E402
from conftest import make_config  # noqa: E402
from dpwa.adapters.hook import GossipHook, gossip_optimizer  # noqa: E402
from dpwa.adapters.pytorch import DpwaPyTorchAdapter  # noqa: E402


def filled(k: float) -> nn.Module:
    net = nn.Linear(4, 2)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(k)
    return net


def one_step(net: nn.Module, opt: Optimizer, conn: GossipHook | None = None) -> Tensor:
    """One batch of the loop as a user writes it: forward, backward, step (and the loss for the hook)."""
    loss = net(torch.ones(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if conn is not None:
        conn.loss = loss
    opt.step()
    return loss


def values(net: nn.Module) -> set[float]:
    return {float(v) for p in net.parameters() for v in p.detach().flatten()}


@pytest.fixture
def peers():
    """Adapters a test makes besides the hook's own, closed after it; then no dpwa thread may be left."""
    made: list[DpwaPyTorchAdapter] = []

    def make(*args, **kwargs) -> DpwaPyTorchAdapter:
        adapter = DpwaPyTorchAdapter(*args, **kwargs)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        adapter.close()
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("dpwa-")] and time.monotonic() < deadline:
        time.sleep(0.01)  # a poll with a deadline: close() joins its threads, this only guards the check
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-")], "threads left behind"


def test_it_is_exported_at_the_top_level_and_from_the_adapters():
    assert dpwa.gossip_optimizer is gossip_optimizer and dpwa.GossipHook is GossipHook
    from dpwa import adapters

    assert adapters.gossip_optimizer is gossip_optimizer


@pytest.mark.io
def test_an_unchanged_loop_blends_the_peer_in_after_each_step_and_the_block_closes_it(peers):
    """w0 (all 0) steps with lr 0 inside the block; w1 (all 10) only serves. The exchange the hook starts on
    entry is finished by the first opt.step(): w0 is at 5, and w1 at 5 once it applies its half. After the
    block: the adapter is closed, and opt.step() no longer exchanges (no error, counters unchanged)."""
    cfg = make_config(2)
    peer_net = filled(10.0)
    peer = peers(peer_net, "w1", {**cfg, "fetch_probability": 0})
    peer.update_send()  # publish all 10
    net = filled(0.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with gossip_optimizer(opt, net, cfg, "w0", batch_size=3) as conn:
        assert (conn.name, conn.rank, conn.world_size) == ("w0", 0, 2)
        assert conn.last_update is None and conn.stats()["fetches_started"] == 1  # the first send, on entry
        loss = one_step(net, opt, conn)
        assert conn.steps == 1
        assert conn.last_update is not None and conn.last_update.averaged, conn.last_update
        assert conn.last_update.factor == 0.5 and conn.last_update.peer == "w1"
        assert values(net) == {5.0}
        assert conn.loss == loss.item() and isinstance(conn.loss, float)  # the tensor was read once, after the step
        assert conn.stats()["averaged"] == 1 and conn.averaged == 1
    peer.update_wait()
    assert values(peer_net) == {5.0}  # the mirror half: both moved, the mean (5) kept
    assert conn.adapter.node.closed
    after = conn.stats()
    assert after["state"] == "closed"
    one_step(net, opt)  # the hook is gone: a step here would raise on the closed node
    one_step(net, opt, conn)
    assert conn.steps == 1 and conn.stats() == after and values(net) == {5.0}


@pytest.mark.io
def test_two_nodes_each_with_an_unchanged_loop_average_to_the_mean(peers):
    """Both nodes train through the hook, each in its own thread (lr 0): they exchange, both end at exactly
    5 (the mean of 0 and 10), each counts blends, and both close."""
    cfg = make_config(2)
    nets = {"w0": filled(0.0), "w1": filled(10.0)}
    hooks: dict[str, GossipHook] = {}
    errors: list[BaseException] = []
    ready = threading.Barrier(2, timeout=30)

    def train(name: str) -> None:
        try:
            net = nets[name]
            opt = torch.optim.SGD(net.parameters(), lr=0.0)
            with gossip_optimizer(opt, net, cfg, name) as conn:
                hooks[name] = conn
                ready.wait()
                deadline = time.monotonic() + 30
                while (conn.steps < 20 or conn.averaged == 0) and time.monotonic() < deadline:
                    one_step(net, opt, conn)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(name,), name=f"test-{name}") for name in nets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a training thread did not finish within 60 s"
    assert errors == []
    for name, conn in hooks.items():
        stats = conn.stats()
        assert stats["state"] == "closed" and conn.averaged > 0, (name, stats)
        assert conn.averaged == sum(peer["averaged"] for peer in stats["peers"].values())
        assert conn.steps >= 20
        assert (conn.rank, conn.world_size) == (int(name[1]), 2)
        assert values(nets[name]) == {5.0}, name


@pytest.mark.io
def test_an_exception_inside_the_block_removes_the_hook_and_closes_the_adapter(peers):
    cfg = make_config(2)
    peers(filled(10.0), "w1", {**cfg, "fetch_probability": 0}).update_send()
    net = filled(0.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with pytest.raises(RuntimeError, match="in the loop"), gossip_optimizer(opt, net, cfg, "w0") as conn:
        one_step(net, opt, conn)
        raise RuntimeError("in the loop")
    assert conn.adapter.node.closed and conn.steps == 1
    one_step(net, opt, conn)  # no hook: no error from the closed node, no step counted
    assert conn.steps == 1


@pytest.mark.io
def test_the_config_and_the_name_come_from_the_environment(peers, tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps({**make_config(3), "fetch_probability": 0}))  # JSON is YAML
    monkeypatch.setenv("DPWA_CONFIG", str(path))
    monkeypatch.setenv("DPWA_NAME", "w2")
    net = filled(1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gossip_optimizer(opt, net) as conn:
        assert (conn.name, conn.rank, conn.world_size) == ("w2", 2, 3)
        assert (conn.adapter.rank, conn.adapter.world_size) == (2, 3)
        assert (conn.adapter.node.rank, conn.adapter.node.world_size) == (2, 3)
        one_step(net, opt, conn)
        assert conn.last_update is not None and conn.last_update.outcome == "no_fetch"
        assert conn.clock == 1  # batch_size 1: the clock counts steps
    monkeypatch.delenv("DPWA_CONFIG")
    with pytest.raises(dpwa.ConfigError, match="DPWA_CONFIG"), gossip_optimizer(opt, net):
        pass
    one_step(net, opt)  # no hook was left behind by the failed start


@pytest.mark.io
def test_the_clock_counts_the_batch_size_and_the_last_send_at_a_normal_exit(peers):
    """batch_size is what each step adds to the clock; the send after the last step counts its batch when
    the block ends (its update_wait), so a block of 3 steps of 8 samples ends at 32, alone."""
    cfg = {**make_config(2), "fetch_probability": 0}
    net = filled(1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gossip_optimizer(opt, net, cfg, "w0", batch_size=8) as conn:
        for _ in range(3):
            one_step(net, opt, conn)
        assert conn.clock == 24
    assert conn.clock == 32


@pytest.mark.parametrize("share", [True, False], ids=["with-optimizer-state", "optimizer-None"])
@pytest.mark.io
def test_a_late_node_takes_its_donors_optimizer_state_unless_told_not_to(peers, share):
    """The hook gives the optimizer to the adapter: a node that joins a trained cluster takes its donor's
    momentum too. ``optimizer=None`` among the keyword arguments: parameters only."""
    cfg = {**make_config(2), "join": "auto"}
    donor_net = filled(1.0)
    donor_opt = torch.optim.SGD(donor_net.parameters(), lr=0.1, momentum=0.9)
    # the donor starts first and alone (join: never: it does not wait for w1 to start)
    donor = peers(donor_net, "w0", {**cfg, "fetch_probability": 0, "join": "never"}, optimizer=donor_opt)
    for _ in range(3):
        donor.update_send(None)
        one_step(donor_net, donor_opt)
        donor.update_wait(None)
    stop = threading.Event()
    lingering = threading.Thread(target=donor.linger, args=(30.0, 60.0, stop.is_set), name="test-linger")
    lingering.start()
    net = filled(5.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    try:
        extra: dict[str, Any] = {} if share else {"optimizer": None}
        with gossip_optimizer(opt, net, cfg, "w1", **extra) as conn:
            joined = conn.adapter.joined
            assert joined is not None and joined.donor == "w0" and joined.rejoined
            assert values(net) != {5.0}  # the donor's parameters (as of its last snapshot)
            if share:  # a joiner that asks for optimizer state gets it with a fresh snapshot: both as of now
                assert joined.extra_meta and values(net) == values(donor_net)
                mine, theirs = opt.state_dict()["state"], donor_opt.state_dict()["state"]
                assert mine.keys() == theirs.keys() and len(mine) == 2
                for index, entry in theirs.items():
                    assert torch.equal(entry["momentum_buffer"], mine[index]["momentum_buffer"]), index
            else:
                assert not joined.extra_meta and opt.state_dict()["state"] == {}
    finally:
        stop.set()
        lingering.join(30)
    assert not lingering.is_alive()


@pytest.mark.io
def test_linger_s_serves_peers_after_a_normal_exit_before_closing(peers):
    """With linger_s, a normal exit keeps the node serving until none was served for min(1 s, linger_s)."""
    cfg = {**make_config(2), "fetch_probability": 0}
    net = filled(1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gossip_optimizer(opt, net, cfg, "w0", linger_s=0.3) as conn:
        one_step(net, opt, conn)
        left = time.monotonic()
    assert time.monotonic() - left >= 0.3 and conn.stats()["state"] == "closed"


@pytest.mark.io
@pytest.mark.timeout(60)
def test_under_dpwas_launcher_the_block_starts_together_with_its_peers(peers, tmp_path, monkeypatch):
    """Issue 48: under ./run.sh nothing started a gossip_optimizer's node together with the others, so the first
    to finish its imports trained alone. Now, with $DPWA_RUN_DIR set, the block's node waits for its peers at
    the ``start`` barrier before its first update_send (as the callbacks' and train.py's do): w0's block
    is not entered until w1 makes its own start_together call."""
    from dpwa.adapters.pytorch import START_BARRIER

    monkeypatch.setenv("DPWA_RUN_DIR", str(tmp_path))
    cfg = make_config(2, mode="pull")
    entered = threading.Event()
    failed: list[BaseException] = []

    def w0() -> None:
        net = filled(0.0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        try:
            with gossip_optimizer(opt, net, cfg, "w0", linger_s=0, metrics=False) as conn:
                entered.set()
                assert conn.adapter.barrier_counters() == {START_BARRIER: 1}
        except BaseException as e:  # noqa: BLE001 - the test thread reports it
            failed.append(e)
            entered.set()

    first = threading.Thread(target=w0, daemon=True)
    first.start()
    try:
        assert not entered.wait(1.0), failed  # w0 waits at the start barrier for w1
        peer = peers(filled(1.0), "w1", cfg)
        assert peer.start_together(timeout_s=20) == []
        assert entered.wait(20) and not failed, failed
        assert peer.barrier_counters() == {START_BARRIER: 1}
        assert peer.start_together() == [] and peer.barrier_counters() == {START_BARRIER: 1}  # passed already
    finally:
        first.join(20)
    assert not first.is_alive() and not failed, failed
