"""dpwa with models on a GPU: the adapter's CUDA path, the optimizer hook, and the comparison's ``--device cuda``.

Every test here needs CUDA and is skipped without it (CI has no GPU);
``scripts/gpu-check.sh`` runs them on a machine with one. Each asserts values
known in advance, as the CPU tests of the same paths do: a blend of two
models filled with 2 and 6 gives 4 everywhere, and the kernels agree with the
CPU's to float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import Tensor, nn  # noqa: E402

from conftest import CHECKOUT_PATH, ORIGINAL, ROOT, make_config  # noqa: E402
from dpwa.adapters.pytorch import TorchParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu-check.sh)")


class Net(nn.Module):
    """Parameters, BatchNorm's running statistics (float buffers) and an integer buffer, as the CPU tests have."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean(dim=(2, 3)))


def filled(k: float) -> Net:
    net = Net()
    with torch.no_grad():
        for t in [*net.parameters(), *(b for b in net.buffers() if b.is_floating_point())]:
            t.fill_(k)
    return net.cuda()


def floats(net: nn.Module) -> list[Tensor]:
    return [*net.parameters(), *(b for b in net.buffers() if b.is_floating_point())]


@pytest.mark.parametrize("settings", [{}, ORIGINAL], ids=["symmetric-delta", "pull-state"])
def test_two_gpu_models_blend_to_their_mean_in_place(adapters, settings):
    """w0 (all 2) and w1 (all 6) on the GPU, f = 1/2: w0 ends at 4 everywhere, its tensors still on the GPU in
    the same storage; in mode symmetric w1 moves to 4 as well, at its next update."""
    cfg = make_config(2, **settings)
    mine_net, peer_net = filled(2.0), filled(6.0)
    pointers = [t.data_ptr() for t in floats(mine_net)]
    peer = adapters(peer_net, "w1", {**cfg, "fetch_probability": 0})
    peer.update_send()
    mine = adapters(mine_net, "w0", cfg)
    mine.update_send(loss=1.0)
    update = mine.update_wait(loss=1.0)
    assert update.averaged and update.factor == 0.5, update
    peer.update_wait()
    moved = [mine_net] + ([peer_net] if not settings else [])
    for net in moved:
        for t in floats(net):
            assert t.is_cuda and torch.all(t == 4.0)
    assert [t.data_ptr() for t in floats(mine_net)] == pointers


def test_the_gpu_kernels_agree_with_the_cpu():
    """TorchParams on the GPU: the copy out, the lerp and the delta blend give the CPU's values (float32)."""
    rng = np.random.default_rng(0)
    cpu_net = Net()
    with torch.no_grad():
        for t in floats(cpu_net):
            t.copy_(torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)))
    gpu_net = Net().cuda()
    gpu_net.load_state_dict(cpu_net.state_dict())
    cpu, gpu = TorchParams(cpu_net), TorchParams(gpu_net)
    assert cpu.size == gpu.size
    out_cpu, out_gpu = np.empty(cpu.size, np.float32), np.empty(gpu.size, np.float32)
    cpu.copy_to(out_cpu)
    gpu.copy_to(out_gpu)
    np.testing.assert_array_equal(out_cpu, out_gpu)
    peer = rng.standard_normal(cpu.size).astype(np.float32)
    cpu.lerp_from(peer, 0.25)
    gpu.lerp_from(peer, 0.25)
    cpu.copy_to(out_cpu)
    gpu.copy_to(out_gpu)
    np.testing.assert_allclose(out_gpu, out_cpu, rtol=1e-6, atol=1e-6)
    own = out_cpu.copy()
    cpu.add_scaled_diff_from(peer, own, 0.5)
    gpu.add_scaled_diff_from(peer, own, 0.5)
    cpu.copy_to(out_cpu)
    gpu.copy_to(out_gpu)
    np.testing.assert_allclose(out_gpu, out_cpu, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_a_large_gpu_model_is_blended_and_published_chunk_by_chunk_as_the_cpu_does(wire):
    """A model above CHUNKED_MIN_ELEMENTS on the GPU (issue 40): blends and publishes go chunk by chunk through
    pinned and device buffers of a chunk's size, made once; the values are the CPU's chunked path's (float32
    rounding), and no buffer of the model's size is made on either side."""
    from dpwa.adapters.pytorch import CHUNK_ELEMENTS, CHUNKED_MIN_ELEMENTS

    def big(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        net = nn.Module()
        net.a = nn.Parameter(torch.randn(3_000_001))
        net.b = nn.Parameter(torch.randn(2_500_000))
        net.register_buffer("running_var", torch.rand(1_200_003))
        return net

    cpu_net, gpu_net = big(0), big(0).cuda()
    cpu, gpu = TorchParams(cpu_net), TorchParams(gpu_net)
    assert gpu.size > CHUNKED_MIN_ELEMENTS and gpu._chunks is not None
    storage = np.float32 if wire == "float32" else np.uint16
    a, b = np.empty(cpu.size, storage), np.empty(cpu.size, storage)
    out_cpu, out_gpu = np.empty(cpu.size, storage), np.empty(cpu.size, storage)
    TorchParams(big(1)).copy_to(a, wire)
    TorchParams(big(2)).copy_to(b, wire)
    for p in (cpu, gpu):
        p.lerp_from(a, 0.3, wire)
        p.add_scaled_diff_from(a, b, 0.25, wire)
    cpu.copy_to(out_cpu, wire)
    gpu.copy_to(out_gpu, wire)
    if wire == "float32":
        np.testing.assert_allclose(out_gpu.astype(np.float32), out_cpu.astype(np.float32), rtol=1e-6, atol=1e-6)
    else:
        assert np.abs(out_gpu.astype(np.int32) - out_cpu.astype(np.int32)).max() <= 1  # a bfloat16 ulp at most
    torch.cuda.synchronize()
    assert all(t.numel() == CHUNK_ELEMENTS for t in gpu._buffers.values())
    assert gpu.scratch_nbytes() <= 8 * CHUNK_ELEMENTS * 4 < gpu.size * 4


def test_the_optimizer_hook_gossips_a_gpu_model(adapters):
    """gossip_optimizer on a GPU model: an unchanged loop (lr 0, so only the exchanges move the parameters)
    of a node at 2 with a peer at 6 ends with its parameters at their mean, 4, on the GPU."""
    from dpwa import gossip_optimizer

    cfg = make_config(2)
    net = filled(2.0)
    peer = adapters(filled(6.0), "w1", cfg)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    x = torch.zeros(4, 2, 6, 6, device="cuda")
    with gossip_optimizer(optimizer, net, cfg, "w0", metrics=False) as hook:
        for _ in range(50):  # bounded: each step's exchange ends by its deadline
            if hook.averaged:
                break
            optimizer.zero_grad()
            net(x).sum().backward()
            optimizer.step()
            peer.update_send()  # the peer serves between our steps, and applies its halves
            peer.update_wait()
        averaged = hook.averaged
    assert averaged > 0
    for t in net.parameters():
        assert t.is_cuda and torch.allclose(t, torch.full_like(t, 4.0))


def test_a_gpu_node_checkpoint_round_trips(adapters, tmp_path):
    """checkpoint() of a node whose model is on the GPU (an outer step's anchor included) survives torch.save
    and a weights_only load, and restore_checkpoint() takes it back."""
    cfg = make_config(2, outer="nesterov", period=1)
    peer = adapters(filled(6.0), "w1", {**cfg, "fetch_probability": 0})
    peer.update_send()
    peer.update_wait()
    net = filled(2.0)
    mine = adapters(net, "w0", cfg)
    for _ in range(3):
        mine.update_send(batch_size=8)
        mine.update_wait()
        peer.update_send()
        peer.update_wait()
    saved = mine.checkpoint()
    torch.save({"model": net.state_dict(), "dpwa": saved}, tmp_path / "node.pt")
    mine.close()
    loaded = torch.load(tmp_path / "node.pt", weights_only=True)
    again = adapters(filled(0.0), "w0", cfg)
    again.net.load_state_dict(loaded["model"])
    again.restore_checkpoint(loaded["dpwa"])
    assert again.clock == saved["clock"] > 0
    assert torch.equal(again.outer_state()["anchor"], saved["outer"]["anchor"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_comparison_trains_on_the_gpu(tmp_path):
    """python -m dpwa.compare --device cuda: gossip, all-reduce (NCCL where each rank has its own GPU, else
    gloo) and DiLoCo train charlm's tiny model on the GPU, and each ends below its first loss."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--device",
        "cuda",
        "--workload",
        "charlm",
        "--model",
        "tiny",
        "--workers",
        "2",
        "--steps",
        "60",
        "--quick",
        "--systems",
        "gossip,allreduce,diloco",
        "--json",
        str(tmp_path / "report.json"),
        "--out",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["workload"]["device"] == "cuda"
    for system in ("gossip", "allreduce", "diloco"):
        summary = report["systems"][system]
        assert summary["completed"], (system, summary.get("error"))
        first_loss = summary["curve"][0][3]  # [seconds, samples, accuracy, loss]: the model before training
        assert summary["final_val_loss"] < first_loss, (system, first_loss, summary["final_val_loss"])
