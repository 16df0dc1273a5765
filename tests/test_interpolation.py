"""Interpolation factors and the divergence rule, from numbers alone."""

from __future__ import annotations

import math

import pytest

from dpwa.config import parse_config
from dpwa.gossip.settings import interpolation_of
from dpwa.mixing.interpolation import ClockWeighted, Constant, LossWeighted, blend_clock, damp_by_divergence


def test_constant_ignores_everything():
    assert Constant(0.3).factor(10, 1000, 5.0, 0.1) == 0.3
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        Constant(1.2)


@pytest.mark.parametrize(
    "clock, peer_clock, expected",
    [
        (100, 300, 0.75),  # the peer trained 3x as much: it pulls 3/4
        (300, 100, 0.25),
        (50, 50, 0.5),
        (0, 0, 0.5),  # two fresh nodes: 0/0 splits evenly
        (0, 10, 1.0),  # a fresh node takes the trained peer whole
        (10, 0, 0.0),
    ],
)
def test_clock_weighting(clock, peer_clock, expected):
    assert ClockWeighted().factor(clock, peer_clock, None, None) == pytest.approx(expected)


@pytest.mark.parametrize(
    "loss, peer_loss, expected",
    [
        (3.0, 1.0, 0.75),  # our loss is 3x the peer's: the peer pulls 3/4
        (1.0, 3.0, 0.25),
        (2.0, 2.0, 0.5),
        (0.0, 0.0, 0.5),  # 0/0 gives 0.5
        (0.0, 1.0, 0.0),  # we are perfect: keep ours
        (None, 1.0, 0.5),  # unknown loss: even split
        (1.0, None, 0.5),
        (-1.0, 2.0, 0.5),  # negative losses are outside the rule's domain
        (math.nan, 1.0, 0.5),
    ],
)
def test_loss_weighting(loss, peer_loss, expected):
    assert LossWeighted().factor(0, 0, loss, peer_loss) == pytest.approx(expected)


@pytest.mark.parametrize(
    "f, loss, threshold, expected",
    [
        (0.5, 0.1, 0.2, 0.25),  # loss below t: f * loss / t
        (0.5, 0.05, 0.2, 0.125),
        (0.5, 0.0, 0.2, 0.0),  # a node at zero loss takes nothing
        (0.5, 0.2, 0.2, 0.5),  # at the threshold: unchanged
        (0.5, 0.3, 0.2, 0.5),  # above: unchanged
        (0.5, 0.1, 0.0, 0.5),  # threshold 0 disables the rule
        (0.5, None, 0.2, 0.5),  # unknown loss: unchanged
    ],
)
def test_divergence_threshold(f, loss, threshold, expected):
    assert damp_by_divergence(f, loss, threshold) == pytest.approx(expected)


def test_clock_after_a_blend_interpolates_like_the_parameters():
    assert blend_clock(0.25, clock=100.0, peer_clock=500.0) == pytest.approx(200.0)
    assert blend_clock(0.0, 100.0, 500.0) == 100.0 and blend_clock(1.0, 100.0, 500.0) == 500.0


def test_factors_always_lie_in_the_unit_interval():
    values = [0, 1e-30, 0.5, 1, 7, 1e30, None, math.inf, math.nan, -3]
    for strategy in (ClockWeighted(), LossWeighted(), Constant(1.0)):
        for a in values:
            for b in values:
                f = strategy.factor(a if a is not None else 0, b if b is not None else 0, a, b)
                assert 0.0 <= f <= 1.0, (strategy.name, a, b, f)


def test_from_config_picks_the_named_strategy():
    nodes = [{"name": "a", "host": "127.0.0.1", "port": 1}]
    assert isinstance(interpolation_of(parse_config({"nodes": nodes, "interpolation": "clock"})), ClockWeighted)
    assert isinstance(interpolation_of(parse_config({"nodes": nodes, "interpolation": "loss"})), LossWeighted)
    constant = interpolation_of(parse_config({"nodes": nodes, "constant": {"value": 0.3}}))
    assert isinstance(constant, Constant) and constant.value == 0.3
