"""DiLoCo: the outer Nesterov step against hand-computed values, and two ranks synchronising over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpwa.mixing.outer import OuterNesterov, OuterSettings, nesterov_step, pseudo_gradient


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def test_the_outer_step_matches_values_computed_by_hand():
    """lr 0.7, momentum 0.9, params [1, 2]; pseudo-gradients [0.5, -1] then [0.1, 0.2].

    step 1: buf = [0.5, -1];   update = g + 0.9 buf = [0.95, -1.9];   params = [1 - 0.665, 2 + 1.33] = [0.335, 3.33]
    step 2: buf = 0.9 [0.5, -1] + [0.1, 0.2] = [0.55, -0.7];   update = [0.1 + 0.495, 0.2 - 0.63] = [0.595, -0.43];
            params = [0.335 - 0.4165, 3.33 + 0.301] = [-0.0815, 3.631]
    """
    outer = OuterNesterov(2, OuterSettings(lr=0.7, momentum=0.9))
    params = f32(1.0, 2.0)
    outer.step(params, f32(0.5, -1.0))
    np.testing.assert_allclose(params, [0.335, 3.33], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outer.buf, [0.5, -1.0], rtol=0, atol=1e-7)
    outer.step(params, f32(0.1, 0.2))
    np.testing.assert_allclose(params, [-0.0815, 3.631], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outer.buf, [0.55, -0.7], rtol=0, atol=1e-6)
    assert outer.steps == 2


def test_the_outer_step_is_torchs_nesterov_sgd():
    rng = np.random.default_rng(0)
    start = rng.normal(size=50).astype(np.float32)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(6)]
    ours = start.copy()
    outer = OuterNesterov(50)  # DiLoCo's defaults
    theirs = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        outer.step(ours, g)
        theirs.grad = torch.from_numpy(g.copy())
        opt.step()
    np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_lr_one_without_momentum_averages_the_workers():
    anchor = f32(1.0, 1.0, 1.0)
    workers = [f32(0.0, 2.0, 4.0), f32(2.0, 2.0, -2.0)]
    mean = np.mean([pseudo_gradient(anchor, w) for w in workers], axis=0).astype(np.float32)
    OuterNesterov(3, OuterSettings(lr=1.0, momentum=0.0)).step(anchor, mean)
    np.testing.assert_allclose(anchor, [1.0, 2.0, 1.0])  # the workers' mean


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: nesterov_step(f32(1, 2), f32(1), f32(0, 0), 0.7, 0.9), "grad has 1 values, expected 2"),
        (lambda: nesterov_step(np.ones(2), f32(1, 2), f32(0, 0), 0.7, 0.9), "params must be a flat float32 array"),
        (lambda: pseudo_gradient(f32(1, 2), f32(1, 2, 3)), "params has 3 values, expected 2"),
        (lambda: OuterSettings(lr=0.0), "outer lr must be in"),
        (lambda: OuterSettings(momentum=1.0), "outer momentum must be in"),
        (lambda: OuterNesterov(0), "size must be at least 1"),
    ],
)
def test_bad_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_outer_state_round_trips_and_is_checked():
    outer = OuterNesterov(2)
    outer.step(f32(1.0, 2.0), f32(0.5, -1.0))
    other = OuterNesterov(2)
    other.load_state(outer.state())
    assert other.steps == 1 and np.array_equal(other.buf, outer.buf)
    for bad, message in [
        ({"buf": f32(1.0), "steps": 1}, "1 values, expected 2"),
        ({"buf": f32(np.nan, 0.0), "steps": 1}, "NaN"),
        ({"buf": f32(0.0, 0.0), "steps": -1}, "steps must be a count"),
    ]:
        with pytest.raises(ValueError, match=message):
            other.load_state(bad)


# --------------------------------------------------------------------------- two ranks over gloo


def _rank(rank: int, world: int, out_dir: str) -> None:
    """Each rank starts at [1, 2]; 'inner steps' move rank 0 to [0.5, 3] and rank 1 to [1.5, 2], then a sync.

    Pseudo-gradients [0.5, -1] and [-0.5, 0]: mean [0, -0.5]; the outer step (0.7, 0.9): buf [0, -0.5],
    update [0, -0.5 - 0.45] = [0, -0.95], anchor [1, 2 + 0.665] = [1, 2.665] on both ranks.
    """
    from dpwa_lab.systems.diloco import DiLoCo

    net = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0], [2.0]]))
    diloco = DiLoCo(net, period=2)
    assert not diloco.step()  # one inner step: no sync yet
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[0.5], [3.0]]) if rank == 0 else torch.tensor([[1.5], [2.0]]))
    synced = diloco.step()
    result = {"synced": synced, "weight": net.weight.detach().flatten().tolist(), "syncs": diloco.syncs}
    result["bytes_per_sync"] = diloco.bytes_per_sync
    with open(f"{out_dir}/rank{rank}.json", "w") as fh:
        json.dump(result, fh)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_synchronise_to_the_hand_computed_anchor(tmp_path, monkeypatch):
    """...through a rendezvous file under a relative folder (as python -m dpwa.compare --out runs/x gives):
    file://nested/run/... would name host "nested" and the folder /run/..., where no rank finds the others."""
    from dpwa_lab.systems.allreduce import launch

    monkeypatch.chdir(tmp_path)
    launch(_rank, (str(tmp_path),), 2, workdir=Path("nested") / "deeper" / "run", timeout_s=60)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["synced"] and result["syncs"] == 1
        np.testing.assert_allclose(result["weight"], [1.0, 2.665], rtol=0, atol=1e-6)
        assert result["bytes_per_sync"] == 16.0  # ring all-reduce of 2 floats over 2 ranks: 2 x 8 bytes
