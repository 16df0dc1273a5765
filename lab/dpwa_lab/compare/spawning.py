"""The processes of one comparison run: started in their own sessions, stopped and killed by PID, never by name.

Each process runs ``python -m dpwa_lab.compare.worker ROLE ...`` with one thread
per library (``OMP_NUM_THREADS=1``), its output in ``logs/NAME.log`` and a
PID file ``pids/NAME.pid`` (``PID START``, see :mod:`dpwa.cluster.processes`).
Each is the leader of its own session and process group, so stopping it also
reaches its children through the group id, and only while the leader is
known to be ours (not yet reaped). Any other process that writes a PID file
into ``pids/`` is stopped too: :meth:`Processes.stop_all` signals those whose
start time still matches, so nothing is left behind even if its parent died
first. With slow links each process runs under ``ip netns exec NS``, which
execs it: the PID is still the process's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dpwa
from dpwa.cluster.processes import THREAD_ENV, process_start, read_pid_file, tail, write_pid_file

__all__ = ["IMPORT_ROOTS", "Processes", "child_pythonpath"]

# the folders that hold the lab's package and the library's (a checkout's lab/ and root, or site-packages), first
# on every child's PYTHONPATH: a child imports the same dpwa_lab and dpwa as the process that started it
IMPORT_ROOTS = tuple(
    dict.fromkeys(str(p) for p in (Path(__file__).resolve().parents[2], Path(dpwa.__file__).resolve().parents[1]))
)


def child_pythonpath() -> str:
    """PYTHONPATH for a child process: :data:`IMPORT_ROOTS`, then this process's own PYTHONPATH if any."""
    return os.pathsep.join(p for p in (*IMPORT_ROOTS, os.environ.get("PYTHONPATH", "")) if p)


class Processes:
    """The processes of one run, by name."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        for sub in ("logs", "pids"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed: dict[str, float] = {}  # name -> when we sent SIGKILL on purpose (time.time())

    def start(
        self,
        name: str,
        role: str,
        run_file: Path,
        index: int = 0,
        *,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start process `name` in `role`; `prefix` goes before its command (``ip netns exec NS``, which execs,
        so the PID is the process's own), `env` adds to its environment."""
        argv = [*prefix, sys.executable, "-m", "dpwa_lab.compare.worker", role, "--run", str(run_file), "--name", name]
        argv += ["--index", str(index)]
        path = child_pythonpath()
        env = {**os.environ, **THREAD_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
        with open(self.workdir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs[name] = proc  # a name started again (a restarted rank) is this new process from now on
        self.killed.pop(name, None)
        write_pid_file(self.workdir / "pids" / f"{name}.pid", proc.pid)
        return proc

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def exit_codes(self) -> dict[str, int | None]:
        return {name: p.poll() for name, p in self.procs.items()}

    def log_tail(self, name: str, lines: int = 8) -> str:
        return tail(self.workdir / "logs" / f"{name}.log", lines)

    def kill(self, name: str) -> bool:
        """SIGKILL the process `name` (one we started, or a rank by its PID file). True if it was running."""
        proc = self.procs.get(name)
        if proc is not None:
            if proc.poll() is not None:
                return False
            proc.kill()
            proc.wait(10)
            self.killed[name] = time.time()
            return True
        pid_file = self.workdir / "pids" / f"{name}.pid"
        pid, start = read_pid_file(pid_file)
        if process_start(pid) != start:
            return False
        os.kill(pid, signal.SIGKILL)
        self.killed[name] = time.time()
        return True

    def pause(self, name: str) -> bool:
        """SIGSTOP the process `name` (ours, still running), so that what it holds cannot change. True if paused."""
        proc = self.procs[name]
        if proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGSTOP)
        return True

    def resume(self, name: str) -> None:
        """SIGCONT the process `name` after :meth:`pause` (a no-op once it has ended)."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    def signal_group(self, name: str, sig: int) -> None:
        """Send `sig` to the process group led by `name`, while that process is still ours (not reaped)."""
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, names: list[str], grace_s: float = 10.0) -> list[str]:
        """SIGTERM these processes' groups; SIGKILL those still running after `grace_s`. Returns those killed."""
        for name in names:
            self.signal_group(name, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(self.running(n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.05)
        stubborn = [n for n in names if self.running(n)]
        for name in stubborn:
            self.signal_group(name, signal.SIGKILL)
        for name in names:
            self.procs[name].wait(10)
        return stubborn

    def stop_all(self, grace_s: float = 10.0) -> list[str]:
        """Stop every process of the run, then any rank whose PID file still names a live process of ours."""
        killed = self.stop(list(self.procs), grace_s)
        for pid_file in sorted((self.workdir / "pids").glob("*.pid")):
            if pid_file.stem in self.procs:
                continue
            try:
                pid, start = read_pid_file(pid_file)
            except (OSError, ValueError):
                continue
            if process_start(pid) == start:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid_file.stem)
        return killed

    def leftover(self) -> list[str]:
        """Names (from every PID file) of processes that still run."""
        out = []
        for pid_file in sorted((self.workdir / "pids").glob("*.pid")):
            try:
                pid, start = read_pid_file(pid_file)
            except (OSError, ValueError):
                continue
            if process_start(pid) == start:
                out.append(pid_file.stem)
        return out
