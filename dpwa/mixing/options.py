"""Declared settings: what a rule reads from ``rule_options`` and a codec from ``wire_options``.

Each setting is declared once, as an :class:`Option` with its default, its check
and a line of help; the config checks the given map against the declarations
when it loads, and the key table lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Option", "checked", "positive_number"]


@dataclass(frozen=True)
class Option:
    """One setting of a rule or a codec.

    Args:
        default: its value when the config does not give one.
        check: takes the config's value and returns it as used, or raises ValueError saying what was expected.
        help: one line for the key table.
    """

    default: Any
    check: Callable[[Any], Any]
    help: str


def positive_number(value: Any) -> float:
    """An Option check: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"expected a finite number > 0, got {value!r}")
    return float(value)


def checked(options: Mapping[str, Option], given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """`given` checked against `options`, defaults filled in; ValueError naming `owner` and the option."""
    unknown = sorted(set(given) - set(options))
    if unknown:
        known = ", ".join(sorted(options)) or "none"
        raise ValueError(f"{owner} has no option {unknown[0]!r} (its options: {known})")
    settings: dict[str, Any] = {}
    for key, option in options.items():
        try:
            settings[key] = option.check(given.get(key, option.default))
        except ValueError as exc:
            raise ValueError(f"{owner}, option {key!r}: {exc}") from None
    return settings
