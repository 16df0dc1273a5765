"""Every way an outer step's state comes in has the same bounds (issue 28, item 7).

A checkpoint's outer state (``restore(outer=...)``) gets exactly the checks a donor's gets, from one
function (:func:`dpwa.gossip.exchange.outer.checked_outer_state`): the node's rule, the model's size, finite
values within ±1e18, a step count. A bad one is refused with a ValueError naming the field, and the
node is left as it was; so a hostile checkpoint can no longer drive the parameters to inf.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from conftest import ORIGINAL, filled, make_config, step_until_averaged
from dpwa import NumpyParams
from dpwa.gossip.exchange.outer import OuterStep, checked_outer_state
from dpwa.mixing.outer import OuterSettings

SIZE = 50


def spoiled(saved: dict, what: str) -> object:
    """`saved` (a node's outer_state()) spoiled as a hostile or corrupted checkpoint would be."""
    if what == "anchor 3e38":
        return {**saved, "anchor": np.full(SIZE, 3e38, np.float32)}
    if what == "anchor NaN":
        return {**saved, "anchor": np.full(SIZE, np.nan, np.float32)}
    if what == "buf -Inf":
        return {**saved, "buf": np.full(SIZE, -np.inf, np.float32)}
    if what == "anchor 2e18 in one value":
        anchor = saved["anchor"].copy()
        anchor[7] = 2e18
        return {**saved, "anchor": anchor}
    if what == "anchor of the wrong size":
        return {**saved, "anchor": np.zeros(SIZE - 1, np.float32)}
    if what == "anchor float64":
        return {**saved, "anchor": np.zeros(SIZE, np.float64)}
    if what == "anchor 2-D":
        return {**saved, "anchor": np.zeros((SIZE, 1), np.float32)}
    if what == "another rule":
        return {**saved, "rule": "noloco"}
    if what == "steps -1":
        return {**saved, "steps": -1}
    if what == "steps 2^60":
        return {**saved, "steps": 1 << 60}
    if what == "steps True":
        return {**saved, "steps": True}
    if what == "no buf":
        return {k: v for k, v in saved.items() if k != "buf"}
    if what == "an unknown field":
        return {**saved, "extra": 1}
    if what == "a list":
        return [saved["anchor"], saved["buf"]]
    raise AssertionError(what)


REFUSED = {
    "anchor 3e38": "anchor holds values beyond ±1e\\+18",
    "anchor NaN": "anchor holds NaN or Inf",
    "buf -Inf": "buf holds NaN or Inf",
    "anchor 2e18 in one value": "anchor holds values beyond ±1e\\+18",
    "anchor of the wrong size": f"anchor must be a flat float32 array of {SIZE} values, got float32 of shape \\(49,\\)",
    "anchor float64": "anchor must be a flat float32 array of 50 values, got float64",
    "anchor 2-D": "anchor must be a flat float32 array",
    "another rule": "rule 'noloco', ours is 'nesterov'",
    "steps -1": "steps must be a count",
    "steps 2^60": "steps must be a count",
    "steps True": "steps must be a count",
    "no buf": "missing buf",
    "an unknown field": "unknown fields 'extra'",
    "a list": "must be a mapping of anchor, buf and steps, got list",
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_a_bad_checkpoint_outer_state_is_refused_and_changes_nothing(nodes, what):
    cfg = make_config(2, outer="nesterov", insecure=True, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, SIZE)))
    node.restore(clock=3.0, barriers={"epoch": 2})  # without outer state: starts afresh (anchor 1)
    node._outer.outer.anchor[:] = 4.0
    node._outer.outer.buf[:] = 0.25
    node._outer.outer.steps = 12
    saved = node.outer_state()
    assert saved["rule"] == "nesterov"  # a checkpoint records the rule it was taken under
    node.restore(clock=3.0, outer=saved)  # the good one is taken
    with pytest.raises(ValueError, match="a checkpoint's outer state: " + REFUSED[what]):
        node.restore(clock=5.0, barriers={"epoch": 7}, outer=spoiled(saved, what))
    after = node.outer_state()
    assert node.clock == 3.0 and node.barrier_counters() == {"epoch": 2}  # nothing of the call was taken
    assert after["anchor"].tolist() == [4.0] * SIZE and after["buf"].tolist() == [0.25] * SIZE
    assert after["steps"] == 12


def test_a_checkpoint_outer_state_without_a_rule_is_still_taken(nodes):
    """A checkpoint written before the rule was recorded: its values are checked all the same."""
    cfg = make_config(2, outer="noloco", insecure=True, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, SIZE)))
    old = {"anchor": np.full(SIZE, 2.0, np.float32), "buf": np.zeros(SIZE, np.float32), "steps": 3}
    node.restore(outer=old)
    assert node.outer_state()["anchor"].tolist() == [2.0] * SIZE and node.outer_state()["steps"] == 3
    with pytest.raises(ValueError, match="anchor holds values beyond"):
        node.restore(outer={**old, "anchor": np.full(SIZE, 3e38, np.float32)})


def test_after_a_refused_3e38_anchor_the_parameters_stay_finite_through_outer_steps(nodes):
    """The reproduction of the issue: restore(outer=...) with an anchor of 3e38, then steps with
    exchanges (each takes an outer step). Before, the parameters were inf five steps later."""
    cfg = make_config(2, **ORIGINAL, outer="nesterov", outer_lr=0.7, outer_momentum=0.9, insecure=True)
    nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(0, SIZE)))
    mine = filled(1, SIZE)
    node = nodes(cfg, "w0", NumpyParams(mine))
    hostile = {**node.outer_state(), "anchor": np.full(SIZE, 3e38, np.float32)}
    with pytest.raises(ValueError, match="anchor holds values beyond"):
        node.restore(outer=hostile)
    blended = 0
    for _ in range(5):
        if step_until_averaged(node, 20, peer="w1") is not None:
            blended += 1
    assert blended == 5 and node.outer_state()["steps"] == 5
    assert np.isfinite(mine).all() and float(np.abs(mine).max()) <= 1.0


def outer_step(rule: str = "nesterov") -> OuterStep:
    return OuterStep(rule, NumpyParams(np.zeros(SIZE, np.float32)), OuterSettings())


@pytest.mark.parametrize("what", ["anchor 3e38", "anchor NaN", "buf -Inf", "anchor 2e18 in one value"])
def test_a_donor_and_a_checkpoint_are_refused_by_the_same_check(what):
    """The join path sends the same state as bytes: it is refused with the same words as the checkpoint."""
    donor, joiner = outer_step(), outer_step()
    bad = spoiled(donor.state(), what)
    assert isinstance(bad, dict)
    meta = msgpack.packb({"rule": "nesterov", "size": SIZE, "steps": 0})
    data = np.concatenate([bad["anchor"], bad["buf"]]).view(np.uint8)
    with pytest.raises(ValueError) as by_join:
        joiner.check(meta, data)
    with pytest.raises(ValueError) as by_checkpoint:
        joiner.restore(bad)
    assert str(by_join.value) == "outer state: " + str(by_checkpoint.value).split(": ", 1)[1]
    assert joiner.state()["anchor"].tolist() == [0.0] * SIZE
    # and the one function, called directly, says the same
    with pytest.raises(ValueError, match=REFUSED[what]):
        checked_outer_state(bad, "nesterov", SIZE, "x")


@pytest.mark.io
def test_the_pytorch_adapter_refuses_a_hostile_checkpoint_outer_state():
    torch = pytest.importorskip("torch")
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    net = torch.nn.Linear(4, 2)
    cfg = make_config(2, outer="nesterov", insecure=True, fetch_probability=0)
    adapter = DpwaPyTorchAdapter(net, "w0", cfg)
    try:
        saved = adapter.outer_state()
        assert saved is not None
        size = saved["anchor"].numel()
        cases: list[tuple[object, str]] = [
            ({**saved, "anchor": torch.full((size,), 3e38)}, "anchor holds values beyond"),
            ({**saved, "buf": torch.full((size,), float("nan"))}, "buf holds NaN or Inf"),
            ({**saved, "anchor": torch.zeros(size + 1)}, "anchor must be a flat float32 array"),
            ({**saved, "anchor": torch.zeros(size, dtype=torch.bfloat16)}, "'anchor'"),
            ("not a mapping", "must be a mapping"),
        ]
        for bad, message in cases:
            with pytest.raises(ValueError, match=message):
                adapter.restore(outer=bad)  # type: ignore[arg-type]
        adapter.restore(outer=saved)
        again = adapter.outer_state()
        assert again is not None and again["anchor"].tolist() == saved["anchor"].tolist()
    finally:
        adapter.close()
