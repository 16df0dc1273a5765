"""The pieces the systems share: a model's layout, flat copies of it, value checks, the flat optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpwa_lab.systems.allreduce import ring_allreduce_bytes
from dpwa_lab.systems.layout import ModelLayout, ModuleView, check_values
from dpwa_lab.systems.optim import FlatSGD, SGDSettings


def small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_layout_lists_parameters_then_floating_buffers():
    view = ModuleView(small_net())
    layout = view.layout
    assert [v.name for v in layout.params] == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert [v.name for v in layout.buffers] == ["1.running_mean", "1.running_var"]  # num_batches_tracked: integer
    assert layout.param_size == 12 + 4 + 4 + 4 + 8 + 2
    assert layout.buffer_size == 8
    assert [v.offset for v in layout.params] == [0, 12, 16, 20, 24, 32]


def test_fingerprint_changes_with_any_shape_or_name():
    a = ModelLayout([("w", (2, 3), "param"), ("b", (3,), "param")])
    assert a.fingerprint == ModelLayout([("w", (2, 3), "param"), ("b", (3,), "param")]).fingerprint
    assert a.fingerprint != ModelLayout([("w", (3, 2), "param"), ("b", (3,), "param")]).fingerprint
    assert a.fingerprint != ModelLayout([("w", (2, 3), "param"), ("c", (3,), "param")]).fingerprint
    assert a.fingerprint != ModelLayout([("w", (2, 3), "param"), ("b", (3,), "buffer")]).fingerprint


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "at least one parameter"),
        ([("w", (2,), "param"), ("w", (2,), "param")], "appears twice"),
        ([("w", (2,), "weight")], "kind must be one of"),
    ],
)
def test_bad_layouts_are_refused_by_name(entries, message):
    with pytest.raises(ValueError, match=message):
        ModelLayout(entries)


def test_state_round_trips_and_loads_in_place():
    source, target = ModuleView(small_net()), ModuleView(small_net())
    with torch.no_grad():
        for i, p in enumerate(source.module.parameters()):
            p.fill_(i + 1.0)
        source.module.get_buffer("1.running_mean").fill_(7.0)
    storage = [p.data_ptr() for p in target.module.parameters()]
    target.load_state(source.state())
    assert np.array_equal(target.state(), source.state())
    assert [p.data_ptr() for p in target.module.parameters()] == storage  # same tensors, new values
    assert float(target.module.get_buffer("1.running_mean")[0]) == 7.0
    with pytest.raises(ValueError, match="expected a flat vector of"):
        target.load_params(np.zeros(3, np.float32))


def test_grads_of_parameters_without_a_gradient_are_zero():
    view = ModuleView(small_net())
    assert not view.grads().any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e13])
def test_check_values_refuses_nan_inf_and_huge(bad):
    values = np.zeros(5, np.float32)
    values[3] = bad
    with pytest.raises(ValueError, match="the gradients"):
        check_values(values, "the gradients")
    check_values(np.full(5, 1e11, np.float32), "fine")


@pytest.mark.parametrize("algorithm", ["sgd", "adamw"])
def test_flat_sgd_takes_exactly_torch_sgd_steps(algorithm):
    """The master and the servers step flat vectors; a worker's torch optimizer steps the module: equal updates."""
    settings = SGDSettings(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, algorithm=algorithm)
    net = small_net()
    reference: torch.optim.Optimizer
    if algorithm == "sgd":
        reference = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    else:
        reference = torch.optim.AdamW(net.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=5e-4)
    assert type(settings.make(small_net().parameters())) is type(reference)
    view = ModuleView(net)
    flat = view.params()
    optimizer = FlatSGD(flat, settings)
    rng = np.random.default_rng(0)
    for _ in range(5):
        grad = rng.standard_normal(flat.size).astype(np.float32)
        for p, v in zip(net.parameters(), view.layout.params, strict=True):
            p.grad = torch.from_numpy(grad[v.offset : v.offset + v.size].reshape(v.shape).copy())
        reference.step()
        optimizer.step(grad, samples=0)
    np.testing.assert_allclose(flat, view.params(), rtol=1e-6, atol=1e-6)


def test_flat_sgd_schedule_and_scale():
    values = np.zeros(4, np.float32)
    optimizer = FlatSGD(
        values,
        SGDSettings(lr=1.0, momentum=0.5, nesterov=False, weight_decay=0.0),
        schedule=lambda samples: 0.5 if samples < 100 else 0.25,
    )
    optimizer.step(np.ones(4, np.float32), samples=0, scale=0.5)
    assert optimizer.lr == 0.25 and np.allclose(values, -0.25)
    optimizer.step(np.ones(4, np.float32), samples=100)
    assert optimizer.lr == 0.25 and np.allclose(values, -0.25 - 0.25 * 1.5)  # momentum 0.5: buffer 1.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": 0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"weight_decay": -1}, "weight_decay"),
        ({"momentum": 0, "nesterov": True}, "nesterov"),
        ({"algorithm": "adam"}, "algorithm must be one of sgd, adamw"),
        ({"algorithm": "adamw", "betas": (0.9, 1.0)}, "betas"),
    ],
)
def test_bad_optimizer_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SGDSettings(**kwargs)


def test_ring_allreduce_bytes():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 2000  # half sent and received twice: 2 (n-1)/n each way
    assert ring_allreduce_bytes(1000, 4) == 3000
