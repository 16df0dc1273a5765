"""Open membership on a node: its view of the members, shared by its threads, and the ``members`` call.

A node whose config names ``bootstrap:`` addresses (issue 32) owns one
:class:`Members`: the pure view (:class:`~dpwa.gossip.membership.view.View`, which
holds the rules) under one lock, because three threads touch it:

* the Rx thread merges the digests requests carry, answers ``members``
  (:class:`MembersServer`), and asks :meth:`Members.__contains__` whether a
  request's ``from`` names a member;
* the Tx thread (or the training thread, for a small model's direct fetch)
  puts a digest in each request and merges the one each reply carries
  (:class:`~dpwa.gossip.transfer.requesting.ReplyReader`);
* the training thread calls :meth:`Members.tick` between steps: silent members
  become suspect, long-suspect ones are removed, and the node's peers (flow
  control and the clients' address book) follow the view
  (:meth:`Members.sync`).

What a peer sends is checked twice: by the schema (:data:`~dpwa.gossip.membership.messages.ENTRY`:
types and lengths) and by :func:`~dpwa.gossip.membership.view.check_entry`
(names, endpoints, counts); every refusal is counted by its reason
(``members.refused.<reason>`` in ``stats()``), none raises. Announcements
(``members`` requests with an entry) admit at most :data:`ANNOUNCES_PER_S`
new members a second whatever names they use, and the view never holds more
than ``members_max``. One connection introduces one member at most (its
first admitted name; another new name from it is refused
``announce_source``): a node announces itself, and nobody else, so a client
that announces a new name with every request on one connection cannot take
the budget from the newcomers (before, one such client took every slot as it
freed, and a newcomer waited 16 s or more). These are the view's rules
(:meth:`~dpwa.gossip.membership.view.View.announce`, tested without a network);
this class adds the checks that need the request: its connection, its CURVE
key, and whether the member can be reached over this node's transport.

Nodes here are reached at their ``tcp://host:port``; in a cluster on
loopback addresses without keys (ipc transport) a member elsewhere cannot be
reached, and is refused (``unreachable``).

**With CURVE keys** every entry carries its member's key and certificate
(:mod:`dpwa.wire.certs`), and a member is admitted only on a certificate the
cluster key signed for that name and key (``members.refused.untrusted_key``
otherwise, and ``certs_refused.<reason>`` says why). :attr:`Members.keys` is
the live key -> name map the Rx thread's ZAP handler and each request's
identity are looked up in (``CurveKeys.open``): a member's key is known as
soon as it is admitted, and forgotten when it is removed. A request from a
key that is no member's (a newcomer) must carry an entry with that very key
(``members.refused.wrong_key`` otherwise), so nobody announces, or speaks
for, a member whose secret key it does not hold. A member whose certificate
expires is removed (``members.refused.cert_expired``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from zmq.utils import z85

from ...config import Config, NodeSpec, split_host_port
from ...logs import logger
from ...wire.calls import Ask
from ...wire.certs import Certifier
from ...wire.client import PeerBook
from ...wire.endpoints import ipc_endpoint
from ...wire.schema import encode
from ...wire.server import Reply, Request, Route
from .flow import FlowControl
from .messages import MEMBERS, MEMBERS_REPLY
from .view import DIGEST_MAX, MemberInfo, View, check_entry

__all__ = ["ANNOUNCES_PER_S", "KeyBook", "Members", "MembersServer", "MembersTask", "TOMBSTONE_MIN_S", "member_spec"]

ANNOUNCES_PER_S = 8  # members admitted by announcements (``members`` requests) per second, all askers together
SOURCES_KEPT = 4096  # connections remembered with the member each introduced (the oldest forgotten first)
TOMBSTONE_MIN_S = 60.0  # a removed member's last news is kept at least this long (and at least suspect + dead time)
TICK_S = 0.05  # the view's clocks are looked at at most this often (each look is one pass over the members)


class Members:
    """This node's view of the cluster, for every thread of the node. Thread-safe; every method is bounded.

    Args:
        config: the cluster (``bootstrap:``, ``members_max``, ``suspect_after_ms``, ``dead_after_ms``).
        spec: this node's entry; its incarnation is its start time in ms.
        rng: randomness for digests' samples.
        clock: monotonic seconds (tests pass a fake one).
        cert: (keyed) this node's member certificate, carried in its own entry.
        certifier: (keyed) the cluster key's consent, asked of every member gossip brings.
        client_options: (keyed) a member's raw server key -> the options of our sockets to it.
        wall_clock: unix seconds, for certificates' expiry.
    """

    def __init__(
        self,
        config: Config,
        spec: NodeSpec,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        cert: str | None = None,
        certifier: Certifier | None = None,
        client_options: Callable[[bytes], Mapping[int, Any]] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock, self._wall_clock = clock, wall_clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._ipc = config.transport == "ipc"
        self._keyed = spec.public_key is not None
        if self._keyed and (cert is None or certifier is None or client_options is None):
            raise ValueError(f"{spec.name}: a keyed cluster's member needs its certificate, a certifier and keys")
        self._certifier, self._client_options = certifier, client_options
        self.incarnation = int(time.time() * 1000)
        own = MemberInfo(spec.name, spec.tcp_endpoint, spec.public_key, self.incarnation, 0, cert)
        suspect_s, dead_s = config.suspect_after_ms / 1000.0, config.dead_after_ms / 1000.0
        self._view = View(
            own,
            max_members=config.members_max,
            suspect_after_s=suspect_s,
            dead_after_s=dead_s,
            tombstone_s=max(TOMBSTONE_MIN_S, 2 * (suspect_s + dead_s)),
            keyed=self._keyed,
            trusted=certifier if certifier is not None else lambda name, key, cert: True,
            cert_order=certifier.order if certifier is not None else lambda cert: None,
            announces_per_s=ANNOUNCES_PER_S,
            sources_kept=SOURCES_KEPT,
        )
        self.keys = KeyBook()  # a member's raw CURVE key -> its name (keyed): what the Rx thread asks
        self._expiry: dict[str, int] = {}  # certificate -> its not_after (keyed; bounded, see _expire)
        self._view_max = config.members_max
        self._checked = -float("inf")  # when _expire last looked
        self._refused: Counter[str] = Counter()  # refusals made here, before the view (unreachable, wrong_key)
        self._changes = 0  # members added or removed so far: the node's peers follow when it moves
        self._synced = -1  # _changes when the node's peers last followed the view (the training thread's)
        self._synced_incarnations: dict[str, int] = {}  # each member's incarnation when the peers last followed
        self._ticked = -float("inf")  # when tick() last looked at the clocks
        self.retired = 0  # members retired for never taking part (retire)
        now = clock()
        for peer in config.peers_of(spec.name):  # the config's other nodes: the first view
            self._view.add(MemberInfo(peer.name, peer.tcp_endpoint, peer.public_key, 0, 0), now)
        self._rekey()

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
            certs = self._certifier.stats() if self._certifier is not None else {}  # it counts under this lock
        out: dict[str, Any] = {"members": names, "members.count": len(names), "members.suspect": suspects}
        out["members.reclaimed"] = self._view.reclaimed
        out["members.retired"] = self.retired
        out.update({f"members.refused.{reason}": count for reason, count in sorted(refused.items())})
        out.update(certs)
        return out

    # ----------------------------------------------------------------- learning

    def merge(self, sender: str, entries: Any) -> list[str]:
        """Take in a digest `sender` sent (None: it sent none); return the names it added. Never raises."""
        if entries is None:
            return []
        if isinstance(entries, Sequence) and not isinstance(entries, (str, bytes)):
            entries = [e for e in entries[: DIGEST_MAX + 1] if self._reachable(e)]
        with self._lock:
            restarts = self._view.restarts
            added = self._view.merge(sender, entries, self._clock())
            self._changed(len(added) + self._view.restarts - restarts)
        for info in added:
            logger.info("%s: %s joined the view (from %s), at %s", self.name, info.name, sender, info.endpoint)
        return [info.name for info in added]

    def announce(self, raw: Any, key: str | None = None, source: bytes | None = None) -> bool:
        """A ``members`` request's entry: admit its sender (within ANNOUNCES_PER_S a second); True if it is
        a member now. `key`: the requester's CURVE key (keyed), which the entry must carry. `source`: the
        connection it came on (the ROUTER's routing id), which may introduce one member at most."""
        try:
            claim = check_entry(raw)
        except ValueError:
            with self._lock:
                self._view.refused["bad_entry"] += 1
            return False
        if not self._reachable(raw) or not self._holds(claim.key, key):
            return False
        with self._lock:  # the view's rules: rate, one member per connection, names (View.announce)
            known = self._view.get(claim.name) is not None
            restarts = self._view.restarts
            added = self._view.announce(raw, source, self._clock())
            self._changed(len(added) + self._view.restarts - restarts)
            member = self._view.get(claim.name)
        if added and not known:
            logger.info("%s: %s announced itself, at %s", self.name, claim.name, claim.endpoint)
        elif added:  # it took its name back from a holder that never answered
            logger.warning("%s: %s took its name back, at %s", self.name, claim.name, claim.endpoint)
        return member is not None and member.info.same_node(claim)

    def admit(self, sender: str, digest: Any, key: str | None = None, source: bytes | None = None) -> bool:
        """A request from `sender` carrying `digest`: is the sender a member? One we do not know yet may
        introduce itself, its own entry first in its digest (:meth:`announce`: rate-limited, within
        ``members_max``, a name nobody else holds). A member was heard from, and its digest is merged.
        `key`: the requester's CURVE key (keyed): the member `sender` names must hold it."""
        if sender not in self and digest and isinstance(digest[0], Mapping) and digest[0].get("name") == sender:
            self.announce(digest[0], key, source)
        if sender not in self or not self._holds(self.key_of(sender), key):
            return False
        self.merge(sender, digest)  # first: its own entry may take its name back from a squatter's (View)
        self.heard(sender)
        return True

    def heard(self, name: str) -> None:
        """`name` answered us, or asked us something: it is alive."""
        with self._lock:
            self._view.heard(name, self._clock())

    def age(self, name: str) -> float:
        """How long `name` has been a member (since it was last admitted), in seconds; 0 if it is not one."""
        with self._lock:
            member = self._view.get(name)
            return self._clock() - member.admitted_at if member is not None else 0.0

    def retire(self, name: str) -> bool:
        """Drop member `name`, which never took part (see :meth:`View.retire`); False if it is not a member."""
        with self._lock:
            retired = self._view.retire(name, self._clock())
            if retired:
                self.retired += 1
                self._changed(1)
        if retired:
            logger.warning("%s: member %s never took part: removed from the view (only a restart readmits it "
                           "soon)", self.name, name)  # fmt: skip
        return retired

    def move(self, endpoint: str) -> None:
        """This node is reached at `endpoint` from now on (``tcp://HOST:PORT``: a relay's port), not where it listens."""
        with self._lock:
            self._view.move(endpoint)
        logger.info("%s: peers reach this node at %s", self.name, endpoint)

    @property
    def certifier(self) -> Certifier | None:
        """The cluster key's consent (a cluster with keys), None without keys."""
        return self._certifier

    def options_for(self, key: str | None) -> Mapping[int, Any] | None:
        """Our sockets' options to a node whose server key is `key` (keyed); None without keys."""
        if self._client_options is None or key is None:
            return None
        return self._client_options(key.encode())

    def key_of(self, name: str) -> str | None:
        """Member `name`'s CURVE key (Z85), if it is a member with one."""
        with self._lock:
            member = self._view.get(name)
            return member.info.key if member is not None else None

    def _holds(self, claimed: str | None, key: str | None) -> bool:
        """Keyed: may a requester holding `key` speak for an entry that carries `claimed`? Only if they are
        the same (a request without CURVE gives no key: an unkeyed cluster, where nothing is compared)."""
        if not self._keyed or key is None or claimed == key:
            return True
        with self._lock:
            self._refused["wrong_key"] += 1
        return False

    def _changed(self, count: int) -> None:
        """(Under the lock) `count` members came or went: the node's peers follow, and so do the keys."""
        if count:
            self._changes += count
            self._rekey()

    def _rekey(self) -> None:
        if self._keyed:  # this node's own key too: a tool (status) asks with the key of the config's node
            infos = [self._view.own, *(m.info for m in self._view.members())]
            self.keys.replace({z85.decode(info.key.encode()): info.name for info in infos if info.key})

    def _expire(self, now: float) -> list[str]:
        """(Under the lock; keyed) Remove the members whose certificate ran out; at most once a second."""
        wall = self._wall_clock()
        if not self._keyed or wall - self._checked < 1.0:
            return []
        self._checked = wall
        assert self._certifier is not None
        if len(self._expiry) > 4 * self._view_max:
            self._expiry.clear()
        gone = []
        for member in self._view.members():
            cert = member.info.cert
            if cert is None:
                continue  # listed in the config: its consent is the config's
            not_after = self._expiry.get(cert)
            if not_after is None:
                not_after = self._expiry[cert] = self._certifier.not_after(cert) or 0
            if wall > not_after and self._view.remove(member.info.name, now):
                self._refused["cert_expired"] += 1
                gone.append(member.info.name)
        self._changed(len(gone))
        return gone

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
            self._changed(sum(1 for _, what in changed if what == "removed"))
            changed += [(name, "removed (its certificate expired)") for name in self._expire(now)]
        for name, what in changed:
            logger.info("%s: member %s is %s", self.name, name, what)
        return changed

    def sync(self, flow: FlowControl, book: PeerBook, gone: Callable[[str], None] = lambda peer: None) -> None:
        """(The training thread) Make the node's peers the view's: new members get a fresh score and an
        address in the clients' book, removed ones are dropped from both. `gone` is told of each member that
        left, and of each that came back as a new incarnation (a restart): a new node under an old name."""
        self.tick()
        with self._lock:
            if self._changes == self._synced:
                return
            self._synced = self._changes
            incarnations = {m.info.name: m.info.incarnation for m in self._view.members()}
        current, asked = self.peers(), set(flow.peers())
        for name in asked - set(current):
            flow.remove_peer(name)
            book.drop(name)
            gone(name)
        for name in set(self._synced_incarnations) - set(incarnations):
            del self._synced_incarnations[name]
        for name, incarnation in incarnations.items():
            if self._synced_incarnations.setdefault(name, incarnation) != incarnation:
                self._synced_incarnations[name] = incarnation
                flow.remove_peer(name)  # a fresh score: its predecessor's failures were not its own
                asked.discard(name)
                gone(name)
        for name, spec in current.items():
            endpoint = ipc_endpoint(spec.port) if self._ipc else spec.tcp_endpoint  # as config.endpoint, no lookup
            if book.get(name) != endpoint:
                book.put(name, endpoint, self.options_for(spec.public_key))
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
    spec = _spec_of(info.endpoint, info.name)
    return dataclasses.replace(spec, public_key=info.key) if spec is not None and info.key else spec


class KeyBook(Mapping[bytes, str]):
    """A member's raw 32-byte CURVE key -> its name: read by the Rx thread (its ZAP handler, and each
    request's identity), replaced whole by the thread that changed the view (a dict swap: readers never
    see one half-built)."""

    def __init__(self) -> None:
        self._keys: dict[bytes, str] = {}

    def replace(self, keys: dict[bytes, str]) -> None:
        self._keys = keys

    def __getitem__(self, key: bytes) -> str:
        return self._keys[key]

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._keys))

    def __len__(self) -> int:
        return len(self._keys)


class MembersServer:
    """Answers ``members`` (Rx thread): merges the asker's entry, if any, and sends a digest of the view."""

    def __init__(self, members: Members) -> None:
        self._members = members

    def routes(self) -> dict[str, Route]:
        return {MEMBERS.name: Route(MEMBERS, self.serve, newcomers=True)}

    def serve(self, request: Request) -> Reply:
        me = request.header.get("me")
        admitted = self._members.announce(me, request.key, request.client) if me is not None else False
        digest = self._members.digest()
        if request.key is not None and request.identity is None and not admitted:
            digest = digest[:1]  # keyed: a key that is no member's learns only who answered, not the view
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
