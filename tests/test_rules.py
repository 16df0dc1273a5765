"""Mixing rules: one interface, one file per rule, found by name; a rule of the user's own named in a config;
peers that mix by another rule refused. And ClippedGossip, the first rule added through the interface."""

from __future__ import annotations

import random
import re
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, filled, make_config, serving_only, step_until_averaged, wait_until
from dpwa import NumpyParams, parse_config
from dpwa.config import ConfigError
from dpwa.mixing.interpolation import Constant
from dpwa.mixing.rules import Rule, RuleError, Side, builtin, rule_class
from dpwa.mixing.rules.clipped import CAP, ClippedGossip
from dpwa_lab.sim.simulate import Gossip

DOCS = ROOT / "docs" / "rules.md"


def test_the_built_in_rules_are_found_by_name_one_file_each():
    rules = builtin()
    assert set(rules) == {"delta", "state", "clipped", "pushsum"}
    for name, cls in rules.items():
        assert cls.__module__ == f"dpwa.mixing.rules.{name}" and issubclass(cls, Rule)
        assert f"`{name}`" in DOCS.read_text(encoding="utf-8")  # a row in the docs' list


def example_module(tmp_path, monkeypatch, name="myrules"):
    """The complete rule that docs/rules.md shows, written to a module outside the package."""
    page = DOCS.read_text(encoding="utf-8")
    code = re.search(r"<!-- rules-example -->\n```python\n(.*?)```", page, flags=re.DOTALL)
    assert code, "docs/rules.md shows no rules-example block"
    assert len(code.group(1).splitlines()) <= 60
    (tmp_path / f"{name}.py").write_text(code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_rule_written_in_the_docs_runs_from_the_users_module_in_a_config(nodes, tmp_path, monkeypatch):
    """rule: myrules:ScaledDelta, scale 1/2, f = 1/2 (symmetric, two nodes: w0 starts). w0 (0) moves by
    0.25 (10 - 0) = 2.5; w1 (10) by 0.25 (0 - 10) to 7.5: the pair keeps its sum."""
    module = example_module(tmp_path, monkeypatch)
    cfg = make_config(2, mode="symmetric", rule=f"{module}:ScaledDelta", rule_options={"scale": 0.5})
    theirs, mine = filled(10), filled(0)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    node = nodes(cfg, "w0", NumpyParams(mine))
    peer.update_send()
    node.update_send()
    update = node.update_wait()
    assert update.averaged and update.factor == 0.25, update
    assert np.all(mine == 2.5)
    assert wait_until(lambda: peer.update_wait() is not None and peer.stats().get("mirrored", 0) == 1, 10)
    assert np.all(theirs == 7.5)
    assert type(node.rule).__name__ == "ScaledDelta" and node.rule.settings == {"scale": 0.5}


@pytest.mark.parametrize(
    ("rule", "options", "expected"),
    [
        ("nowhere_at_all:Rule", {}, "cannot import module 'nowhere_at_all'"),
        ("{m}:Missing", {}, "module '{m}' has no attribute 'Missing'"),
        ("{m}:scale_in_0_1", {}, "is not a subclass of dpwa.mixing.rules.Rule"),
        ("{m}:NoBlend", {}, "does not implement blend"),
        ("{m}:ScaledDelta", {"scale": 2}, "option 'scale': expected a number in (0, 1], got 2"),
        ("{m}:ScaledDelta", {"sclae": 0.5}, "has no option 'sclae' (its options: scale)"),
        ("clipped", {"radius": -1}, "option 'radius': expected a finite number > 0, got -1"),
        ("clipped", {}, "radius auto needs mode pull"),
        ("delat", {}, "expected one of clipped, delta, pushsum, state, or module.path:ClassName"),
    ],
)
def test_a_rule_that_cannot_be_used_fails_the_config_naming_the_file_the_key_and_what_is_missing(
    tmp_path, monkeypatch, rule, options, expected
):
    module = example_module(tmp_path, monkeypatch, name="badrules")
    with open(tmp_path / "badrules.py", "a") as fh:
        fh.write("\n\nclass NoBlend(Rule):\n    name = 'no_blend'\n")
    cfg = make_config(2, mode="symmetric", rule=rule.format(m=module), rule_options=options)
    with pytest.raises(ConfigError) as err:
        parse_config(cfg, source="cluster.yaml")
    message = str(err.value)
    assert message.startswith("cluster.yaml: rule") and expected.format(m=module) in message, message


def test_a_rule_without_a_mirror_is_refused_in_mode_symmetric_unless_it_says_the_default_is_right(
    tmp_path, monkeypatch
):
    """Issue 49: a rule without mirror ran in mode symmetric on the default mirror (a delta's), with no
    warning. Now it is refused at the config, naming the rule and its file and what to do; in mode pull, or
    with default_mirror = True, it runs. The built-in delta and state rules say it; the simulator checks too."""
    module = example_module(tmp_path, monkeypatch, name="mirrorless")
    with open(tmp_path / "mirrorless.py", "a") as fh:
        fh.write(
            "\n\nclass Half(Rule):\n    name = 'half'\n\n    def blend(self, params, own, peer, f, wire):\n"
            "        params.add_scaled_diff_from(peer, own, f / 2, wire)\n        return f / 2\n"
            "\n\nclass HalfDefault(Half):\n    name = 'half_default'\n    default_mirror = True\n"
        )
    symmetric = make_config(2, mode="symmetric", rule=f"{module}:Half")
    with pytest.raises(ConfigError) as err:
        parse_config(symmetric, source="cluster.yaml")
    message = str(err.value)
    assert "rule 'half', Half (" in message and "mirrorless.py), defines no mirror for mode symmetric" in message
    assert "or set default_mirror = True" in message, message
    assert parse_config({**symmetric, "mode": "pull"}).rule == f"{module}:Half"
    assert parse_config({**symmetric, "rule": f"{module}:HalfDefault"}).rule == f"{module}:HalfDefault"
    assert all(parse_config(make_config(2, mode="symmetric", rule=r)).rule == r for r in ("delta", "state"))
    arrays = [np.zeros(4, np.float32), np.ones(4, np.float32)]
    with pytest.raises(RuleError, match="defines no mirror for mode symmetric"):
        Gossip(arrays, mode="symmetric", rule=f"{module}:Half")


BROKEN_RULES = """

class ReturnsArray(ScaledDelta):
    name = "returns_array"

    def blend(self, params, own, peer, f, wire):
        super().blend(params, own, peer, f, wire)
        return peer - own


class ReturnsNaN(ScaledDelta):
    name = "returns_nan"

    def mirror(self, params, served, requester, f, wire):
        return float("nan")
"""


@pytest.mark.parametrize(
    ("cls", "mode", "expected"),
    [
        ("ReturnsArray", "pull", "blend returned an array of shape (4,) (ndarray)"),
        ("ReturnsNaN", "symmetric", "mirror returned nan (float)"),
    ],
)
def test_a_rule_that_returns_something_other_than_a_weight_is_named_at_once(tmp_path, monkeypatch, cls, mode, expected):
    """Issue 49: a blend that returned an array died in numpy ('operands could not be broadcast together',
    or 'The truth value of an array ... is ambiguous' in clamp_clock), and a NaN weight surfaced as an
    EncodeError about the header field 'clock': neither named the rule. Now what blend and mirror return is
    checked at once, and the error names the rule, its class and file, and what it must return."""
    module = example_module(tmp_path, monkeypatch, name="brokenrules")
    with open(tmp_path / "brokenrules.py", "a") as fh:
        fh.write(BROKEN_RULES)
    arrays = [np.zeros(4, np.float32), np.ones(4, np.float32)]
    gossip = Gossip(arrays, mode=mode, rule=f"{module}:{cls}")
    with pytest.raises(RuleError) as err:
        gossip.exchange_now(0, 1)
    message = str(err.value)
    assert f"{cls} (" in message and "brokenrules.py)" in message and expected in message, message
    assert "it must return the weight it gave the peer: one finite number" in message


def test_on_a_node_a_blend_that_returns_an_array_is_named_in_update_wait(nodes, tmp_path, monkeypatch):
    """The same check on a real node (mode pull): update_wait raises RuleError naming the rule and its file."""
    module = example_module(tmp_path, monkeypatch, name="brokenrules2")
    with open(tmp_path / "brokenrules2.py", "a") as fh:
        fh.write(BROKEN_RULES)
    cfg = make_config(2, mode="pull", rule=f"{module}:ReturnsArray", pairing="random")
    nodes(serving_only(cfg), "w1", NumpyParams(filled(10))).update_send()
    node = nodes(cfg, "w0", NumpyParams(filled(0)))
    node.update_send()
    with pytest.raises(RuleError, match=r"ReturnsArray \(.*brokenrules2.py\): blend returned an array of shape"):
        node.update_wait()


NAN_RULES = """

import numpy as np


class WritesNaN(ScaledDelta):
    name = "writes_nan"

    def blend(self, params, own, peer, f, wire):
        bad = peer.copy()
        bad[3] = np.nan
        params.add_scaled_diff_from(bad, own, f, wire)
        return f


class HalfThenRaises(ScaledDelta):
    name = "half_then_raises"

    def blend(self, params, own, peer, f, wire):
        params.add_scaled_diff_from(peer, own, f, wire)
        return 1 / 0


class MirrorWritesNaN(ScaledDelta):
    name = "mirror_writes_nan"

    def mirror(self, params, served, requester, f, wire):
        params.add_scaled_diff_from(np.full_like(requester, np.inf), served, f, wire)
        return f
"""


def nan_rules(tmp_path, monkeypatch, name: str) -> str:
    module = example_module(tmp_path, monkeypatch, name=name)
    with open(tmp_path / f"{name}.py", "a") as fh:
        fh.write(NAN_RULES)
    return module


def test_a_rule_that_writes_nan_into_the_model_is_named_and_the_model_set_back_before_anything_is_published(
    nodes, tmp_path, monkeypatch
):
    """Issue 49: a rule that wrote NaN into the model left the node training to the end on NaN (8% accuracy),
    and nothing named the rule. Now (broken_rule: raise, the default) update_wait raises naming the rule, its
    file and what it did; the model is the snapshot published at update_send (all 0, finite: nothing with NaN
    was ever published); the node's gossip is closed, and a later call says why."""
    module = nan_rules(tmp_path, monkeypatch, "nanrules")
    cfg = make_config(2, mode="pull", rule=f"{module}:WritesNaN", pairing="random")
    nodes(serving_only(cfg), "w1", NumpyParams(filled(10))).update_send()
    model = filled(0)
    node = nodes(cfg, "w0", NumpyParams(model))
    assert node.config.broken_rule == "raise"
    node.update_send()
    with pytest.raises(RuleError, match=r"WritesNaN \(.*nanrules.py\): blend wrote NaN, Inf or a value beyond"):
        node.update_wait()
    assert np.array_equal(model, filled(0))  # set back: not 0 + 0.5 (10 - 0) with a NaN at [3]
    assert node.counters.get("rule_broken") == 1
    with pytest.raises(RuntimeError, match=r"its rule broke \(RuleError: rule 'writes_nan'"):
        node.update_send()
    assert node.closed


def test_a_rule_that_raises_after_writing_half_its_change_leaves_the_model_as_published(nodes, tmp_path, monkeypatch):
    """A rule that raises midway: its own exception reaches the script (a traceback into the user's file), and
    the model holds no half-written change: it is the snapshot published at update_send."""
    module = nan_rules(tmp_path, monkeypatch, "nanrules3")
    cfg = make_config(2, mode="pull", rule=f"{module}:HalfThenRaises", pairing="random")
    nodes(serving_only(cfg), "w1", NumpyParams(filled(10))).update_send()
    model = filled(0)
    node = nodes(cfg, "w0", NumpyParams(model))
    node.update_send()
    with pytest.raises(ZeroDivisionError) as err:
        node.update_wait()
    assert str(err.traceback[-1].path).endswith("nanrules3.py")
    assert np.array_equal(model, filled(0)) and node.counters.get("rule_broken") == 1


def test_with_broken_rule_alone_a_node_whose_mirror_writes_inf_trains_on_alone_and_its_peer_is_unharmed(
    nodes, tmp_path, monkeypatch
):
    """broken_rule: alone, mode symmetric: w1's mirror (the server's half) writes Inf. w1 sets its model back to
    the snapshot it served (all 10), says rule_broken, closes its gossip and goes on: update_send starts
    nothing, update_wait says rule_broken, a barrier waits for nobody. w0, which applied its half, holds finite
    values only."""
    module = nan_rules(tmp_path, monkeypatch, "nanrules2")
    cfg = make_config(2, mode="symmetric", rule=f"{module}:MirrorWritesNaN", broken_rule="alone")
    served_model = filled(10)
    w1 = nodes(serving_only(cfg), "w1", NumpyParams(served_model))
    w1.update_send()
    w0_model = filled(0)
    w0 = nodes(cfg, "w0", NumpyParams(w0_model))
    assert step_until_averaged(w0, timeout_s=20) is not None
    assert np.isfinite(w0_model).all() and w0_model[0] == pytest.approx(2.5)

    def w1_steps() -> bool:
        w1.update_send()
        return w1.update_wait().outcome == "rule_broken"

    assert wait_until(w1_steps, 20)
    assert np.array_equal(served_model, filled(10)) and w1.closed
    assert w1.counters.get("rule_broken") == 1
    assert w1.update_send() is False and w1.update_wait().outcome == "rule_broken"
    assert w1.barrier(timeout_s=0) == ["w0"]


HEAVY_DELTA = """

import numpy as np


class HeavyDelta(ScaledDelta):
    name = "heavy_delta"

    def blend(self, params, own, peer, f, wire):
        # momentum on the peer difference, added with the helper as "x += 1 * (v - 0)": right for parameters,
        # wrong for running statistics, which the helper moves towards its first argument instead
        self.v = 0.5 * getattr(self, "v", 0.0) + f * (peer - own)
        params.add_scaled_diff_from(self.v.astype(np.float32), np.zeros_like(own), 1.0, wire)
        return f
"""


def test_a_rule_that_breaks_running_statistics_breaks_them_in_the_simulator_too(tmp_path, monkeypatch):
    """Issue 49: a rule that adds its momentum as add_scaled_diff_from(v, zeros) set a real model's BatchNorm
    running statistics to the momentum itself (the helper moves buffers towards its first argument), and the
    simulator, whose models had no buffers, showed nothing. Its models may now hold running statistics
    (`statistics=`), treated as the adapter treats buffers: four nodes whose statistics are all 1 keep them at 1
    under the default rule, and HeavyDelta drags them to the momentum (near 0); without the range (the old
    simulator) it seemed harmless."""
    module = example_module(tmp_path, monkeypatch, name="heavyrules")
    with open(tmp_path / "heavyrules.py", "a") as fh:
        fh.write(HEAVY_DELTA)

    def stats_after(rule: str, statistics: list[tuple[int, int]]) -> np.ndarray:
        rng = np.random.default_rng(0)
        arrays = [np.concatenate([rng.normal(size=8), np.ones(4)]).astype(np.float32) for _ in range(4)]
        gossip = Gossip(arrays, mode="pull", rule=rule, seed=1, statistics=statistics)
        for _ in range(40):
            i = gossip.rng.randrange(4)
            gossip.exchange_now(i, gossip.choose(i))
        return np.stack([a[8:] for a in gossip.arrays])

    stats = [(8, 12)]
    assert np.allclose(stats_after("delta", stats), 1.0)  # the default rule: identical statistics stay
    assert np.abs(stats_after(f"{module}:HeavyDelta", stats) - 1.0).max() > 0.5  # broken, and now it shows
    assert np.allclose(stats_after(f"{module}:HeavyDelta", []), 1.0)  # without buffers it looked harmless


def test_every_simulator_command_takes_a_users_rule_with_its_options(tmp_path, monkeypatch, capsys):
    """Issue 49: `sim consensus` took a rule of one's own, `sim rounds` refused it (invalid choice) and `sim
    study` had no rule option. Now all three take module:Class and --rule-options; `study --rule ... --only`
    puts it beside exact averaging; a rule that cannot be used is one line, naming it."""
    from dpwa_lab.sim.simulate import main

    module = example_module(tmp_path, monkeypatch, name="simrules")
    rule = [f"--rule={module}:ScaledDelta", "--rule-options={scale: 0.5}"]
    assert main(["consensus", "--nodes", "4", "--exchanges", "50", *rule]) == 0
    assert f"symmetric/{module}:ScaledDelta" in capsys.readouterr().out
    assert main(["rounds", "--nodes", "4", "--rounds", "2", *rule]) == 0
    assert f"symmetric/{module}:ScaledDelta" in capsys.readouterr().out
    assert main(["study", "--seeds", "1", "--only", "--rule-mode", "pull", *rule]) == 0
    table = capsys.readouterr().out
    assert "| exact all-reduce averaging |" in table and f"| pull, {module}:ScaledDelta |" in table, table
    assert table.count("\n|") == 4  # the header, its rule, and the two rows
    with pytest.raises(SystemExit):
        main(["rounds", "--rule", f"{module}:ScaledDelta", "--rule-options", "{scale: 2}"])
    assert "option 'scale': expected a number in (0, 1], got 2" in capsys.readouterr().err


def test_blend_is_read_as_the_older_name_of_rule():
    cfg = {k: v for k, v in make_config(2).items() if k != "rule"}
    assert parse_config({**cfg, "blend": "delta"}).rule == "delta"
    with pytest.raises(ConfigError, match="blend is the older name of rule: give one of them"):
        parse_config({**cfg, "blend": "state", "rule": "delta"})


def test_a_peer_that_mixes_by_another_rule_or_settings_is_refused_and_nothing_moves(nodes):
    """w1 clips at radius 1; w0 runs plain delta: w0's exchanges are refused bad_rule, counted on w1."""
    cfg = make_config(2, mode="symmetric")
    other = {**cfg, "rule": "clipped", "rule_options": {"radius": 1.0}}
    theirs, mine = filled(10), filled(0)
    peer = nodes(serving_only(other), "w1", NumpyParams(theirs))
    node = nodes(cfg, "w0", NumpyParams(mine))
    peer.update_send()
    node.update_send()
    update = node.update_wait()
    assert not update.averaged and "bad_rule" in (update.reason or "") + update.outcome, update
    assert peer.stats()["rejected.bad_rule"] == 1
    assert np.all(mine == 0) and np.all(theirs == 10)


def test_an_exchange_or_a_reply_that_names_no_rule_is_refused_like_another_rule(nodes, zctx):
    """Issue 41: a peer that leaves the rule's fingerprint out was not checked at all: an exchange request
    with none went on to commit and moved w1 to 5, and a fetch's reply with none moved w0 to 5. Now both are
    refused bad_rule, as another rule is, and nothing moves; a fetch that names no rule (a tool's, such as
    ``python -m dpwa average``) is still served, since it moves nothing here."""
    import zmq

    from dpwa.gossip.transfer.protocol import FETCH, PARAMS
    from dpwa.wire.schema import decode, encode
    from helpers.raw_peer import FakePeer, RawPeer

    cfg = make_config(2, mode="symmetric", insecure=True, same_host="off")
    theirs = filled(10)
    server = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    server.update_send()
    raw = RawPeer(zctx, cfg, "w0")
    no_rule = raw.exchange_with(server.params.fingerprint, filled(0))  # the peer's exchange, without `rule`
    assert no_rule.kind == "error" and no_rule["reason"] == "bad_rule", dict(no_rule.fields)
    assert "names no mixing rule" in no_rule["detail"]
    assert server.stats()["rejected.bad_rule"] == 1 and server.stats().get("exchanges_pending", 0) == 0
    assert raw.exchange(server, filled(0)).kind == "params"  # the control: with the rule, it is served
    tool = zctx.socket(zmq.REQ)
    tool.connect(server.config.endpoint(server.spec))
    tool.send(encode(FETCH, 9, **{"from": "w0"}, fp=server.params.fingerprint, dtype="float32"))
    assert tool.poll(5000) and decode(tool.recv_multipart()[0]).kind == "params"  # a tool's fetch: served
    tool.close(0)

    pull = make_config(2, mode="pull", insecure=True, same_host="off", timeout_ms=1000)
    mine = filled(0)
    node = nodes(pull, "w0", NumpyParams(mine))
    fp = node.params.fingerprint

    def reply(request):  # w1's reply: its snapshot (5 everywhere), first without the rule, then with it
        fields = {"from": "w1", "fp": fp, "dtype": "float32", "nbytes": mine.nbytes, "clock": 0.0, "loss": None}
        fields |= {"version": 1}
        if replies:
            fields["rule"] = request.header["rule"]
        replies.append(request)
        return [encode(PARAMS, request.id, **fields), filled(5).tobytes()]

    replies: list = []
    ctx = zmq.Context()
    fake = FakePeer(ctx, node.config.endpoint(node.config.node("w1")), reply)
    try:
        node.update_send()
        update = node.update_wait()
        assert update.outcome == "rejected" and update.reason.startswith("bad_rule"), update
        assert np.all(mine == 0)
        node.update_send()
        assert node.update_wait().averaged and np.all(mine == 2.5)  # the control: with the rule, blended
    finally:
        fake.close()
        ctx.destroy(linger=0)


def test_the_fingerprint_covers_the_rule_its_settings_and_how_f_is_chosen():
    fps = {
        rule_class("delta")().fingerprint(),
        rule_class("state")().fingerprint(),
        ClippedGossip(radius=1.0).fingerprint(),
        ClippedGossip(radius=2.0).fingerprint(),
        rule_class("delta")(Constant(0.3)).fingerprint(),
        rule_class("delta")(divergence_threshold=0.1).fingerprint(),
    }
    assert len(fps) == 6
    assert ClippedGossip(radius=1.0).fingerprint() == ClippedGossip(radius=1.0).fingerprint()


def test_clipped_gossip_moves_a_far_peer_by_at_most_f_times_the_radius_and_keeps_the_pairs_sum(nodes):
    """Four elements, w0 at 0 and w1 at 10: the distance is 20; radius 4, f = 1/2: the weight is
    0.5 * 4 / 20 = 0.1. w0 moves to 1, w1 to 9 (the sum, 10, kept); each moved by f * radius = 2 in norm."""
    cfg = make_config(2, mode="symmetric", rule="clipped", rule_options={"radius": 4.0})
    theirs, mine = filled(10, 4), filled(0, 4)
    peer = nodes(serving_only(cfg), "w1", NumpyParams(theirs))
    node = nodes(cfg, "w0", NumpyParams(mine))
    peer.update_send()
    node.update_send()
    update = node.update_wait()
    assert update.averaged and update.factor == pytest.approx(0.1), update
    np.testing.assert_allclose(mine, 1.0, rtol=1e-6)
    assert wait_until(lambda: peer.update_wait() is not None and peer.stats().get("mirrored", 0) == 1, 10)
    np.testing.assert_allclose(theirs, 9.0, rtol=1e-6)
    assert node.stats()["rule.clipped"] == 1 and peer.stats()["rule.clipped"] == 1  # both halves clipped


def test_clipped_gossip_leaves_a_near_peer_alone():
    rule = ClippedGossip(radius=100.0)
    x = filled(0, 4)
    w = rule.blend(NumpyParams(x), filled(0, 4), filled(10, 4), 0.5, "float32")
    assert w == 0.5 and np.all(x == 5.0) and rule.clipped == 0


def test_clipped_gossip_auto_clips_an_outlier_to_the_median_of_recent_distances():
    """radius auto, in mode pull: distances 2, 2, 2 seen (each within the median), then a peer 1000 away is
    clipped to the median, 2: the node moves f * 2 = 1 in norm, not 500."""
    rule = ClippedGossip(radius="auto")
    own = filled(0, 1)
    for _ in range(3):
        x = filled(0, 1)
        assert rule.blend(NumpyParams(x), own, filled(2, 1), 0.5, "float32") == 0.5
    x = filled(0, 1)
    w = rule.blend(NumpyParams(x), own, filled(1000, 1), 0.5, "float32")
    assert w == pytest.approx(0.5 * 2 / 1000) and x[0] == pytest.approx(1.0) and rule.clipped == 1


def test_clipped_auto_is_not_ratcheted_by_a_peer_that_moves_a_little_further_each_time():
    """Issue 41's ramp: 3 honest nodes (mode pull, radius auto, f = 0.5) train (noise 0.1 per step) and pull
    at random from each other and from an attacker that serves the honest mean plus r along one axis, r
    growing 5% per attack. Before, each clipped step pushed the honest nodes apart, their distances and so
    the median grew with it, and after 400 steps the honest mean had moved 1.6e7 to 2.4e8 along the attack.
    Now each node's radius is at most CAP times its anchor (its first full window's median), so the mean
    moves by at most f x CAP x anchor per attacker exchange: here about 250, within that bound."""
    rng, pick = np.random.default_rng(0), random.Random(0)
    xs = [(rng.normal(size=32) * 0.5).astype(np.float32) for _ in range(3)]
    rules = [ClippedGossip(radius="auto") for _ in range(3)]
    r, attacks = 1.0, 0
    for _ in range(400):
        snapshots = [x.copy() for x in xs]
        for x in xs:
            x += (rng.normal(size=32) * 0.1).astype(np.float32)
        for i in range(3):
            j = pick.choice([k for k in range(4) if k != i])  # 3: the attacker
            peer = snapshots[j] if j < 3 else np.mean(snapshots, axis=0).astype(np.float32)
            if j == 3:
                peer[0] += r
                r, attacks = r * 1.05, attacks + 1
            rules[i].blend(NumpyParams(xs[i]), snapshots[i], peer, 0.5, "float32")
    anchors = [rule.state()["anchor"] for rule in rules]
    moved = float(np.mean(xs, axis=0)[0])
    assert attacks > 350 and all(0.5 < a < 2 for a in anchors), (attacks, anchors)
    assert moved <= 0.5 * CAP * max(anchors) * attacks / 3 + 5, moved  # each attack moves one node of 3
    assert moved < 1000 and r > 1e7  # the attacker's offset by the end, for scale
    joiner = ClippedGossip(radius="auto")  # a joiner (or a checkpoint) takes the anchor with the distances
    joiner.load_state(joiner.check_state(rules[0].state()))
    assert joiner.state() == rules[0].state() and joiner.state()["anchor"] == anchors[0]


def test_the_simulator_runs_any_rule_by_name_and_clipped_symmetric_keeps_the_mean():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=16).astype(np.float32) for _ in range(4)]
    mean = np.mean(arrays, axis=0)
    gossip = Gossip(arrays, mode="symmetric", rule="clipped", rule_options={"radius": 0.5}, seed=1)
    for i in range(4):
        gossip.exchange_now(i, (i + 1) % 4)
    np.testing.assert_allclose(np.mean(gossip.arrays, axis=0), mean, atol=1e-6)
    assert any(isinstance(r, ClippedGossip) and r.clipped for r in gossip.rules)
    with pytest.raises(RuleError, match="expected one of"):
        Gossip(arrays, rule="nope")


def test_the_default_factor_is_the_interpolation_damped_and_capped_in_mode_symmetric():
    rule = rule_class("delta")(Constant(0.8), divergence_threshold=2.0)
    assert rule.factor(Side(0.0, 1.0), Side(0.0, 1.0)) == pytest.approx(0.4)  # 0.8 * 1 / 2
    assert rule.factor(Side(0.0, 5.0), Side(0.0, 1.0), symmetric=True) == 0.5  # capped


def test_a_joiner_takes_its_donors_clipping_history_so_it_clips_from_its_first_exchange(nodes):
    """Clipped with radius auto (mode pull): w0 (0) keeps pulling from w1 (2, serving only), so its distances
    are 2, 1, 0.5, ... (each pull halves the gap). w2 starts late with join: auto while w0 steps; it takes
    the donor's distances with the parameters (a fresh history would let its first exchanges through
    unclipped). The history keeps the last 16, so on a slow join the oldest have slid out: what w2 holds is
    a run of that sequence, at least the 5 pulls made before it started."""
    cfg = make_config(3, mode="pull", rule="clipped", rule_options={"radius": "auto"}, pairing="random", join="auto")
    w1 = nodes(serving_only({**cfg, "join": "never"}), "w1", NumpyParams(filled(2, 1)))
    w0 = nodes({**cfg, "join": "never"}, "w0", NumpyParams(filled(0, 1)))
    w1.update_send()
    for _ in range(5):
        assert step_until_averaged(w0, 10, peer="w1") is not None
    stop = threading.Event()

    def steps() -> None:  # the donor captures what a joiner takes at its next step
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            w0.update_send()
            w0.update_wait()

    stepper = threading.Thread(target=steps, daemon=True)
    stepper.start()
    try:
        w2 = nodes(cfg, "w2", NumpyParams(filled(0, 1)))
    finally:
        stop.set()
        stepper.join(30)
    assert w2.joined is not None and w2.joined.donor == "w0", w2.joined
    assert "rule" in (w2.joined.extra_state or {}), w2.joined
    seen = w2.rule.state()["seen"]
    assert len(seen) >= 5 and seen[0] > 0, seen
    # the distances w0's pulls saw, in float32: halving until the gap is below float32's resolution at 2,
    # then 0 (a slow join lets w0 pull that long)
    x, distances = np.float32(0), []
    for _ in range(64):
        distances.append(float(np.float32(2) - x))
        x = np.float32(x + np.float32(0.5) * (np.float32(2) - x))
    first = distances.index(seen[0])  # how many slid out
    assert seen == distances[first : first + len(seen)], seen


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"seen": [1.0] * 17}, "at most 16 distances"),
        ({"seen": [float("nan")]}, "finite number >= 0"),
        ({"seen": [-1.0]}, "finite number >= 0"),
        ({"seen": [1.0], "more": 1}, "a list of at most 16"),
        ({"seen": [1.0], "anchor": 0.0}, "the anchor must be a finite distance > 0, got 0.0"),
        ({"seen": [1.0], "anchor": float("inf")}, "the anchor must be a finite distance > 0, got inf"),
        ({"seen": [1.0], "anchor": "1"}, "the anchor must be a finite distance > 0, got '1'"),
        ([1.0], "a list of at most 16"),
    ],
)
def test_a_donors_rule_state_that_does_not_fit_is_refused_whole(state, why):
    import msgpack

    from dpwa.gossip.transfer.extras import RuleState

    rule = ClippedGossip(radius="auto")
    part = RuleState(rule)
    with pytest.raises(ValueError, match=re.escape(why)):
        part.check(b"", np.frombuffer(msgpack.packb(state), np.uint8))
    with pytest.raises(ValueError, match="expected no metadata"):
        part.check(b"x", np.frombuffer(msgpack.packb({"seen": []}), np.uint8))
    with pytest.raises(ValueError, match="not msgpack"):
        part.check(b"", np.frombuffer(b"\xc1", np.uint8))
    good = part.check(*RuleState(ClippedGossip(radius="auto")).capture())
    part.load(good)
    assert rule.state() == {"seen": []}
    assert RuleState.of(ClippedGossip(radius=1.0)) is None and RuleState.of(rule_class("delta")()) is None
