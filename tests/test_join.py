"""Joining: a node that starts late (or restarts) takes the cluster's state from a peer, checked by
hash; at a fresh start every node takes the first node's initial parameters."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time

import numpy as np
import pytest

from conftest import ORIGINAL, filled, free_port, make_config, tcp_endpoint, wait_until
from dpwa import NumpyParams
from dpwa.gossip.transfer.join import Joined
from helpers.chaos import ChaosProxy
from helpers.hostile_donor import HostileDonor, Offer, state_bytes


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(array.astype(np.float32).tobytes()).hexdigest()


class Training:
    """A node stepping on its own thread (+1 every step) until told to stop (or `max_steps`)."""

    def __init__(self, node, step=1.0, max_steps=10_000):
        self.node, self.steps, self.stop, self.max_steps = node, 0, threading.Event(), max_steps
        self.thread = threading.Thread(target=self._run, args=(step,))
        self.thread.start()

    def _run(self, step):
        while not self.stop.is_set() and self.steps < self.max_steps:
            self.node.update_send(batch_size=2)
            self.node.params.array += np.float32(step)
            self.node.update_wait()
            self.steps += 1

    def join(self):
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_a_late_node_takes_a_trained_peers_state_before_it_starts(nodes):
    """w0 and w1 train; w2 starts late with join: auto. Before its constructor returns it holds the
    state of a donor (same hash as the donor's offer), the donor's clock and barrier counters."""
    cfg = make_config(3, join="auto", fetch_probability=0, timeout_ms=500)
    # w0 and w1 stand for a cluster that trains already: join: never, as with join: auto each would wait out
    # the start barrier (10 s) for the peers not started yet (w2 above all, late by design); w2 runs join: auto
    trained = {**cfg, "join": "never"}
    w0 = nodes(trained, "w0", NumpyParams(filled(1, 10_000)))
    w1 = nodes(trained, "w1", NumpyParams(filled(1, 10_000)))
    w0.restore(barriers={"start": 1, "epoch": 3})
    w1.restore(barriers={"start": 1, "epoch": 3})
    trainers = [Training(w0), Training(w1)]
    try:
        assert wait_until(lambda: w0.clock > 10 and w1.clock > 10, 20)
        late = filled(-7, 10_000)
        w2 = nodes(cfg, "w2", NumpyParams(late))
        joined = w2.joined
        assert joined is not None and joined.donor in ("w0", "w1")
        assert sha(late) == hashlib.sha256(joined.params.tobytes()).hexdigest()
        assert np.all(late == late[0]) and late[0] > 1  # a donor's value: 1 + its steps so far
        assert (
            hashlib.blake2b(joined.params.tobytes() + joined.extra.tobytes(), digest_size=32).digest() == joined.digest
        )
        assert w2.clock == joined.clock > 10
        assert w2.barrier_counters() == {"start": 1, "epoch": 3}
        assert w2.stats()["joined"] == 1
        assert joined.rejoined is True  # the cluster had trained: not a fresh start
        assert repr(joined).startswith(f"Joined(donor={joined.donor!r}, clock=") and "rejoined=True" in repr(joined)
        assert len(repr(joined)) < 200 and "10000 float32" in repr(joined)
    finally:
        for t in trainers:
            t.join()


def test_a_joiner_takes_a_donors_restored_state_not_the_one_it_started_with(nodes):
    """w0 starts at 1 (clock 0), then restores a checkpoint as train.py does: its parameters loaded in place
    (7), then restore(clock=500). A node joining now takes 7 at clock 500. (Before, w0 still served the
    snapshot it published when it started: the joiner took 1 at clock 0, a fresh start, while its donor
    was at epoch 3; found by a torchrun restart under test.)"""
    cfg = make_config(2, join="auto", fetch_probability=0, timeout_ms=500)
    mine = filled(1, 1000)
    w0 = nodes({**cfg, "join": "never"}, "w0", NumpyParams(mine))
    mine[:] = 7
    w0.restore(clock=500.0, barriers={"epoch": 3})
    late = filled(-1, 1000)
    w1 = nodes(cfg, "w1", NumpyParams(late))
    assert w1.joined is not None and w1.joined.donor == "w0" and w1.joined.rejoined
    assert np.all(late == 7) and w1.clock == 500.0 and w1.barrier_counters() == {"epoch": 3}


def test_at_a_fresh_start_every_node_takes_the_first_nodes_initial_parameters(nodes):
    """Three nodes start together from different random values (as if seeded differently); with
    join: auto, w1 and w2 start from w0's values, like DDP's broadcast from rank 0. Clocks stay 0."""
    cfg = make_config(3, join="auto", timeout_ms=500)
    values = [np.random.default_rng(k).standard_normal(1000).astype(np.float32) for k in range(3)]
    made, errors = {}, []

    def start(k):
        try:
            made[k] = nodes(cfg, f"w{k}", NumpyParams(values[k]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    first = np.copy(values[0])
    threads = [threading.Thread(target=start, args=(k,)) for k in (2, 1, 0)]  # w0 starts last
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(np.array_equal(v, first) for v in values)
    assert made[0].joined is None and made[1].joined.donor == "w0" and made[2].joined.donor == "w0"
    assert all(made[k].clock == 0 and made[k].barrier_counters() == {} for k in range(3))
    for k in (1, 2):  # took the first node's initial state: a fresh start, not a rejoin
        assert made[k].joined.rejoined is False and made[k].joined.clock == 0
        assert "rejoined=False" in repr(made[k].joined)


def test_join_later_takes_a_trained_peers_state_and_says_it_rejoined(nodes):
    """A node started with join: never, told to join() once its peer trained (as train.py does after a
    torchrun restart): it takes the peer's state and clock, and `joined` says it is a rejoin."""
    cfg = make_config(2, join="never", fetch_probability=0, timeout_ms=500)
    w0 = nodes(cfg, "w0", NumpyParams(filled(1, 1000)))
    mine = filled(-3, 1000)
    w1 = nodes(cfg, "w1", NumpyParams(mine))
    assert w1.joined is None
    trainer = Training(w0)
    try:
        assert wait_until(lambda: w0.clock > 10, 20)
        assert w1.join(wait_s=20)
    finally:
        trainer.join()
    assert w1.joined is not None and w1.joined.donor == "w0" and w1.joined.rejoined is True
    assert w1.clock == w1.joined.clock > 10 and mine[0] > 1


def test_the_repr_of_what_was_taken_is_one_short_line_without_arrays():
    """A large model and an optimizer state: the repr names the donor, clock, kind, sizes and parts only."""
    params = np.zeros(5_000_000, np.float32)
    extra = np.zeros(40_000_000, np.uint8)
    fresh = Joined("w0", 0.0, {}, {}, params, b"", np.zeros(0, np.uint8), bytes(range(32)))
    rejoin = Joined(
        "w3",
        12345.5,
        {"start": 1, "epoch": 7},
        {"start": 1, "epoch": 6},
        params,
        b"meta",
        extra,
        bytes(32),
        extra_state={"optimizer": {"state": {0: {"momentum_buffer": params}}}, "outer": {"anchor": params}},
        reports=tuple({"epoch": 7} for _ in range(500)),
        rejoined=True,
    )
    assert repr(fresh) == (
        "Joined(donor='w0', clock=0, rejoined=False, params=5000000 float32, extra=none, digest=000102030405)"
    )
    assert repr(rejoin) == (
        "Joined(donor='w3', clock=12345.5, rejoined=True, params=5000000 float32, "
        "extra=40000000 bytes [optimizer, outer], digest=000000000000)"
    )
    assert all(len(repr(j)) < 200 and "\n" not in repr(j) for j in (fresh, rejoin))


def test_without_the_first_node_a_node_starts_from_its_own_and_says_so(nodes, caplog, monkeypatch):
    monkeypatch.setattr("dpwa.gossip.start.JOIN_WAIT_MIN_S", 1.0)
    cfg = make_config(2, join="auto", timeout_ms=200)
    mine = filled(5)
    caplog.set_level(logging.WARNING, logger="dpwa")
    t0 = time.monotonic()
    node = nodes(cfg, "w1", NumpyParams(mine))
    assert time.monotonic() - t0 < 10
    assert node.joined is None and np.all(mine == 5)
    assert any("w0 did not answer" in r.getMessage() for r in caplog.records)


def test_join_never_keeps_the_given_state(nodes):
    cfg = make_config(2, fetch_probability=0)
    w0 = nodes(cfg, "w0", NumpyParams(filled(3)))
    w0.update_send()
    w0.update_wait()
    mine = filled(9)
    node = nodes({**cfg, "join": "never"}, "w1", NumpyParams(mine))
    assert node.joined is None and np.all(mine == 9)


@pytest.mark.timeout(180)
def test_a_donor_killed_during_the_transfer_is_replaced_by_another(children, nodes):
    """Two donors in child processes hold a 64 MB model (16 chunks of 4 MB), each behind a proxy.
    Whichever donor the joiner asks first is killed with SIGKILL as soon as its first chunk has
    gone through; the joiner takes the other donor's state whole (one value everywhere)."""
    size = 16_000_000
    cfg = make_config(3, join="auto", timeout_ms=1000, insecure=True, same_host="off")
    donors = {f"w{k}": children({**cfg, "join": "never"}, f"w{k}", fill=k + 1, size=size, fetch=False) for k in (0, 1)}
    for donor in donors.values():
        donor.expect("ready")
        donor.send(cmd="churn")  # training: a clock above 0, and a step that makes an offer when asked
    proxies: dict[str, ChaosProxy] = {}
    killed: list[str] = []
    try:
        entries = []
        for spec in cfg["nodes"]:
            if spec["name"] in donors:
                proxy = proxies[spec["name"]] = ChaosProxy(spec["port"])

                def kill(name=spec["name"]):
                    if not killed:
                        killed.append(name)
                        donors[name].proc.kill()

                proxy.on("join_data", kill)
                spec = dict(spec, port=proxy.port)
            entries.append(spec)
        mine = np.zeros(size, np.float32)
        node = nodes({**cfg, "nodes": entries}, "w2", NumpyParams(mine))
        assert len(killed) == 1 and node.joined is not None
        assert node.joined.donor != killed[0]
        assert mine[0] > 0 and np.all(mine == mine[0])
        assert node.clock > 0
    finally:
        for proxy in proxies.values():
            proxy.close()


# --------------------------------------------------------------------------- a joiner takes nothing on faith


class Trainer(Training):
    """Training, for a torch model with an optimizer: one SGD step per update."""

    def __init__(self, conn, net, opt):
        import torch

        self.net, self.opt, self.x = net, opt, torch.randn(4, 6)
        super().__init__(conn)

    def _run(self, step):
        while not self.stop.is_set() and self.steps < 10_000:
            self.node.update_send(None, batch_size=1)
            self.opt.zero_grad()
            self.net(self.x).square().mean().backward()
            self.opt.step()
            self.node.update_wait(None)
            self.steps += 1


def corrupt(meta: bytes, data, how: str):
    """An SGD state's (meta, bytes), with parameter 0's momentum buffer made bad in the way `how` says."""
    import msgpack

    decoded = msgpack.unpackb(meta, raw=False, strict_map_key=False)
    entry = decoded["state"]["0"]["momentum_buffer"]
    data = data.copy()
    _, offset, shape, _ = entry
    count = int(np.prod(shape))
    values = data[offset : offset + 4 * count].view(np.float32)
    if how == "nan":
        values[:] = np.nan
    elif how == "huge":
        values[:] = 3e38
    elif how == "scalar":
        decoded["state"]["0"]["momentum_buffer"] = ["tensor", offset, [], "float32"]
    elif how == "int":
        decoded["state"]["0"]["momentum_buffer"] = ["value", 5]
    return msgpack.packb(decoded, use_bin_type=True), data


@pytest.mark.parametrize(
    "how, field",
    [
        ("nan", "NaN, Inf or beyond"),
        ("huge", "NaN, Inf or beyond"),
        ("scalar", r"shape \[\]"),
        ("int", "a value, ours is a tensor"),
    ],
)
def test_a_donors_bad_optimizer_state_is_refused_and_the_next_donor_taken(nodes, zctx, caplog, how, field):
    """w0 is a hostile donor with the freshest clock: its offer carries SGD momentum buffers that are NaN,
    3e38, of shape [] or a plain int. The joiner w2 (with an SGD optimizer) checks every field against
    its own optimizer before using any: it refuses w0's state with a log line naming w0 and the field,
    takes honest w1's, and one optimizer step later every parameter is finite. (Before: NaN buffers
    made every parameter NaN after one step; 3e38 gave max|p| = 2.7e37; shape [] and int crashed.)"""
    import msgpack
    import torch

    from dpwa.adapters.pytorch import DpwaPyTorchAdapter, OptimizerState

    cfg = make_config(3, join="auto", fetch_probability=0, timeout_ms=500, insecure=True, same_host="off")
    torch.manual_seed(0)
    honest_net = torch.nn.Linear(6, 3)
    honest_opt = torch.optim.SGD(honest_net.parameters(), lr=0.01, momentum=0.9)
    honest = DpwaPyTorchAdapter(honest_net, "w1", {**cfg, "join": "never"}, optimizer=honest_opt)
    trainer = Trainer(honest, honest_net, honest_opt)
    donor = None
    try:
        assert wait_until(lambda: honest.clock > 3, 20)
        meta, data = OptimizerState(honest_opt).capture()  # a real state, then spoiled
        meta, data = corrupt(meta, data, how)
        meta = msgpack.packb([["optimizer", meta, data.nbytes]], use_bin_type=True)  # as Extras sends it
        params = np.concatenate([p.detach().numpy().ravel() for p in honest_net.parameters()])
        offer = Offer(
            fp=honest.params.fingerprint, params_bytes=params.nbytes, data=state_bytes(params, data), extra_meta=meta
        )
        donor = HostileDonor(zctx, tcp_endpoint(cfg, "w0"), offer)
        caplog.set_level(logging.WARNING, logger="dpwa")
        net = torch.nn.Linear(6, 3)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        with DpwaPyTorchAdapter(net, "w2", cfg, optimizer=opt) as joiner:
            assert joiner.joined is not None and joiner.joined.donor == "w1"
            assert "join_chunk" in donor.asked  # w0 was asked first, and refused once its state was in
            refusals = [r.getMessage() for r in caplog.records if "joining from w0 failed" in r.getMessage()]
            assert refusals and re.search(field, refusals[0]) and "momentum_buffer" in refusals[0], refusals
            net(torch.randn(4, 6)).square().mean().backward()
            opt.step()
            assert all(torch.isfinite(p).all() and p.abs().max() < 1e3 for p in net.parameters())
            assert all(torch.isfinite(s["momentum_buffer"]).all() for s in opt.state.values())
    finally:
        trainer.join()
        honest.close()
        if donor is not None:
            donor.close()


def test_an_offer_larger_than_the_joiners_own_state_is_refused_before_anything_is_allocated(nodes, zctx):
    """A hostile donor announces 1 GB to a joiner with a 4 KB model and no optimizer. The joiner
    checks the size against its own before allocating: it asks for no chunk at all, its peak memory
    does not grow by the offer, and it takes honest w1's state instead. (Before: peak memory went
    from 43 MB to 1.03 GB within 4 s.)"""
    import resource

    cfg = make_config(3, join="auto", fetch_probability=0, timeout_ms=500, insecure=True, same_host="off")
    honest = nodes({**cfg, "join": "never"}, "w1", NumpyParams(filled(2, 1000)))
    trainer = Training(honest)
    donor = None
    try:
        assert wait_until(lambda: honest.clock > 3, 20)
        params = filled(9, 1000)
        offer = Offer(
            fp=honest.params.fingerprint,
            params_bytes=params.nbytes,
            data=state_bytes(params),
            extra_meta=b"\x80",
            nbytes=10**9,
        )
        donor = HostileDonor(zctx, tcp_endpoint(cfg, "w0"), offer)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
        mine = filled(0, 1000)
        joiner = nodes(cfg, "w2", NumpyParams(mine))
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert donor.asked.count("join_info") >= 1 and donor.chunk_offsets == []
        assert grown_kib < 64 * 1024, grown_kib  # far below the 1 GB announced
        assert joiner.joined is not None and joiner.joined.donor == "w1" and mine[0] > 2
    finally:
        trainer.join()
        if donor is not None:
            donor.close()


@pytest.mark.parametrize(
    "claimed, donor_taken, adopted",
    [
        (2**40, "w1", 3),  # outside the wire schema: the offer is refused whole, honest w1 is the donor
        (2**31 - 1, "w0", 4),  # within the schema, far beyond the cluster: cut to what w1 reports plus the slack
    ],
)
def test_a_donors_barrier_counts_are_adopted_only_near_what_the_cluster_reports(
    nodes, zctx, caplog, claimed, donor_taken, adopted
):
    """w0 offers its state with barrier counts {epoch: claimed}; w1 is at epoch 3. The joiner w2 adopts
    at most the median of what its peers report plus one, never a count outside the schema, and
    still answers barrier queries: w1's next epoch barrier counts it as arrived. (Before: a count of
    2**40 was adopted; the joiner's next barrier call was outside the schema and it could no longer
    answer, so both it and w1 waited out the whole timeout at every epoch.)"""
    cfg = make_config(3, join="auto", fetch_probability=0, timeout_ms=500, insecure=True, same_host="off")
    honest = nodes({**cfg, "join": "never"}, "w1", NumpyParams(filled(2, 1000)))
    honest.restore(barriers={"epoch": 3})
    trainer = Training(honest)
    donor = None
    try:
        assert wait_until(lambda: honest.clock > 3, 20)
        params = filled(9, 1000)
        offer = Offer(
            fp=honest.params.fingerprint,
            params_bytes=params.nbytes,
            data=state_bytes(params),
            barriers={"epoch": claimed},
            yours={"epoch": claimed},
        )
        donor = HostileDonor(zctx, tcp_endpoint(cfg, "w0"), offer)
        caplog.set_level(logging.WARNING, logger="dpwa")
        joiner = nodes(cfg, "w2", NumpyParams(filled(0, 1000)))
        assert joiner.joined is not None and joiner.joined.donor == donor_taken
        assert joiner.barrier_counters() == {"epoch": adopted}
    finally:
        trainer.join()
    try:
        # w1 arrives at its 4th epoch barrier: the joiner (at 3 or 4) answers it; the fake w0 never does (both
        # barriers wait out their timeout for it: 1.5 s is three of the cluster's 0.5 s timeouts, time enough
        # to hear the joiner in this one process)
        waiting = threading.Thread(target=lambda: joiner.barrier("epoch", timeout_s=1.5, missing="proceed"))
        waiting.start()
        assert honest.barrier("epoch", timeout_s=1.5, missing="proceed") == ["w0"]
        waiting.join(10)
    finally:
        donor.close()


def test_a_busy_donor_is_asked_again_within_the_joins_deadline(nodes, zctx):
    """The donor answers the first two chunk requests busy (its unsent-reply budget is spent): the
    joiner asks again with back-off and takes its state. (Before: one busy made it give up and start
    from its own parameters at clock 0.)"""
    cfg = make_config(2, join="auto", fetch_probability=0, timeout_ms=500, insecure=True, same_host="off")
    params = np.arange(1000, dtype=np.float32)
    from dpwa.mixing.params import NumpyParams as _NP

    fp = _NP(filled(0, 1000)).fingerprint
    donor = HostileDonor(
        zctx, tcp_endpoint(cfg, "w0"), Offer(fp=fp, params_bytes=params.nbytes, data=state_bytes(params), busy_chunks=2)
    )
    try:
        mine = filled(0, 1000)
        joiner = nodes(cfg, "w1", NumpyParams(mine))
        assert joiner.joined is not None and joiner.joined.donor == "w0"
        assert donor.chunk_offsets == [0, 0, 0] and np.array_equal(mine, params)
        assert joiner.clock == 1e6
    finally:
        donor.close()


def test_a_join_info_flood_costs_the_donor_one_offer_a_second_at_most(nodes, zctx, caplog):
    """An attacker (any node name of an insecure cluster) asks a training donor for join offers as fast
    as it can for 2 s. Each new offer hashes the whole state on the donor's Rx thread, so the donor
    makes at most one a second, whoever asks, and logs only those. (Before: one offer, two full
    hashes and a log line per published snapshot: per step.)"""
    import time as _time

    import zmq

    from dpwa.gossip.transfer.join import JOIN_INFO, JOIN_OFFER, OFFER_INTERVAL_S
    from dpwa.wire.schema import decode, encode

    cfg = make_config(3, fetch_probability=0, timeout_ms=500, insecure=True, same_host="off")
    donor = nodes(cfg, "w0", NumpyParams(filled(1, 250_000)))
    trainer = Training(donor)
    caplog.set_level(logging.INFO, logger="dpwa")
    sock = zctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tcp_endpoint(cfg, "w0"))
    try:
        asked, ready = 0, 0
        start = _time.monotonic()
        while _time.monotonic() - start < 2.0 and asked < 5000:
            sock.send(encode(JOIN_INFO, asked + 1, **{"from": "w2"}, extra=False))
            assert sock.poll(5000)
            reply = decode(sock.recv(), {JOIN_OFFER.name: JOIN_OFFER})
            asked += 1
            ready += bool(reply.get("ready"))
        elapsed = _time.monotonic() - start
    finally:
        sock.close()
        trainer.join()
    offers = [r for r in caplog.records if "offers w2 its state" in r.getMessage()]
    assert asked > 50 and trainer.steps > 50 and ready > 0
    assert 1 <= len(offers) <= elapsed / OFFER_INTERVAL_S + 1, (len(offers), asked, trainer.steps)


def test_at_a_fresh_start_no_node_trains_before_every_node_holds_the_first_nodes_state(nodes):
    """A node list with join: auto, started one by one: w0 first. Like DDP's constructor, w0's does not
    return while its peers have not taken its state (it says so in its status: at_barrier); once w1
    and w2 start and take it, every constructor returns, all holding w0's initial parameters, and
    w0 averages with them from its first steps. (Before: w0 returned at once and trained alone, every
    fetch refused not_ready, while the others were still joining.)"""
    from dpwa import parse_config
    from dpwa.cluster.status import StatusClient

    cfg = make_config(3, **ORIGINAL, join="auto", timeout_ms=500)
    values = [np.full(1000, float(k + 1), np.float32) for k in range(3)]
    made, errors, returned = {}, [], {k: threading.Event() for k in range(3)}

    def start(k):
        try:
            made[k] = nodes(cfg, f"w{k}", NumpyParams(values[k]))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            returned[k].set()

    first = threading.Thread(target=start, args=(0,))
    first.start()
    with StatusClient(parse_config(cfg)) as client:
        assert wait_until(lambda: client.ask(1.0)[0]["state"] == "at_barrier", 20)
    assert not returned[0].is_set()  # serving its state, waiting for the others to take it
    others = [threading.Thread(target=start, args=(k,)) for k in (1, 2)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(60)
    assert not errors, errors
    assert all(np.all(v == 1.0) for v in values)
    assert made[1].joined.donor == "w0" and made[2].joined.donor == "w0"
    updates = []
    for _ in range(5):
        made[0].update_send()
        updates.append(made[0].update_wait())
    assert all(update.averaged for update in updates), updates


def test_a_peer_that_asked_from_its_start_barrier_counts_as_started_though_it_cannot_be_asked(nodes, caplog):
    """w1 takes w0's state and asks w0's status from its own start barrier (at_start): that tells w0 that w1
    has joined. w0's config lists w1 at an address where nothing listens, so w0 can never ask w1 itself, as
    when a short script's node has trained and gone before w0's next poll (`dpwa run` with 40 steps: w0
    waited out its 10 s and the two never averaged). w0's constructor returns without waiting that out."""
    from dpwa import parse_config
    from dpwa.cluster.status import StatusClient

    caplog.set_level(logging.WARNING, logger="dpwa")
    cfg1 = make_config(2, **ORIGINAL, join="auto", timeout_ms=500)
    cfg0 = {**cfg1, "nodes": [cfg1["nodes"][0], {**cfg1["nodes"][1], "port": free_port()}]}
    made, errors = {}, []

    def start_w0():
        try:
            made[0] = nodes(cfg0, "w0", NumpyParams(np.full(100, 1.0, np.float32)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    first = threading.Thread(target=start_w0)
    first.start()
    with StatusClient(parse_config(cfg0)) as client:
        assert wait_until(lambda: client.ask(1.0)[0]["state"] == "at_barrier", 20)
    w1 = nodes(cfg1, "w1", NumpyParams(np.full(100, 2.0, np.float32)))
    assert w1.joined is not None and w1.joined.donor == "w0"
    first.join(60)
    assert not first.is_alive() and not errors, errors
    assert not [r for r in caplog.records if "did not start within" in r.getMessage()]


def test_only_a_peer_of_the_config_is_heard_at_the_start_barrier():
    from dpwa.gossip.start import AtStart

    at_start = AtStart(["w1", "w2"])
    for sender in ("mallory", "?", "w1", "w1"):
        at_start.heard(sender)
    assert at_start.names() == {"w1"}


def test_offers_read_to_their_end_let_the_donors_slots_go(nodes, monkeypatch):
    """An offer holds one of the donor's two snapshot slots. A joiner that took it whole says join_done, and the
    offer goes at once (before, it was held OFFER_DONE_S more: the donor's publishes were skipped, and under
    torchrun its exchanges missed 4 or 5 of a short run's first steps). A joiner that never says so (an older
    dpwa, or its join_done lost) still lets it go OFFER_DONE_S after its last chunk, not OFFER_TTL_S: before,
    the donor could publish nothing for 30 s (the relay walkthrough's restarts froze the public node so)."""
    import time as _time

    from dpwa.gossip.transfer import join
    from dpwa.gossip.transfer.join import JoinTask

    # 2 s by default; the test's margin, still far from OFFER_TTL_S (30 s), which it would take otherwise
    monkeypatch.setattr(join, "OFFER_DONE_S", 6.0)
    OFFER_DONE_S = join.OFFER_DONE_S
    cfg = make_config(3, join="never", fetch_probability=0, timeout_ms=500)
    w0 = nodes(cfg, "w0", NumpyParams(filled(1, 1000)))
    joiners = [nodes(cfg, f"w{i}", NumpyParams(filled(-i, 1000))) for i in (1, 2)]
    trainer = Training(w0, max_steps=10**7)  # bounded by the test's own deadlines: it steps until the end
    try:
        assert wait_until(lambda: w0.clock > 10, 20)
        offers = w0.services.joins._offers
        assert joiners[0].join(wait_s=20)
        assert not offers and w0.stats()["served.join_done"] == 1  # said join_done: gone at once
        # w1 holds w0's state now, at a clock within 10% of w0's while w0 steps slowly (under CI's load): w2
        # could join from w1 instead, and w0 would make no offer (CI, twice). Closed, w1 is no donor.
        joiners[0].close()
        monkeypatch.setattr(JoinTask, "_done", lambda self, ask, session: None)  # a joiner that never says it
        assert joiners[1].join(wait_s=20)
        assert len(offers) == 1, offers
        done = _time.monotonic()
        assert wait_until(lambda: not offers, OFFER_DONE_S + 3.0, 0.05), offers
        assert _time.monotonic() - done < OFFER_DONE_S + 3.0
        skipped = w0.stats()["publish_skipped"]
        steps = trainer.steps
        assert wait_until(lambda: trainer.steps > steps + 20, 20)
        assert w0.stats()["publish_skipped"] == skipped  # every publish found a slot
    finally:
        trainer.join()


def test_a_capture_left_from_a_joiner_served_meanwhile_is_not_handed_to_a_later_joiner(monkeypatch):
    """A joiner that asks for the optimizer state makes the donor capture it at its next step. If the joiner's
    patience ran out first (it took the parameters alone), the capture stayed, and a joiner that came later got
    it: a state from before the donor's training since (CI, 2026-12-06: a node restarted mid-run took clock 0
    and the initial weights). Now a capture serves only a joiner that asked before it was made."""
    from types import SimpleNamespace

    from dpwa.gossip.membership.barrier import BarrierCounts
    from dpwa.gossip.transfer import join
    from dpwa.gossip.transfer.snapshots import SnapshotStore
    from dpwa.mixing.model import WireModel
    from dpwa.wire.schema import decode, encode
    from dpwa.wire.server import Request

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(join, "time", SimpleNamespace(monotonic=lambda: clock.now))

    class Optimizer:
        def capture(self):
            return b"state", np.zeros(8, np.uint8)

        def budget(self):
            return 8

        def check(self, meta, data):
            return data

        def load(self, checked):
            pass

    store = SnapshotStore(4, np.float32)
    model = WireModel(b"f" * 16, "float32", 16)
    donor = join.JoinServer(
        "w0", store, model, BarrierCounts(["w1", "w2"]), lambda: "training", Optimizer(), ["w1", "w2"]
    )

    def ask(who: str) -> dict:
        request = Request(decode(encode(join.JOIN_INFO, 1, **{"from": who}, extra=True)), (), b"", None)
        return dict(decode(donor.serve_info(request).header).fields)

    def step(k: float) -> None:  # the donor's training step: publish, then capture if a joiner wants it
        store.publish(lambda a: a.fill(k), clock=k, loss=None)
        donor.capture_if_wanted()

    step(0.0)
    assert not ask("w1")["ready"]  # w1 wants the optimizer state too: captured at the donor's next step
    clock.now = join.EXTRA_PATIENCE_S + 0.5
    assert ask("w1")["ready"]  # no step came in time: w1 takes the parameters alone
    step(0.0)  # the capture w1 asked for comes now, for nobody
    clock.now += join.OFFER_INTERVAL_S
    step(100.0)  # the donor trains on
    clock.now += join.OFFER_INTERVAL_S
    first = ask("w2")
    assert not first["ready"], first  # not the capture left over (clock 0): one of its own, at the next step
    step(101.0)
    offer = ask("w2")
    assert offer["ready"] and offer["clock"] == 101.0, offer
    donor.close()
