"""Processes of a run: free ports, PID files that survive PID reuse, and the node processes themselves.

A PID file holds one line, ``PID START``: START is when the process started
(clock ticks since boot from ``/proc/PID/stat``, or ``ps -o lstart`` where
there is no /proc). A process is signalled only while its start time still
matches, so a stale file whose PID now belongs to another process is harmless;
``stop.sh`` applies the same rule.

Each node runs in its own session (a terminal's Ctrl-C reaches only the
launcher, which then stops the nodes in order), pinned to one core with
``taskset`` where it exists, with ``OMP_NUM_THREADS=1``. Stopping sends
SIGTERM to every node, waits `grace_s`, then sends SIGKILL to any left.

PID files and logs are mode 0600 in folders of mode 0700 (:mod:`dpwa.runfiles.private`), and
every node runs with umask 077 (:data:`PRIVATE_UMASK`): what it writes into
the run folder is this user's alone too.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from ..runfiles.private import make_private_dir, open_private, write_private
from ..wire.endpoints import ipc_claimed, is_loopback

__all__ = [
    "PRIVATE_UMASK",
    "Cluster",
    "PORTS_ENV",
    "free_ports",
    "port_range",
    "check_ports_free",
    "process_start",
    "write_pid_file",
    "read_pid_file",
    "tail",
]

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
PRIVATE_UMASK = 0o077  # the processes a launcher starts create files 0600 and folders 0700 unless they say otherwise


# --------------------------------------------------------------------------- ports


PORTS_ENV = "DPWA_PORTS"  # LO-HI: free_ports draws from this range instead of the kernel's ephemeral one


def port_range(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """The range `$DPWA_PORTS` names (``LO-HI``, both included), or None where it is unset or empty."""
    text = (os.environ if environ is None else environ).get(PORTS_ENV, "").strip()
    if not text:
        return None
    lo_text, sep, hi_text = text.partition("-")
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        lo = hi = -1
    if not sep or not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"${PORTS_ENV}={text!r}: expected LO-HI, two port numbers 1024 <= LO <= HI <= 65535")
    return lo, hi


_range_cursor: dict[tuple[int, int], int] = {}  # where this process's next draw from a $DPWA_PORTS range starts


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports on `host` that were free a moment ago. On a loopback host a port whose
    ipc endpoint is claimed is skipped too: loopback nodes listen there (node-PORT), not on the port.

    The kernel picks them, from its ephemeral range; where `$DPWA_PORTS` names a range (``LO-HI``), they come
    from that range instead, tried on from where this process's last draw ended (the first from a random
    place): a firewall's open range, or one of its own for each of several launchers on one host (the test
    suite's parallel workers), so that none draws a port another has just drawn and let go."""
    if count <= 0:
        return []
    loopback = is_loopback(host)
    chosen = port_range()
    candidates: Iterator[int] = iter(lambda: 0, None)  # port 0: the kernel's choice, each time
    tries = count + 100  # bounded: each claimed port costs one more draw
    if chosen is not None:
        lo, hi = chosen
        start = _range_cursor.get(chosen, random.randrange(lo, hi + 1))
        candidates = itertools.chain(range(start, hi + 1), range(lo, start))
        tries = hi - lo + 1
    sockets: list[socket.socket] = []  # all kept open until the end, so no port is drawn twice
    ports: list[int] = []
    try:
        for candidate in itertools.islice(candidates, tries):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            try:
                s.bind((host, candidate))
            except OSError:
                if candidate == 0:
                    raise
                continue  # in use: the next one in the range
            port = s.getsockname()[1]
            if chosen is not None:  # the next draw goes on from here: a port comes round again only after the rest
                _range_cursor[chosen] = port + 1 if port < chosen[1] else chosen[0]
            if not (loopback and ipc_claimed(port)):
                ports.append(port)
                if len(ports) == count:
                    return ports
    except OSError as exc:
        raise OSError(
            f"cannot bind a port on {host}: {exc.strerror or exc} (is {host} an address of this machine?)"
        ) from exc
    finally:
        for s in sockets:
            s.close()
    where = f"${PORTS_ENV}={chosen[0]}-{chosen[1]}" if chosen else f"{tries} draws"
    raise OSError(f"no {count} free ports on {host} whose ipc endpoints are unclaimed in {where}")


def check_ports_free(host: str, ports: list[int]) -> None:
    """Raise OSError naming the first port on `host` that a node could not bind."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise OSError(
                    f"port {port} on {host} is not free ({exc.strerror}); another run may hold it: "
                    "stop it (./stop.sh), choose another --base-port, or leave --base-port out"
                ) from exc


# --------------------------------------------------------------------------- PID files


def process_start(pid: int) -> str | None:
    """When process `pid` started, as a token that differs for a later process with the same PID; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()  # the fields after "(command name)"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        if not Path("/proc/self/stat").exists():  # no /proc (macOS): ask ps
            out = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True)
            return "_".join(out.stdout.split()) or None
        return None
    if fields[0] == b"Z":  # exited, not yet reaped
        return None
    return fields[19].decode()  # field 22 of stat: start time in clock ticks since boot


def write_pid_file(path: Path, pid: int) -> None:
    """Write "PID START" to `path` atomically, mode 0600 (its folder made 0700 if missing)."""
    make_private_dir(path.parent)
    write_private(path, f"{pid} {process_start(pid) or '-'}\n")


def read_pid_file(path: str | Path) -> tuple[int, str]:
    """(PID, start time) from a PID file written by write_pid_file."""
    text = Path(path).read_text()
    try:
        pid, start = text.split()
        return int(pid), start
    except ValueError:
        raise ValueError(f"{path}: expected 'PID START', got {text.strip()!r}") from None


# --------------------------------------------------------------------------- node processes


class Cluster:
    """The node processes of one run: started in their own sessions, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        run_dir: str | Path,
        commands: dict[str, list[str]],
        *,
        pin: bool = True,
        grace_s: float = 10.0,
        env: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.commands = commands  # argv per node name, in start order
        self.pin = pin
        self.grace_s = grace_s
        self.env = env or {}  # per node: what its environment adds
        self.procs: dict[str, subprocess.Popen] = {}
        self.cores = self._cores() if pin else []
        self.taskset = shutil.which("taskset") if pin else None

    @staticmethod
    def _cores() -> list[int]:
        if hasattr(os, "sched_getaffinity"):
            return sorted(os.sched_getaffinity(0))
        return list(range(os.cpu_count() or 1))

    def pinning(self) -> str:
        """How nodes are pinned, in words."""
        if not self.pin:
            return "not pinned (--no-pin)"
        if not self.taskset:
            return "not pinned (taskset not found)"
        cores = [self.cores[i % len(self.cores)] for i in range(len(self.commands))]
        return "pinned to cores " + ", ".join(map(str, cores)) + " (taskset)"

    def start(self) -> None:
        """Start every node: output to logs/NAME.log, PID file pids/NAME.pid."""
        for name in self.commands:
            self._spawn(name)

    def _spawn(self, name: str) -> None:
        env = {**os.environ, **THREAD_ENV, "PYTHONUNBUFFERED": "1", **self.env.get(name, {})}
        argv = self.commands[name]
        if self.taskset:
            i = list(self.commands).index(name)
            argv = [self.taskset, "-c", str(self.cores[i % len(self.cores)])] + argv
        with open_private(self.run_dir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                umask=PRIVATE_UMASK,
            )
        self.procs[name] = proc
        write_pid_file(self.run_dir / "pids" / f"{name}.pid", proc.pid)

    def restart(self, name: str) -> None:
        """Start node `name` again (its previous process has exited): same command, its log appended."""
        old = self.procs[name]
        if old.poll() is None:
            raise RuntimeError(f"{name} (pid {old.pid}) is still running; stop it before starting it again")
        self._spawn(name)

    def kill(self, name: str) -> bool:
        """SIGKILL node `name` now (chaos mode). False if it had exited already."""
        proc = self.procs[name]
        if proc.poll() is not None:
            return False
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def exited(self) -> dict[str, int]:
        """Exit codes of the nodes that have exited so far."""
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def alive(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is None]

    def signal(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:  # not yet reaped, so the PID is still ours
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace_s: float | None = None) -> list[str]:
        """SIGTERM every node, SIGKILL those still alive after `grace_s`; returns the names that needed SIGKILL."""
        grace_s = self.grace_s if grace_s is None else grace_s
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed = self.alive()
        if killed:
            self.signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait()
        return killed


def tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").rstrip("\n").split("\n")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])
