"""Mixing rules: the interface (:mod:`.base`) and one module per rule, found by name.

Each module here other than ``base`` defines ``RULE``, a :class:`Rule` subclass,
and is found by that class's ``name``: adding a rule is adding a file.
A config may also name a rule in the user's own code, ``module.path:ClassName``;
it is imported when the config loads (:func:`rule_class`). Peers never send
code: only a node's own config names its rule, and a peer whose rule or
settings differ is refused (the fingerprint in every request).

=====================  =======================================  ==========================================
rule                   requester i                              server j (mode symmetric)
=====================  =======================================  ==========================================
delta (the default)    x_i += f (s_j - s_i)                      x_j += f (s_i - s_j), once i confirms
state (2017)           x_i += f (s_j - x_i)                      x_j += f (s_i - s_j), once i confirms
clipped                x_i += f clip(s_j - s_i, tau)            x_j += f clip(s_i - s_j, tau)
pushsum (mode pull)    x_i += g/(w_i+g) (x_j - x_i), w_i += g   gives g = w_j/2 of its weight with the reply
=====================  =======================================  ==========================================
"""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
import sys
from typing import Any

import numpy as np

from .base import FINGERPRINT_BYTES, MAX_CARRIED, MAX_SYMMETRIC_FACTOR, Option, Rule, RuleError, Side

__all__ = [
    "FINGERPRINT_BYTES",
    "MAX_CARRIED",
    "MAX_SYMMETRIC_FACTOR",
    "Option",
    "Rule",
    "RuleError",
    "Side",
    "builtin",
    "check_mode",
    "rule_class",
    "weight",
    "where",
]

DEFAULT = "delta"


@functools.cache
def _found() -> tuple[tuple[str, type[Rule]], ...]:
    """The built-in rules, found once per process (a scan of this package's modules)."""
    found: dict[str, type[Rule]] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name == "base":
            continue
        rule = getattr(importlib.import_module(f"{__name__}.{module.name}"), "RULE", None)
        if isinstance(rule, type) and issubclass(rule, Rule):
            found[rule.name] = rule
    return tuple(found.items())


def where(rule: type[Rule] | Rule) -> str:
    """A rule's class and the file it is defined in, for an error message: ``HeavyDelta (myrules.py)``."""
    cls = rule if isinstance(rule, type) else type(rule)
    path = getattr(sys.modules.get(cls.__module__), "__file__", None) or cls.__module__
    return f"{cls.__qualname__} ({path})"


def check_mode(rule: type[Rule], mode: str, settings: dict[str, Any]) -> None:
    """Can `rule` with `settings` run in `mode`? Its own :meth:`Rule.check_mode`, and in mode symmetric a
    server's half: a rule that defines no :meth:`Rule.mirror` must say that the default one is right for it
    (``default_mirror = True``). RuleError otherwise, naming the rule and its file."""
    rule.check_mode(mode, settings)
    if mode == "symmetric" and rule.mirror is Rule.mirror and not rule.default_mirror:
        raise RuleError(
            f"rule {rule.name!r}, {where(rule)}, defines no mirror for mode symmetric (the server's half): define "
            "mirror(self, params, served, requester, f, wire), or set default_mirror = True in the class if the "
            "default, x_j += f (s_i - s_j), is right for it"
        )


def weight(rule: Rule, half: str, value: Any) -> float:
    """What `rule`'s ``blend`` or ``mirror`` (`half`) returned, checked: the weight it gave the peer, one finite
    number. RuleError otherwise, naming the rule, its file and what was expected (before, an array or a NaN
    surfaced later as numpy's broadcast error or a header field's, far from the rule)."""
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and math.isfinite(float(value)):
        return float(value)
    shown = f"an array of shape {value.shape}" if isinstance(value, np.ndarray) else f"{value!r:.80}"
    raise RuleError(
        f"rule {rule.name!r}, {where(rule)}: {half} returned {shown} ({type(value).__name__}); it must return the "
        "weight it gave the peer: one finite number (f, or less where the rule gave less)"
    )


def builtin() -> dict[str, type[Rule]]:
    """The rules that ship with dpwa, by name: one module of this package each."""
    return dict(_found())


def rule_class(spec: str) -> type[Rule]:
    """The rule a config names: a built-in name, or ``module.path:ClassName`` in the user's own code.

    Raises RuleError saying what is wrong: not found, not importable, not a Rule subclass, or a part of
    the interface it does not implement.
    """
    rules = builtin()
    if ":" not in spec:
        if spec in rules:
            return rules[spec]
        raise RuleError(
            f"expected one of {', '.join(sorted(rules))}, or module.path:ClassName for a rule of your own; got {spec!r}"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure of the user's module: say which, and why
        raise RuleError(
            f"cannot import module {module_name!r} for rule {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    rule = getattr(module, attr, None)
    if rule is None:
        raise RuleError(f"module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(rule, type) and issubclass(rule, Rule)):
        raise RuleError(f"{spec} is not a subclass of dpwa.mixing.rules.Rule")
    missing = sorted(getattr(rule, "__abstractmethods__", ()))
    if missing:
        raise RuleError(f"{spec} does not implement {', '.join(missing)}")
    if not rule.name or not isinstance(rule.name, str):
        raise RuleError(f"{spec} sets no name (a class attribute: name = '...')")
    if len(rule.carries) > MAX_CARRIED:
        raise RuleError(f"{spec} carries {len(rule.carries)} scalars with a snapshot, at most {MAX_CARRIED}")
    if rule.name in rules:
        raise RuleError(f"{spec} is named {rule.name!r}, the name of a built-in rule: choose another")
    return rule
