"""A rule of the user's own, applied under guard: a broken one is named, undone and contained.

Each half of an exchange (``blend`` at the requester, ``mirror`` at the server) runs through
:meth:`RuleGuard.apply`. For a rule that ships with dpwa it only checks what the rule returned
(:func:`dpwa.mixing.rules.weight`). For a rule of the user's own it also checks the model before and
after: a rule that raises, returns something other than one finite weight, or leaves a NaN, an Inf or a
value beyond :data:`~dpwa.gossip.transfer.protocol.MAX_VALUE` in a model that was within bounds before, is broken.
The model is then set back to the snapshot the half started from (so a broken rule's write is never
published), ``rule_broken`` is counted, no later half runs the rule, and ``broken_rule`` says what follows:
``raise`` (the default) the error, naming the rule and its file, from the node's call that ran the half
(``update_wait`` mostly; in mode symmetric a served half may run in ``update_send``, ``barrier`` or ``linger``);
``alone``, the node logs it and trains on without averaging. Either way the node then closes its gossip
(:meth:`dpwa.gossip.node.Node.update_wait`), so peers see it leave.

A model that was already out of bounds before the half (its own training diverged) is not the rule's
doing: that half is not checked, and peers refuse such a snapshot (``not_finite``) as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...config import BROKEN_RULE
from ...logs import logger
from ...mixing import rules
from ...mixing.params import FlatParams
from ...mixing.rules import Rule, RuleError
from ...stats import Counters
from ..transfer.protocol import MAX_VALUE

__all__ = ["RuleGuard"]


class RuleGuard:
    """Applies one half of a rule (training thread), checking it; see the module's docstring.

    Args:
        name: the node's name, for the log.
        rule: the node's rule; a rule outside dpwa's package is checked in full.
        params: the model the rule writes.
        counters: ``rule_broken`` and ``rule_skipped`` are counted here.
        policy: ``raise`` or ``alone`` (the config's ``broken_rule``).
    """

    def __init__(self, name: str, rule: Rule, params: FlatParams, counters: Counters, policy: str) -> None:
        if policy not in BROKEN_RULE:
            raise ValueError(f"broken_rule must be one of {', '.join(BROKEN_RULE)}, got {policy!r}")
        self.name, self.rule, self.params, self.counters, self.policy = name, rule, params, counters, policy
        self.checked = type(rule) not in rules.builtin().values()  # dpwa's own rules are tested: no model scans
        self.broken: str | None = None  # why the rule is broken, once it is

    def apply(self, half: str, run: Callable[[], Any], start: np.ndarray | None, wire: str) -> float:
        """The weight `run` (the rule's `half`, ``blend`` or ``mirror``) gave the peer, checked.

        `start` is the snapshot of this node the half started from (the model is set back to it if the rule
        broke; None: left as the rule wrote it). When the rule breaks: raises under policy ``raise``, returns 0.0
        under ``alone``; either way every later half is skipped, returning 0.0 (a node closing after the
        error settles its exchanges without running the rule again).
        """
        if self.broken is not None:
            self.counters.add("rule_skipped")
            return 0.0
        check = self.checked and self.params.within(MAX_VALUE)  # out of bounds before: not this rule's doing
        try:
            weight = rules.weight(self.rule, half, run())
            if check and not self.params.within(MAX_VALUE):
                raise RuleError(
                    f"rule {self.rule.name!r}, {rules.where(self.rule)}: {half} wrote NaN, Inf or a value beyond "
                    f"±{MAX_VALUE:g} into the model, which was within bounds before it"
                )
            return weight
        except Exception as exc:
            if not self.checked:
                raise
            self._undo(start, wire)
            self.counters.add("rule_broken")
            self.broken = f"{type(exc).__name__}: {exc}"  # every later half is skipped (closing the node too)
            if self.policy == "raise":
                raise
            logger.error(
                "%s: the rule broke (%s); parameters set back to the snapshot the %s started from; "
                "broken_rule: alone: this node averages no more and trains alone",
                self.name,
                self.broken,
                half,
            )
            return 0.0

    def _undo(self, start: np.ndarray | None, wire: str) -> None:
        if start is None:
            logger.error("%s: no snapshot to set the model back to: it is left as the broken rule wrote it", self.name)
            return
        self.params.load_from(start, wire)
