"""The parameter servers' message kinds, with bounded fields.

=================  ==================  ====================================================
kind               direction           meaning
=================  ==================  ====================================================
ps_pull            trainer -> server   "send me the latest values of every block you hold"
ps_params          server -> trainer   one frame: the server's blocks, in plan order, and
                                       each block's version (updates applied so far)
ps_push            trainer -> server   one frame: the gradient (parameter blocks) or the
                                       delta (buffer blocks) of each of the server's
                                       blocks, and the version of each block it was
                                       computed on
ps_queued          server -> trainer   every block's update was queued
ps_status          anyone -> server    counts, for monitors and tests
ps_status_reply    server -> anyone    the counts, and the staleness histogram
=================  ==================  ====================================================

Every request names its sender (``from``), the shard plan's fingerprint
(``fp``) and the server it is for (``server``), so a request for another
plan or another server is refused before any value is read. Refusals:
``busy`` (a block's queue is full: ordinary), and ``bad_fingerprint``,
``bad_server``, ``bad_blocks``, ``bad_version``, ``bad_size``, ``bad_values``
(no honest trainer sends these).
"""

from __future__ import annotations

from dpwa.wire.schema import NAME_PATTERN, Blob, Integer, ListOf, MapOf, Number, Text, message_kind

__all__ = ["PARAMS", "PULL", "PUSH", "QUEUED", "STATUS", "STATUS_REPLY"]

MAX_BLOCKS = 4096  # blocks one server holds
MAX_VERSION = 2**53
NAME = Text(64, NAME_PATTERN)
FINGERPRINT = Blob(length=16)
SERVER = Integer(0, 1023)
VERSIONS = ListOf(Integer(0, MAX_VERSION), MAX_BLOCKS)
COUNT = Integer(0, 2**63)
BIG_HEADER = 1 << 16  # version lists of thousands of blocks

PULL = message_kind("ps_pull", {"from": NAME, "fp": FINGERPRINT, "server": SERVER})
PARAMS = message_kind(
    "ps_params",
    {"server": SERVER, "versions": VERSIONS, "samples": COUNT, "nbytes": COUNT},
    payload=1,
    max_header_bytes=BIG_HEADER,
)
PUSH = message_kind(
    "ps_push",
    {"from": NAME, "fp": FINGERPRINT, "server": SERVER, "versions": VERSIONS, "batch": Integer(1, 1 << 16)},
    payload=1,
    max_header_bytes=BIG_HEADER,
)
QUEUED = message_kind("ps_queued", {"depth": COUNT})
STATUS = message_kind("ps_status", {"from": NAME})
STATUS_REPLY = message_kind(
    "ps_status_reply",
    {
        "server": SERVER,
        "blocks": COUNT,
        "elements": COUNT,
        "pushes": COUNT,
        "applied": COUNT,  # block updates applied
        "samples": COUNT,  # the fewest samples any block has applied
        "versions": VERSIONS,
        "staleness": ListOf(ListOf(COUNT, 2), 4096),  # [versions behind at apply time, updates], ...
        "staleness_mean": Number(0.0),
        "staleness_max": COUNT,
        "queued": COUNT,  # updates waiting in the queues now
        "refused": MapOf(Text(64, NAME_PATTERN), COUNT, 64),
    },
    max_header_bytes=BIG_HEADER,
)
