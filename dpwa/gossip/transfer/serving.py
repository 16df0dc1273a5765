"""The serving side of a node: answer ``fetch`` with the latest snapshot (Rx thread).

A reply carries the snapshot as zero-copy frames leased until ZeroMQ has
sent them; or, to a same-host peer that asked for it and when the snapshot's
slot is in shared memory, only the slot's name and version: the peer locks
and reads the slot itself (see :mod:`dpwa.wire.shm`); or, to a peer that
asked for a ``bulk`` transfer, a token (and, with CURVE keys, the transfer's
own key) and the port where the leased snapshot waits for it (see
:mod:`dpwa.wire.bulk`). When the bulk server refuses the transfer (its
budget is spent, or it is closing), the snapshot goes over ZeroMQ instead
if the requester's budget of unsent replies allows it. The symmetric
exchange's server half (:mod:`dpwa.gossip.exchange.driver`) answers with the same
replies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...mixing.codecs import Sender
from ...mixing.model import WireModel
from ...stats import Counters
from ...wire.bulk import BulkServer
from ...wire.errors import ProtocolError, Refused, refused
from ...wire.schema import Header, encode
from ...wire.server import Reply, Request, Route
from ..membership.members import Members
from .protocol import BULK_PARAMS, FETCH, PARAMS, SHM_PARAMS, check_payload
from .snapshots import Lease, SnapshotStore

__all__ = ["Serving"]


class Serving:
    """Answers snapshot requests from a :class:`SnapshotStore`.

    Args:
        name: this node.
        store: the published snapshots.
        model: what our model looks like on the wire.
        shm_id: the id of our shared-memory slot directory, if same-host peers may read it.
        counters: where to count same-host replies.
        bulk: streams snapshots to peers that ask for a bulk transfer (sealed in clusters with keys).
        bulk_ttl_s: how long a bulk transfer waits for its requester.
        sender: the wire codec's encoder (``wire_dtype: int8`` or ``topk``): snapshots are encoded as they
            are sent, for the peer that asked; None: the kept array travels as it is.
        carry: the scalars the node's rule sends with each snapshot a fetch is served (its ``served``), or None.
        members: open membership's view: the digest a request carries is merged, and each reply carries one.
            None: digests are neither read nor sent.
    """

    def __init__(
        self,
        name: str,
        store: SnapshotStore,
        model: WireModel,
        shm_id: str | None,
        counters: Counters,
        bulk: BulkServer | None = None,
        bulk_ttl_s: float = 0.0,
        sender: Sender | None = None,
        carry: Callable[[int], dict[str, float]] | None = None,
        members: Members | None = None,
    ) -> None:
        self.name, self.store = name, store
        self._members = members
        self._carry = carry
        self.model = model
        self.shm_id = shm_id
        self._counters = counters
        self._bulk, self._bulk_ttl_s = bulk, bulk_ttl_s
        self._sender = sender  # a compressing codec: snapshots are encoded as they are sent

    def routes(self) -> dict[str, Route]:
        return {FETCH.name: Route(FETCH, self.serve_fetch, bulk=True, newcomers=True)}

    def check_request(self, header: Header, key: str | None = None, source: bytes | None = None) -> None:
        """The requester's model must be ours: fingerprint, wire dtype (and size, for an exchange), and its rule
        (a fetch may name none: a tool's, which moves nothing here).

        With open membership the requester must be a member of our view: one we do not know yet may introduce
        itself, its own entry first in its digest, as an announcement (:meth:`Members.announce`: rate-limited,
        within ``members_max``, a name nobody else holds). Then its digest is merged, and it was heard from.
        `key`: the requester's CURVE key (open membership with keys), which that member must hold."""
        members = self._members
        if members is not None:
            sender = header["from"]
            if not members.admit(sender, header.get("digest"), key, source):
                raise ProtocolError("bad_identity", f"{sender!r} is not a member of this node's view")
        check_payload(header, self.model, rule_required=header.kind != FETCH.name)

    def serve_fetch(self, request: Request) -> Reply:
        self.check_request(request.header, request.key, request.client)
        self.check_budget(request)
        lease = self.store.lease()
        if lease is None:
            raise refused(*self.store.refusal())
        if self._carry is None or request.header.get("rule") is None:
            # a tool's fetch (status, average: it names no rule) takes nothing: a push-sum weight given to a
            # tool would be lost to the cluster
            return self.reply(request, lease)
        # asked once per fetch served, for the snapshot it is served
        return self.reply(request, lease, carry=list(self._carry(lease.snapshot.version).values()))

    def reply(self, request: Request, lease: Lease, **extra: Any) -> Reply:
        """Our snapshot for `request` (a fetch or an exchange): by stream if the requester asked for one and
        we serve streams, else as :meth:`snapshot_reply` gives it (the reply takes over `lease`)."""
        if request.header.get("bulk") and self._bulk is not None:
            return self._bulk_reply(request, lease, **extra)
        return self.snapshot_reply(request.header, lease, **extra)

    def _bulk_reply(self, request: Request, lease: Lease, **extra: Any) -> Reply:
        """The snapshot's header, and the ticket that claims it at our bulk port (the lease goes with it).

        When the bulk server refuses, the snapshot goes over ZeroMQ if the sender's unsent budget allows.
        """
        assert self._bulk is not None
        snap = lease.snapshot
        fields = {**self._fields(lease), **extra}
        buffers: list[Any] = [snap.array]
        hold: Lease | None = lease
        if self._sender is not None:  # the encoded copy streams; the snapshot is free again once offered
            encoded = self._sender.encode(snap.array, request.header["from"], request.header)
            buffers, hold = [encoded.buffer], None
            fields.update(encoded.fields, nbytes=encoded.buffer.nbytes)
        try:
            ticket = self._bulk.offer(request.sender, buffers, hold, self._bulk_ttl_s)
        except Refused:
            if request.may_send_payload:
                self._counters.add("bulk_declined")
                return self.snapshot_reply(request.header, lease, **extra)
            lease.release()
            raise
        if hold is None:
            lease.release()
        self._counters.add("bulk_served")
        if ticket.key is not None:
            fields["key"] = ticket.key
        return Reply(encode(BULK_PARAMS, request.header.id, **fields, port=self._bulk.port, token=ticket.token))

    def check_budget(self, request: Request) -> None:
        """Refuse "busy" when the reply would carry our snapshot and the sender's unsent budget is spent."""
        if request.may_send_payload or (request.header.get("bulk") and self._bulk is not None):
            return  # a bulk transfer has its own budget (dpwa.wire.bulk)
        current = self.store.current()
        if request.header.get("shm") and self.shm_id is not None and current is not None and current.shared:
            return  # the reply only names a shared-memory slot
        raise refused("busy", "earlier replies to you are still unsent")

    def snapshot_reply(self, header: Header, lease: Lease, **extra: Any) -> Reply:
        """Our snapshot for a requester: a zero-copy frame, or the name of a shared-memory slot.

        The reply takes over `lease` (released once the frame has left, or at once for a slot).
        """
        snap = lease.snapshot
        fields = {**self._fields(lease), **extra}
        if header.get("shm") and snap.shared and self.shm_id is not None:
            # The peer locks the slot's file and checks its version itself: if we
            # rewrite the slot before it locks it, it sees a newer version and
            # asks again; once it holds the lock, we cannot rewrite it.
            lease.release()
            self._counters.add("same_host_served")
            self._counters.add("shm_bytes_out", self.model.nbytes)
            return Reply(encode(SHM_PARAMS, header.id, **fields, shm_slot=snap.slot, shm_id=self.shm_id))
        if self._sender is not None:  # the encoded copy travels; the snapshot is free again at once
            with lease:
                encoded = self._sender.encode(snap.array, header["from"], header)
            fields.update(encoded.fields, nbytes=encoded.buffer.nbytes)
            return Reply(encode(PARAMS, header.id, **fields), payload=[encoded.buffer])
        return Reply(encode(PARAMS, header.id, **fields), payload=[snap.array], hold=lease)

    def _fields(self, lease: Lease) -> dict[str, Any]:
        snap = lease.snapshot
        return {
            "from": self.name,
            "fp": self.model.fingerprint,
            "dtype": self.model.dtype,
            "nbytes": self.model.nbytes,
            "clock": snap.clock,
            "loss": snap.loss,
            "version": snap.version,
            **({"rule": self.model.rule} if self.model.rule is not None else {}),
            **({"digest": self._members.digest()} if self._members is not None else {}),
        }
