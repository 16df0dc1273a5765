"""Fake dpwa peers for tests: a ROUTER socket that answers each request with crafted frames
(:class:`FakePeer`), and a REQ socket that sends a node exchange requests by hand (:class:`RawPeer`).

A real node's config names the fake's endpoint as one of its peers (``insecure:
true`` TCP, so no keys are needed), and the fake answers the node's fetches,
exchanges and confirms with whatever the test's ``respond(request)`` returns,
malformed on purpose or not. Nothing here validates what it sends.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

__all__ = ["BulkRawPeer", "FakePeer", "FakeRequest", "RawPeer", "bulk_exchange_header"]


@dataclass
class FakeRequest:
    """One request as the fake received it: the raw header, its msgpack content if any, payload frames."""

    raw: bytes
    header: dict[str, Any]  # {} when the header is not a msgpack map
    payload: list[bytes]

    @property
    def kind(self) -> str | None:
        return self.header.get("kind")

    @property
    def id(self) -> int:
        return self.header.get("id", 0)


class FakePeer:
    """Serves `endpoint` on its own thread until closed.

    Args:
        ctx: the ZeroMQ context.
        endpoint: where to bind (the TCP endpoint a node's config gives the faked peer).
        respond: called for each request (on the fake's thread); returns the reply's frames
            (without the envelope), or None to send nothing.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, respond: Callable[[FakeRequest], list[bytes] | None]) -> None:
        self._respond = respond
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.handled = 0
        self.errors: list[str] = []  # exceptions raised by `respond`: a broken test, not a broken node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-fake-peer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            if len(frames) < 3:
                continue
            ident, raw, payload = frames[0], frames[2], frames[3:]
            try:
                header = msgpack.unpackb(raw, raw=False)
                if not isinstance(header, dict):
                    header = {}
            except Exception:
                header = {}
            try:
                reply = self._respond(FakeRequest(raw, header, payload))
            except Exception:
                self.errors.append(traceback.format_exc())
                continue
            self.handled += 1
            if reply is not None:
                self.sock.send_multipart([ident, b"", *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(linger=0)


class RawPeer:
    """A REQ socket that speaks the exchange protocol by hand, as node `name`, to node `server`."""

    def __init__(self, ctx: zmq.Context, config: dict[str, Any], name: str, server: str = "w1") -> None:
        from dpwa import parse_config

        parsed = parse_config(config)
        self.name, self.sock = name, ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(parsed.endpoint(parsed.node(server)))

    def exchange(self, node: Any, payload: Any, clock: float = 0.0, **fields: Any) -> Any:
        """An exchange with `node` as one of its peers would send it (its model's layout and its rule)."""
        return self.exchange_with(node.params.fingerprint, payload, clock, rule=node.model.rule, **fields)

    def exchange_with(self, fingerprint: bytes, payload: Any, clock: float = 0.0, **fields: Any) -> Any:
        """An exchange that offers `payload` for a model whose layout has `fingerprint` (`fields`: optional
        header fields, such as ``wait_ms``, or ``rule``: the rule's fingerprint, without which a node refuses
        it ``bad_rule``)."""
        from dpwa.gossip.transfer.protocol import EXCHANGE
        from dpwa.wire.schema import encode

        header = encode(
            EXCHANGE,
            1,
            **{"from": self.name},
            fp=fingerprint,
            dtype="float32",
            nbytes=payload.nbytes,
            clock=clock,
            loss=None,
            **fields,
        )
        from dpwa.wire.payload import chunks

        return self._ask([header, *chunks([payload])])

    def confirm(self, xid: int) -> Any:
        from dpwa.gossip.transfer.protocol import CONFIRM
        from dpwa.wire.schema import encode

        return self._ask([encode(CONFIRM, 2, **{"from": self.name}, xid=xid)])

    def _ask(self, frames: list[Any]) -> Any:
        from dpwa.wire.schema import decode

        self.sock.send_multipart(frames)
        assert self.sock.poll(5000), "no answer"
        return decode(self.sock.recv_multipart()[0])


class BulkRawPeer(RawPeer):
    """A raw peer that offers its snapshot at whatever port (and token) it says: ``bulk_exchange``."""

    def bulk_exchange(self, node, port):
        return self._ask([bulk_exchange_header(node.params.fingerprint, port, name=self.name, rule=node.model.rule)])


def bulk_exchange_header(fingerprint, port, token=None, name="w2", nbytes=None, rule=None):
    """A ``bulk_exchange`` request from `name` (clock 0, no loss) for a snapshot of `nbytes` (by default
    the smallest model that streams), offered at `port` with `token` (by default a fixed one), naming the
    mixing rule whose fingerprint is `rule` (None: none, which a node refuses ``bad_rule``)."""
    from dpwa.gossip.services import BULK_MIN_BYTES
    from dpwa.gossip.transfer.protocol import BULK_EXCHANGE
    from dpwa.wire.bulk import TOKEN_BYTES
    from dpwa.wire.schema import encode

    return encode(
        BULK_EXCHANGE,
        1,
        **{"from": name},
        fp=fingerprint,
        dtype="float32",
        nbytes=BULK_MIN_BYTES if nbytes is None else nbytes,
        clock=0.0,
        loss=None,
        version=1,
        port=port,
        token=b"t" * TOKEN_BYTES if token is None else token,
        **({"rule": rule} if rule is not None else {}),
    )
