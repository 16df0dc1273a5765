"""delta (the default): ``x += f (s_peer - s_own)``, moving by the difference of the exchanged snapshots, so the
gradient step taken since our snapshot is kept whole. In mode symmetric the server's half is its exact opposite,
so the pair's sum, and the mean of all nodes, is kept (up to float rounding)."""

from __future__ import annotations

from .base import Rule


class DeltaRule(Rule):
    name = "delta"
    summary = "`x += f (peer - own snapshot)`: keeps the local step whole, and in mode symmetric the nodes' mean"
    default_mirror = True  # its server's half is the delta mirror

    def blend(self, params, own, peer, f, wire):
        if own is None:
            raise ValueError("rule delta needs our own snapshot")
        params.add_scaled_diff_from(peer, own, f, wire)
        return f


RULE = DeltaRule
