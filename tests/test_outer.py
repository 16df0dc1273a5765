"""Local steps with an outer step, and int8 exchanges: the math against hand-computed values, the node's
period and outer step, and the outer state through joins and checkpoints."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from conftest import ORIGINAL, filled, make_config, step_until_averaged, wait_until
from dpwa import NumpyParams, parse_config
from dpwa.gossip.exchange.outer import OuterStep
from dpwa.gossip.transfer.extras import Extras
from dpwa.mixing.codecs import int8 as quantize
from dpwa.mixing.outer import GossipOuter, OuterSettings, nesterov_step, noloco_step

# --------------------------------------------------------------------------- the outer rules, by hand


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def test_nesterov_matches_hand_computed_steps():
    """lr 0.5, momentum 0.5, from anchor [1, 2] with gradients [1, -2], then [1, -2] again:
    buf = g = [1, -2]; x -= 0.5 (g + 0.5 buf) = [1, 2] - [0.75, -1.5] = [0.25, 3.5];
    buf = 0.5 [1, -2] + [1, -2] = [1.5, -3]; x -= 0.5 ([1, -2] + [0.75, -1.5]) = [-0.625, 5.25]."""
    x, buf = f32(1, 2), f32(0, 0)
    nesterov_step(x, f32(1, -2), buf, 0.5, 0.5)
    assert x.tolist() == [0.25, 3.5] and buf.tolist() == [1.0, -2.0]
    nesterov_step(x, f32(1, -2), buf, 0.5, 0.5)
    assert x.tolist() == [-0.625, 5.25] and buf.tolist() == [1.5, -3.0]


def test_noloco_matches_hand_computed_steps():
    """lr 0.5, momentum 0.5, anchor [1, 2], mixed [2, 0]: buf = 0.5 ([2, 0] - [1, 2]) = [0.5, -1],
    anchor = [1.5, 1]; mixed = the anchor again: buf = 0.5 buf = [0.25, -0.5], anchor = [1.75, 0.5]."""
    anchor, buf = f32(1, 2), f32(0, 0)
    noloco_step(anchor, f32(2, 0), buf, 0.5, 0.5)
    assert anchor.tolist() == [1.5, 1.0] and buf.tolist() == [0.5, -1.0]
    noloco_step(anchor, anchor.copy(), buf, 0.5, 0.5)
    assert anchor.tolist() == [1.75, 0.5] and buf.tolist() == [0.25, -0.5]


@pytest.mark.parametrize("rule", ["nesterov", "noloco"])
def test_plain_averaging_is_lr_1_without_momentum(rule):
    """With outer lr 1 and no momentum, either rule moves the anchor to the mixed parameters: the outer
    step is a no-op, and the node behaves as without one."""
    outer = GossipOuter(rule, f32(1, 2, 3), OuterSettings(lr=1.0, momentum=0.0))
    mixed = f32(4, -1, 0.5)
    assert outer.step(mixed).tolist() == mixed.tolist()


@pytest.mark.parametrize("rule", ["nesterov", "noloco"])
@pytest.mark.parametrize("lr, momentum", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.0)])
def test_each_step_keeps_the_weighted_sum_it_says(rule, lr, momentum):
    """kept_weights' (a, b, c): a * params + b * anchor + c * buf before a step (params: the mixed values)
    equals it after (params: the new anchor), over 50 random steps, in float64 within float32 rounding."""
    rng = np.random.default_rng(3)
    outer = GossipOuter(rule, rng.standard_normal(100).astype(np.float32), OuterSettings(lr, momentum))
    a, b, c = outer.kept_weights()
    for _ in range(50):
        mixed = (outer.anchor + rng.standard_normal(100)).astype(np.float32)
        before = a * mixed.astype(np.float64) + b * outer.anchor + c * outer.buf.astype(np.float64)
        after_anchor = outer.step(mixed)
        after = a * after_anchor.astype(np.float64) + b * after_anchor + c * outer.buf.astype(np.float64)
        assert np.abs(after - before).max() < 1e-4 * max(1.0, np.abs(before).max())


def test_apply_leaves_running_statistics_where_averaging_put_them():
    """GossipOuter.apply steps the parameters, not the ranges FlatParams.statistics names: those stay
    as mixed and keep no momentum."""

    class WithStats(NumpyParams):
        def statistics(self):
            return [(2, 4)]

    values = f32(1, 1, 5, 5)
    params = WithStats(values)
    outer = GossipOuter("noloco", f32(0, 0, 0, 0), OuterSettings(lr=0.5, momentum=0.5))
    outer.apply(params)  # mixed [1, 1, 5, 5]: buf = 0.5 (mixed - 0) = [0.5, 0.5, 2.5, 2.5] -> stats: 0
    assert values.tolist() == [0.5, 0.5, 5.0, 5.0]
    assert outer.buf.tolist() == [0.5, 0.5, 0.0, 0.0] and outer.anchor.tolist() == values.tolist()


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="outer lr"):
        OuterSettings(lr=0.0)
    with pytest.raises(ValueError, match="outer momentum"):
        OuterSettings(momentum=1.0)
    with pytest.raises(ValueError, match="outer rule"):
        GossipOuter("adam", f32(1), OuterSettings())


# --------------------------------------------------------------------------- int8 with error feedback, by hand


def test_int8_encodes_a_block_by_hand():
    """One block [127, -63.5, 0.4, 0]: scale 127 / 127 = 1, codes [127, -64 (rint of -63.5: even), 0, 0].
    Decoded [127, -64, 0, 0]; the residual is what was left out: [0, 0.5, 0.4, 0]."""
    values = f32(127, -63.5, 0.4, 0)
    out = np.empty(quantize.encoded_bytes(4), np.uint8)
    residual = np.zeros(4, np.float32)
    quantize.encode(values, out, residual)
    assert out[:4].view(np.float32).tolist() == [1.0] and out[4:].view(np.int8).tolist() == [127, -64, 0, 0]
    decoded = np.empty(4, np.float32)
    quantize.decode(out, decoded, 1e18)
    assert decoded.tolist() == [127.0, -64.0, 0.0, 0.0]
    assert residual.tolist() == pytest.approx([0.0, 0.5, 0.4, 0.0])
    # the next send carries what the first left out: [127, -63.5 + 0.5, 0.4 + 0.4, 0] -> codes [127, -63, 1, 0]
    quantize.encode(values, out, residual)
    assert out[4:].view(np.int8).tolist() == [127, -63, 1, 0]
    assert residual.tolist() == pytest.approx([0.0, 0.0, -0.2, 0.0], abs=1e-6)


def test_error_feedback_keeps_the_sum_of_what_arrives_within_one_residual():
    """Sending the same values k times: the decoded sends sum to k * values minus the last residual,
    exactly (to float32 rounding), so the error never piles up. Without feedback it grows with k."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(5000).astype(np.float32) * np.repeat(f32(1, 100, 0.01, 3, 10), 1000)
    encoder = quantize.Encoder(values.size)
    total = np.zeros(values.size, np.float64)
    decoded = np.empty(values.size, np.float32)
    plain = np.empty(quantize.encoded_bytes(values.size), np.uint8)
    quantize.encode(values, plain)
    once = np.empty(values.size, np.float32)
    quantize.decode(plain, once, 1e18)
    k = 40
    for _ in range(k):
        quantize.decode(encoder.encode(values), decoded, 1e18)
        total += decoded
    with_feedback = np.abs(total - k * values.astype(np.float64) + encoder.residual()).max()
    assert with_feedback < 1e-3, with_feedback
    without = np.abs(k * (once.astype(np.float64) - values)).max()
    assert np.abs(encoder.residual()).max() < without / 10  # what is still owed is small beside k errors


@pytest.mark.parametrize("scale", [np.nan, np.inf, -1.0, 1e18 / 127])
def test_int8_decode_refuses_a_bad_scale_before_writing(scale):
    """A NaN, infinite or negative scale, or one that a code of -128 would carry past the bound: refused,
    naming the block, and the output untouched."""
    encoded = np.zeros(quantize.encoded_bytes(2048), np.uint8)
    encoded[:8].view(np.float32)[:] = [1.0, scale]
    out = np.full(2048, 7.0, np.float32)
    with pytest.raises(ValueError, match="block 1 has scale"):
        quantize.decode(encoded, out, 1e18)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="bytes"):
        quantize.decode(encoded[:-1], out, 1e18)


# --------------------------------------------------------------------------- a joiner's checks


def outer_step(size: int = 8, rule: str = "noloco") -> OuterStep:
    return OuterStep(rule, NumpyParams(np.zeros(size, np.float32)), OuterSettings())


def test_an_outer_state_round_trips_through_capture_and_check():
    donor, joiner = outer_step(), outer_step()
    donor.outer.anchor[:] = 3.0
    donor.outer.buf[:] = -0.5
    donor.outer.steps = 7
    joiner.load(joiner.check(*donor.capture()))
    assert joiner.state()["anchor"].tolist() == [3.0] * 8 and joiner.state()["buf"].tolist() == [-0.5] * 8
    assert joiner.state()["steps"] == 7


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda m, d: (msgpack.packb({**m, "rule": "nesterov"}), d), "rule 'nesterov'"),
        (lambda m, d: (msgpack.packb({**m, "size": 9}), d), "size 9"),
        (lambda m, d: (msgpack.packb({**m, "steps": True}), d), "steps must be a count"),
        (lambda m, d: (msgpack.packb({**m, "steps": -1}), d), "steps must be a count"),
        (lambda m, d: (msgpack.packb({"rule": "noloco"}), d), "rule, size and steps"),
        (lambda m, d: (b"\xc1", d), "not msgpack"),
        (lambda m, d: (msgpack.packb(m), d[:-4]), "bytes, expected"),
        (lambda m, d: (msgpack.packb(m), np.full(64, 0xFF, np.uint8)), "finite"),  # NaN
        (lambda m, d: (msgpack.packb(m), f32(*[3e30] * 16).view(np.uint8)), "finite and within"),
    ],
)
def test_a_donors_bad_outer_state_is_refused_naming_the_field(spoil, message):
    donor, joiner = outer_step(), outer_step()
    meta, data = donor.capture()
    meta, data = spoil(msgpack.unpackb(meta), data)
    before = joiner.state()
    with pytest.raises(ValueError, match=message):
        joiner.check(meta, data)
    assert joiner.state()["anchor"].tolist() == before["anchor"].tolist()


def test_extras_check_each_part_and_refuse_what_does_not_add_up():
    """Two parts travel as one; a joiner refuses an unknown or repeated part, byte counts beyond a part's
    budget or not adding up to what came, and passes each part to that part's own check."""
    donor = Extras({"outer": outer_step(), "other": outer_step(4, "nesterov")})
    joiner = Extras({"outer": outer_step(), "other": outer_step(4, "nesterov")})
    meta, data = donor.capture()
    checked = joiner.check(meta, data)
    assert set(checked) == {"outer", "other"}
    joiner.load(checked)
    listed = msgpack.unpackb(meta)
    for bad, message in [
        ([["nope", listed[0][1], listed[0][2]]], "unknown or repeated"),
        ([listed[0], listed[0]], "unknown or repeated"),
        ([[listed[0][0], listed[0][1], 10**9], listed[1]], "we take at most"),
        ([listed[0]], "the parts hold"),
        ([[listed[0][0], listed[0][1]]], r"\[name, metadata, bytes\]"),
        ({"outer": 1}, "a list of at most"),
    ]:
        with pytest.raises(ValueError, match=message):
            joiner.check(msgpack.packb(bad), data)
    # a part the donor does not have is the joiner's own: only what came is checked and loaded
    only = Extras({"outer": outer_step()})
    assert set(joiner.check(*only.capture())) == {"outer"}


# --------------------------------------------------------------------------- on a node


def test_the_period_starts_an_exchange_every_h_steps(nodes):
    """period 3 with fetch_probability 1: steps 3, 6, 9 start a fetch, the others are local only."""
    cfg = make_config(2, **ORIGINAL, period=3, insecure=True, same_host="off")
    nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(0, 100)))
    node = nodes(cfg, "w0", NumpyParams(filled(1, 100)))
    started = []
    for _ in range(9):
        started.append(node.update_send())
        node.update_wait()
    assert started == [False, False, True] * 3
    assert node.stats()["averaged"] == 3


def test_a_failed_exchange_is_tried_again_at_the_next_step(nodes):
    """period 4, and the only peer holds another model (it refuses our fetches): step 4 tries and
    fails, and so does every step after it, until one succeeds; once w1 holds our model, the next
    exchange succeeds and the node waits a whole period again."""
    cfg = make_config(2, period=4, insecure=True, same_host="off")
    other = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(0, 50)))
    node = nodes(cfg, "w0", NumpyParams(filled(1, 100)))
    tried, outcomes = [], []
    for _ in range(6):
        tried.append(node.update_send())
        outcomes.append(node.update_wait().outcome)
    assert tried == [False, False, False, True, True, True]
    assert outcomes[3:] == ["refused"] * 3  # the server checks the fingerprint first
    other.close()
    nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(0, 100)))
    assert step_until_averaged(node, 20, peer="w1") is not None
    tried = []
    for _ in range(4):
        tried.append(node.update_send())
        node.update_wait()
    assert tried == [False, False, False, True]


def test_a_pull_with_an_outer_step_lands_on_the_hand_computed_anchor(nodes):
    """noloco, lr 0.5, momentum 0.5, f = 1/2: w0 at 2 fetches w1 at 0. mixed = 1, anchor 2:
    buf = 0.5 (1 - 2) = -0.5, anchor = 1.5. Then w0 trains +1 (2.5) and fetches again: mixed = 1.25,
    buf = 0.5 (-0.5) + 0.5 (1.25 - 1.5) = -0.375, anchor = 1.125."""
    cfg = make_config(2, **ORIGINAL, period=1, outer="noloco", outer_lr=0.5, outer_momentum=0.5, insecure=True)
    mine = filled(2, 100)
    nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(0, 100)))
    node = nodes(cfg, "w0", NumpyParams(mine))
    assert step_until_averaged(node, 20, peer="w1") is not None
    assert np.all(mine == 1.5)
    node.update_send()
    mine += 1.0
    assert node.update_wait().averaged
    assert np.all(mine == 1.125)
    state = node.outer_state()
    assert state["steps"] == 2 and np.all(state["buf"] == -0.375)


def test_the_outer_state_survives_a_checkpoint(nodes):
    """outer_state() on one node, restore(outer=...) on another: the same anchor, momentum and steps;
    a bad one is refused and changes nothing; restore() without one starts afresh from the parameters."""
    cfg = make_config(2, outer="nesterov", insecure=True, fetch_probability=0)
    a = nodes(cfg, "w0", NumpyParams(filled(1, 50)))
    a._outer.outer.anchor[:] = 4.0
    a._outer.outer.buf[:] = 0.25
    a._outer.outer.steps = 12
    saved = a.outer_state()
    mine = filled(9, 50)
    b = nodes(cfg, "w1", NumpyParams(mine))
    b.restore(clock=3.0, outer=saved)
    assert b.outer_state()["anchor"].tolist() == [4.0] * 50 and b.outer_state()["steps"] == 12
    with pytest.raises(ValueError, match="NaN or Inf"):
        b.restore(clock=5.0, outer={**saved, "buf": np.full(50, np.nan, np.float32)})
    assert b.clock == 3.0 and b.outer_state()["buf"].tolist() == [0.25] * 50
    b.restore()
    assert b.outer_state()["anchor"].tolist() == [9.0] * 50 and b.outer_state()["steps"] == 0


def test_a_joiner_takes_its_donors_outer_state(nodes):
    """w0 has trained (clock > 0) with a known outer state and a period so long that it takes no outer
    step; w1 joins and holds exactly w0's anchor, momentum and step count, and w0's parameters."""
    cfg = make_config(2, outer="noloco", period=10_000, join="auto", fetch_probability=0, timeout_ms=500)
    donor = nodes({**cfg, "join": "never"}, "w0", NumpyParams(filled(1, 300)))
    donor._outer.outer.anchor[:] = 5.0
    donor._outer.outer.buf[:] = -2.0
    donor._outer.outer.steps = 3
    stop = threading.Event()

    def train():  # steps until told to stop (at most 60 s): the donor captures its state at a step
        deadline = time.monotonic() + 60
        for _ in range(10**8):
            if stop.is_set() or time.monotonic() > deadline:
                return
            donor.update_send()
            donor.update_wait()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert wait_until(lambda: donor.clock > 2, 10)
        mine = filled(0, 300)
        joiner = nodes(cfg, "w1", NumpyParams(mine))
        assert joiner.joined is not None and joiner.joined.donor == "w0"
        state = joiner.outer_state()
        assert state["anchor"].tolist() == [5.0] * 300 and state["buf"].tolist() == [-2.0] * 300
        assert state["steps"] == 3 and np.all(mine == 1.0)
    finally:
        stop.set()
        thread.join(10)


def test_a_joiner_whose_donor_sent_no_outer_state_starts_afresh_from_the_donors_parameters(nodes):
    """The donor has outer: none (its cluster config differs): the joiner's anchor is the donor's
    parameters, not its own from before the join."""
    cfg = make_config(2, join="auto", fetch_probability=0, timeout_ms=500)
    # join: never for the donor, which starts alone: join: auto would make it wait out the start barrier (10 s)
    # for w1, which starts only once w0 has trained; the joiner runs join: auto
    donor = nodes({**cfg, "join": "never"}, "w0", NumpyParams(filled(6, 300)))
    for _ in range(3):
        donor.update_send()
        donor.update_wait()
    joiner = nodes({**cfg, "outer": "noloco"}, "w1", NumpyParams(filled(0, 300)))
    assert joiner.joined is not None
    assert joiner.outer_state()["anchor"].tolist() == [6.0] * 300


def test_a_preset_sets_its_keys_and_a_key_in_the_file_wins():
    """The defaults (the rule measured best), the original's rule one key away, and the low-bandwidth preset;
    a key the file gives itself wins over its preset."""
    nodes = {"nodes": make_config(4)["nodes"]}
    cfg = parse_config(nodes)
    assert (cfg.mode, cfg.rule, cfg.pairing, cfg.period, cfg.outer, cfg.wire_dtype) == (
        "symmetric",
        "delta",
        "auto",
        1,
        "none",
        "auto",
    )
    cfg = parse_config({**nodes, "preset": "original"})
    assert (cfg.mode, cfg.rule, cfg.pairing) == ("pull", "state", "random")
    cfg = parse_config({**nodes, "preset": "low_bandwidth"})
    assert (cfg.period, cfg.outer, cfg.wire_dtype, cfg.mode) == (8, "none", "int8", "symmetric")
    cfg = parse_config({**nodes, "preset": "low_bandwidth", "period": 2, "wire_dtype": "bfloat16"})
    assert (cfg.period, cfg.wire_dtype) == (2, "bfloat16")


# --------------------------------------------------------------------------- int8 between nodes


@pytest.mark.parametrize("mode", ["pull", "symmetric"])
@pytest.mark.parametrize("size", [1000, 4_500_000])  # 4.5 MB encoded: by stream over TCP in mode pull (bulk)
def test_int8_exchanges_blend_the_decoded_values(nodes, make_cluster, mode, size):
    """w1's values are multiples of 1/128 with a max of 127/128 in every block of 1,024 (the scale is
    then 2^-7), so int8 carries them exactly: w0 at 0 blends to exactly half of them, over TCP (and its stream for
    the large model) and through shared memory."""
    cfg = make_cluster(2, wire_dtype="int8", mode=mode, rule="state")
    theirs = np.random.default_rng(size).integers(-127, 128, size).astype(np.float32) / np.float32(128)
    theirs[:: quantize.BLOCK] = 127 / 128
    nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs.copy()))
    mine = np.zeros(size, np.float32)
    node = nodes(cfg, "w0", NumpyParams(mine))
    assert step_until_averaged(node, 30, peer="w1") is not None
    assert np.array_equal(mine, theirs / 2)
    stats = node.stats()
    assert stats["bytes_in"] <= 1.1 * quantize.encoded_bytes(size) * max(1, stats["fetches_ok"]) + 4096
    streamed = make_cluster.transport == "tcp" and mode == "pull" and size > 4 << 20
    assert (stats.get("bulk_fetches", 0) > 0) == streamed, stats
