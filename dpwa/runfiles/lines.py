"""What a line of a run folder's JSON-lines files must hold: the checks every writer and reader shares.

:func:`check_event` checks what every line has (``t``, ``kind``, ``node``);
:func:`check_metrics` also gives each known field of a metrics line its type
(the names: :data:`METRIC_NUMBERS`, :data:`METRIC_COUNTS`, :data:`METRIC_TEXTS`).
Each returns None, or what is wrong in words. The writer
(:mod:`dpwa.runfiles.metrics`) refuses a line that fails them; the readers
(:mod:`dpwa.cluster.events`) skip and report it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "MAX_TIME",
    "METRIC_COUNTS",
    "METRIC_NUMBERS",
    "METRIC_TEXTS",
    "check_event",
    "check_metrics",
    "kind_of",
    "number",
]

MAX_TIME = 1e12  # |t| of a line beyond this is no Unix time (year 33658)


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _field(record: dict[str, Any], key: str, want: str, ok: Callable[[Any], bool]) -> str | None:
    value = record.get(key)
    if value is None or ok(value):
        return None
    return f"{key} is {_describe(value)}, not {want}"


def _describe(value: Any) -> str:
    """A value as a message names it: a number as itself (a long integer by its length), else its kind."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(value)))
        return f"an integer of {digits} digits" if digits > 20 else str(value)
    if isinstance(value, float):
        return repr(value)
    return kind_of(value)


def number(value: Any) -> float | None:
    """`value` if it is a finite int or float (not a bool), else None: a line's number, fit to show."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and abs(value) < 1e300 else None


def _is_number(value: Any) -> bool:
    """A float (NaN and Infinity included), or an int a float can hold."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) < 1e308)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def check_event(record: dict[str, Any]) -> str | None:
    """What every line of a run folder's JSON-lines files has: ``t`` (Unix time, within ±1e12), ``kind`` (a
    string) and, if any, ``node`` (a string). None if so, else what is wrong."""
    t = record.get("t")
    if t is None:
        return "t (the time) is missing"
    if not _is_number(t) or not (math.isfinite(t) and abs(t) <= MAX_TIME):
        return f"t is {_describe(t)}, not a Unix time (a finite number within ±{MAX_TIME:g} s)"
    if not isinstance(record.get("kind"), str):
        return "kind is missing" if "kind" not in record else f"kind is {kind_of(record['kind'])}, not a string"
    return _field(record, "node", "a string", lambda v: isinstance(v, str))


# The fields of a metrics line (RUN_DIR/metrics/NODE.jsonl; see dpwa.cluster.monitor) the tools compute with.
# Each may be absent or null; present, it must have its type. Other fields are not looked at.
METRIC_NUMBERS = ("loss", "lr", "exchanges_per_s", "test_acc", "test_loss", "val_loss", "waited_s", "clock")
METRIC_COUNTS = (
    "epoch",
    "step",
    "epoch_step",
    "averaged",
    "failed",
    "epochs",
    "steps_per_epoch",
    "batch_size",
    "train_images",
)
METRIC_TEXTS = ("started", "reason", "error", "name", "data")


def check_metrics(record: dict[str, Any]) -> str | None:
    """A metrics line's known fields, by type: None if every one fits, else the first that does not, in words.

    ``t``, ``kind``, ``node`` as :func:`check_event`; numbers (``loss``, ``test_acc``, ...: NaN and
    Infinity are numbers, as a diverging run writes them), counts (``epoch``, ``step``, ``averaged``, ...:
    integers from 0), texts (``started``, ``reason``, ...), ``peers`` (an object of counts), ``stats``
    (an object) and ``skipped`` (a list).
    """
    problem = check_event(record)
    if problem:
        return problem
    for key in METRIC_NUMBERS:
        problem = problem or _field(record, key, "a number", _is_number)
    for key in METRIC_COUNTS:
        problem = problem or _field(record, key, "a count (an integer from 0)", _is_count)
    for key in METRIC_TEXTS:
        problem = problem or _field(record, key, "a string", lambda v: isinstance(v, str))
    problem = problem or _field(record, "stats", "an object", lambda v: isinstance(v, dict))
    problem = problem or _field(record, "skipped", "a list", lambda v: isinstance(v, list))
    problem = problem or _field(record, "peers", "an object of counts", _is_peer_counts)
    return problem


def _is_peer_counts(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_count(n) for k, n in value.items())
