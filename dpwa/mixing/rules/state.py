"""state (the 2017 rule): ``x += f (s_peer - x)``, pulling the whole current state, so the gradient step taken
since our snapshot is scaled by ``1 - f``. In mode symmetric the server's half is the delta mirror, so the mean is
kept only when nothing trains between publishing and blending."""

from __future__ import annotations

from .. import interpolation as interp
from .base import Rule


class StateRule(Rule):
    name = "state"
    summary = "`x += f (peer - x)`: the original's"
    uses_own_snapshot = False
    default_mirror = True  # its server's half is the delta mirror

    def blend(self, params, own, peer, f, wire):
        params.lerp_from(peer, f, wire)
        return f

    def clock(self, clock, own_clock, peer_clock, f):
        return interp.blend_clock(f, clock, peer_clock)


RULE = StateRule
