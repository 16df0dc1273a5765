"""The PyTorch adapter's outer_optimizer: any torch optimizer over the pseudo-gradient as the outer step.

Torch's SGD with nesterov=True is the named ``outer: nesterov`` step, to float32 rounding, over several
exchanges between two nodes; Adam runs; joins and restores start it afresh; it is refused beside ``outer:``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from conftest import endpoint_is_free, make_config, step_until_averaged
from dpwa.adapters.outer import TorchOuter
from dpwa.adapters.pytorch import DpwaPyTorchAdapter


def small_net(seed: int) -> nn.Sequential:
    """A linear layer and a BatchNorm (whose running statistics are buffers: blended, never stepped)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        batch_norm(net).weight.normal_()
        batch_norm(net).bias.normal_()
        stat(net, "running_mean").normal_()
    return net


def batch_norm(net: nn.Sequential) -> nn.BatchNorm1d:
    layer = net[1]
    assert isinstance(layer, nn.BatchNorm1d)
    return layer


def stat(net: nn.Sequential, name: str) -> torch.Tensor:
    """A running statistic of the BatchNorm (a buffer)."""
    value = getattr(batch_norm(net), name)
    assert isinstance(value, torch.Tensor)
    return value


def floats(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every floating tensor of the model (parameters and running statistics), copied."""
    return {k: v.detach().clone() for k, v in net.state_dict().items() if v.is_floating_point()}


@torch.no_grad()
def local_step(net: nn.Sequential, generator: torch.Generator) -> None:
    """What training does between exchanges, made deterministic: every parameter and the running mean move."""
    for p in [*net.parameters(), stat(net, "running_mean")]:
        p.add_(0.1 * torch.randn(p.shape, generator=generator))


def nesterov(lr: float, momentum: float):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def run(adapters, exchanges: int, **settings) -> tuple[list[dict[str, torch.Tensor]], DpwaPyTorchAdapter]:
    """w0 and w1 each take a local step, then w0 starts an exchange with w1, `exchanges` times; returns
    w0's floating tensors after each exchange, and w0. The same seeds every run: only the outer step
    differs (`outer_optimizer` goes to both adapters, the rest to the config)."""
    outer = {"outer_optimizer": settings.pop("outer_optimizer")} if "outer_optimizer" in settings else {}
    cfg = make_config(2, insecure=True, same_host="off", **settings)
    peer_net, my_net = small_net(1), small_net(0)
    peer = adapters(peer_net, "w1", {**cfg, "fetch_probability": 0}, **outer)
    mine = adapters(my_net, "w0", cfg, **outer)
    generator = torch.Generator().manual_seed(7)
    after = []
    for _ in range(exchanges):
        local_step(peer_net, generator)
        peer.update_send()  # publishes w1's values (in mode symmetric: after applying its last mirrored half)
        peer.update_wait()
        local_step(my_net, generator)
        assert step_until_averaged(mine, 20, peer="w1") is not None  # a failed try changes nothing
        after.append(floats(my_net))
    return after, mine


@pytest.mark.parametrize("mode, rule", [("pull", "state"), ("symmetric", "delta")])
def test_torchs_nesterov_sgd_is_the_named_nesterov_step(adapters, mode, rule):
    """outer_optimizer=SGD(lr 0.7, momentum 0.9, nesterov=True) against outer: nesterov with outer_lr 0.7,
    outer_momentum 0.9: the same parameters and running statistics after each of five exchanges, to
    float32 rounding. Torch's rule is the named one (buf = mu buf + g, starting at g; x -= lr (g + mu buf)),
    and both leave running statistics where averaging put them. Neither is plain averaging."""
    named, _ = run(adapters, 5, mode=mode, rule=rule, outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    ours, _ = run(adapters, 5, mode=mode, rule=rule, outer_optimizer=nesterov(0.7, 0.9))
    plain, _ = run(adapters, 5, mode=mode, rule=rule)
    for k, (a, b, c) in enumerate(zip(named, ours, plain, strict=True)):
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-5), (k, name, a[name], b[name])
        for name in ("1.running_mean", "1.running_var"):  # blended, never stepped: as plain averaging left them
            assert torch.equal(b[name], c[name]), (k, name)
        assert not torch.allclose(b["0.weight"], c["0.weight"], atol=1e-3), k  # the outer step did something


def test_the_first_outer_step_by_hand(adapters):
    """w0 (all 2) fetches w1 (all 6), f = 1/2: mixed 4, pseudo-gradient g = 2 - 4 = -2. SGD lr 0.5,
    momentum 0.5, nesterov: buf = g = -2; x = 2 - 0.5 (-2 + 0.5 (-2)) = 3.5: the parameters; the running
    statistics stay at 4 (the blend) and the optimizer holds the buffer."""
    cfg = make_config(2, insecure=True, same_host="off")
    peer_net, my_net = small_net(0), small_net(0)
    with torch.no_grad():
        for net, value in ((peer_net, 6.0), (my_net, 2.0)):
            for t in floats_of(net):
                t.fill_(value)
    adapters(peer_net, "w1", {**cfg, "fetch_probability": 0}).update_send()
    mine = adapters(my_net, "w0", cfg, outer_optimizer=nesterov(0.5, 0.5))
    assert step_until_averaged(mine, 20, peer="w1") is not None
    for p in my_net.parameters():
        assert torch.all(p == 3.5)
    assert torch.all(stat(my_net, "running_mean") == 4.0) and torch.all(stat(my_net, "running_var") == 4.0)
    assert mine.outer_optimizer is not None
    buffers = [s["momentum_buffer"] for s in mine.outer_optimizer.state.values()]
    assert len(buffers) == 4 and all(torch.all(b == -2.0) for b in buffers)
    assert all(p.grad is None for p in my_net.parameters())  # the model's own gradients are untouched


def floats_of(net: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*net.parameters(), *net.buffers()] if t.is_floating_point()]


def test_an_adam_outer_optimizer_runs_and_moves_the_parameters(adapters):
    """Adam over the pseudo-gradient: after each exchange the parameters are Adam's new anchor, neither
    where they were nor where plain averaging put them; its state counts the steps."""
    ours, mine = run(adapters, 3, outer_optimizer=lambda params: torch.optim.Adam(params, lr=0.05))
    plain, _ = run(adapters, 3)
    for a, b in zip(ours, plain, strict=True):
        assert torch.isfinite(a["0.weight"]).all()
        assert not torch.allclose(a["0.weight"], b["0.weight"], atol=1e-3)
    assert isinstance(mine.outer_optimizer, torch.optim.Adam)
    assert [float(s["step"]) for s in mine.outer_optimizer.state.values()] == [3.0] * 4


def test_a_parameter_the_optimizer_leaves_out_stays_where_averaging_put_it(adapters):
    """The factory filters frozen parameters out (requires_grad is mirrored on the anchors): the frozen
    one takes no outer step (stays at the blend, 4), the others take SGD lr 0.5: 2 - 0.5 (2 - 4) = 3."""
    cfg = make_config(2, insecure=True, same_host="off")
    peer_net, my_net = small_net(0), small_net(0)
    with torch.no_grad():
        for net, value in ((peer_net, 6.0), (my_net, 2.0)):
            for t in floats_of(net):
                t.fill_(value)
    my_net[0].bias.requires_grad_(False)
    adapters(peer_net, "w1", {**cfg, "fetch_probability": 0}).update_send()
    factory = lambda params: torch.optim.SGD([p for p in params if p.requires_grad], lr=0.5)  # noqa: E731
    mine = adapters(my_net, "w0", cfg, outer_optimizer=factory)
    assert step_until_averaged(mine, 20, peer="w1") is not None
    linear = my_net[0]
    assert isinstance(linear, nn.Linear)
    assert torch.all(linear.bias == 4.0) and torch.all(linear.weight == 3.0)


@pytest.mark.io
def test_outer_optimizer_beside_outer_in_the_config_is_refused_before_anything_starts():
    """A ValueError naming both, before a socket or a thread exists, and before the factory is called."""
    called: list[object] = []
    for rule in ("nesterov", "noloco"):
        cfg = make_config(1, outer=rule, insecure=True, same_host="off")
        with pytest.raises(ValueError, match=rf"outer_optimizer and outer: {rule}"):
            DpwaPyTorchAdapter(small_net(0), "w0", cfg, outer_optimizer=called.append)  # type: ignore[arg-type]
        assert endpoint_is_free(cfg, "w0")
    assert not called and not [t for t in threading.enumerate() if t.name.startswith("dpwa-")]


def test_an_optimizer_over_other_tensors_is_refused():
    """Built over the model's parameters instead of the anchors it is given, over none of them, or not
    an optimizer at all: refused, naming what is wrong."""
    net = small_net(0)
    with pytest.raises(ValueError, match="not given"):
        TorchOuter(net, lambda params: torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="none of the tensors"):
        TorchOuter(net, _empty_of)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        TorchOuter(net, lambda params: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="callable"):
        TorchOuter(net, "sgd")  # type: ignore[arg-type]


def _empty_of(params) -> torch.optim.Optimizer:
    """An optimizer that takes its anchors but holds none of them (its only group emptied afterwards)."""
    list(params)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    optimizer.param_groups[0]["params"] = []
    return optimizer


def test_a_joiner_starts_the_outer_optimizer_afresh_from_the_donors_parameters(adapters):
    """The outer optimizer's state does not travel: a joiner's anchors are the donor's parameters (6), not
    its own from before the join (2), and its optimizer holds no state yet."""
    cfg = make_config(2, join="auto", fetch_probability=0, timeout_ms=500)
    donor_net, joiner_net = small_net(0), small_net(1)
    with torch.no_grad():
        for net, value in ((donor_net, 6.0), (joiner_net, 2.0)):
            for t in floats_of(net):
                t.fill_(value)
    donor = adapters(donor_net, "w0", {**cfg, "join": "never"}, outer_optimizer=nesterov(0.7, 0.9))
    for _ in range(3):  # the donor has trained (its clock is above 0): a joiner takes its state
        donor.update_send()
        donor.update_wait()
    joiner = adapters(joiner_net, "w1", cfg, outer_optimizer=nesterov(0.7, 0.9))
    assert joiner.joined is not None and joiner.joined.donor == "w0"
    assert all(torch.all(p == 6.0) for p in joiner_net.parameters())
    outer = joiner.node._own_outer
    assert isinstance(outer, TorchOuter)
    assert all(torch.all(a == 6.0) for a in outer.anchor) and not outer.optimizer.state
    assert joiner.outer_state() is None


def test_restore_starts_the_outer_optimizer_afresh_from_the_loaded_weights(adapters):
    """After exchanges the optimizer holds momentum; loading other weights and calling restore() makes
    them the anchor and empties the optimizer's state (its state_dict may be loaded after)."""
    cfg = make_config(2, insecure=True, same_host="off")
    peer_net, my_net = small_net(1), small_net(0)
    adapters(peer_net, "w1", {**cfg, "fetch_probability": 0}).update_send()
    mine = adapters(my_net, "w0", cfg, outer_optimizer=nesterov(0.7, 0.9))
    assert step_until_averaged(mine, 20, peer="w1") is not None
    assert mine.outer_optimizer is not None and mine.outer_optimizer.state
    saved = mine.outer_optimizer.state_dict()
    with torch.no_grad():
        for p in my_net.parameters():
            p.fill_(1.5)
    mine.restore(clock=3.0)
    outer = mine.node._own_outer
    assert isinstance(outer, TorchOuter)
    assert all(torch.all(a == 1.5) for a in outer.anchor) and not mine.outer_optimizer.state
    mine.outer_optimizer.load_state_dict(saved)  # the way to keep its momentum across a checkpoint
    assert mine.outer_optimizer.state and mine.clock == 3.0


@pytest.mark.io
def test_leaving_the_adapter_leaves_nothing_behind():
    """`with` closes the node: no dpwa thread, the endpoint free, the model's tensors the same storage
    with no gradient written, and the adapter refuses further steps."""
    cfg = make_config(2, insecure=True, same_host="off")
    peer_net, my_net = small_net(1), small_net(0)
    pointers = [t.data_ptr() for t in floats_of(my_net)]
    with DpwaPyTorchAdapter(peer_net, "w1", {**cfg, "fetch_probability": 0}) as peer:
        peer.update_send()
        with DpwaPyTorchAdapter(my_net, "w0", cfg, outer_optimizer=nesterov(0.7, 0.9)) as mine:
            assert step_until_averaged(mine, 20, peer="w1") is not None
        assert mine.node.closed and endpoint_is_free(cfg, "w0")
        with pytest.raises(RuntimeError, match="closed"):
            mine.update_send()
    assert endpoint_is_free(cfg, "w1")
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-")]
    assert [t.data_ptr() for t in floats_of(my_net)] == pointers
    assert all(p.grad is None for p in my_net.parameters())
