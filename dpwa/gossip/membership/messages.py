"""Open membership's message kinds: a member as a digest tells it, a digest, and the ``members`` call.

The kinds the node's snapshot messages carry digests in are :mod:`dpwa.gossip.transfer.protocol`'s; they take
:data:`DIGEST` from here, so that membership, the lower layer, names its own messages.
"""

from __future__ import annotations

from ...wire.certs import CERT_MAX
from ...wire.schema import NAME_PATTERN, Flag, Integer, ListOf, Record, Text, message_kind
from .view import DIGEST_MAX, MAX_COUNT

__all__ = ["DIGEST", "DIGEST_HEADER_BYTES", "ENTRY", "MEMBERS", "MEMBERS_REPLY"]

# One member as a digest tells it (dpwa.gossip.membership.view.check_entry checks each field's meaning on arrival):
# an entry has no `key` where the cluster has none
ENTRY = Record(
    {
        "name": Text(64, NAME_PATTERN),
        "endpoint": Text(270),
        "inc": Integer(0, MAX_COUNT),
        "beat": Integer(0, MAX_COUNT),
    },
    {"key": Text(40), "cert": Text(CERT_MAX)},
)
DIGEST = ListOf(ENTRY, max_len=DIGEST_MAX)  # the sender's view, sampled: its own entry first
DIGEST_HEADER_BYTES = 1 << 14  # a kind that may carry a digest: DIGEST_MAX entries of at most ~430 bytes, and more

MEMBERS = message_kind("members", {}, {"me": ENTRY})
MEMBERS_REPLY = message_kind(
    "members_reply", {"members": DIGEST, "admitted": Flag()}, max_header_bytes=DIGEST_HEADER_BYTES
)
