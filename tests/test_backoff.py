"""The one back-off every retry uses (dpwa/backoff.py): its waits, its cap, its jitter, its reset."""

from __future__ import annotations

import ast
import random

import pytest

from conftest import ROOT
from dpwa.backoff import Backoff, Backoffs


def test_waits_double_from_the_initial_wait_up_to_the_cap_and_start_over_after_a_reset():
    backoff = Backoff(0.1, 1.0)
    assert [backoff.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.failures == 6
    backoff.reset()
    assert backoff.next() == pytest.approx(0.1)


def test_fail_says_when_to_try_again_and_ready_says_whether_that_time_came():
    backoff = Backoff(0.5, 4.0, factor=3.0)
    assert backoff.ready(0.0)
    assert backoff.fail(10.0) == pytest.approx(10.5)
    assert not backoff.ready(10.4) and backoff.ready(10.5)
    assert backoff.fail(11.0) == pytest.approx(12.5)
    assert backoff.peek() == pytest.approx(4.0)  # 4.5, capped


def test_jitter_shortens_a_wait_by_at_most_its_fraction_and_a_seed_replays_it():
    waits = [Backoff(1.0, 1.0, jitter=0.25, rng=random.Random(7)).next() for _ in range(200)]
    assert all(0.75 <= w <= 1.0 for w in waits) and len(set(waits)) == 1  # same seed, same wait
    spread = Backoff(1.0, 1.0, jitter=0.25, rng=random.Random(7))
    assert len({spread.next() for _ in range(50)}) > 1


def test_a_huge_number_of_failures_stays_at_the_cap():
    assert Backoff(0.001, 30.0).after(10_000) == 30.0


@pytest.mark.parametrize(
    "args, word", [((0, 1), "initial_s"), ((2, 1), "cap_s"), ((1, 2, 0.5), "factor"), ((1, 2, 2, 1.0), "jitter")]
)
def test_settings_that_make_no_sense_are_refused_by_name(args, word):
    with pytest.raises(ValueError, match=word):
        Backoff(*args)


def test_backoffs_keep_one_per_key_and_forget_a_key_on_reset():
    each: Backoffs[str] = Backoffs(1.0, 8.0)
    assert each.ready("a", 0.0) and each.failures("a") == 0
    assert each.fail("a", 0.0) == 1.0 and each.fail("a", 1.0) == 3.0
    assert each.fail("b", 0.0) == 1.0
    assert not each.ready("a", 2.9) and each.ready("a", 3.0) and each.failures("a") == 2
    each.reset("a")
    assert "a" not in each and each.ready("a", 0.0) and each.retry_at("a") == 0.0
    assert each.fail("a", 5.0) == 6.0


def test_failed_at_is_when_the_last_failure_was_and_backoffs_list_their_keys():
    backoff = Backoff(1.0, 4.0)
    backoff.fail(3.0)
    assert backoff.failed_at == 3.0 and backoff.retry_at == 4.0
    backoff.fail(5.0)
    assert backoff.failed_at == 5.0 and backoff.retry_at == 7.0
    backoff.reset()
    assert backoff.failed_at == 0.0 and backoff.retry_at == 0.0
    each: Backoffs[str] = Backoffs(1.0, 4.0)
    each.fail("a", 2.0)
    each.fail("b", 3.0)
    assert each.failed_at("a") == 2.0 and each.failed_at("c") == 0.0
    assert len(each) == 2 and sorted(each) == ["a", "b"]
    for key in each:  # the keys are a copy: forgetting while iterating is fine
        each.reset(key)
    assert len(each) == 0


# ----------------------------------------------------------------------------- one back-off in the library

# Names of a wait: a value so named that is multiplied and assigned back is a hand-written back-off.
_WAIT_WORDS = ("pause", "wait", "backoff", "interval", "delay", "sleep", "retry")
# Hand-written back-offs still allowed, by file: (line's source, why). Keep it short and say why.
_KNOWN: dict[str, dict[str, str]] = {
    # not a wait between tries: RFC 6298's multiplier of a request's deadline (how long an answer is waited
    # for), applied to an estimate that moves with each sample, and capped as a product (dpwa/gossip/membership/deadlines.py)
    "dpwa/gossip/membership/deadlines.py": {"est.backoff *= 2": "a deadline's multiplier"},
}


def _key(node: ast.AST) -> str | None:
    """The name a target is known by: `x`, `self.x`, `x[k]` and `x.get(k)` are all `x`."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return None


def _targets(node: ast.AST) -> set[str]:
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    names = set()
    for target in targets:
        for part in target.elts if isinstance(target, ast.Tuple) else [target]:
            key = _key(part)
            if key is not None:
                names.add(key)
    return names


def _two(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in (2, 2.0) and not isinstance(node.value, bool)


def _doubles(op: ast.AST, names: set[str]) -> bool:
    """Is `op` one of `names` times 2 (``2 * x``, ``x * 2``)?"""
    if not (isinstance(op, ast.BinOp) and isinstance(op.op, ast.Mult) and (_two(op.left) or _two(op.right))):
        return False
    other = op.right if _two(op.left) else op.left
    return any(_key(n) in names for n in ast.walk(other) if isinstance(n, (ast.Name, ast.Attribute)))


def _grows(value: ast.AST, names: set[str]) -> bool:
    """Inside a min() (a cap), is one of `names` multiplied by 2, or is 2 raised to a count (2 ** n)?"""
    for call in ast.walk(value):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "min"):
            continue
        for op in ast.walk(call):
            if not isinstance(op, ast.BinOp):
                continue
            if isinstance(op.op, ast.Pow) and _two(op.left) and not isinstance(op.right, ast.Constant):
                return True
            if _doubles(op, names):
                return True
    return False


def hand_written_backoffs(source: str) -> list[tuple[int, str]]:
    """(line, source) of each hand-written back-off in `source`: a wait grown by 2 and assigned back under a
    cap (``pause = min(CAP, 2 * pause)``, also into ``x[k]`` or a tuple), a capped ``base * 2 ** n``, or a
    wait doubled in place (``backoff *= 2``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or node.value is None:
            continue
        names, value = _targets(node), node.value
        if isinstance(node, ast.AugAssign):  # x *= 2
            doubled = isinstance(node.op, ast.Mult) and _two(value)
        else:  # x = x * 2, uncapped
            doubled = _doubles(value, names)
        waits = any(word in name.lower() for name in names for word in _WAIT_WORDS)
        if (doubled and waits) or _grows(value, names):
            found.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return found


@pytest.mark.parametrize(
    "code, caught",
    [
        ("pause = min(pause * 2, 0.1)", True),
        ("self.interval_s = min(REFRESH_MAX_S, 2 * self.interval_s)", True),
        ("self._pause[p] = min(CAP, max(self._timeout_s, 2 * self._pause[p]))", True),
        ("pause[p] = min(self._poll_max_s, 2 * pause.get(p, 0.01))", True),
        ("next_try, backoff = now + backoff, min(2 * backoff, CAP)", True),
        ("pause = min(MAX_S, FIRST_S * 2.0 ** min(failures - 1, 16))", True),
        ("est.backoff *= 2", True),
        ("delay_s = delay_s * 2", True),
        ("size = size * 2", False),  # not a wait
        ("self._stride *= 2", False),  # a sampling stride, not a wait
        ("first = Backoff(min(2 * self.first_s, CAP), CAP)", False),  # a setting, not a wait grown
        ("cap = min(cap, 2 * timeout_s)", False),
        ("wait = backoff.next()", False),
    ],
)
def test_the_scan_tells_a_hand_written_backoff(code, caught):
    assert bool(hand_written_backoffs(code)) == caught


def test_every_retry_uses_the_one_backoff():
    """No hand-written back-off (a wait doubled, capped and reset by hand) in the library or the lab: each uses
    dpwa.backoff.Backoff. The few left are listed in _KNOWN with their reason."""
    found, left = [], {path: dict(known) for path, known in _KNOWN.items()}
    for path in sorted([*(ROOT / "dpwa").rglob("*.py"), *(ROOT / "lab").rglob("*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "dpwa/backoff.py":
            continue
        for line, code in hand_written_backoffs(path.read_text()):
            if left.get(relative, {}).pop(code, None) is None:
                found.append(f"{relative}:{line}: {code}")
    assert not found, "hand-written back-offs (use dpwa.backoff.Backoff):\n" + "\n".join(found)
    stale = {path: sorted(known) for path, known in left.items() if known}
    assert not stale, f"_KNOWN lists back-offs that are gone (remove them from the list): {stale}"
