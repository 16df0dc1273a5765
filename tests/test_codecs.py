"""Wire codecs (dpwa.mixing.codecs): the registry, and the top-k codec (CHOCO-SGD's compressed gossip).

Top-k's promises, each tried: the requester's copy of a peer's model equals the peer's reference bit for bit
after every reply; what one reply leaves out arrives later (error feedback); a lost reply, a restarted peer
or a dropped copy costs one full send and never a wrong delta; a hostile reply is refused before anything
is written; memory stays within one copy per peer on each side.
"""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from conftest import ORIGINAL, make_config, step_until_averaged
from dpwa import ConfigError, NumpyParams, parse_config
from dpwa.gossip.transfer.protocol import MAX_VALUE
from dpwa.mixing import codecs
from dpwa.mixing.codecs import CodecError
from dpwa.mixing.codecs.topk import TopK
from dpwa.mixing.model import WireModel
from dpwa.wire.schema import PROTOCOL_VERSION
from helpers.raw_peer import FakePeer

SIZE = 1000
K = 50  # TopK's default 5% of 1000


def pair(size: int = SIZE, peers: int = 4):
    codec = TopK(size)
    return codec.sender(peers), codec.receiver(peers)


def send(sender, receiver, values, peer="w0"):
    """One fetch from `peer`'s point of view: its request, the reply, decoded; returns (estimate, encoded)."""
    encoded = sender.encode(values, peer, receiver.request("w1"))
    out = np.empty(values.size, np.float32)
    receiver.decode(encoded.buffer, "w1", encoded.fields, out, MAX_VALUE)
    return out, encoded


def reference(sender, peer="w0"):
    return sender._refs[peer].values


# --------------------------------------------------------------------------- the registry


def test_every_wire_dtype_is_a_codec_found_by_its_module():
    """The config's wire_dtype values are the codecs' names, found by module: the plain dtypes first."""
    assert codecs.names() == ("float32", "float16", "bfloat16", "int8", "topk")
    assert codecs.codec_class("topk") is TopK
    with pytest.raises(ValueError, match="unknown wire codec 'int4'; expected one of float32, float16"):
        codecs.codec_class("int4")


def test_a_wire_model_takes_its_sizes_from_its_codec():
    assert WireModel(b"f" * 16, "float32", 1000).nbytes == 4000
    assert WireModel(b"f" * 16, "bfloat16", 1000).nbytes == 2000
    assert WireModel(b"f" * 16, "int8", 2048).nbytes == 2 * 4 + 2048
    model = WireModel(b"f" * 16, "topk", 1000)
    assert (model.kept, model.encoded, model.nbytes) == ("float32", True, 4000)
    assert model.payload_nbytes({"cbase": 0}) == 4000 and model.payload_nbytes({"cbase": 7}) == 8 * K


def test_topk_is_refused_in_mode_symmetric_naming_the_key_and_the_mode():
    with pytest.raises(ConfigError, match="wire_dtype: topk runs in mode pull, not mode symmetric"):
        parse_config(make_config(2, wire_dtype="topk"))
    assert parse_config(make_config(2, wire_dtype="topk", mode="pull")).wire_dtype == "topk"


def test_wire_options_are_checked_by_the_codec_when_the_config_loads():
    cfg = parse_config(make_config(2, wire_dtype="topk", mode="pull", wire_options={"fraction": 0.01}))
    codec = WireModel(b"f" * 16, "topk", 1000, options=cfg.wire_options).codec
    assert isinstance(codec, TopK) and codec.k == 10
    with pytest.raises(
        ConfigError, match=r"wire_options: wire codec 'topk', option 'fraction': expected a number in \(0, 0.5\], got 2"
    ):
        parse_config(make_config(2, wire_dtype="topk", mode="pull", wire_options={"fraction": 2}))
    with pytest.raises(
        ConfigError, match=r"wire_options: wire codec 'int8' has no option 'fraction' \(its options: none\)"
    ):
        parse_config(make_config(2, wire_dtype="int8", wire_options={"fraction": 0.1}))
    with pytest.raises(ConfigError, match="wire_options must be a map of settings"):
        parse_config(make_config(2, wire_options=[1]))


# --------------------------------------------------------------------------- top-k, the math


def test_the_first_reply_is_the_values_in_full_then_deltas_of_k_entries():
    sender, receiver = pair()
    values = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
    est, encoded = send(sender, receiver, values)
    assert encoded.fields["cbase"] == 0 and encoded.buffer.nbytes == 4 * SIZE
    assert np.array_equal(est, values)
    moved = values.copy()
    moved[[3, 500, 999]] += np.float32(2.0)
    est, encoded = send(sender, receiver, moved)
    assert encoded.fields["cbase"] > 0 and encoded.buffer.nbytes == 8 * K
    assert np.array_equal(est, moved)  # three changes, 50 entries sent: all of it arrives


def test_what_a_reply_leaves_out_arrives_later_and_both_copies_stay_equal():
    """Error feedback: every entry changed, the values then held still: each reply sends the 50 largest of
    what is left, so after 20 replies the estimate is the values exactly; after every reply the requester's
    copy equals the server's reference bit for bit."""
    sender, receiver = pair()
    rng = np.random.default_rng(1)
    values = rng.standard_normal(SIZE).astype(np.float32)
    send(sender, receiver, values)
    values = values + rng.standard_normal(SIZE).astype(np.float32)
    errors = []
    for _ in range(SIZE // K):
        est, _ = send(sender, receiver, values)
        assert np.array_equal(est, reference(sender))
        errors.append(float(np.abs(values - est).max()))
    assert errors == sorted(errors, reverse=True)  # the largest left out is sent first
    assert np.array_equal(est, values)


def test_lost_replies_are_undone_and_an_older_version_costs_one_full_send():
    """A reply that never arrives is undone when the requester asks again holding the version before it,
    however many are lost in a row; a request holding any other version gets the values in full."""
    sender, receiver = pair()
    rng = np.random.default_rng(2)
    values = rng.standard_normal(SIZE).astype(np.float32)
    send(sender, receiver, values)
    stale = receiver.request("w1")
    values = values + rng.standard_normal(SIZE).astype(np.float32)
    est, _ = send(sender, receiver, values)
    for _ in range(3):
        sender.encode(values, "w0", receiver.request("w1"))  # this reply never arrives
    est, encoded = send(sender, receiver, values)
    assert encoded.fields["cbase"] > 0  # a delta on the version the requester holds
    assert np.array_equal(est, reference(sender))
    encoded = sender.encode(values, "w0", stale)  # two versions back: nothing to build on
    assert encoded.fields["cbase"] == 0 and np.array_equal(encoded.buffer.view(np.float32), values)


def test_a_restarted_server_or_a_dropped_copy_costs_one_full_send():
    sender, receiver = pair()
    values = np.arange(SIZE, dtype=np.float32)
    send(sender, receiver, values)
    restarted, _ = pair()
    _, encoded = send(restarted, receiver, values + 1)  # a new stream id: our copy is not its reference
    assert encoded.fields["cbase"] == 0
    receiver._held.clear()
    _, encoded = send(restarted, receiver, values)
    assert encoded.fields["cbase"] == 0


def test_memory_stays_within_one_copy_per_peer_on_each_side():
    """A server with 2 peers keeps 2 references; a third requester drops the least recently used."""
    codec = TopK(SIZE)
    sender = codec.sender(2)
    values = np.ones(SIZE, np.float32)
    for peer in ("w1", "w2", "w3", "w2"):
        sender.encode(values, peer, {})
    assert list(sender._refs) == ["w3", "w2"]
    receiver = codec.receiver(2)
    for peer in ("w1", "w2", "w3"):
        encoded = codec.sender(1).encode(values, "w0", {})
        receiver.decode(encoded.buffer, peer, encoded.fields, np.empty(SIZE, np.float32), MAX_VALUE)
    assert list(receiver._held) == ["w2", "w3"]


# --------------------------------------------------------------------------- top-k, hostile replies


def hostile_replies(held_stream: bytes, held_version: int):
    """(what, reason, fields, payload): replies an honest server never sends to a requester that holds
    `held_version` of `held_stream`."""
    good_idx = np.arange(0, 20 * K, 20, dtype=np.int32)
    good = np.ones(K, np.float32)

    def delta(idx=good_idx, vals=good):
        return np.concatenate(
            [np.ascontiguousarray(idx, np.int32).view(np.uint8), np.ascontiguousarray(vals, np.float32).view(np.uint8)]
        )

    fields = {"cstream": held_stream, "cver": held_version + 1, "cbase": held_version}
    return [
        ("an index past the end", "bad_delta", fields, delta(np.r_[good_idx[:-1], SIZE])),
        ("a negative index", "bad_delta", fields, delta(np.r_[-1, good_idx[1:]])),
        ("an index twice", "bad_delta", fields, delta(np.r_[good_idx[:-1], good_idx[-2]])),
        ("indices not sorted", "bad_delta", fields, delta(good_idx[::-1])),
        ("a NaN", "bad_value", fields, delta(vals=np.r_[good[:-1], np.nan])),
        ("a value past MAX_VALUE", "bad_value", fields, delta(vals=np.r_[good[:-1], 3e38])),
        ("a delta on another version", "bad_delta", {**fields, "cbase": held_version + 5}, delta()),
        ("a delta on another stream", "bad_delta", {**fields, "cstream": b"\x00" * 8}, delta()),
        ("a delta cut short", "bad_size", fields, delta()[:-4]),
        ("no codec fields", "bad_delta", {}, delta()),
        (
            "a full snapshot with a NaN",
            "bad_value",
            {**fields, "cbase": 0},
            np.full(SIZE, np.nan, np.float32).view(np.uint8),
        ),
    ]


@pytest.mark.parametrize("case", range(11))
def test_a_hostile_reply_is_refused_before_anything_is_written(case):
    """Each reply is refused for the reason expected; the output buffer is untouched, and the copy is
    dropped, so the next fetch asks for the values in full."""
    sender, receiver = pair()
    send(sender, receiver, np.zeros(SIZE, np.float32))
    held = receiver.request("w1")
    what, reason, fields, payload = hostile_replies(held["cstream"], held["cver"])[case]
    out = np.full(SIZE, 7.0, np.float32)
    with pytest.raises(CodecError) as raised:
        receiver.decode(payload, "w1", fields, out, MAX_VALUE)
    assert raised.value.reason == reason, (what, str(raised.value))
    assert np.all(out == 7.0), what
    assert receiver.request("w1") == {}, what


# --------------------------------------------------------------------------- top-k between nodes


def test_topk_between_nodes_sends_the_values_once_then_k_entries(nodes):
    """w0 pulls from w1 (rule state, f = 1/2) over TCP: the first reply is w1's values in full (w0 at 0
    blends to exactly half of them); w1 then changes 5 entries, w0 is reset to 0, and its next blend is
    exactly half the new values, every fetch since then having carried 8k bytes."""
    size = 10_000
    k = 500
    cfg = make_config(2, **ORIGINAL, wire_dtype="topk", same_host="off", insecure=True)
    rng = np.random.default_rng(3)
    theirs = rng.standard_normal(size).astype(np.float32)
    server = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(theirs))
    mine = np.zeros(size, np.float32)
    node = nodes(cfg, "w0", NumpyParams(mine))
    assert step_until_averaged(node, 30, peer="w1") is not None
    assert np.array_equal(mine, theirs / 2)
    before = node.stats()
    theirs[[1, 10, 100, 1000, 9999]] += np.float32(1.5)
    server.update_send()
    server.update_wait()  # publishes the changed values
    mine[:] = 0
    update = step_until_averaged(node, 30, peer="w1")
    assert update is not None and np.array_equal(mine, theirs / 2)
    after = node.stats()
    fetched = after["fetches_ok"] - before["fetches_ok"]
    assert fetched >= 1 and after["bytes_in"] - before["bytes_in"] == 8 * k * fetched


@pytest.mark.timeout(120)
def test_hostile_topk_replies_are_never_applied(nodes):
    """A fake w1 answers w0's fetches with a full snapshot, then with hostile deltas (each of the kinds
    above, in a random order): none is applied, each is refused for its reason, and after each the
    next fetch holds nothing from w1, so an honest full snapshot is applied exactly at the end."""
    cfg = make_config(2, **ORIGINAL, wire_dtype="topk", same_host="off", insecure=True, timeout_ms=2000)
    original = np.random.default_rng(4).standard_normal(SIZE).astype(np.float32)
    mine = original.copy()
    node = nodes(cfg, "w0", NumpyParams(mine))
    stream = b"s" * 8
    theirs = np.full(SIZE, 0.5, np.float32)
    requests: list[dict] = []

    def reply(request, fields, payload):
        requests.append(dict(request.header))
        header = {
            "v": PROTOCOL_VERSION,
            "kind": "params",
            "id": request.id,
            "from": "w1",
            "fp": node.params.fingerprint,
            "dtype": "topk",
            "nbytes": len(payload),
            "clock": 1.0,
            "loss": None,
            "version": len(requests),
            "rule": node.model.rule,
            **fields,
        }
        return [msgpack.packb(header, use_bin_type=True), bytes(payload)]

    cases = hostile_replies(stream, 1)[:-3]  # the size and field cases are refused before the codec
    plan = [c for c in cases for _ in range(3)]
    random.Random(5).shuffle(plan)
    queue = []
    for case in plan:
        queue.append(({"cstream": stream, "cver": 1, "cbase": 0}, theirs.view(np.uint8)))  # held again
        queue.append((case[2], case[3]))
    ctx = zmq.Context()
    fake = FakePeer(ctx, node.config.endpoint(node.config.node("w1")), lambda r: reply(r, *queue.pop(0)))
    reasons: Counter[str] = Counter()
    try:
        for what, reason, _, _ in plan:
            node.update_send()
            assert node.update_wait().averaged  # the full snapshot
            mine[:] = original  # forget the blend: the hostile reply must leave these exact values
            node.update_send()
            update = node.update_wait()
            assert not update.averaged and update.reason.split(":")[0] == reason, (what, update)
            assert mine.tobytes() == original.tobytes(), what
            reasons[reason] += 1
        assert not fake.errors, fake.errors[0]
        assert all("cstream" not in r for r in requests[::2]), "a refused delta must drop the copy"
    finally:
        fake.close()
        ctx.destroy(linger=0)
    assert set(reasons) == {"bad_delta", "bad_value"} and node.alive
