"""Learning-rate schedules on the cluster's clock: the rate is a function of the clock, so nodes whose
clocks agree use the same rate."""

from __future__ import annotations

import math
import threading

import pytest

import dpwa
from conftest import make_config, serving_only
from dpwa.adapters.schedule import ClockSchedule, step_decay


class FakeClock:
    """A clock source whose clock the test sets."""

    def __init__(self, clock: float = 0.0) -> None:
        self.clock = clock


class FakeOptimizer:
    """What a schedule needs of an optimizer: param groups with a learning rate."""

    def __init__(self, *lrs: float) -> None:
        self.param_groups: list[dict] = [{"params": [], "lr": lr} for lr in lrs]


def lrs(optimizer) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def test_step_decay_counts_the_milestones_reached():
    rule = step_decay([200, 100], gamma=0.25)  # given in any order
    assert [rule(c) for c in (0, 99.5, 100, 150, 199.99, 200, 1e9)] == [1, 1, 0.25, 0.25, 0.25, 0.0625, 0.0625]
    assert step_decay([])(1e6) == 1
    assert step_decay([10])(10) == pytest.approx(0.1)  # the default gamma, as MultiStepLR's


@pytest.mark.parametrize("milestones, gamma", [([-1], 0.5), ([math.inf], 0.5), ([1], -0.5), ([1], math.nan)])
def test_step_decay_refuses_bad_values(milestones, gamma):
    with pytest.raises(ValueError):
        step_decay(milestones, gamma)


def test_every_group_follows_the_clock():
    """Two groups (lr 20 and 2), milestones 100 and 200, gamma 1/4: the rates at known clocks."""
    clock, optimizer = FakeClock(), FakeOptimizer(20.0, 2.0)
    schedule = ClockSchedule(optimizer, clock, step_decay([100, 200], gamma=0.25))
    assert lrs(optimizer) == [20.0, 2.0]  # the constructor applies the clock as it is
    for value, expected in [(99.5, [20.0, 2.0]), (100, [5.0, 0.5]), (250, [1.25, 0.125])]:
        clock.clock = value
        assert schedule.step() == value
        assert lrs(optimizer) == expected == schedule.get_last_lr()
        assert schedule.last_clock == value
    clock.clock = 150.0  # a blend can move a node's clock back: the rate is the clock's, not a count of decays
    schedule.step()
    assert lrs(optimizer) == [5.0, 0.5]
    assert schedule.base_lrs == [20.0, 2.0]


def test_a_node_that_starts_late_starts_at_the_clusters_rate():
    """The clock is already past a milestone when the schedule is made (a joined or resumed node)."""
    optimizer = FakeOptimizer(20.0)
    ClockSchedule(optimizer, FakeClock(300.0), step_decay([100, 200], gamma=0.25))
    assert lrs(optimizer) == [1.25]


def test_the_clock_may_come_from_a_function():
    optimizer = FakeOptimizer(1.0)
    schedule = ClockSchedule(optimizer, lambda: 30.0, lambda clock: 1 / (1 + clock / 10))
    assert lrs(optimizer) == [0.25] and schedule.last_clock == 30.0


def test_the_base_rate_survives_a_checkpoint():
    """An optimizer whose state was loaded from a checkpoint holds the decayed rate, and the base rate as
    ``initial_lr`` (as torch's schedulers leave it): the schedule starts from the base rate."""
    optimizer = FakeOptimizer(20.0)
    ClockSchedule(optimizer, FakeClock(250.0), step_decay([100, 200], gamma=0.25))
    assert optimizer.param_groups[0] == {"params": [], "lr": 1.25, "initial_lr": 20.0}
    clock = FakeClock(150.0)
    schedule = ClockSchedule(optimizer, clock, step_decay([100, 200], gamma=0.25))  # made again, after a resume
    assert schedule.base_lrs == [20.0] and lrs(optimizer) == [5.0]


def test_a_torch_optimizer():
    torch = pytest.importorskip("torch")
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters(), "lr": 2.0}], lr=20.0)
    clock = FakeClock(0.0)
    schedule = ClockSchedule(optimizer, clock, step_decay([100], gamma=0.25))
    clock.clock = 100.0
    schedule.step()
    assert lrs(optimizer) == [5.0, 0.5]
    restored = torch.optim.SGD([{"params": first.parameters()}, {"params": second.parameters()}], lr=1.0)
    restored.load_state_dict(optimizer.state_dict())  # the base rates travel in the optimizer's state
    assert ClockSchedule(restored, FakeClock(0.0), step_decay([100], gamma=0.25)).base_lrs == [20.0, 2.0]
    assert lrs(restored) == [20.0, 2.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_factor_that_is_not_a_rate_is_refused(bad):
    optimizer = FakeOptimizer(1.0)
    clock = FakeClock(0.0)
    schedule = ClockSchedule(optimizer, clock, lambda c: 1.0 if c < 5 else bad)
    clock.clock = 5.0
    with pytest.raises(ValueError, match="lr_lambda"):
        schedule.step()
    assert lrs(optimizer) == [1.0]  # left as it was


def test_a_source_without_a_clock_is_refused():
    with pytest.raises(TypeError, match="clock"):
        ClockSchedule(FakeOptimizer(1.0), object(), step_decay([1]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lr_lambda"):
        ClockSchedule(FakeOptimizer(1.0), FakeClock(), 0.5)  # type: ignore[arg-type]


def test_the_schedule_is_exported_at_the_top_level():
    assert dpwa.ClockSchedule is ClockSchedule and dpwa.step_decay is step_decay
    assert {"ClockSchedule", "step_decay"} <= set(dpwa.__all__)


@pytest.mark.io
def test_two_nodes_whose_clocks_were_apart_agree_on_the_rate_after_an_exchange():
    """Mode symmetric, rule delta, f = 1/2 (the defaults), pairing hypercube: w0 asks w1 every round and
    w1 asks nobody. w0's clock is at 0, w1's at 3,000 (lr 20,
    milestones 1,000 and 2,000, gamma 1/4): w0 at lr 20, w1 at 1.25. w0 asks w1; each trains one batch
    (clock + 1). Requester: 1 + (3000 - 0) / 2 = 1501; server, at its next update_wait:
    3001 + (0 - 3000) / 2 = 1501. Both clocks are 1501 (sums of halves of integers: exact in floats), so
    both rates are 20 / 4 = 5; then three more rounds of one batch each keep them equal (1504, 5)."""
    torch = pytest.importorskip("torch")
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    cfg = make_config(2, mode="symmetric", rule="delta", pairing="hypercube")
    made: list[DpwaPyTorchAdapter] = []
    before = {t.ident for t in threading.enumerate()}
    try:
        torch.manual_seed(0)
        nets = [torch.nn.Linear(4, 1) for _ in range(2)]
        made.append(DpwaPyTorchAdapter(nets[1], "w1", serving_only(cfg)))
        made.append(DpwaPyTorchAdapter(nets[0], "w0", cfg))
        server, requester = made
        server.restore(clock=3000.0)
        optimizers = [torch.optim.SGD(net.parameters(), lr=20.0) for net in nets]
        rule = step_decay([1000, 2000], gamma=0.25)
        schedules = [ClockSchedule(optimizers[0], requester, rule), ClockSchedule(optimizers[1], server, rule)]
        assert [lrs(o)[0] for o in optimizers] == [20.0, 1.25]
        for _ in range(4):
            server.update_send()
            requester.update_send()
            update = requester.update_wait()
            assert update.averaged, update
            server.update_wait()  # applies its half of the exchange
            for schedule in schedules:
                schedule.step()
            assert requester.clock == server.clock  # equal here: each exchange leaves both at their mean, + 1
            assert lrs(optimizers[0]) == lrs(optimizers[1]) == [5.0]
        assert requester.clock == server.clock == 1504.0
    finally:
        for adapter in made:
            adapter.close()
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dpwa-")]
