"""What every socket owner of the wire shares: poll slices, frame allowances, queue marks, base options."""

from __future__ import annotations

import zmq

__all__ = ["BULK_RCVHWM", "FRAME_ALLOWANCE", "POLL_SLICE_S", "SNDHWM", "base_options"]

POLL_SLICE_S = 0.05  # how often blocked loops look at their stop flags
# ZMQ_MAXMSGSIZE applies to a frame as it arrives, and a CURVE-encrypted frame is
# longer than its plaintext (command name, nonce, MAC): limits get this allowance.
FRAME_ALLOWANCE = 256
BULK_RCVHWM = 4  # queued requests per connection when requests may carry a model
SNDHWM = 8  # queued replies per connection (small ones: payload replies are budgeted per client)


def base_options(sock: zmq.Socket, heartbeat_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Detect dead or stalled connections: without a PONG within the timeout the
    # connection is dropped, and payloads queued for it are released.
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * heartbeat_ms)
