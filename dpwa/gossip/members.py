"""Open membership on a node: its view of the members, shared by its threads, and the ``members`` call.

A node whose config names ``bootstrap:`` addresses (issue 32) owns one
:class:`Members`: the pure view (:class:`~dpwa.gossip.membership.View`, which
holds the rules) under one lock, because three threads touch it:

* the Rx thread merges the digests requests carry, answers ``members``
  (:class:`MembersServer`), and asks :meth:`Members.__contains__` whether a
  request's ``from`` names a member;
* the Tx thread (or the training thread, for a small model's direct fetch)
  puts a digest in each request and merges the one each reply carries
  (:class:`~dpwa.gossip.requesting.ReplyReader`);
* the training thread calls :meth:`Members.tick` between steps: silent members
  become suspect, long-suspect ones are removed, and the node's peers (flow
  control and the clients' address book) follow the view
  (:meth:`Members.sync`).

What a peer sends is checked twice: by the schema (:data:`~dpwa.gossip.protocol.ENTRY`:
types and lengths) and by :func:`~dpwa.gossip.membership.check_entry`
(names, endpoints, counts); every refusal is counted by its reason
(``members.refused.<reason>`` in ``stats()``), none raises. Announcements
(``members`` requests with an entry) admit at most :data:`ANNOUNCES_PER_S`
new members a second whatever names they use, and the view never holds more
than ``members_max``.

Nodes here are reached at their ``tcp://host:port``; in a cluster on
loopback addresses without keys (ipc transport) a member elsewhere cannot be
reached, and is refused (``unreachable``).
"""

from __future__ import annotations

import ipaddress
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..config import Config, NodeSpec, split_host_port
from ..logs import logger
from ..wire.calls import Ask
from ..wire.client import PeerBook
from ..wire.endpoints import ipc_endpoint
from ..wire.schema import encode
from ..wire.server import Reply, Request, Route
from .flow import FlowControl
from .membership import DIGEST_MAX, MemberInfo, View, check_entry
from .protocol import MEMBERS, MEMBERS_REPLY

__all__ = ["ANNOUNCES_PER_S", "Members", "MembersServer", "MembersTask", "TOMBSTONE_MIN_S", "member_spec"]

ANNOUNCES_PER_S = 8  # members admitted by announcements (``members`` requests) per second, all askers together
TOMBSTONE_MIN_S = 60.0  # a removed member's last news is kept at least this long (and at least suspect + dead time)
TICK_S = 0.05  # the view's clocks are looked at at most this often (each look is one pass over the members)


class Members:
    """This node's view of the cluster, for every thread of the node. Thread-safe; every method is bounded.

    Args:
        config: the cluster (``bootstrap:``, ``members_max``, ``suspect_after_ms``, ``dead_after_ms``).
        spec: this node's entry; its incarnation is its start time in ms.
        rng: randomness for digests' samples.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        config: Config,
        spec: NodeSpec,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._ipc = config.transport == "ipc"
        self.incarnation = int(time.time() * 1000)
        own = MemberInfo(spec.name, spec.tcp_endpoint, None, self.incarnation, 0)
        suspect_s, dead_s = config.suspect_after_ms / 1000.0, config.dead_after_ms / 1000.0
        self._view = View(
            own,
            max_members=config.members_max,
            suspect_after_s=suspect_s,
            dead_after_s=dead_s,
            tombstone_s=max(TOMBSTONE_MIN_S, 2 * (suspect_s + dead_s)),
        )
        self._announced: deque[float] = deque(maxlen=ANNOUNCES_PER_S)  # when announcements admitted members
        self._refused: Counter[str] = Counter()  # refusals made here, before the view (unreachable, announce_rate)
        self._changes = 0  # members added or removed so far: the node's peers follow when it moves
        self._synced = -1  # _changes when the node's peers last followed the view (the training thread's)
        self._ticked = -float("inf")  # when tick() last looked at the clocks
        now = clock()
        for peer in config.peers_of(spec.name):  # the config's other nodes: the first view
            self._view.add(MemberInfo(peer.name, peer.tcp_endpoint, None, 0, 0), now)

    @property
    def name(self) -> str:
        return self._view.own.name

    # ----------------------------------------------------------------- reading

    def __contains__(self, name: object) -> bool:
        """Is `name` a member (alive or suspect)? What the Rx thread asks of a request's ``from``."""
        with self._lock:
            return isinstance(name, str) and self._view.get(name) is not None

    def names(self) -> list[str]:
        """Every member's name, this node's included, sorted."""
        with self._lock:
            return self._view.names()

    def others(self) -> set[str]:
        """Every member's name but this node's (whom a barrier waits for)."""
        with self._lock:
            return {member.info.name for member in self._view.members()}

    def own_entry(self) -> dict[str, Any]:
        """This node's digest entry, as announced in a ``members`` request (its heartbeat not raised)."""
        with self._lock:
            return _wire(self._view.own.entry())

    def peers(self) -> dict[str, NodeSpec]:
        """Every member but this node, as the node entries its clients connect to, by name."""
        with self._lock:
            members = self._view.members()
        out = {}
        for member in members:
            spec = _spec(member.info)
            if spec is not None:
                out[spec.name] = spec
        return out

    def digest(self) -> list[dict[str, Any]]:
        """A digest to send: this node first (its heartbeat raised), then a random sample of the others."""
        with self._lock:
            return [_wire(entry) for entry in self._view.digest(self._rng, DIGEST_MAX)]

    def report(self) -> dict[str, Any]:
        """For ``stats()``: the members' names and count, and every refusal by reason (``members.refused.*``)."""
        with self._lock:
            names = self._view.names()
            refused = self._view.refused + self._refused
            suspects = sum(1 for m in self._view.members() if m.status == "suspect")
        out: dict[str, Any] = {"members": names, "members.count": len(names), "members.suspect": suspects}
        out.update({f"members.refused.{reason}": count for reason, count in sorted(refused.items())})
        return out

    # ----------------------------------------------------------------- learning

    def merge(self, sender: str, entries: Any) -> list[str]:
        """Take in a digest `sender` sent (None: it sent none); return the names it added. Never raises."""
        if entries is None:
            return []
        if isinstance(entries, Sequence) and not isinstance(entries, (str, bytes)):
            entries = [e for e in entries[: DIGEST_MAX + 1] if self._reachable(e)]
        with self._lock:
            added = self._view.merge(sender, entries, self._clock())
            self._changes += len(added)
        for info in added:
            logger.info("%s: %s joined the view (from %s), at %s", self.name, info.name, sender, info.endpoint)
        return [info.name for info in added]

    def announce(self, raw: Any) -> bool:
        """A ``members`` request's entry: admit its sender (within ANNOUNCES_PER_S a second); True if it is
        a member now."""
        try:
            claim = check_entry(raw)
        except ValueError:
            with self._lock:
                self._view.refused["bad_entry"] += 1
            return False
        if not self._reachable(raw):
            return False
        now = self._clock()
        with self._lock:
            known = self._view.get(claim.name)
            if known is None:
                if len(self._announced) == ANNOUNCES_PER_S and now - self._announced[0] < 1.0:
                    self._refused["announce_rate"] += 1
                    return False
                added = self._view.merge(claim.name, [raw], now)
                if added:
                    self._announced.append(now)
                    self._changes += 1
                    logger.info("%s: %s announced itself, at %s", self.name, claim.name, claim.endpoint)
                return bool(added)
            self._view.merge(claim.name, [raw], now)
            member = self._view.get(claim.name)
            return member is not None and member.info.same_node(claim)

    def admit(self, sender: str, digest: Any) -> bool:
        """A request from `sender` carrying `digest`: is the sender a member? One we do not know yet may
        introduce itself, its own entry first in its digest (:meth:`announce`: rate-limited, within
        ``members_max``, a name nobody else holds). A member was heard from, and its digest is merged."""
        if sender not in self and digest and isinstance(digest[0], Mapping) and digest[0].get("name") == sender:
            self.announce(digest[0])
        if sender not in self:
            return False
        self.heard(sender)
        self.merge(sender, digest)
        return True

    def heard(self, name: str) -> None:
        """`name` answered us, or asked us something: it is alive."""
        with self._lock:
            self._view.heard(name, self._clock())

    def _reachable(self, raw: Any) -> bool:
        """Over ipc (a loopback cluster without keys) only members on this machine's loopback can be reached:
        a loopback address, or ``localhost`` (never resolved: a peer's host name must cost no DNS lookup)."""
        if not self._ipc or not isinstance(raw, dict) or not isinstance(raw.get("endpoint"), str):
            return True  # the view's own checks judge it
        spec = _spec_of(raw["endpoint"], "?")
        if spec is None or _literal_loopback(spec.host):
            return True
        with self._lock:
            self._refused["unreachable"] += 1
        return False

    # ----------------------------------------------------------------- time

    def tick(self) -> list[tuple[str, str]]:
        """Suspect the silent, remove the long suspected; return (name, ``suspect`` or ``removed``) per change."""
        now = self._clock()
        with self._lock:
            if now - self._ticked < TICK_S:
                return []
            self._ticked = now
            changed = self._view.tick(now)
            self._changes += sum(1 for _, what in changed if what == "removed")
        for name, what in changed:
            logger.info("%s: member %s is %s", self.name, name, what)
        return changed

    def sync(self, flow: FlowControl, book: PeerBook) -> None:
        """(The training thread) Make the node's peers the view's: new members get a fresh score and an
        address in the clients' book, removed ones are dropped from both."""
        self.tick()
        with self._lock:
            if self._changes == self._synced:
                return
            self._synced = self._changes
        current, asked = self.peers(), set(flow.peers())
        for name in asked - set(current):
            flow.remove_peer(name)
            book.drop(name)
        for name, spec in current.items():
            endpoint = ipc_endpoint(spec.port) if self._ipc else spec.tcp_endpoint  # as config.endpoint, no lookup
            if book.get(name) != endpoint:
                book.put(name, endpoint)
            if name not in asked:
                flow.add_peer(name)


def _wire(entry: dict[str, Any]) -> dict[str, Any]:
    """A view entry as it travels: without ``key`` where there is none (the schema's ``key`` is a string)."""
    return {field: value for field, value in entry.items() if value is not None}


def _literal_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def member_spec(name: str, endpoint: str) -> NodeSpec | None:
    """A member's node entry from its digest endpoint (``tcp://host:port``); None if it is not one."""
    return _spec_of(endpoint, name)


def _spec_of(endpoint: str, name: str) -> NodeSpec | None:
    host_port = split_host_port(endpoint.removeprefix("tcp://"))
    return NodeSpec(name=name, host=host_port[0], port=host_port[1]) if host_port is not None else None


def _spec(info: MemberInfo) -> NodeSpec | None:
    return _spec_of(info.endpoint, info.name)


class MembersServer:
    """Answers ``members`` (Rx thread): merges the asker's entry, if any, and sends a digest of the view."""

    def __init__(self, members: Members) -> None:
        self._members = members

    def routes(self) -> dict[str, Route]:
        return {MEMBERS.name: Route(MEMBERS, self.serve)}

    def serve(self, request: Request) -> Reply:
        me = request.header.get("me")
        admitted = self._members.announce(me) if me is not None else False
        digest = self._members.digest()
        return Reply(encode(MEMBERS_REPLY, request.header.id, members=digest, admitted=admitted))


class MembersTask:
    """Ask a node (a bootstrap address) who the members are, announcing ourselves. Its value is
    (the reply's digest, whether we were admitted)."""

    def __init__(self, peer: str, deadline: float, me: dict[str, Any] | None) -> None:
        self.peer, self.deadline, self._me = peer, deadline, me

    def run(self, ask: Ask) -> tuple[list[dict[str, Any]], bool]:
        fields = {"me": self._me} if self._me is not None else {}
        response = ask(lambda rid: [encode(MEMBERS, rid, **fields)], {MEMBERS_REPLY.name: MEMBERS_REPLY})
        return list(response.header["members"]), bool(response.header["admitted"])
