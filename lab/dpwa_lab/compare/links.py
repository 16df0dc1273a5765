"""Slow links for a comparison run: each process in its own network namespace, its link shaped by tc, and delayed

One run's network (``python -m dpwa.compare --link-mbit R``)::

    namespace dpwa<PID>x<K>-hub      a bridge (br0) and one end of each host's veth pair (h0, h1, ...)
    namespace dpwa<PID>x<K>-<host>   the other end (eth0, 10.99.0.<i+1>/24) and lo; the host's process runs here

With a delay (``--link-delay-ms D``) the hub routes instead of bridging, and
holds every packet D ms in a userspace delay line (:mod:`.delayline`)::

    namespace dpwa<PID>x<K>-hub      h<i> at 10.99.<i+1>.1/24 for each host; forwarding on; a TUN device (dtun)
                                     and the delay line process attached to it; every packet that arrives on an
                                     h<i> is routed into dtun (ip rule iif h<i> lookup 100: default dev dtun),
                                     held D ms, written back, and routed on to its destination's h<j>
    namespace dpwa<PID>x<K>-<host>   eth0 at 10.99.<i+1>.2/24, its default route via 10.99.<i+1>.1

``<PID>`` is the runner's process id and ``<K>`` counts the runner's networks,
so runs (and tests) never collide; nothing is created in the machine's own
namespace, so the addresses cannot clash with its networks either. Each
host's link is shaped to R Mbit/s in each direction: a ``tbf`` qdisc on its
``eth0`` (what it sends) and one on its end in the hub (what it receives),
with a 32 KiB burst and at most 400 ms of queue. The kernel on the machine
this was written on has ``tbf`` and ``htb`` but no ``netem``, so a delay
does not use ``netem``: a packet between two hosts crosses the hub once,
and is held there D ms, so a round trip takes 2 D more (measured by
``tests/test_links.py``). The delay line needs ``/dev/net/tun``
(:func:`check_delay`).

Processes are started with ``ip netns exec NS`` in front of their command
(:meth:`Links.prefix`); it switches namespace and execs, so the PID the
runner sees is the process's own.

**Teardown** (:meth:`Links.close`, idempotent): every process still in one of
the run's namespaces is killed by PID (``ip netns pids``), then every
namespace is deleted (the veths and the bridge go with them). It runs on
every exit path: a normal end and an exception leave the ``with`` block;
Ctrl-C (SIGINT) raises KeyboardInterrupt and the command turns SIGTERM into
one; a worker killed with SIGKILL changes nothing (its namespace is deleted
with the others). If the runner itself is killed with SIGKILL, a reaper
process, started before anything is created and in a session of its own
(Ctrl-C in the terminal does not reach it), sees its pipe from the runner
close and does the same teardown.

Everything here needs root (:func:`check_root`) and ``ip``/``tc`` from iproute2.

    python -m dpwa_lab.compare.links --check      # can this machine do it? (root, tools, namespaces, a TUN device)
"""

from __future__ import annotations

import argparse
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .spawning import child_pythonpath

__all__ = [
    "INTERFACE",
    "LinkSpec",
    "Links",
    "LinksUnavailable",
    "check_delay",
    "check_root",
    "run_prefix",
]

INTERFACE = "eth0"  # a host's end of its veth pair, inside its namespace
SUBNET = "10.99.0"  # hosts are SUBNET.1, SUBNET.2, ... (/24), inside the run's namespaces only
MAX_HOSTS = 250
BURST_BYTES = 32 * 1024
QUEUE_LATENCY_MS = 400
COMMAND_TIMEOUT_S = 20.0
REAPER_WAIT_S = 10.0
TUN = "dtun"  # the delay line's device, in the hub
DELAY_TABLE = "100"  # the hub's routing table whose default route is the delay line
DELAY_READY_S = 20.0  # the delay line attached to its device within this
_counter = itertools.count()


class LinksUnavailable(RuntimeError):
    """Shaped links cannot be made here (no root, no iproute2, namespaces refused, no TUN device for a delay)."""


@dataclass(frozen=True)
class LinkSpec:
    """Every host's link."""

    rate_mbit: float  # each direction
    delay_ms: float = 0.0  # one way between two hosts: the hub's delay line holds every packet this long

    def __post_init__(self) -> None:
        if not 0.1 <= self.rate_mbit <= 100_000:
            raise ValueError(f"link rate must be in [0.1, 100000] Mbit/s, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"link delay must be in [0, 10000] ms, got {self.delay_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def describe(self) -> str:
        delay = f", {self.delay_ms:g} ms one way (a userspace delay line)" if self.delay_ms else ""
        return f"{self.rate_mbit:g} Mbit/s per host each way (tc tbf){delay}"


def check_root(euid: int | None = None) -> None:
    """Raise LinksUnavailable unless this process is root (`euid`: the effective user id to judge, for tests)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise LinksUnavailable(
            f"--link-mbit needs root: it creates network namespaces, veth pairs, a bridge and tc qdiscs, and runs "
            f"every process inside a namespace (this process runs as user id {euid}); run it as root, or leave out "
            "--link-mbit to compare over loopback"
        )


def _check_tools() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinksUnavailable(f"--link-mbit needs {' and '.join(missing)} from iproute2 (apt-get install iproute2)")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise LinksUnavailable(f"{' '.join(argv)}: no answer within {COMMAND_TIMEOUT_S:.0f} s") from exc
    if check and done.returncode != 0:
        raise LinksUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip() or f'status {done.returncode}'}")
    return done


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _teardown(prefix: str) -> list[str]:
    """Kill every process in a namespace named `prefix`..., delete those namespaces; return their names."""
    names = [n for n in _namespaces() if n.startswith(prefix)]
    for name in names:
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ValueError, ProcessLookupError, PermissionError):
                pass
    for name in names:
        _run(["ip", "netns", "delete", name], check=False)
    return names


def check_delay(delay_ms: float) -> None:
    """Raise LinksUnavailable if a delay of `delay_ms` cannot be made here (it needs a TUN device)."""
    if delay_ms > 0 and not os.path.exists("/dev/net/tun"):
        raise LinksUnavailable(
            f"--link-delay-ms {delay_ms:g} needs /dev/net/tun (the delay line holds packets in a TUN device); this "
            "machine has none: load the tun module (modprobe tun), or leave out --link-delay-ms"
        )


def run_prefix(namespace: str) -> list[str]:
    """The command prefix that runs a program in `namespace` (same PID: ip execs it)."""
    return ["ip", "netns", "exec", namespace]


class Links:
    """The shaped network of one run: a namespace per host, on one bridge. A context manager.

    Args:
        hosts: the processes' names (each gets a namespace, an address and a link).
        spec: the links' rate (and delay).
    """

    def __init__(self, hosts: Sequence[str], spec: LinkSpec) -> None:
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{MAX_HOSTS} distinct names, got {list(hosts)}")
        for host in hosts:
            if not host.replace("-", "").isalnum() or len(host) > 16:
                raise ValueError(f"host name {host!r} must be letters, digits and dashes, at most 16")
        self.hosts = list(hosts)
        self.spec = spec
        self.prefix = f"dpwa{os.getpid()}x{next(_counter)}-"
        self.hub = self.prefix + "hub"
        self._reaper: subprocess.Popen[bytes] | None = None
        self._line: subprocess.Popen[bytes] | None = None  # the delay line, in the hub (with a delay)
        self._closed = False
        self.setup_s = 0.0

    def namespace(self, host: str) -> str:
        return self.prefix + host

    @property
    def routed(self) -> bool:
        """Whether the hub routes (through the delay line) rather than bridges."""
        return self.spec.delay_ms > 0

    def address(self, host: str) -> str:
        i = self.hosts.index(host) + 1
        return f"10.99.{i}.2" if self.routed else f"{SUBNET}.{i}"

    def run_prefix(self, host: str) -> list[str]:
        return run_prefix(self.namespace(host))

    @property
    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(h) for h in self.hosts]

    def _tbf(self, namespace: str, device: str) -> list[list[str]]:
        rate = f"{self.spec.rate_mbit:g}mbit"
        tbf = ["tbf", "rate", rate, "burst", str(BURST_BYTES), "latency", f"{QUEUE_LATENCY_MS}ms"]
        return [["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf]]

    def start(self) -> Links:
        """Make the network (root needed). On any failure, what was made is removed before the error is raised."""
        check_root()
        _check_tools()
        t0 = time.monotonic()
        path = child_pythonpath()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "dpwa_lab.compare.links", "--reap", self.prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # Ctrl-C in the terminal reaches the runner, not the reaper
        )
        hub = self.hub
        commands = [["ip", "netns", "add", hub], ["ip", "-n", hub, "link", "set", "lo", "up"]]
        if self.routed:
            sysctl = ["ip", "netns", "exec", hub, "sysctl", "-qw"]
            commands += [
                # forward between the hosts; packets come back from the delay line with their hosts' sources
                [
                    *sysctl,
                    "net.ipv4.ip_forward=1",
                    "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.default.rp_filter=0",
                ],
                ["ip", "-n", hub, "tuntap", "add", "dev", TUN, "mode", "tun"],
                ["ip", "-n", hub, "link", "set", TUN, "up"],
                ["ip", "-n", hub, "route", "add", "default", "dev", TUN, "table", DELAY_TABLE],
            ]
        else:
            commands += [
                ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
                ["ip", "-n", hub, "link", "set", "br0", "up"],
            ]
        for i, host in enumerate(self.hosts):
            ns, end = self.namespace(host), f"h{i}"
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", hub, "link", "add", end, "type", "veth", "peer", "name", INTERFACE, "netns", ns],
            ]
            if self.routed:
                commands += [
                    ["ip", "-n", hub, "addr", "add", f"10.99.{i + 1}.1/24", "dev", end],
                    ["ip", "-n", hub, "rule", "add", "iif", end, "lookup", DELAY_TABLE],
                ]
            else:
                commands.append(["ip", "-n", hub, "link", "set", end, "master", "br0"])
            commands += [
                ["ip", "-n", hub, "link", "set", end, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE],
                ["ip", "-n", ns, "link", "set", INTERFACE, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                *([["ip", "-n", ns, "route", "add", "default", "via", f"10.99.{i + 1}.1"]] if self.routed else []),
                *self._tbf(ns, INTERFACE),
                *self._tbf(hub, end),
            ]
        try:
            for command in commands:
                _run(command)
            if self.routed:
                self._start_line(path)
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - t0
        return self

    def _start_line(self, path: str) -> None:
        """Start the delay line in the hub, attached to its TUN device; return once it is (it says "ready")."""
        line = self._line = subprocess.Popen(
            [
                *run_prefix(self.hub),
                sys.executable,
                "-m",
                "dpwa_lab.compare.delayline",
                "--tun",
                TUN,
                "--delay-ms",
                f"{self.spec.delay_ms:g}",
            ],
            stdin=subprocess.PIPE,  # closed by close(): the line ends (teardown kills it by PID anyway)
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,
        )
        assert line.stdout is not None
        ready, _, _ = select.select([line.stdout], [], [], DELAY_READY_S)
        first = line.stdout.readline().decode(errors="replace").strip() if ready else ""
        if first != "ready":
            raise LinksUnavailable(
                f"the delay line did not attach to {TUN} in {self.hub} within {DELAY_READY_S:.0f} s"
                + (f": {first}" if first else "")
            )

    def close(self) -> list[str]:
        """Kill what still runs in the run's namespaces, delete them; stop the reaper. Returns the namespaces removed."""
        if self._closed:
            return []
        self._closed = True
        removed = _teardown(self.prefix)  # the delay line too: it runs in the hub
        if self._line is not None:
            if self._line.stdin is not None:
                self._line.stdin.close()
            try:
                self._line.wait(REAPER_WAIT_S)
            except subprocess.TimeoutExpired:
                self._line.kill()
                self._line.wait(REAPER_WAIT_S)
            if self._line.stdout is not None:
                self._line.stdout.close()
        if self._reaper is not None:
            try:
                if self._reaper.stdin is not None:
                    self._reaper.stdin.close()  # the reaper tears down again (nothing is left) and exits
                self._reaper.wait(REAPER_WAIT_S)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait(REAPER_WAIT_S)
        return removed

    def __enter__(self) -> Links:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, object]:
        return {
            "rate_mbit": self.spec.rate_mbit,
            "delay_ms": self.spec.delay_ms,
            "shaping": f"tc tbf rate {self.spec.rate_mbit:g}mbit burst {BURST_BYTES} latency {QUEUE_LATENCY_MS}ms on "
            "each host's eth0 (egress) and on its end in the hub (ingress): R each way"
            + (
                f"; every packet between two hosts held {self.spec.delay_ms:g} ms by a userspace delay line in the "
                "hub (lab/dpwa_lab/compare/delayline.py)"
                if self.routed
                else ""
            ),
            "addresses": {h: self.address(h) for h in self.hosts},
            "namespaces": self.namespaces,
        }


def _reap(prefix: str) -> int:
    """The reaper: wait until the runner's end of the pipe closes (it ended, or was killed), then tear down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    _teardown(prefix)
    return 0


def _check() -> int:
    try:
        check_root()
        _check_tools()
    except LinksUnavailable as exc:
        print(f"shaped links: no: {exc}")
        return 1
    print("shaped links: yes (root, ip, tc, network namespaces)")
    tun = os.path.exists("/dev/net/tun")
    print("delay (a userspace delay line on a TUN device): " + ("yes" if tun else "no: /dev/net/tun is missing"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa_lab.compare.links", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="say whether this machine can make shaped links")
    group.add_argument("--reap", metavar="PREFIX", help=argparse.SUPPRESS)  # the runner's reaper
    args = parser.parse_args(argv)
    if args.reap:
        if not args.reap.startswith("dpwa") or not args.reap.endswith("-"):
            parser.error(f"--reap takes a run's namespace prefix (dpwa<PID>x<K>-), got {args.reap!r}")
        return _reap(args.reap)
    return _check()


if __name__ == "__main__":
    sys.exit(main())
