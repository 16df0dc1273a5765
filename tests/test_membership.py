"""The membership view's rules (dpwa.gossip.membership.view), without a network: a simulated clock, seeded gossip.

What each test asserts is known in advance: who is in every view after a
bounded number of rounds, what a refusal is counted as, and that no
hostile digest changes an honest view.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from dpwa.gossip.membership.view import DIGEST_MAX, MemberInfo, View, check_entry

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a well-formed Z85 key (40 characters)
OTHER_KEY = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def info(i: int, incarnation: int = 0, beat: int = 0, port: int | None = None) -> MemberInfo:
    return MemberInfo(f"n{i}", f"tcp://127.0.0.1:{port or 20000 + i}", None, incarnation, beat)


def status(v: View, name: str) -> str:
    member = v.get(name)
    assert member is not None, f"{name} is not in the view"
    return member.status


def view(i: int, **kwargs) -> View:
    return View(info(i), suspect_after_s=5.0, dead_after_s=10.0, tombstone_s=60.0, **kwargs)


def gossip_round(views: dict[str, View], alive: set[str], rng: random.Random, now: float) -> None:
    """Every live node sends its digest to one random member it knows that is alive; the receiver merges it,
    answers with its own (merged by the sender), and each hears the other directly."""
    for name in sorted(alive):
        v = views[name]
        targets = [m.info.name for m in v.members() if m.info.name in alive]
        if not targets:
            continue
        peer = rng.choice(targets)
        views[peer].merge(name, v.digest(rng), now)
        v.merge(peer, views[peer].digest(rng), now)
        views[peer].heard(name, now)
        v.heard(peer, now)


def test_a_digest_is_bounded_and_its_sender_comes_first():
    v = view(0, max_members=100, new_per_sender=100)
    assert v.merge("n1", [info(i).entry() for i in range(1, 17)], now=0.0) != []
    digest = v.digest(random.Random(0), size=5)
    assert len(digest) == 5 and digest[0]["name"] == "n0"
    again = v.digest(random.Random(0), size=100)
    assert len(again) == DIGEST_MAX
    assert check_entry(digest[1]).name in {m.info.name for m in v.members()}
    assert (digest[0]["beat"], again[0]["beat"]) == (1, 2)  # this node's heartbeat rises with each digest


def test_eight_nodes_from_one_bootstrap_address_all_see_all_within_bounded_rounds():
    """n1..n7 each know only n0 (their bootstrap): within 12 rounds of gossip every view holds all eight."""
    rng = random.Random(1)
    views = {f"n{i}": view(i) for i in range(8)}
    for i in range(1, 8):
        views[f"n{i}"].merge("n0", [info(0).entry()], now=0.0)  # what the bootstrap address answered
        views["n0"].merge(f"n{i}", [info(i).entry()], now=0.0)  # and what the joiner announced
    alive = set(views)
    for r in range(12):
        gossip_round(views, alive, rng, now=0.1 * r)
        if all(len(v) == 8 for v in views.values()):
            break
    assert {name: v.names() for name, v in views.items()} == {name: sorted(views) for name in views}
    assert all(not v.refused for v in views.values())


def test_two_killed_and_three_new_and_every_view_converges_within_the_stated_bound():
    """n6 and n7 stop (SIGKILL: they send and answer nothing); n8, n9, n10 join through n1. Within
    suspect_after + dead_after (+ a few rounds) every live view holds exactly n0..n5 and n8..n10."""
    rng = random.Random(2)
    views = {f"n{i}": view(i) for i in range(8)}
    for a in views.values():
        a.merge("n0", [info(i).entry() for i in range(8)], now=0.0)
    alive = set(views) - {"n6", "n7"}
    for i in (8, 9, 10):
        views[f"n{i}"] = view(i)
        views[f"n{i}"].merge("n1", [info(1).entry()], now=0.0)
        views["n1"].merge(f"n{i}", [info(i).entry()], now=0.0)
        alive.add(f"n{i}")
    now, step = 0.0, 0.25
    while now < 5.0 + 10.0 + 3.0:  # suspect_after + dead_after, and three seconds of rounds
        gossip_round(views, alive, rng, now)
        for name in alive:
            views[name].tick(now)
        now += step
    expected = sorted(alive)
    assert {name: views[name].names() for name in alive} == {name: expected for name in alive}


def test_a_silent_member_is_suspected_then_removed_and_stale_gossip_cannot_bring_it_back():
    v = view(0)
    v.merge("n1", [info(1).entry(), info(2).entry()], now=0.0)
    assert [m.status for m in v.members()] == ["alive", "alive"]
    v.heard("n1", 4.0)
    assert v.tick(5.0) == [("n2", "suspect")]  # silent since 0
    v.heard("n2", 6.0)  # it answered after all
    assert status(v, "n2") == "alive"
    assert v.tick(11.0) == [("n1", "suspect"), ("n2", "suspect")]  # n1 silent since 4, n2 since 6
    assert v.tick(21.5) == [("n1", "removed"), ("n2", "removed")]  # suspected for 10 s
    assert v.names() == ["n0"]
    assert v.merge("n3", [info(2).entry()], now=22.0) == []  # stale gossip: nothing newer than it last said
    assert v.names() == ["n0"]
    assert v.merge("n3", [info(2, beat=5).entry()], now=23.0) == [info(2, beat=5)]  # it came back
    assert v.merge("n3", [info(1, incarnation=7).entry()], now=23.0) == [info(1, incarnation=7)]  # restarted
    assert v.names() == ["n0", "n1", "n2"]


def test_a_member_heard_of_only_through_others_stays_while_its_heartbeat_rises():
    """n0 never exchanges with n2, but n1 passes on n2's rising heartbeat: n2 is never suspected. Once n2
    stops (its heartbeat stands still), n0 suspects it after suspect_after_s, however often n1 repeats it."""
    v = view(0)
    v.merge("n1", [info(1).entry(), info(2).entry()], now=0.0)
    for t in range(1, 20):
        v.merge("n1", [info(1, beat=t).entry(), info(2, beat=t).entry()], now=float(t))
        assert v.tick(float(t)) == []
    for t in range(20, 26):
        v.merge("n1", [info(1, beat=t).entry(), info(2, beat=19).entry()], now=float(t))
        v.tick(float(t))
    assert status(v, "n1") == "alive" and status(v, "n2") == "suspect"


def test_forged_news_of_a_live_member_cannot_evict_it_and_its_own_word_refutes_it():
    """Issue 41: one relayed entry of n1 with incarnation and heartbeat 2**53 made every later true entry of
    n1 "older": n1 was suspected and removed while alive (2.1 s after one request, in the review's run).
    Now a third party cannot raise n1's incarnation (incarnation_by_other), a relayed heartbeat may run
    ahead of the last news by BEAT_RATE a second at most (beat_too_far), and n1's own entry, from n1,
    is taken as the truth (SWIM's refutation): n1 stays a member for the whole attack."""
    from dpwa.gossip.membership.view import BEAT_RATE, BEAT_SLACK, MAX_COUNT

    v = view(0)
    v.merge("n1", [info(1, incarnation=3, beat=10).entry()], now=0.0)
    v.merge("n2", [info(2).entry()], now=0.0)
    assert v.merge("n2", [info(1, incarnation=MAX_COUNT, beat=MAX_COUNT).entry()], now=0.5) == []
    assert v.refused["incarnation_by_other"] == 1 and v.get("n1").info.incarnation == 3  # type: ignore[union-attr]
    assert v.merge("n2", [info(1, incarnation=3, beat=MAX_COUNT).entry()], now=0.5) == []
    assert v.refused["beat_too_far"] == 1 and v.get("n1").info.beat == 10  # type: ignore[union-attr]
    most = 10 + int(BEAT_RATE * 0.5) + BEAT_SLACK  # as far as half a second allows
    v.merge("n2", [info(1, incarnation=3, beat=most).entry()], now=0.5)
    assert v.get("n1").info.beat == most  # type: ignore[union-attr]
    v.merge("n1", [info(1, incarnation=3, beat=11).entry()], now=1.0)  # n1 speaks for itself: the truth
    assert v.get("n1").info.beat == 11  # type: ignore[union-attr]
    v.merge("n2", [info(1, incarnation=3, beat=12).entry()], now=1.5)  # and true relays count again
    assert v.get("n1").info.beat == 12  # type: ignore[union-attr]
    for t in range(2, 40):  # the attack goes on; n1 keeps talking to us now and then
        v.merge("n2", [info(2, beat=t).entry(), info(1, incarnation=MAX_COUNT, beat=MAX_COUNT).entry()], float(t))
        if t % 3 == 0:
            v.merge("n1", [info(1, incarnation=3, beat=12 + t).entry()], now=float(t))
        v.tick(float(t))
        assert status(v, "n1") == "alive", t
    assert v.merge("n1", [info(1, incarnation=4, beat=0).entry()], now=40.0) == []  # restarted: its own word
    assert v.get("n1").info.incarnation == 4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "claim",
    [
        info(1, port=46000),  # n1's name, another endpoint
        MemberInfo("n1", "tcp://127.0.0.1:20001", KEY),  # n1's name and endpoint, another key
        info(1, incarnation=9, beat=9, port=46000),  # an impostor with later news
    ],
)
def test_an_impersonated_name_is_refused_and_the_honest_view_does_not_change(claim):
    v = view(0)
    v.merge("n1", [info(1).entry()], now=0.0)
    before = v.members()
    assert v.merge("n9", [claim.entry()], now=1.0) == []
    assert v.refused == {"name_taken": 1} and v.members() == before
    assert v.merge("n9", [info(0, port=1).entry()], now=1.0) == []  # our own name, elsewhere
    assert v.merge("n9", [info(0, incarnation=5).entry()], now=1.0) == []  # news of ourselves: ours to make
    assert v.refused["name_taken"] == 2 and v.own == info(0)


def test_ten_thousand_fake_members_and_malformed_entries_are_refused_with_reasons():
    v = view(0, max_members=32, new_per_sender=8)
    fake = [info(i + 1).entry() for i in range(10_000)]
    added = v.merge("n1", fake, now=0.0)
    assert len(added) == 8 and v.refused["digest_too_long"] == 1  # cut to 16, then 8 new per sender and second
    assert v.refused["rate_limited"] == DIGEST_MAX - 8
    for sender in range(2, 40):  # many senders: the view stays within its stated maximum
        v.merge(f"n{sender}", [info(1000 + 20 * sender + k).entry() for k in range(DIGEST_MAX)], now=0.5)
    assert len(v) == 32 and v.refused["view_full"] > 0
    bad = [
        "n1",
        {"name": "n 1", "endpoint": "tcp://a:1", "key": None, "inc": 0, "beat": 0},
        {"name": "x" * 65, "endpoint": "tcp://a:1", "key": None, "inc": 0, "beat": 0},
        {"name": "n2", "endpoint": "ipc:///tmp/x", "key": None, "inc": 0, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:70000", "key": None, "inc": 0, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1", "key": "short", "inc": 0, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1", "key": None, "inc": -1, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1", "key": None, "inc": True, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1", "key": None, "inc": 2**60, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1", "key": None, "inc": 0, "beat": "1"},
        {"name": "n2", "endpoint": "tcp://a:1", "key": None, "inc": 0, "beat": 0, "extra": 1},
        # a pattern's $ also matches before a last newline: each field must match whole
        {"name": "n2\n", "endpoint": "tcp://a:1", "key": None, "inc": 0, "beat": 0},
        {"name": "n2", "endpoint": "tcp://a:1\n", "key": None, "inc": 0, "beat": 0},
        {
            "name": "n2",
            "endpoint": "tcp://a:1",
            "key": "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7\n",
            "inc": 0,
            "beat": 0,
        },
    ]
    w = view(0)
    assert w.merge("n1", bad, now=0.0) == [] and w.refused == {"bad_entry": len(bad)}
    assert w.merge("n1", "n1,n2", now=0.0) == [] and w.refused["bad_digest"] == 1
    assert w.names() == ["n0"]


def test_check_entry_names_the_field_at_fault():
    with pytest.raises(ValueError, match="n2: endpoint must be tcp://HOST:PORT"):
        check_entry({"name": "n2", "endpoint": "udp://a:1", "key": None, "inc": 0, "beat": 0})
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        check_entry({"name": "n2", "extra": 1})
    assert check_entry(info(3).entry()) == info(3)


def test_a_keyed_cluster_admits_only_keys_it_trusts():
    own = MemberInfo("n0", "tcp://127.0.0.1:20000", KEY)
    v = View(own, keyed=True, trusted=lambda name, key, cert: (name, key) == ("n1", OTHER_KEY))
    v.merge("n1", [MemberInfo("n1", "tcp://127.0.0.1:20001", OTHER_KEY).entry()], now=0.0)
    v.merge("n1", [MemberInfo("n2", "tcp://127.0.0.1:20002", KEY).entry()], now=0.0)  # a key not trusted
    v.merge("n1", [info(3).entry()], now=0.0)  # no key at all
    assert v.names() == ["n0", "n1"] and v.refused == {"untrusted_key": 2}
    with pytest.raises(ValueError, match="needs a key"):
        View(info(0), keyed=True)


def test_an_older_certificate_still_valid_never_replaces_the_newer_one():
    """Issue 41: an old certificate of n1 that was still valid, relayed by anyone, swapped the view back to
    it, and n1 was removed as expired 101 s later although it held one valid for 30 days. Of two valid
    certificates the view keeps the newer (issued later): the older is refused (older_cert), its news taken."""
    own = MemberInfo("n0", "tcp://127.0.0.1:20000", KEY)
    issued = {"old": (100, 200), "new": (150, 3000), "newest": (160, 4000)}
    v = View(own, keyed=True, trusted=lambda name, key, cert: True, cert_order=lambda cert: issued.get(cert or ""))
    n1 = MemberInfo("n1", "tcp://127.0.0.1:20001", OTHER_KEY, 1, 1, cert="new")
    v.merge("n1", [n1.entry()], now=0.0)
    v.merge("n2", [replace(n1, beat=2, cert="old").entry()], now=1.0)
    member = v.get("n1")
    assert member is not None and member.info.cert == "new" and member.info.beat == 2
    assert v.refused["older_cert"] == 1
    v.merge("n1", [replace(n1, beat=3, cert="newest").entry()], now=2.0)  # a renewal: taken
    assert v.get("n1").info.cert == "newest"  # type: ignore[union-attr]


def test_a_node_takes_its_name_back_from_a_holder_that_never_answered_but_not_from_a_live_one():
    """Issue 41: one claim of n1 at a dead port kept the real n1 out when it restarted (its peers held n1 at
    the squatter's port). The node itself, claiming its own name (it is the digest's sender), takes it back
    from a holder that never answered us directly, or that is suspect; a third party cannot, and nobody can
    take a name from a holder that answers."""
    v = view(0)
    v.merge("n9", [info(1, port=46000).entry()], now=0.0)  # the squatter's entry: n1 at a dead port
    assert v.merge("n9", [info(1).entry()], now=0.5) == [] and v.refused["name_taken"] == 1  # not a third party
    assert v.merge("n1", [info(1).entry()], now=1.0) == [info(1)]  # n1 itself: never heard at 46000
    assert v.get("n1").info.endpoint == "tcp://127.0.0.1:20001" and v.reclaimed == 1  # type: ignore[union-attr]
    v.heard("n1", 2.0)  # n1 answers us at its endpoint
    assert v.merge("n1", [info(1, port=47000).entry()], now=3.0) == []  # a live holder keeps the name
    assert v.get("n1").info.endpoint == "tcp://127.0.0.1:20001" and v.refused["name_taken"] == 2  # type: ignore[union-attr]
    v.tick(8.0)  # silent since 2: suspect
    assert status(v, "n1") == "suspect"
    assert v.merge("n1", [info(1, incarnation=2, port=47000).entry()], now=8.5) == [info(1, incarnation=2, port=47000)]
    assert v.reclaimed == 2  # n1 restarted on another port: its own entry takes over from its old, suspect one


def test_a_member_removed_after_a_relayed_heartbeat_ran_ahead_comes_back_on_its_own_word():
    """Issue 41: n3 relays n2's heartbeat as far ahead as the rate bound allows (2,000 a second); n2's true
    entries relayed after that are "older" and ignored, so n2, silent to n0 directly, is removed with the
    forged heartbeat in its tombstone. Relayed true news still cannot bring it back, but n2's own entry, from
    n2 at the same endpoint, does (before, it stayed out until its own heartbeat passed the forged one)."""
    v = view(0)
    v.merge("n1", [info(1).entry(), info(2, beat=10).entry(), info(3).entry()], now=0.0)
    assert v.merge("n3", [info(3).entry(), info(2, beat=2010).entry()], now=1.0) == []
    n2 = v.get("n2")
    assert n2 is not None and n2.info.beat == 2010  # plausible: within the bound
    for t in range(2, 18):
        v.merge("n1", [info(1, beat=t).entry(), info(2, beat=10 + t).entry(), info(3, beat=t).entry()], float(t))
        v.tick(float(t))
    assert "n2" not in v.names()  # removed: its true heartbeats were older than the forged one
    assert v.merge("n1", [info(1, beat=30).entry(), info(2, beat=40).entry()], now=18.0) == []  # relayed: no
    assert v.merge("n2", [info(2, beat=41).entry()], now=18.5) == [info(2, beat=41)]  # its own word: yes
    assert status(v, "n2") == "alive"


def test_announcements_admit_a_bounded_number_a_second_and_one_member_per_connection():
    """A node announces itself (a ``members`` request): at most `announces_per_s` newcomers a second whatever
    names they use, one newcomer per connection (its first), and a member's own word is merge's."""
    v = view(0, announces_per_s=3, new_per_sender=100)
    assert v.announce(info(1).entry(), b"c1", now=0.0) == [info(1)]
    assert v.announce(info(2).entry(), b"c1", now=0.1) == [] and v.refused["announce_source"] == 1
    assert v.announce(info(1, beat=5).entry(), b"c1", now=0.2) == []  # its own news again: taken, not added
    assert v.get("n1").info.beat == 5  # type: ignore[union-attr]
    assert [len(v.announce(info(i).entry(), f"c{i}".encode(), now=0.3)) for i in (2, 3, 4)] == [1, 1, 0]
    assert v.refused["announce_rate"] == 1 and "n4" not in v.names()
    assert v.announce(info(4).entry(), b"c4", now=1.0) == [info(4)]  # a second after the first: room again
    assert v.announce({"name": "n5"}, b"c5", now=2.0) == [] and v.refused["bad_entry"] == 1


def test_the_connections_remembered_are_bounded_and_the_oldest_forgotten_first():
    v = view(0, announces_per_s=100, sources_kept=2, new_per_sender=100)
    for i in (1, 2, 3):
        assert v.announce(info(i).entry(), f"c{i}".encode(), now=float(i)) == [info(i)]
    assert v.announce(info(4).entry(), b"c1", now=5.0) == [info(4)]  # c1 was forgotten: it may introduce one
    assert v.announce(info(5).entry(), b"c3", now=6.0) == [] and v.refused["announce_source"] == 1


def test_a_member_that_comes_back_as_a_new_incarnation_counts_as_a_restart():
    """Its own entry with a new incarnation is a new node under the old name (the node's peers forget its
    predecessor's record); relayed news of one is refused, and a higher heartbeat is no restart."""
    v = view(0)
    v.merge("n1", [info(1).entry(), info(2).entry()], now=0.0)
    v.merge("n1", [info(1, beat=3).entry()], now=1.0)
    v.merge("n1", [info(2, incarnation=7).entry()], now=1.0)  # a third party: incarnation_by_other
    assert v.restarts == 0 and v.refused["incarnation_by_other"] == 1
    v.merge("n2", [info(2, incarnation=7).entry()], now=2.0)
    assert v.restarts == 1 and v.get("n2").info.incarnation == 7  # type: ignore[union-attr]
    v.tick(8.0)  # n1 silent since 1: suspect; restarted elsewhere, it takes its name back (a restart too)
    assert v.announce(info(1, incarnation=2, port=47000).entry(), None, now=8.5) == [info(1, 2, port=47000)]
    assert v.restarts == 2 and v.reclaimed == 1
