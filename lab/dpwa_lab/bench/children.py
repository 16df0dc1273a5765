"""The helper processes the benchmark starts (``python -m dpwa.bench --serve-...``), stopped by PID, and their log.

Each helper (a raw floor's server, a dpwa node that only serves, a second
training node) says ``ready`` on its standard output once it serves, and
stops when its standard input closes. Its error output and its log records
go to the log file the benchmark names (:data:`LOG_ENV`), as the
benchmark's own do (:func:`log_to`), so that standard output holds only the
tables.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

LOG_ENV = "DPWA_BENCH_LOG"  # the log file, handed to the helper processes


def set_when_stdin_closes(event: threading.Event) -> None:
    sys.stdin.read()  # returns when the parent closes our stdin
    event.set()


_handed_out: set[int] = set()  # every port free_port gave: helpers start side by side, so a port is bound late


def free_port() -> int:
    """A free port that this process has not handed out before (the kernel may offer a port again once it is
    let go, and a helper started side by side with others binds its port only later)."""
    from dpwa.cluster.processes import free_ports

    for _ in range(100):  # bounded: the ports handed out are few
        port = free_ports(1)[0]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port that this benchmark has not used already ({len(_handed_out)} used)")


class Child:
    """A helper process of the benchmark; stopped by PID, never by name. Its stderr goes to the bench's log."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> None:
        """Start the helper; with `wait`, return once it serves (else call :meth:`wait_ready` before using it,
        so that several helpers start side by side)."""
        self.args = args
        log_path = self.log_path = os.environ.get(LOG_ENV)
        log = open(log_path, "ab") if log_path else None  # noqa: SIM115  (closed below; the child keeps a copy)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dpwa_lab.bench", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, **(env or {})},
            )
        finally:
            if log is not None:
                log.close()
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the helper said it serves; stop it and raise if it said anything else (or died)."""
        if self.ready:
            return
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded: the helper says ready, or exits and the pipe closes
        if line.strip() != "ready":
            self.stop()
            where = f"; see {self.log_path}" if self.log_path else ""
            raise RuntimeError(f"benchmark helper {self.args} failed to start (said {line!r}){where}")
        self.ready = True

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def log_to(path: Path) -> None:
    """Send every log record and Python warning of this process to `path` instead of the terminal."""
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
