"""The interface every mixing rule implements: how one exchange changes each side. Pure math.

Notation for one exchange between a requester i and a server j: ``x`` are
current parameters, ``s`` the snapshots published at ``update_send`` and
exchanged, ``f`` the factor.

A rule owns, in one class:

- ``name``, a one-line ``summary``, and its ``options``: the settings it reads
  from the config's ``rule_options`` map, each declared once with a default,
  a check and a help text (they appear in the generated key table);
- :meth:`Rule.factor`: f, from both snapshots' clocks and losses (by default
  the configured interpolation, damped by the divergence threshold, and in
  mode symmetric capped at 1/2);
- :meth:`Rule.blend`: the requester's half (mode pull: the only one);
- :meth:`Rule.mirror`: the server's half in mode symmetric (by default
  ``x_j += f (s_i - s_j)``, the exact opposite of a delta blend);
- :meth:`Rule.clock` and :meth:`Rule.mirror_clock`: the clocks after each half;
- :meth:`Rule.fingerprint`: the rule and its settings, sent with every request
  so that a peer running anything else is refused (``bad_rule``);
- :meth:`Rule.state`, :meth:`Rule.check_state`, :meth:`Rule.load_state`: its
  per-node state that a joiner takes from its donor (ClippedGossip's recent
  distances), checked like everything a donor sends;
- ``carries`` and :meth:`Rule.served`: the scalars it sends with each
  snapshot it serves (a push-sum weight), each declared with its bounds: a
  peer's values outside them are refused before the rule sees them
  (:meth:`Rule.checked_carried`), and the rule reads them in ``peer.carried``;
  :meth:`Rule.published` tells it which snapshot holds the parameters as they
  are now, so that what it serves can belong to that snapshot.

Both halves return the weight they actually gave the peer, which may differ
from f (a rule that clips scales it down); the clock follows that weight.

Every correction is taken relative to a snapshot, so a node that takes part
in k exchanges on one state ends at ``(1 - k f) s_i + f * sum(partners)``: at
k = 2 and f = 1/2 its own weight is zero and two nodes swap instead of
averaging. So in mode symmetric a node takes part in one unsettled exchange
at a time and each snapshot in one exchange (:mod:`dpwa.mixing.admission`),
whatever the rule: its own weight is then ``1 - f >= 1/2``.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .. import interpolation as interp
from ..options import Option, checked, positive_number
from ..params import FlatParams

__all__ = [
    "FINGERPRINT_BYTES",
    "MAX_CARRIED",
    "MAX_SYMMETRIC_FACTOR",
    "Option",
    "Rule",
    "RuleError",
    "Side",
    "positive_number",
]

MAX_SYMMETRIC_FACTOR = 0.5  # beyond it a symmetric exchange would move a side past its partner
FINGERPRINT_BYTES = 8
MAX_CARRIED = 8  # scalars a rule may send with a snapshot


class RuleError(ValueError):
    """A rule that cannot be used: not found, not a Rule, or an option out of its bounds. The message says
    what was expected; the config layer adds the file and the key."""


class Side(NamedTuple):
    """One snapshot's numbers, as both sides of an exchange see them."""

    clock: float
    loss: float | None
    carried: Mapping[str, float] | None = None  # the scalars the snapshot came with (Rule.carries), checked


class Rule(ABC):
    """How one exchange changes each side. Subclass it, set ``name`` (and ``summary``, ``options``),
    implement :meth:`blend`, and override what else differs from a delta exchange.

    Args:
        interpolation: how f is chosen from clocks and losses (the config's ``interpolation``).
        divergence_threshold: the config's ``divergence_threshold`` (0: off).
        options: the config's ``rule_options``; each is checked against :attr:`options`.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[Mapping[str, Option]] = {}
    uses_own_snapshot: ClassVar[bool] = True  # blend reads our own snapshot (mode pull keeps it for the step)
    carries: ClassVar[Mapping[str, tuple[float, float]]] = {}  # scalars sent with each served snapshot: [lo, hi]
    # mode symmetric: the default mirror, x_j += f (s_i - s_j), is right for this rule. A rule that defines no
    # mirror and does not say so is refused in mode symmetric (rules.check_mode): the default is a delta's
    default_mirror: ClassVar[bool] = False

    def __init__(
        self,
        interpolation: interp.Interpolation | None = None,
        divergence_threshold: float = 0.0,
        **options: Any,
    ) -> None:
        self.interpolation = interpolation if interpolation is not None else interp.Constant(0.5)
        self.divergence_threshold = float(divergence_threshold)
        self.settings = self.checked_options(options)

    @classmethod
    def checked_options(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` checked against :attr:`options`, with the defaults filled in; RuleError names the option."""
        try:
            return checked(cls.options, given, f"rule {cls.name!r}")
        except ValueError as exc:
            raise RuleError(str(exc)) from None

    @classmethod
    def check_mode(cls, mode: str, settings: dict[str, Any]) -> None:
        """Raise RuleError if these settings cannot run in `mode` (``pull`` or ``symmetric``)."""
        return None

    # ----------------------------------------------------------------- the factor

    def factor(self, own: Side, peer: Side, symmetric: bool = False) -> float:
        """f for an exchange, from the requester's point of view (`own` is the requester's snapshot; in mode
        symmetric the server computes it from the same four numbers, so both agree exactly)."""
        f = self.interpolation.factor(own.clock, peer.clock, own.loss, peer.loss)
        f = interp.damp_by_divergence(f, own.loss, self.divergence_threshold)
        return min(max(f, 0.0), MAX_SYMMETRIC_FACTOR) if symmetric else f

    # ----------------------------------------------------------------- the two halves

    @abstractmethod
    def blend(self, params: FlatParams, own: np.ndarray | None, peer: np.ndarray, f: float, wire: str) -> float:
        """The requester's half: change `params` in place, given our snapshot `own` (None when
        :attr:`uses_own_snapshot` is False) and the peer's `peer` (both of wire dtype `wire`). Returns the
        weight given to the peer."""

    def mirror(self, params: FlatParams, served: np.ndarray, requester: np.ndarray, f: float, wire: str) -> float:
        """The server's half in mode symmetric: by default ``x_j += f (s_i - s_j)``. Returns the weight."""
        params.add_scaled_diff_from(requester, served, f, wire)
        return f

    def clock(self, clock: float, own_clock: float, peer_clock: float, f: float) -> float:
        """The requester's clock after its half gave the peer weight f (`own_clock`: our snapshot's)."""
        return clock + f * (peer_clock - own_clock)

    def mirror_clock(self, clock: float, served_clock: float, requester_clock: float, f: float) -> float:
        """The server's clock after its half gave the requester weight f."""
        return clock + f * (requester_clock - served_clock)

    # ----------------------------------------------------------------- scalars that travel with a snapshot

    def served(self, version: int) -> dict[str, float]:
        """(The Rx thread) the scalars to send with snapshot `version`, served now, one per name in
        :attr:`carries`. It may change the rule's own state (push-sum gives half its weight away): guard that
        state with a lock."""
        return {}

    def cluster(self, most_nodes: int) -> None:
        """(At the node's start) the most nodes its cluster can hold: the config's nodes, or with open
        membership ``members_max`` + 1. A rule whose state is conserved across the cluster (push-sum's
        weight) bounds what a peer can carry by it. By default nothing is kept."""
        return None

    def published(self, version: int) -> None:
        """(The training thread) snapshot `version` was just published: it holds the parameters as they are
        now. Called only for a rule that :attr:`carries` something. By default nothing is kept."""
        return None

    def checked_carried(self, values: Any) -> dict[str, float]:
        """A peer's carried scalars (a list in :attr:`carries` order, or None), checked against their bounds.
        Raises ValueError naming the scalar and the bound."""
        names = list(self.carries)
        if values is None:
            values = []
        if not isinstance(values, list) or len(values) != len(names):
            raise ValueError(f"rule {self.name!r} expects {len(names)} carried values ({', '.join(names)})")
        checked: dict[str, float] = {}
        for name, value in zip(names, values, strict=True):
            lo, hi = self.carries[name]
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"carried {name} = {value!r} is outside [{lo:g}, {hi:g}]")
            checked[name] = float(value)
        return checked

    # ----------------------------------------------------------------- per-node state a joiner takes

    def state(self) -> dict[str, Any]:
        """(The training thread) the node's own state a joiner should take from it, as msgpack-able numbers and
        lists; {} (the default) when there is none. A node whose rule has state sends it with a join."""
        return {}

    def check_state(self, state: Any) -> Any:
        """A donor's :meth:`state`, checked (it came from a peer); raises ValueError naming what does not fit.
        Returns what :meth:`load_state` takes."""
        if state != {}:
            raise ValueError(f"rule {self.name!r} keeps no state, got {type(state).__name__}")
        return state

    def load_state(self, checked: Any) -> None:
        """(The training thread) take over a state :meth:`check_state` returned."""
        return None

    def report(self) -> dict[str, float]:
        """Numbers for ``stats()`` (as ``rule.<name>``) and status: what the rule did (any thread)."""
        return {}

    def mass(self) -> float:
        """This node's weight in the cluster's mean (the quantity a rule keeps): 1, but for push-sum's weight."""
        return 1.0

    # ----------------------------------------------------------------- identity

    def describe(self) -> dict[str, Any]:
        """Everything both sides of an exchange must agree on: the rule, its settings, how f is chosen."""
        interpolation: dict[str, Any] = {"name": self.interpolation.name}
        if isinstance(self.interpolation, interp.Constant):
            interpolation["value"] = self.interpolation.value
        return {
            "rule": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "settings": self.settings,
            "interpolation": interpolation,
            "divergence_threshold": self.divergence_threshold,
        }

    def fingerprint(self) -> bytes:
        """:data:`FINGERPRINT_BYTES` bytes that two nodes share exactly when :meth:`describe` is equal."""
        text = json.dumps(self.describe(), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).digest()[:FINGERPRINT_BYTES]
