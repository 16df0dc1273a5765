"""The gossip node's message kinds, with the bounds every number from a peer must meet.

==========  =====================  ==================================================
kind        direction              meaning
==========  =====================  ==================================================
fetch       requester -> server    "send me your latest snapshot" (with ``wire_dtype:
                                   topk``, `cstream` and `cver`: the copy of the
                                   server's model it holds)
params      server -> requester    a snapshot: header + one payload frame of `nbytes`
                                   (topk: `cbase`, the version it builds on, 0 for
                                   the values in full, and `cver`, the one it makes)
shm_params  server -> requester    a snapshot in a same-host shared-memory slot
bulk_params server -> requester    a snapshot waiting at the server's bulk port for
                                   the holder of `token` (asked with ``bulk``), with
                                   `key`, the transfer's own AES-256 key, in a
                                   cluster with CURVE keys (dpwa.wire.bulk)
exchange    requester -> server    (mode symmetric) "here is my snapshot, send yours";
                                   one payload frame; answered params / shm_params
                                   with the server-assigned exchange id `xid` and `f`
shm_exchange requester -> server   the same from a same-host peer whose snapshot is in
                                   its shared-memory slot `shm_slot` (no payload); the
                                   server locks the slot while the exchange is pending
bulk_exchange requester -> server  the same for a large snapshot between hosts: it waits
                                   at the requester's bulk port for the holder of
                                   `token` (and `key`, with CURVE keys), and the server
                                   streams it in while the exchange is pending; with
                                   ``bulk``, the server's own snapshot is offered by
                                   stream too (answered bulk_params with `xid` and `f`)
confirm     requester -> server    "apply exchange `xid`": the server decides (with
                                   `withdraw`: "abort it", from a requester that
                                   served a crossing exchange instead)
decision    server -> requester    the server's final word on `xid`: commit, abort,
                                   or unknown (never seen, or forgotten)
ack         requester -> server    "I know your commit of `xid`" (sent when the requester
                                   closes; answered with the decision)
known       server -> requester    (a closing server) "which of these commits of mine
                                   do you know?"; answered known_reply with that subset
members     anyone -> server       (open membership) "who is in the cluster?", with the
                                   asker's own entry `me` to announce itself (optional:
                                   a tool announces nothing); answered members_reply
members_reply server -> asker      a digest of the server's view (`members`) and
                                   whether `me` is a member now (`admitted`)
==========  =====================  ==================================================

With open membership (``bootstrap:``) the snapshot requests and replies
(fetch, exchange and their replies) also carry `digest`: at most
:data:`~dpwa.gossip.membership.view.DIGEST_MAX` entries of the sender's view, its
own first (:mod:`dpwa.gossip.membership.members`). Nodes without it send none and
ignore one.

Errors travel as the transport's ``error`` kind. See :mod:`dpwa.gossip.exchange.driver`
for the exchange's state machine.
"""

from __future__ import annotations

from typing import Literal, get_args

from ...mixing import codecs
from ...mixing.model import WireModel
from ...mixing.rules import FINGERPRINT_BYTES, MAX_CARRIED, MAX_SYMMETRIC_FACTOR
from ...wire.bulk import KEY_BYTES, TOKEN_BYTES
from ...wire.errors import ProtocolError
from ...wire.schema import (
    MAX_ID,
    NAME_PATTERN,
    Blob,
    Choice,
    Flag,
    Header,
    Integer,
    ListOf,
    Number,
    Text,
    message_kind,
)
from ..membership.messages import DIGEST, DIGEST_HEADER_BYTES

__all__ = [
    "NodeState",
    "STATES",
    "ACK",
    "BULK_EXCHANGE",
    "BULK_PARAMS",
    "KNOWN",
    "KNOWN_REPLY",
    "CONFIRM",
    "DECISION",
    "EXCHANGE",
    "DIGEST_HEADER_BYTES",
    "FETCH",
    "MAX_CLOCK",
    "MAX_LOSS",
    "MAX_VALUE",
    "PARAMS",
    "SHM_EXCHANGE",
    "SHM_PARAMS",
    "SNAPSHOT_REPLIES",
    "check_payload",
]

MAX_CLOCK = 1e15  # samples; a clock beyond this is a lie or a bug
MAX_LOSS = 1e30  # |loss| beyond this is treated as a lie
MAX_VALUE = 1e18  # |parameter| beyond this is refused: blends of such values stay far from overflow

NAME = Text(64, NAME_PATTERN)
# what a node is doing, as its join offers and status replies say
NodeState = Literal["starting", "joining", "training", "at_barrier", "lingering", "closing", "closed"]
STATES: tuple[NodeState, ...] = get_args(NodeState)
FINGERPRINT = Blob(length=16)
DTYPE = Choice(codecs.names())  # the wire codec (dpwa.mixing.codecs)
CLOCK = Number(0.0, MAX_CLOCK)
LOSS = Number(-MAX_LOSS, MAX_LOSS, optional=True)
NBYTES = Integer(0, 1 << 40)
XID = Integer(1, MAX_ID)
FACTOR = Number(0.0, MAX_SYMMETRIC_FACTOR)
_SNAPSHOT = {
    "from": NAME,
    "fp": FINGERPRINT,
    "dtype": DTYPE,
    "nbytes": NBYTES,
    "clock": CLOCK,
    "loss": LOSS,
    "version": Integer(1, MAX_ID),
}
_RULE = {"rule": Blob(length=FINGERPRINT_BYTES)}  # the sender's mixing rule and its settings (optional: tools omit it)
# scalars the server's rule sends with a snapshot it serves (a push-sum weight); each rule checks its own bounds
_CARRY = {"carry": ListOf(Number(-MAX_VALUE, MAX_VALUE), max_len=MAX_CARRIED)}
# a codec's state (dpwa.mixing.codecs.topk): the stream of references the requester holds from the server, and
# the version it holds; in a reply, the version it makes and the version it builds on (0: the values in full)
_CODEC_REQUEST = {"cstream": Blob(length=8), "cver": Integer(1, MAX_ID)}
_CODEC_REPLY = {**_CODEC_REQUEST, "cbase": Integer(0, MAX_ID)}
_SLOT = {"shm_slot": Integer(0, 1023), "shm_id": Text(16, "[0-9a-f]{16}")}  # a slot of a same-host node
_EXCHANGE_REPLY = {"xid": XID, "f": FACTOR}  # present in replies to an exchange
# an exchange request's deadline, in ms (dpwa.gossip.membership.deadlines): the server holds it pending that long (within
# its own timeout_ms and CAP_FACTOR times that, whatever is asked)
_WAIT = {"wait_ms": Integer(1, 1 << 31)}

_DIGEST = {"digest": DIGEST}  # open membership: the sender's view, sampled (dpwa.gossip.membership.messages)

FETCH = message_kind(
    "fetch",
    {"from": NAME, "fp": FINGERPRINT, "dtype": DTYPE},
    {"shm": Flag(), "bulk": Flag(), **_RULE, **_CODEC_REQUEST, **_DIGEST},
    max_header_bytes=DIGEST_HEADER_BYTES,
)
PARAMS = message_kind(
    "params",
    _SNAPSHOT,
    {**_EXCHANGE_REPLY, **_RULE, **_CARRY, **_CODEC_REPLY, **_DIGEST},
    payload=1,
    max_header_bytes=DIGEST_HEADER_BYTES,
)
SHM_PARAMS = message_kind(
    "shm_params",
    {**_SNAPSHOT, **_SLOT},
    {**_EXCHANGE_REPLY, **_RULE, **_CARRY, **_DIGEST},
    max_header_bytes=DIGEST_HEADER_BYTES,
)
_TICKET = {"port": Integer(1, 65535), "token": Blob(length=TOKEN_BYTES)}  # a transfer waiting at a bulk port
_KEY = {"key": Blob(length=KEY_BYTES)}  # a sealed stream's key: only ever sent inside a CURVE-encrypted message
BULK_PARAMS = message_kind(  # the snapshot waits at a bulk port for the holder of the token (dpwa.wire.bulk)
    "bulk_params",
    {**_SNAPSHOT, **_TICKET},
    {**_KEY, **_EXCHANGE_REPLY, **_RULE, **_CARRY, **_CODEC_REPLY, **_DIGEST},
    max_header_bytes=DIGEST_HEADER_BYTES,
)
EXCHANGE = message_kind(
    "exchange",
    {"from": NAME, "fp": FINGERPRINT, "dtype": DTYPE, "nbytes": NBYTES, "clock": CLOCK, "loss": LOSS},
    {"shm": Flag(), **_WAIT, **_RULE, **_DIGEST},
    payload=1,
    max_header_bytes=DIGEST_HEADER_BYTES,
)
SHM_EXCHANGE = message_kind(  # an exchange whose snapshot waits in the requester's slot (same host)
    "shm_exchange",
    {**_SNAPSHOT, **_SLOT},
    {"shm": Flag(), **_WAIT, **_RULE, **_DIGEST},
    max_header_bytes=DIGEST_HEADER_BYTES,
)
BULK_EXCHANGE = message_kind(  # an exchange whose snapshot waits at the requester's bulk port (another host)
    "bulk_exchange",
    {**_SNAPSHOT, **_TICKET},
    {**_KEY, "bulk": Flag(), **_WAIT, **_RULE, **_DIGEST},
    max_header_bytes=DIGEST_HEADER_BYTES,
)
# withdraw: the requester will not confirm `xid` (it served a crossing exchange instead): abort it now
CONFIRM = message_kind("confirm", {"from": NAME, "xid": XID}, {"withdraw": Flag()})
DECISION = message_kind("decision", {"xid": XID, "outcome": Choice(("commit", "abort", "unknown"))})
ACK = message_kind("ack", {"from": NAME, "xid": XID})
KNOWN = message_kind("known", {"from": NAME, "xids": ListOf(XID, max_len=8)})
KNOWN_REPLY = message_kind("known_reply", {"xids": ListOf(XID, max_len=8)})

SNAPSHOT_REPLIES = {PARAMS.name: PARAMS, SHM_PARAMS.name: SHM_PARAMS, BULK_PARAMS.name: BULK_PARAMS}


def check_payload(header: Header, model: WireModel, rule_required: bool = True) -> None:
    """Check that a snapshot-carrying header describes a model like ours: fingerprint, dtype, size, and
    that its sender mixes by our rule with our settings. A header that names no rule is refused like one that
    names another (a snapshot it carries would move our model by a rule we cannot check), unless
    `rule_required` is False: a fetch request, which moves nothing here (tools, such as ``python -m dpwa
    average``, send those without a rule, and are given no push-sum weight). A node without a rule (a tool)
    checks none."""
    if header["fp"] != model.fingerprint:
        raise ProtocolError(
            "bad_fingerprint",
            f"model fingerprint {header['fp'].hex()} differs from ours {model.fingerprint.hex()} "
            "(different layer names, shapes or dtypes)",
        )
    if header["dtype"] != model.dtype:
        raise ProtocolError(
            "bad_dtype", f"dtype {header['dtype']!r}, this node uses {model.dtype!r} (do the nodes share one config?)"
        )
    theirs = header.get("rule")
    if model.rule is not None and theirs is None and rule_required:
        raise ProtocolError(
            "bad_rule",
            f"the {header.kind} names no mixing rule; this node mixes by rule fingerprint {model.rule.hex()} and "
            "takes snapshots only from peers that name theirs (is the peer a dpwa node of this cluster?)",
        )
    if model.rule is not None and theirs is not None and theirs != model.rule:
        raise ProtocolError(
            "bad_rule",
            f"mixing rule fingerprint {theirs.hex()} differs from ours {model.rule.hex()} "
            "(another rule, rule_options, interpolation or divergence_threshold: do the nodes share one config?)",
        )
    expected = model.payload_nbytes(header)
    if header.get("nbytes", expected) != expected:
        raise ProtocolError(
            "bad_size",
            f"the header announces {header['nbytes']} bytes, expected {expected} (do the nodes share wire_options?)",
        )
