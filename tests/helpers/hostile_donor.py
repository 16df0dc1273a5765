"""A fake donor for join tests: answers ``join_info`` with an offer the test crafts, and ``join_chunk``
with the offer's bytes. Headers are packed by hand (msgpack), so an offer may break the schema on
purpose; everything the joiner asks is counted. Any other request is refused ``not_ready``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from dpwa.gossip.transfer.join import CHUNK_BYTES
from helpers.raw_peer import FakePeer, FakeRequest


@dataclass
class Offer:
    """What the fake offers; `data` is the whole state (parameters, then extra bytes)."""

    fp: bytes
    params_bytes: int
    data: bytes
    extra_meta: bytes = b""
    clock: float = 1e6
    barriers: dict[str, Any] = field(default_factory=dict)
    yours: dict[str, Any] = field(default_factory=dict)
    nbytes: int | None = None  # announced size (default: len(data))
    busy_chunks: int = 0  # answer the first this many join_chunk requests "busy"


def header(kind: str, request_id: int, **fields: Any) -> bytes:
    return msgpack.packb({"v": 2, "kind": kind, "id": request_id, **fields}, use_bin_type=True)


class HostileDonor:
    """Serves `endpoint` (a config node's TCP endpoint) with `offer` until closed."""

    def __init__(self, ctx: zmq.Context, endpoint: str, offer: Offer) -> None:
        self.offer = offer
        self.asked: list[str] = []  # kinds of the requests received, in order
        self.chunk_offsets: list[int] = []
        self._busy_left = offer.busy_chunks
        self._peer = FakePeer(ctx, endpoint, self._respond)

    def _respond(self, request: FakeRequest) -> list[bytes] | None:
        offer = self.offer
        self.asked.append(str(request.kind))
        if request.kind == "join_info":
            digest = hashlib.blake2b(offer.data, digest_size=32).digest()
            return [
                header(
                    "join_offer",
                    request.id,
                    clock=offer.clock,
                    barriers=offer.barriers,
                    yours=offer.yours,
                    state="training",
                    ready=True,
                    session=7,
                    fp=offer.fp,
                    dtype="float32",
                    params_bytes=offer.params_bytes,
                    nbytes=len(offer.data) if offer.nbytes is None else offer.nbytes,
                    digest=digest,
                    extra=offer.extra_meta,
                )
            ]
        if request.kind == "join_chunk":
            offset = int(request.header.get("offset", 0))
            self.chunk_offsets.append(offset)
            if self._busy_left > 0:
                self._busy_left -= 1
                return [header("error", request.id, reason="busy", detail="earlier replies to you are still unsent")]
            chunk = offer.data[offset : offset + CHUNK_BYTES]
            if not chunk:  # asked beyond what we hold: a size that was announced and never meant
                chunk = bytes(min(CHUNK_BYTES, max(0, (offer.nbytes or 0) - offset)))
            return [header("join_data", request.id, session=7, offset=offset), chunk]
        return [header("error", request.id, reason="not_ready", detail="a fake donor")]

    def close(self) -> None:
        self._peer.close()


def state_bytes(params: np.ndarray, extra: np.ndarray | None = None) -> bytes:
    """An offer's bytes: float32 parameters, then the extra state's raw bytes."""
    data = np.ascontiguousarray(params, dtype=np.float32).tobytes()
    return data if extra is None else data + np.ascontiguousarray(extra).view(np.uint8).tobytes()
