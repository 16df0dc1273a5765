"""A userspace delay line: every packet through a TUN device is held a fixed time, then sent on

For kernels without netem (:mod:`.links`). The hub namespace of a run with
``--link-delay-ms D`` routes between its hosts instead of bridging them, and
every packet that arrives from a host is routed into a TUN device
(``ip rule add iif hI lookup T``, table T's default route: the TUN device).
This process owns that device: it reads each packet, keeps it for D ms and
writes it back, and the kernel then routes it to its destination's veth. A
packet crosses the hub once between two hosts, so a round trip between two
hosts takes 2 D more than without the line.

Bounded: at most ``max_bytes`` are held at once (a packet beyond that is
dropped, as a full router queue drops it, and counted); each wake-up reads
at most :data:`BATCH` packets. It runs until stdin closes or SIGTERM, and a
run's teardown (``ip netns pids`` of the hub) kills it by PID like every
process in the run's namespaces.

    ip netns exec NS python -m dpwa_lab.compare.delayline --tun dtun --delay-ms 25
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

__all__ = ["BATCH", "DelayLine", "open_tun"]

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
BATCH = 256  # packets read per wake-up at most
MAX_PACKET = 65_536
DEFAULT_MAX_BYTES = 64 << 20


def open_tun(name: str) -> int:
    """A non-blocking file descriptor attached to the (existing, persistent) TUN device `name`, packets without
    a protocol header."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        os.set_blocking(fd, False)
    except BaseException:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Holds each packet read from `fd` for `delay_s`, then writes it back, keeping at most `max_bytes` held."""

    def __init__(self, fd: int, delay_s: float, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if delay_s < 0 or max_bytes < MAX_PACKET:
            raise ValueError(f"delay must be >= 0 and the queue at least {MAX_PACKET} bytes")
        self.fd, self.delay_s, self.max_bytes = fd, delay_s, max_bytes
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.forwarded = self.dropped = 0

    def timeout(self, now: float) -> float:
        """Seconds until the next packet is due (0.5 when none is held)."""
        return max(0.0, self._queue[0][0] - now) if self._queue else 0.5

    def read(self, now: float) -> None:
        for _ in range(BATCH):
            try:
                packet = os.read(self.fd, MAX_PACKET)
            except BlockingIOError:
                return
            if not packet:
                return
            if self.held + len(packet) > self.max_bytes:
                self.dropped += 1
                continue
            self._queue.append((now + self.delay_s, packet))
            self.held += len(packet)

    def release(self, now: float) -> None:
        while self._queue and self._queue[0][0] <= now:
            _, packet = self._queue.popleft()
            self.held -= len(packet)
            try:
                os.write(self.fd, packet)
                self.forwarded += 1
            except (BlockingIOError, OSError):
                self.dropped += 1

    def run(self, stop_fds: list[int]) -> None:
        """Until one of `stop_fds` is readable (stdin at its end when the caller is gone, or the signal pipe)."""
        while True:
            ready, _, _ = select.select([self.fd, *stop_fds], [], [], self.timeout(time.monotonic()))
            if any(fd in ready for fd in stop_fds):
                return
            now = time.monotonic()
            if self.fd in ready:
                self.read(now)
            self.release(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa_lab.compare.delayline", description=__doc__.split("\n")[0])
    parser.add_argument("--tun", required=True, help="the TUN device (made by the caller: ip tuntap add ... mode tun)")
    parser.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="bytes held at most")
    args = parser.parse_args(argv)
    fd = open_tun(args.tun)
    line = DelayLine(fd, args.delay_ms / 1000, args.max_bytes)
    stop_r, stop_w = os.pipe()
    signal.signal(signal.SIGTERM, lambda *_: os.write(stop_w, b"x"))
    print("ready", flush=True)  # attached: the device has its carrier, packets routed to it are held from now on
    try:
        line.run([stop_r, sys.stdin.fileno()])  # the caller never writes: stdin is readable once it is gone
    finally:
        os.close(fd)
    print(f"forwarded {line.forwarded}, dropped {line.dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
