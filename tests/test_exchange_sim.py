"""The symmetric exchange's machine (dpwa.gossip.exchange.machine) and the membership view
(dpwa.gossip.membership.view) under a deterministic simulation: thousands of seeded schedules of 2 to 4 nodes
whose messages are dropped, delayed, duplicated and reordered, with crashes, restarts and closes, each checked
for every promise of the protocol and of the view (tests/helpers/exchange_sim.py). A unit
test: no socket, thread or sleep. A failure names its seed; ``DPWA_SIM_SEED=123 python -m pytest -q
tests/test_exchange_sim.py::test_one_seed_replays`` replays it exactly (``DPWA_SIM_LONG=1`` for a long one).

Also a few rules of the machine held directly, with values known in advance, and planted bugs that the
simulation must catch (it has teeth)."""

from __future__ import annotations

import ast
import os
from dataclasses import replace
from pathlib import Path

import pytest

from dpwa.gossip.exchange import machine as em
from dpwa.gossip.membership.view import MemberInfo, View
from helpers.exchange_sim import Violation, run_schedule

SCHEDULES = 10_000  # short schedules with faults, in chunks (two workers share them)
CHUNKS = 10
LONG_SCHEDULES = 200  # a node gone for good and its peers running past RESOLVE_LIMIT_S (simulated: 75 s each)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_every_schedule_keeps_every_promise(chunk):
    """Each exchange applied on both sides or neither (both alive), the sum kept, nothing in doubt past its
    limit, nothing held after close, one unsettled exchange a node: SCHEDULES seeds in all, none violated. The
    schedules cover what they are for: commits, in doubt, aborts after doubt, expiries, preemptions, crossings
    given way, late confirms and drops all happen (counted across the chunk)."""
    size = SCHEDULES // CHUNKS
    counts: dict[str, int] = {}
    for seed in range(chunk * size, (chunk + 1) * size):
        for key, value in run_schedule(seed).counts.items():
            counts[key] = counts.get(key, 0) + value
    for key in ("decided.commit", "in_doubt", "aborted", "expired", "preempted", "given_way", "confirmed_late"):
        assert counts.get(f"exchanges_{key}", 0) >= 10, (key, counts)
    for key in ("answered_streaming", "streamed_in", "stream_failed"):  # bulk exchanges, in a quarter of them
        assert counts.get(f"sim.{key}", 0) >= 10, (key, counts)
    assert counts["exchanges_dropped"] >= 1, counts  # a requester gave up on a crashed or closed server
    # the views: members suspected, removed, admitted again, a restarted node back at its new incarnation, and
    # a node crashed for good checked absent past its bound
    for key in ("suspect", "removed", "admitted", "new_incarnation", "checked_gone"):
        assert counts.get(f"view.{key}", 0) >= 10, (key, counts)


def test_long_schedules_give_up_on_a_gone_peer_within_the_limit():
    """A node crashes for good; its peers run on for RESOLVE_LIMIT_S and more (simulated): what they were in
    doubt about with it is given up (dropped) within the limit, and nothing else is; and every live view has
    removed it by its bound (checked at each step past it, in every long schedule). In those of three nodes
    or more whose views keep their members through the gaps, another node crashes and restarts too, and is
    back in every live view at its new incarnation by the end of training (Sim.check_back)."""
    counts = [run_schedule(seed, long=True).counts for seed in range(LONG_SCHEDULES)]
    dropped = sum(c.get("exchanges_dropped", 0) for c in counts)
    assert dropped >= 5, dropped  # the schedules reach the limit (runs here: 47 drops, in 43 of the 200)
    gone = sum(1 for c in counts if c.get("view.checked_gone", 0))
    assert gone == LONG_SCHEDULES, gone  # every long schedule outlives its removal bound, checked
    back = sum(1 for c in counts if c.get("view.checked_back", 0))
    assert back >= 30, back  # runs here: 45 of the 200


def test_one_seed_replays():
    """DPWA_SIM_SEED (and DPWA_SIM_LONG=1) replays one schedule; without it, a seed run twice does exactly the
    same (the counts, every node's value and the clock at the end)."""
    seed = int(os.environ.get("DPWA_SIM_SEED", "7"))
    long = os.environ.get("DPWA_SIM_LONG", "") == "1"
    first, again = run_schedule(seed, long), run_schedule(seed, long)
    assert first.counts == again.counts
    assert [node.value for node in first.all] == [node.value for node in again.all]
    assert first.now == again.now


# --------------------------------------------------------------------------- teeth: planted bugs are caught

CAUGHT_WITHIN = 2000  # schedules; runs here caught each planted bug within the first few hundred


def _apply_on_abort(monkeypatch):
    monkeypatch.setattr(em, "decision_applies", lambda outcome: outcome in ("commit", "abort"))


def _commit_after_expiry(monkeypatch):
    monkeypatch.setattr(em.ServerMachine, "_expired", lambda self, entry, now: False)


def _commit_soon_after_expiry(monkeypatch):
    monkeypatch.setattr(em.ServerMachine, "_expired", lambda self, entry, now: now >= entry.expires + 0.3)


def _commit_before_the_stream_is_in(monkeypatch):
    decide = em.ServerMachine._decide

    def planted(self, peer, xid, withdraw, now):
        entry = self._pending.get((peer, xid))
        if entry is not None:
            entry.arrived = True
        return decide(self, peer, xid, withdraw, now)

    monkeypatch.setattr(em.ServerMachine, "_decide", planted)


def _give_way_while_confirming(monkeypatch):
    give_way = em.ServerMachine._give_way

    def planted(self, peer, version):
        self._own_confirming = False
        return give_way(self, peer, version)

    monkeypatch.setattr(em.ServerMachine, "_give_way", planted)


def _incarnation_by_anyone(monkeypatch):
    """View._plausible drops its incarnation rule: a third party's digest may raise a member's incarnation."""
    plausible = View._plausible

    def planted(self, member, claim, now):
        return plausible(self, member, replace(claim, incarnation=member.info.incarnation), now)

    monkeypatch.setattr(View, "_plausible", planted)


def _older_incarnation_by_heartbeat(monkeypatch):
    """News is compared heartbeat first, and the incarnation rule stops only raises: a relayed entry of a
    member's old incarnation with a higher heartbeat replaces its newer incarnation."""
    plausible = View._plausible

    def planted(self, member, claim, now):
        if claim.incarnation < member.info.incarnation:
            claim = replace(claim, incarnation=member.info.incarnation)
        return plausible(self, member, claim, now)

    monkeypatch.setattr(
        MemberInfo, "newer_than", lambda self, other: (self.beat, self.incarnation) > (other.beat, other.incarnation)
    )
    monkeypatch.setattr(View, "_plausible", planted)


def _remove_without_the_dead_window(monkeypatch):
    """A suspect member is removed at the next tick, without waiting dead_after_s."""
    tick = View.tick

    def planted(self, now):
        for member in self._members.values():
            if member.status == "suspect":
                member.since = min(member.since, now - self._dead_after)
        return tick(self, now)

    monkeypatch.setattr(View, "tick", planted)


def _heard_but_still_suspect(monkeypatch):
    """A member heard from is not made alive again: it stays suspect, and is removed while it talks to us."""
    monkeypatch.setattr(View, "_alive", lambda self, member, now: setattr(member, "heard_at", now))


@pytest.mark.parametrize(
    "plant",
    [
        _apply_on_abort,
        _commit_after_expiry,
        _commit_soon_after_expiry,
        _commit_before_the_stream_is_in,
        _give_way_while_confirming,
        _incarnation_by_anyone,
        _older_incarnation_by_heartbeat,
        _remove_without_the_dead_window,
        _heard_but_still_suspect,
    ],
    ids=[
        "apply on abort",
        "commit after expiry",
        "commit up to 0.3 s after expiry",
        "commit before the stream is in",
        "give way while confirming",
        "view: incarnation raised by anyone",
        "view: older incarnation by heartbeat",
        "view: removal without the dead window",
        "view: heard but still suspect",
    ],
)
def test_a_planted_bug_is_caught(monkeypatch, plant, capsys):
    """Each planted bug breaks a promise in some schedule within CAUGHT_WITHIN (runs here: apply on abort at
    the 1st schedule, a pending exchange that never expires (so commits after expiry) at the 7th, commit up
    to 0.3 s after expiry at the 504th, commit before the requester's stream is in at the 5th, give way while
    confirming at the 3rd; in the view: an incarnation raised by a third party's digest at the 1st, an old
    incarnation relayed over a newer one at the 31st, a suspect removed without the dead window at the 1st, a
    member heard from left suspect (removed while it talks to us) at the 1st)."""
    plant(monkeypatch)
    for seed in range(CAUGHT_WITHIN):
        try:
            run_schedule(seed)
        except Violation as caught:
            with capsys.disabled():
                print(f"\n{plant.__name__[1:]}: caught at schedule {seed + 1}: {str(caught).splitlines()[0]}")
            return
    pytest.fail(f"{plant.__name__[1:]} was not caught in {CAUGHT_WITHIN} schedules")


# --------------------------------------------------------------------------- the machine's rules, directly

ROOT = Path(__file__).resolve().parents[1]
NO_IO = {"zmq", "socket", "threading", "select", "time", "asyncio", "subprocess"}


def imports_of(path: Path) -> tuple[set[str], set[Path]]:
    """The top-level modules `path` imports from outside dpwa, and the dpwa modules it imports (their files)."""
    outside, inside = set(), set()
    package = path.relative_to(ROOT).parent.parts
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            names = [".".join((*base, node.module or ""))] if node.level else [node.module or ""]
        for name in names:
            if name.split(".")[0] == "dpwa":
                module = ROOT.joinpath(*name.split("."))
                inside.add(module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__init__.py")
            else:
                outside.add(name.split(".")[0])
    return outside, inside


@pytest.mark.parametrize(
    "module, needs",
    [
        ("exchange/machine.py", {"machine.py", "backoff.py", "admission.py"}),
        ("membership/view.py", {"view.py"}),
    ],
)
def test_the_machine_and_the_view_and_what_they_import_do_no_io(module, needs):
    """dpwa/gossip/exchange/machine.py and dpwa/gossip/membership/view.py, and every dpwa module they import
    (transitively; packages' __init__ files aside), import none of zmq, socket, threading, select or time: the
    protocol and the view hold no socket, thread or clock."""
    todo, seen = [ROOT / "dpwa" / "gossip" / module], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        outside, inside = imports_of(path)
        assert not outside & NO_IO, f"{path.relative_to(ROOT)} imports {sorted(outside & NO_IO)}"
        todo += [p for p in inside if p.name != "__init__.py"]
    assert {p.name for p in seen} >= needs, seen


class Handle:
    released = False


def served(machine: em.ServerMachine, peer: str, now: float, version: int = 1, wait_s: float = 1.0) -> int:
    """`peer`'s exchange served by `machine` at `now` on snapshot `version`: its xid."""
    assert machine.refusal(peer, now) is None
    assert machine.admit(peer, version, now) == ""
    xid = 100 + int(now * 1000)
    machine.hold(peer, xid, Handle(), now, now + wait_s + em.TTL_MARGIN_S)
    return xid


def test_the_server_commits_a_confirm_before_expiry_aborts_after_and_answers_the_same_again():
    machine: em.ServerMachine[Handle] = em.ServerMachine("w1", ttl_s=2.0)
    xid = served(machine, "w0", 0.0)
    assert machine.confirm("w0", xid, False, 1.9) == ("commit", True)
    assert machine.confirm("w0", xid, False, 5.0) == ("commit", False)  # remembered
    assert machine.confirm("w2", xid, False, 5.0) == ("unknown", False)  # keyed by the peer
    assert len(machine.take_committed(5.0)) == 1
    machine.applied(published=1)
    late = served(machine, "w0", 10.0, version=2)
    assert machine.confirm("w0", late, False, 12.0) == ("abort", False)  # expired at 12.0: an abort
    assert len(machine.take_released()) == 1 and machine.held() == 0


def test_failed_exchanges_pause_a_peer_for_the_ttl_doubling_to_the_limit_and_a_commit_resets_it():
    """EXPIRIES_BEFORE_PAUSE strikes in a row pause a peer for the ttl, then 2, 4, ... times it, up to
    RESOLVE_LIMIT_S (the Backoff that replaced min(RESOLVE_LIMIT_S, max(ttl, 2 * pause)))."""
    machine: em.ServerMachine[Handle] = em.ServerMachine("w1", ttl_s=10.0)
    now, pauses = 0.0, []
    for version in range(1, 9):
        served(machine, "w0", now, version, wait_s=1.0)
        now += 2.0 + em.TTL_MARGIN_S  # it expires unconfirmed: a strike
        machine.tick(now)
        refusal = machine.refusal("w0", now)
        if refusal is not None:
            until = now + float(refusal[1].rsplit("in ", 1)[1].split(" s")[0])
            pauses.append(round(until - now, 1))
            now = until
    assert pauses == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    xid = served(machine, "w0", now, 9)
    assert machine.confirm("w0", xid, False, now + 0.1)[0] == "commit"
    machine.take_committed(now)
    machine.applied(9)
    for version in (10, 11, 12):  # after a commit, three strikes again before a pause, and it is the ttl
        served(machine, "w0", now, version)
        now += 2.0 + em.TTL_MARGIN_S
        machine.tick(now)
    assert machine.refusal("w0", now) == ("busy", "your last exchanges failed on your side; ask again in 10.0 s")


def test_a_requester_asks_again_backing_off_and_gives_up_at_the_limit():
    machine: em.RequesterMachine[Handle] = em.RequesterMachine()
    half = Handle()
    machine.add("w1", 7, half, 0.0)
    assert machine.due(0.0) == ([("w1", 7)], [])
    gaps, now = [], 0.0
    for _ in range(6):  # each try fails: asked again after 0.1, 0.2, 0.4, 0.5, 0.5, 0.5 s
        machine.answered("w1", 7, None, now)
        retry_at = machine.doubts()[0].retry.retry_at
        assert machine.due(retry_at - 0.001) == ([], [])
        assert machine.due(retry_at) == ([("w1", 7)], [])
        gaps.append(round(retry_at - now, 6))
        now = retry_at
    assert gaps == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    machine.answered("w1", 7, None, now)
    asks, dropped = machine.due(em.RESOLVE_LIMIT_S + 0.01)
    assert asks == [] and [(d.peer, d.xid, d.half) for d in dropped] == [("w1", 7, half)]
    assert len(machine) == 0


def test_a_decision_in_doubt_is_applied_only_on_commit():
    machine: em.RequesterMachine[Handle] = em.RequesterMachine()
    committed, aborted = Handle(), Handle()
    machine.add("w1", 1, committed, 0.0)
    assert machine.answered("w1", 1, "commit", 0.1) is committed
    machine.add("w2", 2, aborted, 0.2)
    assert machine.answered("w2", 2, "abort", 0.3) is None
    assert machine.take_released() == [aborted] and len(machine) == 0


def test_a_reply_is_confirmed_only_with_its_id_the_same_factor_and_time_left():
    assert em.check_reply(5, 0.5, 0.5, now=0.0, deadline=1.0, min_confirm_s=0.1) is None
    assert em.check_reply(None, 0.5, 0.5, 0.0, 1.0, 0.1)[0] == "bad_reply"  # type: ignore[index]
    assert em.check_reply(5, 0.5, 0.25, 0.0, 1.0, 0.1)[0] == "bad_factor"  # type: ignore[index]
    assert em.check_reply(5, 0.5, 0.5, 0.95, 1.0, 0.1)[0] == "timeout"  # type: ignore[index]


def test_settling_stops_committing_once_decided_and_quiet_and_is_done_once_every_commit_is_known():
    settling = em.Settling()
    assert not settling.stop_committing(10.0, own_decided=False, pending=0, last_confirm=0.0)
    assert not settling.stop_committing(10.0, own_decided=True, pending=1, last_confirm=9.5)  # a confirm 0.5 s ago
    assert not settling.done(0, 0)
    assert settling.stop_committing(10.0, own_decided=True, pending=1, last_confirm=9.0)
    assert not settling.done(acks_pending=0, unacknowledged=1) and settling.done(0, 0)
