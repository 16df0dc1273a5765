"""Slow links for a comparison run: each process in its own network namespace, on a bridge, its link shaped by tc.

One run's network (``python -m dpwa.compare --link-mbit R``)::

    namespace dpwa<PID>x<K>-hub      a bridge (br0) and one end of each host's veth pair (h0, h1, ...)
    namespace dpwa<PID>x<K>-<host>   the other end (eth0, 10.99.0.<i+1>/24) and lo; the host's process runs here

``<PID>`` is the runner's process id and ``<K>`` counts the runner's networks,
so runs (and tests) never collide; nothing is created in the machine's own
namespace, so the addresses cannot clash with its networks either. Each
host's link is shaped to R Mbit/s in each direction: a ``tbf`` qdisc on its
``eth0`` (what it sends) and one on its end in the hub (what it receives),
with a 32 KiB burst and at most 400 ms of queue. The kernel on the machine
this was written on has ``tbf`` and ``htb`` but no ``netem``: a delay
(``delay_ms``) is tried with ``netem`` and refused with the kernel's answer
when it is missing (:func:`check_delay`).

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

    python -m dpwa.compare.links --check      # can this machine do it? (root, tools, namespaces, netem)
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "INTERFACE",
    "LinkSpec",
    "Links",
    "LinksUnavailable",
    "check_delay",
    "check_root",
    "probe_netem",
    "run_prefix",
]

INTERFACE = "eth0"  # a host's end of its veth pair, inside its namespace
SUBNET = "10.99.0"  # hosts are SUBNET.1, SUBNET.2, ... (/24), inside the run's namespaces only
MAX_HOSTS = 250
BURST_BYTES = 32 * 1024
QUEUE_LATENCY_MS = 400
COMMAND_TIMEOUT_S = 20.0
REAPER_WAIT_S = 10.0
_counter = itertools.count()


class LinksUnavailable(RuntimeError):
    """Shaped links cannot be made here (no root, no iproute2, namespaces refused, no netem for a delay)."""


@dataclass(frozen=True)
class LinkSpec:
    """Every host's link."""

    rate_mbit: float  # each direction
    delay_ms: float = 0.0  # one way, on each host's egress (netem; not on kernels without it)

    def __post_init__(self) -> None:
        if not 0.1 <= self.rate_mbit <= 100_000:
            raise ValueError(f"link rate must be in [0.1, 100000] Mbit/s, got {self.rate_mbit}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"link delay must be in [0, 10000] ms, got {self.delay_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def describe(self) -> str:
        delay = f", {self.delay_ms:g} ms one way" if self.delay_ms else ""
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


def probe_netem(delay_ms: float = 10.0) -> str | None:
    """None if the kernel can delay packets with netem; else its answer to the attempt (in a namespace made for it)."""
    check_root()
    _check_tools()
    probe = f"dpwa{os.getpid()}p{next(_counter)}"
    _run(["ip", "netns", "add", probe])
    try:
        done = _run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", f"{delay_ms:g}ms"], False
        )
        return None if done.returncode == 0 else (done.stderr.strip() or f"status {done.returncode}")
    finally:
        _run(["ip", "netns", "delete", probe], check=False)


def check_delay(delay_ms: float) -> None:
    """Raise LinksUnavailable, with the kernel's answer, if a delay of `delay_ms` cannot be made here."""
    if delay_ms <= 0:
        return
    answer = probe_netem(delay_ms)
    if answer is not None:
        raise LinksUnavailable(
            f"--link-delay-ms needs the netem qdisc, and this kernel has none: 'tc qdisc add ... netem delay "
            f"{delay_ms:g}ms' answered: {answer}. Links can be slowed in rate here (tbf), not delayed; leave out "
            "--link-delay-ms"
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
        self._closed = False
        self.setup_s = 0.0

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def run_prefix(self, host: str) -> list[str]:
        return run_prefix(self.namespace(host))

    @property
    def namespaces(self) -> list[str]:
        return [self.hub] + [self.namespace(h) for h in self.hosts]

    def _tbf(self, namespace: str, device: str) -> list[list[str]]:
        rate = f"{self.spec.rate_mbit:g}mbit"
        tbf = ["tbf", "rate", rate, "burst", str(BURST_BYTES), "latency", f"{QUEUE_LATENCY_MS}ms"]
        if self.spec.delay_ms and namespace != self.hub:  # netem first, the rate under it (kernels with netem)
            delay = ["netem", "delay", f"{self.spec.delay_ms:g}ms"]
            return [
                ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", *delay],
                ["tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf],
            ]
        return [["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf]]

    def start(self) -> Links:
        """Make the network (root needed). On any failure, what was made is removed before the error is raised."""
        check_root()
        _check_tools()
        t0 = time.monotonic()
        package_parent = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "dpwa.compare.links", "--reap", self.prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # Ctrl-C in the terminal reaches the runner, not the reaper
        )
        commands = [
            ["ip", "netns", "add", self.hub],
            ["ip", "-n", self.hub, "link", "set", "lo", "up"],
            ["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", self.hub, "link", "set", "br0", "up"],
        ]
        for i, host in enumerate(self.hosts):
            ns, end = self.namespace(host), f"h{i}"
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", self.hub, "link", "add", end, "type", "veth", "peer", "name", INTERFACE, "netns", ns],
                ["ip", "-n", self.hub, "link", "set", end, "master", "br0"],
                ["ip", "-n", self.hub, "link", "set", end, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE],
                ["ip", "-n", ns, "link", "set", INTERFACE, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                *self._tbf(ns, INTERFACE),
                *self._tbf(self.hub, end),
            ]
        try:
            for command in commands:
                _run(command)
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - t0
        return self

    def close(self) -> list[str]:
        """Kill what still runs in the run's namespaces, delete them; stop the reaper. Returns the namespaces removed."""
        if self._closed:
            return []
        self._closed = True
        removed = _teardown(self.prefix)
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
            "each host's eth0 (egress) and on its end in the hub (ingress): R each way",
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
        answer = probe_netem()
    except LinksUnavailable as exc:
        print(f"shaped links: no: {exc}")
        return 1
    print("shaped links: yes (root, ip, tc, network namespaces)")
    print("delay (netem): " + ("yes" if answer is None else f"no; the kernel answered: {answer}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa.compare.links", description=__doc__.split("\n")[0])
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
