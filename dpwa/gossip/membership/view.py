"""Open membership's view: who is in the cluster, as this node knows it. Pure: no sockets, no threads, no clock.

The view is the ground for open membership (nodes that join through any
known peer; issue 32): the node, its exchanges and barriers will read it,
and exchanges will carry its digests. This module owns the rules alone, so
they can be tested without a network:

* **Liveness, by heartbeats that travel by gossip** (van Renesse et al.
  1998). Each digest a node sends carries its own entry with its heartbeat
  raised by one. A member whose heartbeat rose, in anyone's digest, or that
  answered us directly, was heard from now. One not heard from for
  ``suspect_after_s`` is ``suspect`` (SWIM's word, Das et al. 2002: still a
  member, and alive again as soon as it is heard from); one suspected for
  ``dead_after_s`` is removed. So a member is judged by what the whole
  cluster heard of it, not by whether this node happened to exchange with it.
* **Removal is remembered** (a tombstone, ``tombstone_s``): gossip that
  brings nothing newer than what the member last said cannot bring it back;
  the member's own word, from itself at the same endpoint, does (a relayed
  heartbeat run ahead before it was removed must not keep it out).
  A member that comes back, after a partition or a restart, says something
  newer: a higher heartbeat, or a higher *incarnation* (a restarted node
  starts with a new one, as the caller picks it, its start time say), and is
  admitted again.
* **Digests, after peer sampling** (Jelasity et al. 2007): at most
  :data:`DIGEST_MAX` entries, the sender first and the rest a random sample
  of what it knows, never the whole view.
* **Bounds.** The view holds at most ``max_members``. One sender may
  introduce at most ``new_per_sender`` members per ``new_interval_s``. A
  digest is cut to :data:`DIGEST_MAX` entries, each field checked
  (:func:`check_entry`). A node that announces itself (:meth:`View.announce`:
  a ``members`` request's entry) is admitted within ``announces_per_s``
  newcomers a second, whoever announces them (``announce_rate``), and one
  connection introduces one member at most, its first (``announce_source``):
  a node announces itself, and nobody else. Every refusal is counted by its
  reason in :attr:`View.refused`; nothing a peer sends raises out of
  :meth:`View.merge` or :meth:`View.announce`.
* **News is evidence, not truth** (issue 41). A member's incarnation is its
  own to raise: a claim that raises it reaches the view only from the member
  itself (the digest's sender), never relayed. A relayed heartbeat may run
  ahead of the last news by at most :data:`BEAT_RATE` a second (and
  :data:`BEAT_SLACK`), not jump to 2**53. And the member's own entry, from
  the member itself, is taken as the truth about it even when it is not
  "newer" (SWIM's refutation): forged news that ran ahead of it is undone the
  next time the member speaks to us. (Before, one forged entry with
  incarnation and heartbeat 2**53 made every later true entry "older": the
  member was suspected and removed while it was alive.)
* **A member that never takes part is retired** (:meth:`View.retire`, the
  caller's judgement: a barrier's, :mod:`dpwa.gossip.membership.barrier`). It leaves the
  view as a dead one would, but its heartbeats cannot bring it back: for
  ``tombstone_s`` only a new incarnation, a restart of the node, readmits it
  (``retired`` counts the claims refused meanwhile). A ghost that answers
  every poll and never arrives is thus not re-admitted by its own rising
  heartbeat a moment later.
* **Names are unique.** A claim that gives a member's name another endpoint
  or key is refused (``name_taken``): a member cannot be impersonated, or
  pushed out, by claims about it. Only the node itself takes its name back
  from a holder that never answered us directly, or that is suspect (a
  squatter's entry at an address nobody serves, or its own entry from before
  a restart): :attr:`View.reclaimed`. Claims about this node itself are not
  taken from others at all, and one naming it elsewhere is refused the same way.
* **Consent.** Where the cluster has keys, a member is admitted only if
  ``trusted(name, key, cert)`` says so (a cluster key's signature on a
  member certificate the entry carries, :mod:`dpwa.wire.certs`, decided by
  the caller); a claim without a key is refused there. Later news of a
  member may bring a renewed certificate; one that is not trusted is not
  taken (the news is, with the certificate the view had), so nobody can
  spread a bad certificate in a member's name. :meth:`View.remove` drops a
  member whose consent ended (its certificate expired).
"""

from __future__ import annotations

import random
import re
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["BEAT_RATE", "BEAT_SLACK", "DIGEST_MAX", "MAX_COUNT", "Member", "MemberInfo", "View", "check_entry"]

Status = Literal["alive", "suspect"]
DIGEST_MAX = 16  # entries one digest carries at most
MAX_COUNT = 2**53  # an incarnation or a heartbeat beyond this is refused: nobody skips ahead without bound
BEAT_RATE = 2000.0  # heartbeats a second a relayed claim may add to the last news of a member, at most ...
BEAT_SLACK = 64  # ... plus this (a node raises its own by one per digest it sends)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as a config's node names, at most 64 characters
_ENDPOINT_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")
_KEY_RE = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")  # a Z85 CURVE public key
_CERT_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")  # a member certificate: base64url, as dpwa.wire.certs has it
_FIELDS = ("name", "endpoint", "key", "cert", "inc", "beat")


@dataclass(frozen=True)
class MemberInfo:
    """One member as a digest tells it: who it is (name, endpoint, key) and how recent the news is."""

    name: str
    endpoint: str  # tcp://host:port, where its Rx thread listens
    key: str | None = None  # its Z85 CURVE public key, in a keyed cluster
    incarnation: int = 0  # a new one at each start of the node (the caller picks it: its start time, say)
    beat: int = 0  # raised by the node itself with each digest it sends
    cert: str | None = None  # its member certificate, in a keyed cluster (not part of who it is: it is renewed)

    def same_node(self, other: MemberInfo) -> bool:
        """The same node: the same name, endpoint and key."""
        return (self.name, self.endpoint, self.key) == (other.name, other.endpoint, other.key)

    def newer_than(self, other: MemberInfo) -> bool:
        """Is this later news of the node than `other`: a later incarnation, or a later heartbeat in one?"""
        return (self.incarnation, self.beat) > (other.incarnation, other.beat)

    def entry(self) -> dict[str, Any]:
        """The digest entry of this member (what :func:`check_entry` reads back)."""
        return {"name": self.name, "endpoint": self.endpoint, "key": self.key, "cert": self.cert,
                "inc": self.incarnation, "beat": self.beat}  # fmt: skip


def check_entry(raw: Any) -> MemberInfo:
    """A digest entry as a peer sent it, checked field by field; ValueError naming the field otherwise."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"an entry must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {sorted(map(str, unknown))}")
    name, endpoint, key, cert = raw.get("name"), raw.get("endpoint"), raw.get("key"), raw.get("cert")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"name must be 1 to 64 letters, digits, '_', '.', '-', got {name!r:.80}")
    match = _ENDPOINT_RE.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{name}: endpoint must be tcp://HOST:PORT, got {endpoint!r:.80}")
    if key is not None and (not isinstance(key, str) or not _KEY_RE.fullmatch(key)):
        raise ValueError(f"{name}: key must be a 40-character Z85 public key or null, got {key!r:.80}")
    if cert is not None and (not isinstance(cert, str) or not _CERT_RE.fullmatch(cert) or key is None):
        raise ValueError(f"{name}: cert must be a member certificate (base64url, with a key) or null, got {cert!r:.80}")
    counts = []
    for field in ("inc", "beat"):
        value = raw.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise ValueError(f"{name}: {field} must be an integer in [0, 2**53], got {value!r:.80}")
        counts.append(value)
    return MemberInfo(name, str(endpoint), key, counts[0], counts[1], cert)


@dataclass
class Member:
    """A member in the view: the latest news of it, when it was last heard from, and its status here."""

    info: MemberInfo
    heard_at: float  # monotonic seconds: it answered us, or its heartbeat rose in someone's digest
    status: Status = "alive"
    since: float = 0.0  # when its status last changed
    news_at: float = 0.0  # when `info` last changed (a relayed heartbeat is bounded by the time since)
    direct: bool = False  # it answered us, or asked us, at least once at this endpoint (not only gossip)
    admitted_at: float = -float("inf")  # when it (last) entered the view: set by the view


def _consent(info: MemberInfo) -> tuple[str, str | None, str | None]:
    return info.name, info.key, info.cert


class View:
    """This node's view of the members. Owned by one thread (the caller's); every method is bounded.

    Args:
        own: this node.
        max_members: the most members the view holds, this node included; newcomers beyond it are refused.
        suspect_after_s: a member not heard from for this long is suspect.
        dead_after_s: a suspect for this long is removed.
        tombstone_s: a removed member's last news is kept this long: gossip no newer is ignored.
        new_per_sender: members one sender may introduce per `new_interval_s`.
        keyed: the cluster has CURVE keys: a member must have one, and `trusted` must accept it.
        trusted: ``trusted(name, key, cert)``: may this member join? (keyed clusters: a cluster key's signature.)
        cert_order: a certificate's (issued, expires) times, or None if unknown: of two valid certificates of a
            member, the view keeps the newer (an older one still valid, relayed by anyone, never replaces it).
        announces_per_s: newcomers :meth:`announce` admits a second at most, whoever announces them.
        sources_kept: connections remembered with the member each introduced (the oldest forgotten first).
    """

    def __init__(
        self,
        own: MemberInfo,
        *,
        max_members: int = 256,
        suspect_after_s: float = 5.0,
        dead_after_s: float = 10.0,
        tombstone_s: float = 60.0,
        new_per_sender: int = 8,
        new_interval_s: float = 1.0,
        keyed: bool = False,
        trusted: Callable[[str, str | None, str | None], bool] = lambda name, key, cert: True,
        cert_order: Callable[[str | None], tuple[int, int] | None] = lambda cert: None,
        announces_per_s: int = 8,
        sources_kept: int = 4096,
    ) -> None:
        if min(max_members, new_per_sender, announces_per_s, sources_kept) < 1:
            raise ValueError(
                "max_members, new_per_sender, announces_per_s and sources_kept must be at least 1, got "
                f"{max_members}, {new_per_sender}, {announces_per_s} and {sources_kept}"
            )
        if min(suspect_after_s, dead_after_s, tombstone_s, new_interval_s) <= 0:
            raise ValueError("the view's times must be positive")
        if keyed and own.key is None:
            raise ValueError(f"{own.name}: a keyed cluster's member needs a key")
        self.own = own
        self._max, self._keyed, self._trusted, self._cert_order = max_members, keyed, trusted, cert_order
        self._suspect_after, self._dead_after, self._tombstone_s = suspect_after_s, dead_after_s, tombstone_s
        self._new_per_sender, self._new_interval = new_per_sender, new_interval_s
        self._members: dict[str, Member] = {}
        self._tombstones: dict[str, tuple[MemberInfo, float]] = {}  # name -> (its last news, removed at)
        self._retired: set[str] = set()  # tombstones that only a new incarnation beats (retire)
        self._introduced: dict[str, deque[float]] = {}  # sender -> when it introduced members, the latest few
        self._announced: deque[float] = deque(maxlen=announces_per_s)  # when announcements admitted members
        self._sources: OrderedDict[Hashable, str] = OrderedDict()  # a connection -> the member it introduced
        self._sources_kept = sources_kept
        self.refused: Counter[str] = Counter()  # claims refused, by reason
        self.reclaimed = 0  # names taken back by their node from a holder that never answered (_reclaims)
        self.restarts = 0  # members that came back as a new incarnation (a restarted node), so far

    # ----------------------------------------------------------------- reading

    def __len__(self) -> int:
        """Members this node counts, itself included (alive or suspect)."""
        return 1 + len(self._members)

    def members(self) -> list[Member]:
        """Every member but this node, alive or suspect, by name."""
        return [self._members[name] for name in sorted(self._members)]

    def names(self) -> list[str]:
        """Every member's name, this node's included, sorted (what a barrier counts)."""
        return sorted([self.own.name, *self._members])

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    def digest(self, rng: random.Random, size: int = DIGEST_MAX) -> list[dict[str, Any]]:
        """At most `size` entries (and at most DIGEST_MAX): this node first, its heartbeat raised by one,
        then a random sample of the others."""
        size = max(1, min(size, DIGEST_MAX))
        self.own = replace(self.own, beat=min(self.own.beat + 1, MAX_COUNT))
        others = [m.info for m in self._members.values()]
        sample = rng.sample(others, min(size - 1, len(others)))
        return [self.own.entry(), *(info.entry() for info in sample)]

    def move(self, endpoint: str) -> None:
        """This node is reached at `endpoint` from now on (a relay gave it a port there): its own entry says so
        under a higher incarnation, so the news wins over the old address in every view."""
        self.own = replace(self.own, endpoint=endpoint, incarnation=min(self.own.incarnation + 1, MAX_COUNT))

    # ----------------------------------------------------------------- learning

    def heard(self, name: str, now: float) -> bool:
        """`name` answered us directly: it is alive. False if it is not a member."""
        member = self._members.get(name)
        if member is None:
            return False
        member.direct = True
        self._alive(member, now)
        return True

    def merge(self, sender: str, entries: Sequence[Any], now: float) -> list[MemberInfo]:
        """Take in a digest `sender` sent; return the members it added.

        Nothing raises: a digest longer than DIGEST_MAX is cut to it (counted ``digest_too_long``), and every
        entry refused is counted in :attr:`refused` by its reason.
        """
        if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
            self.refused["bad_digest"] += 1
            return []
        if len(entries) > DIGEST_MAX:
            self.refused["digest_too_long"] += 1
            entries = entries[:DIGEST_MAX]
        added = []
        for raw in entries:
            try:
                claim = check_entry(raw)
            except ValueError:
                self.refused["bad_entry"] += 1
                continue
            if claim.name == self.own.name:
                if not claim.same_node(self.own):
                    self.refused["name_taken"] += 1  # someone else claims our name
                continue  # news of ourselves is ours to make
            member = self._members.get(claim.name)
            if member is None:
                if self._admit(sender, claim, now):
                    added.append(claim)
            elif not member.info.same_node(claim):
                if not self._reclaims(sender, member, claim, now):
                    self.refused["name_taken"] += 1
                else:
                    added.append(claim)
            elif sender == claim.name or claim.newer_than(member.info):
                if sender != claim.name and not self._plausible(member, claim, now):
                    continue  # a third party's claim that only the member could make, or a jump
                if self._keyed and claim.cert != member.info.cert and not self._trusted(*_consent(claim)):
                    self.refused["untrusted_cert"] += 1  # the news, but not a certificate we cannot trust
                    claim = replace(claim, cert=member.info.cert)
                elif self._keyed and claim.cert != member.info.cert and self._older_cert(claim, member.info):
                    self.refused["older_cert"] += 1  # the news, but the newer certificate stays
                    claim = replace(claim, cert=member.info.cert)
                if claim.incarnation != member.info.incarnation:
                    self.restarts += 1  # a new node under the old name: the caller forgets its predecessor
                member.info, member.news_at = claim, now  # from the member itself: the truth, newer or not
                self._alive(member, now)
        return added

    def announce(self, raw: Any, source: Hashable | None, now: float) -> list[MemberInfo]:
        """A node announces itself: `raw` is its own entry (a ``members`` request's), which came on connection
        `source` (None: unknown). Merged as the node's own word (:meth:`merge`, the node the sender). A name
        the view does not hold is admitted within two bounds more: at most ``announces_per_s`` newcomers a
        second, whoever announces them (``announce_rate``), and one newcomer per connection, its first
        (``announce_source``). Returns the members added (the node, or none); never raises."""
        try:
            claim = check_entry(raw)
        except ValueError:
            self.refused["bad_entry"] += 1
            return []
        if self._members.get(claim.name) is not None:  # a member's word (it may take its name back: merge)
            return self.merge(claim.name, [raw], now)
        introduced = self._sources.get(source) if source is not None else None
        if introduced is not None and introduced != claim.name:
            self.refused["announce_source"] += 1  # this connection introduced another member already
            return []
        if len(self._announced) == self._announced.maxlen and now - self._announced[0] < 1.0:
            self.refused["announce_rate"] += 1
            return []
        added = self.merge(claim.name, [raw], now)
        if added:
            if source is not None:
                self._sources[source] = claim.name
                while len(self._sources) > self._sources_kept:
                    self._sources.popitem(last=False)
            self._announced.append(now)
        return added

    def _reclaims(self, sender: str, member: Member, claim: MemberInfo, now: float) -> bool:
        """A node claims its own name, held here at another endpoint (or with another key): it takes the name
        back when the holder never answered us directly (a squatter's entry at an address nobody serves), or
        is suspect (the node's own old entry, from before a restart). Only the node itself may, and in a keyed
        cluster only with a certificate the view trusts. A holder we hear from keeps the name."""
        if sender != claim.name or (member.direct and member.status != "suspect"):
            return False
        if self._keyed and (claim.key is None or not self._trusted(*_consent(claim))):
            return False
        self._members[claim.name] = Member(claim, heard_at=now, since=now, news_at=now, admitted_at=now)
        self.reclaimed += 1
        self.restarts += claim.incarnation != member.info.incarnation
        return True

    def _older_cert(self, claim: MemberInfo, known: MemberInfo) -> bool:
        """Is the claim's certificate older than the one the view holds (issued earlier, or as early and
        expiring sooner)? Unknown orders are not older."""
        theirs, ours = self._cert_order(claim.cert), self._cert_order(known.cert)
        return theirs is not None and ours is not None and theirs < ours

    def _plausible(self, member: Member, claim: MemberInfo, now: float) -> bool:
        """May a third party bring `claim` of `member`? Not a new incarnation (the member's own to raise), and
        not a heartbeat further ahead of the last news than BEAT_RATE a second allows."""
        if claim.incarnation != member.info.incarnation:
            self.refused["incarnation_by_other"] += 1
            return False
        if claim.beat > member.info.beat + BEAT_RATE * max(0.0, now - member.news_at) + BEAT_SLACK:
            self.refused["beat_too_far"] += 1
            return False
        return True

    def add(self, info: MemberInfo, now: float) -> bool:
        """Admit a member this node's own configuration names (not gossip: no rate limit, no consent asked);
        still within ``max_members``, and never a second claim to a name. False if it was not added."""
        if info.name == self.own.name or info.name in self._members:
            return False
        if len(self) >= self._max:
            self.refused["view_full"] += 1
            return False
        self._tombstones.pop(info.name, None)
        self._retired.discard(info.name)
        self._members[info.name] = Member(info, heard_at=now, since=now, news_at=now, admitted_at=now)
        return True

    def remove(self, name: str, now: float) -> bool:
        """Drop member `name` now (its consent ended: a certificate expired), remembering its last news as
        :meth:`tick` does: only later news brings it back. False if it is not a member."""
        member = self._members.pop(name, None)
        if member is None:
            return False
        self._tombstones[name] = (member.info, now)
        return True

    def retire(self, name: str, now: float) -> bool:
        """Drop member `name`, which never took part (it never completed an exchange with us, and a barrier
        waited a suspicion period for it alone): as :meth:`remove`, but for ``tombstone_s`` only a new
        incarnation brings it back, not a newer heartbeat. False if it is not a member."""
        if not self.remove(name, now):
            return False
        self._retired.add(name)
        return True

    def _alive(self, member: Member, now: float) -> None:
        member.heard_at = now
        if member.status != "alive":
            member.status, member.since = "alive", now

    def _admit(self, sender: str, claim: MemberInfo, now: float) -> bool:
        buried = self._tombstones.get(claim.name)
        if buried is not None:
            own_word = sender == claim.name and claim.same_node(buried[0])  # refutes, as in the view (merge)
            if not claim.newer_than(buried[0]) and not own_word:
                return False  # stale gossip about a member removed
            if claim.name in self._retired and claim.incarnation <= buried[0].incarnation:
                self.refused["retired"] += 1  # a member retired for never taking part: only a restart
                return False
            del self._tombstones[claim.name]
            self._retired.discard(claim.name)
        if len(self) >= self._max:
            self.refused["view_full"] += 1
            return False
        introduced = self._introduced.setdefault(sender, deque(maxlen=self._new_per_sender))
        if len(introduced) == self._new_per_sender and now - introduced[0] < self._new_interval:
            self.refused["rate_limited"] += 1
            return False
        # the signature last: a claim that cannot be admitted anyway costs no verification
        if self._keyed and (claim.key is None or not self._trusted(*_consent(claim))):
            self.refused["untrusted_key"] += 1
            return False
        introduced.append(now)
        self._members[claim.name] = Member(claim, heard_at=now, since=now, news_at=now, admitted_at=now)
        return True

    # ----------------------------------------------------------------- time

    def tick(self, now: float) -> list[tuple[str, str]]:
        """Suspect the silent, remove the long suspected, forget old tombstones; return (name, what happened)
        for each change: ``suspect`` or ``removed``."""
        changed = []
        for name, member in list(self._members.items()):
            if member.status == "alive" and now - member.heard_at >= self._suspect_after:
                member.status, member.since = "suspect", now
                changed.append((name, "suspect"))
            elif member.status == "suspect" and now - member.since >= self._dead_after:
                del self._members[name]
                self._tombstones[name] = (member.info, now)
                changed.append((name, "removed"))
        for name, (_, removed_at) in list(self._tombstones.items()):
            if now - removed_at >= self._tombstone_s:
                del self._tombstones[name]
                self._retired.discard(name)
        for sender, times in list(self._introduced.items()):
            if times and now - times[-1] >= self._new_interval:
                del self._introduced[sender]
        return changed
