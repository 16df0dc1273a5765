"""A mixing rule's per-node state goes into checkpoints: ``rule_state()`` and ``restore(rule=...)``.

The state is the one a joiner takes from its donor (:meth:`dpwa.mixing.rules.Rule.state`: ClippedGossip with
``radius: auto`` keeps its recent distances), saved as ``{"rule": name, "state": ...}`` and checked on restore
exactly as a donor's is (:class:`dpwa.gossip.transfer.extras.RuleState`: msgpack-able, at most 64 KiB, then the rule's
own ``check_state``). A state that does not fit, or that another rule (or a rule that keeps none) saved, is
refused with a ValueError before anything of the call is taken. Push-sum keeps no such state (its weight is
mass: a restarted node starts again at weight 1), so its ``rule_state()`` is None.
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import re
from typing import Any

import msgpack
import numpy as np
import pytest

from conftest import filled, make_config, serving_only, step_until_averaged
from dpwa import NumpyParams
from dpwa.gossip.transfer.extras import MAX_RULE_STATE_BYTES, RuleState
from dpwa.mixing.rules.clipped import ClippedGossip

AUTO = {"mode": "pull", "rule": "clipped", "rule_options": {"radius": "auto"}, "pairing": "random"}
HISTORY = [2.0, 1.0, 0.5, 0.25, 0.125]  # w0 (0) pulling five times from w1 (2): each pull halves the gap


def clipped_history(nodes) -> dict[str, Any]:
    """A node with radius auto that pulled five times from a peer 2 away: its rule_state()."""
    cfg = make_config(2, **AUTO)
    nodes(serving_only(cfg), "w1", NumpyParams(filled(2, 1)))
    w0 = nodes(cfg, "w0", NumpyParams(filled(0, 1)))
    for _ in range(5):
        assert step_until_averaged(w0, 10, peer="w1") is not None
    saved = w0.rule_state()
    assert saved == {"rule": "clipped", "state": {"seen": HISTORY}}, saved
    return saved


def through_torch(saved: object) -> Any:
    """`saved` through torch.save and a weights_only torch.load, as a checkpoint holds it."""
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save({"dpwa": {"rule": saved}}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["dpwa"]["rule"]


def test_clipped_auto_recent_distances_survive_a_checkpoint_and_clip_the_first_exchange(nodes):
    """The five distances are saved, go through torch.save/load and are restored exactly on a fresh node of
    another cluster. Its first pull, from a peer 2 away, is then clipped to the median of [2, 1, 0.5, 0.25,
    0.125, 2] = 0.75: it moves 0.5 * 0.75 = 0.375, not 1 (a fresh history would let that pull through)."""
    loaded = through_torch(clipped_history(nodes))
    cfg = make_config(2, **AUTO)
    nodes(serving_only(cfg), "w1", NumpyParams(filled(2, 1)))
    mine = filled(0, 1)
    fresh = nodes(cfg, "w0", NumpyParams(mine))
    assert fresh.rule_state() == {"rule": "clipped", "state": {"seen": []}}
    fresh.restore(clock=4.0, barriers={"epoch": 1}, rule=loaded)
    assert fresh.rule.state() == {"seen": HISTORY} and fresh.rule_state() == loaded
    assert fresh.clock == 4.0 and fresh.barrier_counters() == {"epoch": 1}
    fresh.restore(clock=5.0)  # no rule state (a checkpoint written before it was kept): the rule's is left
    assert fresh.rule.state() == {"seen": HISTORY}
    assert step_until_averaged(fresh, 10, peer="w1") is not None
    assert fresh.stats()["rule.clipped"] == 1 and mine[0] == pytest.approx(0.375)
    assert fresh.rule.state() == {"seen": [*HISTORY, 2.0]}


def test_a_checkpoints_rule_state_is_checked_by_the_same_function_as_a_donors():
    """The same state refused by the join path (bytes from a donor) and by the checkpoint path, in the same
    words."""
    rule = ClippedGossip(radius="auto")
    part = RuleState(rule)
    bad = {"seen": [1.0, -3.0]}
    with pytest.raises(ValueError) as by_join:
        part.check(b"", np.frombuffer(msgpack.packb(bad), np.uint8))
    with pytest.raises(ValueError) as by_checkpoint:
        part.checked(bad, "a checkpoint's rule state")
    assert str(by_checkpoint.value) == f"a checkpoint's rule state: {by_join.value}"
    assert "a distance must be a finite number >= 0, got -3.0" in str(by_join.value)
    assert rule.state() == {"seen": []}


HOSTILE: dict[str, tuple[object, str]] = {
    "a list": ([1.0, 2.0], "must be a mapping of rule and state (rule_state()'s), got list"),
    "no state": ({"rule": "clipped"}, "must be a mapping of rule and state"),
    "an unknown field": ({"rule": "clipped", "state": {"seen": []}, "more": 1}, "must be a mapping of rule and state"),
    "a rule that is not a name": ({"rule": 5, "state": {"seen": []}}, "saved under rule 5, but this node's rule is"),
    "another rule's": (
        {"rule": "pushsum", "state": {"weight": 2.0}},
        "saved under rule 'pushsum', but this node's rule is 'clipped'",
    ),
    "a state that is a list": ({"rule": "clipped", "state": [1.0]}, "state must be {seen: a list of at most 16"),
    "seen that is a string": ({"rule": "clipped", "state": {"seen": "1.0"}}, "a list of at most 16 distances"),
    "a field besides seen": ({"rule": "clipped", "state": {"seen": [], "weight": 1.0}}, "a list of at most 16"),
    "17 distances": ({"rule": "clipped", "state": {"seen": [1.0] * 17}}, "a list of at most 16 distances"),
    "NaN": ({"rule": "clipped", "state": {"seen": [1.0, math.nan]}}, "finite number >= 0, got nan"),
    "Inf": ({"rule": "clipped", "state": {"seen": [math.inf]}}, "finite number >= 0, got inf"),
    "a negative distance": ({"rule": "clipped", "state": {"seen": [1.0, -0.5]}}, "finite number >= 0, got -0.5"),
    "true": ({"rule": "clipped", "state": {"seen": [True]}}, "finite number >= 0, got True"),
    "a numpy float32": ({"rule": "clipped", "state": {"seen": [np.float32(1.0)]}}, "not plain numbers"),
    "an int of 2^70": ({"rule": "clipped", "state": {"seen": [1 << 70]}}, "not plain numbers"),
    "100 KB": ({"rule": "clipped", "state": {"seen": [1.0] * 12000}}, f"at most {MAX_RULE_STATE_BYTES}"),
    "70 fields": ({"rule": "clipped", "state": {f"k{i}": 0 for i in range(70)}}, "rule state: not msgpack"),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_bad_checkpoint_rule_state_is_refused_and_changes_nothing(nodes, what):
    cfg = make_config(2, **AUTO, outer="nesterov", insecure=True, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, 8)))
    good = {"rule": "clipped", "state": {"seen": [3.0, 1.5]}}
    node.restore(clock=3.0, barriers={"epoch": 2}, rule=good)
    outer = node.outer_state()
    moved = {**outer, "anchor": np.full(8, 7.0, np.float32), "steps": 9}  # good: would be taken with a good rule
    bad, message = HOSTILE[what]
    with pytest.raises(ValueError, match=re.escape("a checkpoint's rule state: ") + ".*" + re.escape(message)):
        node.restore(clock=5.0, barriers={"epoch": 7}, outer=moved, rule=bad)
    assert node.clock == 3.0 and node.barrier_counters() == {"epoch": 2}  # nothing of the call was taken
    assert node.rule.state() == {"seen": [3.0, 1.5]} and node.rule_state() == good
    assert node.outer_state()["anchor"].tolist() == [1.0] * 8 and node.outer_state()["steps"] == 0


def test_a_good_rule_state_is_not_taken_when_another_part_of_the_call_is_refused(nodes):
    """A bad outer state or barrier counts refuse the call whole: the rule's state stays as it was."""
    cfg = make_config(2, **AUTO, outer="nesterov", insecure=True, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, 8)))
    node.restore(barriers={"epoch": 2})
    good = {"rule": "clipped", "state": {"seen": [3.0, 1.5]}}
    hostile_outer = {**node.outer_state(), "anchor": np.full(8, np.nan, np.float32)}
    with pytest.raises(ValueError, match="a checkpoint's outer state: anchor holds NaN"):
        node.restore(clock=5.0, outer=hostile_outer, rule=good)
    with pytest.raises(ValueError):
        node.restore(clock=5.0, barriers={"epoch": -1}, rule=good)
    with pytest.raises(ValueError, match="clock must be a number"):
        node.restore(clock=-1.0, rule=good)
    assert node.rule.state() == {"seen": []} and node.clock == 0.0 and node.barrier_counters() == {"epoch": 2}


def test_a_rule_that_keeps_no_state_refuses_a_checkpoints_rule_state_naming_both(nodes):
    """clipped with a fixed radius keeps no state: a checkpoint taken under radius auto is refused (the
    settings changed), not silently dropped."""
    cfg = make_config(2, mode="pull", rule="clipped", rule_options={"radius": 1.0}, fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, 8)))
    assert node.rule_state() is None
    with pytest.raises(
        ValueError,
        match=re.escape("saved under rule 'clipped', but this node's rule keeps no state (its settings: ")
        + ".*'radius': 1.0",
    ):
        node.restore(clock=2.0, rule={"rule": "clipped", "state": {"seen": [1.0]}})
    assert node.clock == 0.0
    node.restore(clock=2.0, rule=None)
    assert node.clock == 2.0


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        (
            {"rule": "pushsum", "state": {"weight": 0.25}},
            "saved under rule 'pushsum', but this node's rule keeps no state",
        ),
        (
            {"rule": "pushsum", "state": {"weight": -1.0}},
            "saved under rule 'pushsum', but this node's rule keeps no state",
        ),
        (
            {"rule": "pushsum", "state": {"weight": 1e9}},
            "saved under rule 'pushsum', but this node's rule keeps no state",
        ),
        (
            {"rule": "pushsum", "state": {"weight": math.nan}},
            "saved under rule 'pushsum', but this node's rule keeps no state",
        ),
        (
            {"rule": "clipped", "state": {"seen": [1.0]}},
            "saved under rule 'clipped', but this node's rule is 'pushsum'",
        ),
    ],
    ids=["a weight", "a negative weight", "a weight beyond the bound", "a NaN weight", "clipped's"],
)
def test_pushsum_keeps_no_checkpoint_state_and_refuses_one(nodes, saved, message):
    """Push-sum's weight is mass, not state a checkpoint or a joiner takes (docs/rules.md): a node whose
    weight moved away from 1 (it served a fetch, giving half away) has no rule_state(), and a checkpoint
    claiming a weight (or holding another rule's state) is refused; the weight, clock and counters stay."""
    cfg = make_config(2, mode="pull", rule="pushsum", pairing="random", fetch_probability=0)
    node = nodes(cfg, "w0", NumpyParams(filled(1, 4)))
    node.restore(clock=3.0, barriers={"epoch": 1})
    node.rule.published(7)
    assert node.rule.served(7) == {"weight": 0.5} and node.rule.mass() == 0.5
    assert node.rule_state() is None
    with pytest.raises(ValueError, match=re.escape(f"a checkpoint's rule state: {message}")):
        node.restore(clock=5.0, barriers={"epoch": 3}, rule=saved)
    assert node.rule.mass() == 0.5 and node.clock == 3.0 and node.barrier_counters() == {"epoch": 1}


@pytest.mark.io
def test_the_pytorch_adapter_saves_and_restores_the_rule_state():
    torch = pytest.importorskip("torch")
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    cfg = make_config(2, **AUTO, fetch_probability=0)
    a = DpwaPyTorchAdapter(torch.nn.Linear(4, 2), "w0", cfg)
    b = DpwaPyTorchAdapter(torch.nn.Linear(4, 2), "w1", cfg)
    try:
        a.restore(rule={"rule": "clipped", "state": {"seen": [0.5, 4.0, 2.0]}})
        saved = through_torch(a.rule_state())
        with pytest.raises(ValueError, match="a checkpoint's rule state: .*finite number >= 0, got nan"):
            b.restore(clock=1.0, rule={"rule": "clipped", "state": {"seen": [math.nan]}})
        with pytest.raises(ValueError, match="a checkpoint's rule state: .*not plain numbers"):
            b.restore(rule={"rule": "clipped", "state": {"seen": [torch.tensor(1.0)]}})
        assert b.clock == 0.0 and b.rule_state() == {"rule": "clipped", "state": {"seen": []}}
        b.restore(clock=1.0, rule=saved)
        assert b.rule_state() == {"rule": "clipped", "state": {"seen": [0.5, 4.0, 2.0]}} and b.clock == 1.0
    finally:
        a.close()
        b.close()


@pytest.mark.io
def test_the_examples_checkpoint_holds_the_rule_state_and_restores_it(tmp_path):
    """examples/pytorch-cifar/train.py: node_state() saves conn.rule_state() under dpwa.rule; a checkpoint
    written and read back (checkpoints.save, weights_only load) restores it with load_checkpoint; one
    written before rule states were kept (no dpwa.rule) still loads, leaving the rule's state as it is."""
    torch = pytest.importorskip("torch")
    import example_helpers  # noqa: F401 - puts the example on sys.path
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter
    from dpwa.runfiles import checkpoints

    train = importlib.import_module("train")  # by name: mypy checks what the tests import, and train.py is not typed

    cfg = make_config(2, **AUTO, fetch_probability=0)

    def parts(name: str):
        net = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        return DpwaPyTorchAdapter(net, name, cfg), optimizer, schedule, torch.Generator()

    conn, optimizer, schedule, order = parts("w0")
    other, optimizer2, schedule2, order2 = parts("w1")
    try:
        conn.restore(clock=6.0, barriers={"epoch": 3}, rule={"rule": "clipped", "state": {"seen": [1.0, 0.25]}})
        state = train.node_state(conn.net, optimizer, schedule, order, conn, {"epoch": 3, "step": 30})
        assert state["dpwa"]["rule"] == {"rule": "clipped", "state": {"seen": [1.0, 0.25]}}
        checkpoints.save(tmp_path, 3, "w1", state)
        old = {**state, "dpwa": {k: v for k, v in state["dpwa"].items() if k != "rule"}}
        checkpoints.save(tmp_path, 2, "w1", old)
        args = argparse.Namespace(run_dir=tmp_path, name="w1")
        progress: dict[str, int] = {}
        train.load_checkpoint(args, 2, other, optimizer2, schedule2, order2, progress)
        assert other.rule_state() == {"rule": "clipped", "state": {"seen": []}} and other.clock == 6.0
        train.load_checkpoint(args, 3, other, optimizer2, schedule2, order2, progress)
        assert other.rule_state() == {"rule": "clipped", "state": {"seen": [1.0, 0.25]}}
        assert other.clock == 6.0 and other.barrier_counters() == {"epoch": 3} and progress["epoch"] == 3
    finally:
        conn.close()
        other.close()
