"""The PyTorch adapter: in-place blends of parameters and floating buffers, storage untouched."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402

import dpwa  # noqa: E402
from conftest import ORIGINAL, make_config  # noqa: E402
from dpwa.adapters.pytorch import DpwaPyTorchAdapter, TorchParams  # noqa: E402


class Net(nn.Module):
    steps: Tensor  # a registered integer buffer

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int32))

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


def filled_net(k: float, **kwargs) -> Net:
    net = Net()
    with torch.no_grad():
        for t in list(net.parameters()) + [b for b in net.buffers() if b.is_floating_point()]:
            t.fill_(k)
        assert net.bn.num_batches_tracked is not None
        net.bn.num_batches_tracked.fill_(int(k) * 10)
        net.steps.fill_(int(k))
    return net


def pair(adapters, cfg, k0, k1, **kwargs):
    peer_net, my_net = filled_net(k1), filled_net(k0)
    peer = adapters(peer_net, "w1", {**cfg, "fetch_probability": 0}, **kwargs)
    peer.update_send()
    peer.update_wait()
    mine = adapters(my_net, "w0", cfg, **kwargs)
    return mine, my_net, peer_net


def test_the_adapter_is_exported_at_the_top_level():
    assert dpwa.DpwaPyTorchAdapter is DpwaPyTorchAdapter


def test_parameters_and_float_buffers_blend_in_place(adapters, make_cluster):
    mine, net, _ = pair(adapters, make_cluster(2), 2.0, 6.0)
    pointers = {name: t.data_ptr() for name, t in list(net.named_parameters()) + list(net.named_buffers())}
    params_before = list(net.parameters())
    mine.update_send(loss=1.0)
    update = mine.update_wait(loss=1.0)
    assert update.averaged and update.factor == 0.5
    for name, t in list(net.named_parameters()) + [(n, b) for n, b in net.named_buffers() if b.is_floating_point()]:
        assert torch.all(t == 4.0), name
    assert torch.all(net.bn.num_batches_tracked == 20)  # integer buffers are left alone
    assert torch.all(net.steps == 2)
    after = {name: t.data_ptr() for name, t in list(net.named_parameters()) + list(net.named_buffers())}
    assert after == pointers  # storage never replaced
    assert all(a is b for a, b in zip(net.parameters(), params_before, strict=True))


def test_buffers_can_be_excluded(adapters, make_cluster):
    mine, net, _ = pair(adapters, make_cluster(2), 2.0, 6.0, include_buffers=False)
    mine.update_send()
    assert mine.update_wait().averaged
    assert torch.all(net.fc.weight == 4.0)
    assert torch.all(net.bn.running_mean == 2.0) and torch.all(net.bn.running_var == 2.0)


def test_an_optimizer_keeps_working_across_blends(adapters, make_cluster):
    torch.manual_seed(0)
    mine, net, _ = pair(adapters, make_cluster(2, **ORIGINAL), 0.0, 1.0)
    for p in net.parameters():
        torch.nn.init.normal_(p)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    losses: list[float] = []
    for _ in range(5):
        mine.update_send(losses[-1] if losses else None, batch_size=8)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        before = net.fc.weight.detach().clone()
        opt.step()
        stepped = net.fc.weight.detach().clone()
        assert not torch.equal(before, stepped)  # the optimizer still moves the real parameters
        update = mine.update_wait(loss)
        assert update.averaged
        assert torch.allclose(net.fc.weight, 0.5 * stepped + 0.5 * 1.0)  # and the blend acts on them too
        losses.append(loss.item())
    # each step: clock += 8, then clock = 0.5 * peer_clock (0) + 0.5 * clock
    assert mine.clock == 4 + 2 + 1 + 0.5 + 0.25


def test_mixed_dtypes_and_channels_last():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(2, 2).double())
    # torch documents Module.to(memory_format=...), but its overloads leave it out
    net[0].to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    params = TorchParams(net)
    assert params.size == sum(p.numel() for p in net.parameters())
    flat = np.empty(params.size, np.float32)
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 100 * i)
    params.copy_to(flat)
    expected = np.concatenate([(np.arange(p.numel()) + 100 * i) for i, p in enumerate(net.parameters())])
    assert np.array_equal(flat, expected.astype(np.float32))  # logical order, whatever the memory format
    params.lerp_from(np.zeros(params.size, np.float32), 0.5)
    for i, p in enumerate(net.parameters()):
        ref = (torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) + 100 * i) / 2
        assert torch.allclose(p.double(), ref), i
    assert net[1].weight.dtype == torch.float64
    assert net[0].get_parameter("weight").is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_model_with_nan_or_inf_is_seen_and_set_back_to_a_snapshot_exactly(monkeypatch, chunked):
    """A guarded rule's check and undo (docs/rules.md#a-broken-rule): within() sees a NaN, an Inf or a value
    beyond the bound in any tensor (mixed dtypes, BatchNorm buffers); load_from() sets every tensor back to
    a snapshot bit for bit, though lerp at f = 1 would keep a NaN (NaN * 0 is NaN)."""
    import dpwa.adapters.pytorch as pytorch_adapter

    if chunked:
        monkeypatch.setattr(pytorch_adapter, "CHUNK_ELEMENTS", 8)
        monkeypatch.setattr(pytorch_adapter, "CHUNKED_MIN_ELEMENTS", 1)
    torch.manual_seed(0)
    first, norm, last = nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2).to(torch.bfloat16)
    params = TorchParams(nn.Sequential(first, norm, last))
    assert (params._chunks is not None) == chunked
    snapshot = np.empty(params.size, np.float32)
    params.copy_to(snapshot)
    assert params.within(1e18) and not params.within(1e-9)
    running_var = norm.running_var
    assert running_var is not None
    for tensor, bad in [(first.weight, math.nan), (running_var, math.inf), (last.bias, -math.inf)]:
        with torch.no_grad():
            tensor.view(-1)[0] = bad
        assert not params.within(1e18)
        params.load_from(snapshot)
        after = np.empty_like(snapshot)
        params.copy_to(after)
        assert params.within(1e18) and np.array_equal(after, snapshot)


def test_a_rules_own_vector_is_added_to_the_parameters_and_never_to_the_running_statistics():
    """add_to_parameters(v, w) (docs/rules.md): x += w v over every parameter, in logical order whatever the
    layout and dtype, and the BatchNorm buffers untouched; the FlatParams default (through
    add_scaled_diff_from) does the same; a vector of another size or dtype is refused, naming what it takes."""
    from dpwa.mixing.params import FlatParams

    conv = nn.Conv2d(1, 2, 3).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    net = nn.Sequential(conv, nn.BatchNorm2d(2), nn.Linear(2, 2).double())
    params = TorchParams(net)
    stats = params.statistics()
    before = np.empty(params.size, np.float32)
    params.copy_to(before)
    v = np.arange(params.size, dtype=np.float32) / 8
    for add, times in [(params.add_to_parameters, 1), (lambda v, w: FlatParams.add_to_parameters(params, v, w), 2)]:
        add(v, 0.5)
        after = np.empty_like(before)
        params.copy_to(after)
        expected = before + times * 0.5 * v
        for start, end in stats:
            expected[start:end] = before[start:end]
        assert np.allclose(after, expected, atol=1e-6)
    with pytest.raises(
        ValueError, match=rf"a float32 vector of shape \({params.size},\), the model's size; got float64"
    ):
        params.add_to_parameters(v.astype(np.float64))


def test_fingerprints_tell_models_apart():
    a, b = TorchParams(Net()), TorchParams(Net())
    assert a.fingerprint == b.fingerprint
    assert TorchParams(Net(), include_buffers=False).fingerprint != a.fingerprint
    assert TorchParams(nn.Linear(4, 3)).fingerprint != TorchParams(nn.Linear(3, 4)).fingerprint


def test_unusable_models_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="has no parameters to average"):
        TorchParams(nn.ReLU())
    meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="device meta is not supported"):
        TorchParams(meta)


def test_add_scaled_diff_on_mixed_dtypes_and_layouts():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(2, 2).double())
    # torch documents Module.to(memory_format=...), but its overloads leave it out
    net[0].to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    params = TorchParams(net)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
    a = np.full(params.size, 5.0, np.float32)
    b = np.full(params.size, 3.0, np.float32)
    params.add_scaled_diff_from(a, b, 0.25)  # 1 + 0.25 * (5 - 3)
    for p in net.parameters():
        assert torch.all(p == 1.5)
    half = np.full(params.size, 5.0, np.float16)
    params.add_scaled_diff_from(half, b.astype(np.float16), 0.5, wire="float16")  # 1.5 + 0.5 * 2
    for p in net.parameters():
        assert torch.all(p == 2.5)


def test_a_delta_blend_keeps_running_statistics_convex():
    """Parameters move by the snapshots' difference; BatchNorm's running statistics move
    towards the peer's, so a running variance cannot turn negative (0.01 + 0.5 (1 - 5) would)."""
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Conv2d(1, 1, 1).double())
    params = TorchParams(net)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1.0)
        net[1].get_buffer("running_mean").fill_(0.0)
        net[1].get_buffer("running_var").fill_(0.01)
    a = np.empty(params.size, np.float32)
    params.copy_to(a)
    b = a.copy()
    stats = slice(params.size - 4, params.size)  # running_mean, running_var: the last 4 values
    a[: params.size - 4], b[: params.size - 4] = 5.0, 3.0
    a[stats], b[stats] = [2.0, 2.0, 1.0, 1.0], [0.0, 0.0, 5.0, 5.0]
    params.add_scaled_diff_from(a, b, 0.5)
    for p in net.parameters():
        assert torch.all(p == 2.0)  # 1 + 0.5 * (5 - 3), the float64 conv too
    assert torch.allclose(net[1].running_mean, torch.tensor([1.0, 1.0]))  # 0 + 0.5 * (2 - 0)
    assert torch.allclose(net[1].running_var, torch.tensor([0.505, 0.505]))  # 0.01 + 0.5 * (1 - 0.01)


def _large_model(seed: int) -> nn.Module:
    """Tensors whose boundaries fall inside chunks, a tiny one, and running statistics spanning a chunk's end."""
    torch.manual_seed(seed)
    net = nn.Module()
    net.a = nn.Parameter(torch.randn(3_000_001))
    net.b = nn.Parameter(torch.randn(2_500_000))
    net.c = nn.Parameter(torch.randn(7))
    net.register_buffer("running_var", torch.rand(1_200_003))
    return net


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_a_large_model_blends_chunk_by_chunk_to_the_same_bits_with_no_model_sized_buffer(wire):
    """A CPU model above CHUNKED_MIN_ELEMENTS is blended piece by piece in place: the same bits as the flat
    path (forced here on an identical model), with at most three chunks of scratch instead of a float32 work
    buffer of the model's size (and, for a half-precision wire, two more conversion buffers)."""
    from dpwa.adapters.pytorch import CHUNK_ELEMENTS, CHUNKED_MIN_ELEMENTS

    chunked, flat = _large_model(0), _large_model(0)
    ours, theirs = TorchParams(chunked), TorchParams(flat)
    assert ours.size > CHUNKED_MIN_ELEMENTS and ours._chunks is not None
    theirs._chunks = None  # the flat path, for reference
    storage = np.float32 if wire == "float32" else np.uint16
    a, b = np.empty(ours.size, storage), np.empty(ours.size, storage)
    TorchParams(_large_model(1)).copy_to(a, wire)
    TorchParams(_large_model(2)).copy_to(b, wire)
    for blend in (lambda p: p.lerp_from(a, 0.3, wire), lambda p: p.add_scaled_diff_from(a, b, 0.25, wire)):
        blend(ours)
        blend(theirs)
        for (name, x), y in zip(chunked.state_dict().items(), flat.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    assert ours.scratch_nbytes() <= 3 * CHUNK_ELEMENTS * 4 < ours.size * 4 <= theirs.scratch_nbytes()


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_the_cuda_chunk_path_stages_through_chunk_buffers_to_the_same_bits(wire):
    """The CUDA path of a large model (issue 40): each snapshot chunk goes through a pinned chunk and a device
    chunk, a publish comes back through a device chunk, and nothing of the model's size is made. Run here on
    the CPU: the device type is made to read "cuda" and every buffer is made on the CPU, so the chunking,
    staging and offsets are checked against the flat path's bits (tests/test_cuda.py runs it on a GPU)."""
    from dpwa.adapters.pytorch import CHUNK_ELEMENTS

    made: list[tuple[str, str, int]] = []

    class CudaOnCpu(TorchParams):
        def _buffer(self, where: str, wire: str, size: int | None = None) -> Tensor:
            if (where, wire) not in self._buffers:
                dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wire]
                self._buffers[(where, wire)] = torch.empty(self.size if size is None else size, dtype=dtype)
                made.append((where, wire, self.size if size is None else size))
            return self._buffers[(where, wire)]

    staged, flat = _large_model(0), _large_model(0)
    ours, theirs = CudaOnCpu(staged), TorchParams(flat)
    ours.device = torch.device("cuda")  # (only its type is read on the chunked path)
    theirs._chunks = None
    storage = np.float32 if wire == "float32" else np.uint16
    a, b = np.empty(ours.size, storage), np.empty(ours.size, storage)
    out, ref = np.empty(ours.size, storage), np.empty(ours.size, storage)
    TorchParams(_large_model(1)).copy_to(a, wire)
    TorchParams(_large_model(2)).copy_to(b, wire)
    for blend in (lambda p: p.lerp_from(a, 0.3, wire), lambda p: p.add_scaled_diff_from(a, b, 0.25, wire)):
        blend(ours)
        blend(theirs)
        for (name, x), y in zip(staged.state_dict().items(), flat.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    ours.copy_to(out, wire)
    theirs.copy_to(ref, wire)
    assert np.array_equal(out, ref)
    assert all(size == CHUNK_ELEMENTS for _, _, size in made), made
    assert {"pinned_chunk_a", "device_chunk_a", "pinned_chunk_b", "device_chunk_b", "device_out"} <= {
        where for where, _, _ in made
    }


def test_a_model_all_in_one_half_precision_is_snapshotted_and_sent_in_it(adapters):
    """`wire_dtype: auto` (the default): a bfloat16 or float16 model is kept and sent in its own dtype, so a
    slot is a copy of its own bytes, not of a float32 version of it; a model of mixed dtypes, or a float32
    one, travels in float32; a wire_dtype the file names wins."""
    cases = [
        ([torch.bfloat16], {}, "bfloat16"),
        ([torch.float16, torch.float16], {}, "float16"),
        ([torch.bfloat16, torch.float32], {}, "float32"),
        ([torch.float32], {}, "float32"),
        ([torch.bfloat16], {"wire_dtype": "float32"}, "float32"),
    ]
    for dtypes, settings, wire in cases:
        net = nn.Module()
        net.weights = nn.ParameterList([nn.Parameter(torch.ones(10, dtype=d)) for d in dtypes])
        adapter = adapters(net, "w0", make_config(2, fetch_probability=0, **settings))
        assert adapter.node.config.wire_dtype == wire, dtypes
        adapter.update_send(1.0)
        adapter.update_wait(1.0)
        snapshot = adapter.node.services.store.current()
        assert snapshot is not None and snapshot.array.nbytes == 10 * len(dtypes) * (4 if wire == "float32" else 2)
        adapter.close()


@pytest.mark.parametrize("size", [1_000, 5_000_001])  # the flat path, and the chunked one
def test_a_bfloat16_model_blends_to_the_same_bits_from_a_bfloat16_wire_as_from_float32(size):
    """What `wire_dtype: auto` promises a bfloat16 model: nothing lost. Its values are bfloat16 either way,
    so the peer's snapshot in bfloat16 or in float32 blends to the same bits."""
    nets = []
    for _ in range(2):
        torch.manual_seed(0)
        net = nn.Module()
        net.w = nn.Parameter(torch.randn(size).to(torch.bfloat16))
        nets.append(net)
    params = [TorchParams(net) for net in nets]
    assert params[0].natural_wire == "bfloat16"
    torch.manual_seed(1)
    peer, own = (torch.randn(size).to(torch.bfloat16) for _ in range(2))
    wires = {
        "bfloat16": [t.view(torch.int16).numpy().view(np.uint16) for t in (peer, own)],
        "float32": [t.float().numpy() for t in (peer, own)],
    }
    for p, wire in zip(params, wires, strict=True):
        a, b = wires[wire]
        p.lerp_from(a, 0.3, wire)
        p.add_scaled_diff_from(a, b, 0.25, wire)
    assert torch.equal(nets[0].w, nets[1].w)


def test_a_large_model_in_the_default_mode_holds_its_stated_buffers_and_no_more(adapters, make_cluster):
    """The memory budget (docs/design.md#memory), counted, not timed: two nodes of a 5.5M-parameter model in
    the default mode, stepping side by side until each has blended a few times (over TCP, the snapshots
    stream both ways; the default way, they are read in place from shared memory). Each holds at most
    MAX_SNAPSHOT_SLOTS snapshot slots and never retired one, at most one receive buffer at a time (none
    beside a same-host peer), and its adapter's scratch is three chunks, not a model-sized buffer."""
    from dpwa.adapters.pytorch import CHUNK_ELEMENTS
    from dpwa.gossip.services import MAX_SNAPSHOT_SLOTS

    cfg = make_cluster(2, timeout_ms=5000)
    pair = [adapters(_large_model(i), f"w{i}", cfg) for i in range(2)]
    errors: list[BaseException] = []

    def train(adapter: DpwaPyTorchAdapter) -> None:
        try:
            for _ in range(200):  # bounded; ends once both nodes blended 4 times (one that stopped early
                adapter.update_send(1.0)  # would leave its peer a spent snapshot to ask for)
                adapter.update_wait(1.0)
                if all(p.node.stats()["averaged"] + p.node.stats().get("mirrored", 0) >= 4 for p in pair):
                    break
            adapter.node.barrier("done", timeout_s=60)  # neither closes while the other still steps
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(adapter,)) for adapter in pair]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for adapter in pair:
        stats, parts = adapter.node.stats(), adapter.node.services
        assert stats["averaged"] + stats.get("mirrored", 0) >= 4, stats
        # beside a same-host peer: 2 slots, its snapshots read in place; over TCP: 2 slots and 1 receive buffer
        received = 0 if parts.local else 1
        assert stats["snapshot_slots"] <= MAX_SNAPSHOT_SLOTS and stats["slots_retired"] == 0, stats
        readers = [parts.reader] + ([parts.streams_in[1]] if parts.streams_in is not None else [])
        assert all(reader.arrivals.wire.most_out <= received for reader in readers)
        if not parts.local and adapter is pair[0]:  # the requester (pairing: hypercube): the server's snapshot
            assert stats["slots_lent"] >= 1, stats  # streamed into its own slot that nobody held, not a buffer
        assert adapter.params.scratch_nbytes() <= 3 * CHUNK_ELEMENTS * 4


def test_a_symmetric_delta_exchange_through_the_adapter(adapters, make_cluster):
    """w0 (all 2) asks w1 (all 6), f = 1/2, rule delta: w0 moves to 4 at once, and w1 to 4
    at its next update (the mirror image), buffers included."""
    cfg = make_cluster(2, mode="symmetric", rule="delta")
    my_net, peer_net = filled_net(2.0), filled_net(6.0)
    peer = adapters(peer_net, "w1", {**cfg, "fetch_probability": 0})
    peer.update_send()
    mine = adapters(my_net, "w0", cfg)
    mine.update_send()
    assert mine.update_wait().averaged
    peer.update_wait()
    for net in (my_net, peer_net):
        for t in list(net.parameters()) + [b for b in net.buffers() if b.is_floating_point()]:
            assert torch.all(t == 4.0)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
        lambda params: torch.optim.Adam(params, lr=0.01),
        lambda params: torch.optim.SGD(params, lr=0.1),  # no momentum: an empty state (once refused, bad_size)
    ],
)
def test_a_joining_node_takes_its_donors_parameters_and_optimizer_state(adapters, make_optimizer):
    """w0 trains three steps (its optimizer builds momentum, Adam's step counts and moments), then
    lingers; w1 starts late with join: auto and its own optimizer. Before the constructor returns,
    w1's parameters, float buffers, clock and optimizer state equal w0's, tensor by tensor."""
    cfg = make_config(2, join="auto", fetch_probability=0)
    torch.manual_seed(0)
    donor_net = Net()
    donor_opt = make_optimizer(donor_net.parameters())
    # the donor starts alone with join: never: with join: auto it would wait out the start barrier (10 s) for
    # w1, which this test starts only once w0 has trained; the joiner runs join: auto, as a late node does
    donor = adapters(donor_net, "w0", {**cfg, "join": "never"}, optimizer=donor_opt)
    x = torch.randn(8, 2, 6, 6)
    for _ in range(3):
        donor.update_send(None, batch_size=8)
        loss = donor_net(x).square().mean()
        donor_opt.zero_grad()
        loss.backward()
        donor_opt.step()
        donor.update_wait(loss.item())
    # w0 has finished and lingers (as train.py does after its epochs): it offers its state as of now
    stop = threading.Event()
    lingering = threading.Thread(target=donor.linger, args=(30.0, 60.0, stop.is_set))
    lingering.start()
    try:
        torch.manual_seed(1)
        joiner_net = Net()
        joiner_opt = make_optimizer(joiner_net.parameters())
        joiner = adapters(joiner_net, "w1", cfg, optimizer=joiner_opt)
    finally:
        stop.set()
        lingering.join(30)
    assert joiner.joined is not None and joiner.joined.donor == "w0" and joiner.joined.extra_meta
    for (name, a), (_, b) in zip(donor_net.state_dict().items(), joiner_net.state_dict().items(), strict=True):
        if a.is_floating_point():
            assert torch.equal(a, b), name
    assert joiner.clock == donor.clock == 24.0
    donor_state, joiner_state = donor_opt.state_dict()["state"], joiner_opt.state_dict()["state"]
    assert donor_state.keys() == joiner_state.keys()
    for index, entry in donor_state.items():
        for key, value in entry.items():
            other = joiner_state[index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (index, key)
    # and training goes on with the taken state
    joiner.update_send(None, batch_size=8)
    loss = joiner_net(x).square().mean()
    joiner_opt.zero_grad()
    loss.backward()
    joiner_opt.step()
    joiner.update_wait(loss.item())


def test_an_optimizer_state_that_does_not_fit_is_refused_with_a_reason():
    from dpwa.adapters.pytorch import OptimizerState

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 2, 6, 6)).sum().backward()
    opt.step()
    meta, data = OptimizerState(opt).capture()
    other = torch.optim.SGD(Net().parameters(), lr=0.1, momentum=0.9)
    OptimizerState(other).restore(meta, data)  # fits
    with pytest.raises(ValueError, match="does not describe the bytes"):
        OptimizerState(other).restore(meta, data[:-4])
    with pytest.raises(ValueError, match="unreadable|does not describe"):
        OptimizerState(other).restore(b"\xc1junk", data)
    small = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer state for parameter|shape"):
        OptimizerState(torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)).restore(meta, data)


def test_a_node_checkpoint_round_trips_through_torch_save(adapters, make_cluster, tmp_path):
    """checkpoint() holds the clock, the barrier counters, the outer step's and the rule's state, saved with the
    model by torch.save and loaded with weights_only=True; restore_checkpoint() on a fresh node takes them back.
    What is not a checkpoint is refused, naming what it got."""
    cfg = make_cluster(2, outer="nesterov", period=1)
    mine, net, _ = pair(adapters, cfg, 2.0, 6.0)
    for _ in range(3):
        mine.update_send(batch_size=32)
        mine.update_wait()
    saved = mine.checkpoint()
    assert saved["clock"] == mine.clock > 0 and saved["outer"] is not None
    torch.save({"model": net.state_dict(), "dpwa": saved}, tmp_path / "node.pt")
    mine.close()
    loaded = torch.load(tmp_path / "node.pt", weights_only=True)
    again = adapters(filled_net(0.0), "w0", cfg)
    again.net.load_state_dict(loaded["model"])
    again.restore_checkpoint(loaded["dpwa"])
    assert again.clock == saved["clock"]
    assert again.barrier_counters() == saved["barriers"]
    assert torch.equal(again.outer_state()["anchor"], saved["outer"]["anchor"])
    with pytest.raises(ValueError, match="must be a mapping"):
        again.restore_checkpoint([1, 2])  # a list, as a bad file could give
