"""Start, watch and stop one process per dpwa node on this machine.

A launch is a :class:`LaunchSpec`: the cluster's configuration (every node,
local or not), which of its nodes to start here, and the command each runs.
:func:`prepare` makes the run folder; :func:`run` runs the cluster in the
foreground with a live view and a summary; :func:`detach` hands it to a
background supervisor (``python -m dpwa.cluster.launch RUN_DIR``) and returns.

The run folder::

    runs/<timestamp>/
        config.yaml           the cluster configuration every node reads
        launch.json           the spec (what was started, how)
        pids/<node>.pid       "PID START" per node; pids/launcher.pid for the launcher
                              and pids/finish.pid for the finish command. START is
                              the process start time, so a PID reused by another
                              process is never signalled (see stop.sh)
        logs/<node>.log       each node's stdout and stderr (launcher.log: detached launcher)
        metrics/<node>.jsonl  written by the nodes (fields: see dpwa.cluster.monitor)
        events.jsonl          what the launcher did and saw: starts, kills, exits, restarts (dpwa.cluster.events)
        dashboard.json        with --dashboard: its URL; with the kill button the URL holds the token,
                              which is written nowhere else (no log, no output)
        models/<node>.pt      written by the nodes
        summary.json, summary.txt, curves.png   written at the end

The run folder is this user's alone (:mod:`dpwa.runfiles.private`): it and every folder in
it are mode 0700, its files 0600, whatever the umask; a run folder that
belongs to another user or that others may write to is refused, naming it.
Node processes, the finish command and the detached launcher run with umask
077, so what they write is private too.

The processes themselves (pinning, PID files, SIGTERM then SIGKILL) are
:mod:`dpwa.cluster.processes`; the live view and the summary are :mod:`dpwa.cluster.monitor`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..config import ConfigError, parse_config
from ..runfiles.private import make_private_dir, make_private_file, open_private, write_private
from .events import EventLog
from .monitor import LiveView, MetricsTail, format_summary, summarize
from .processes import PRIVATE_UMASK, Cluster, tail, write_pid_file

__all__ = ["LaunchSpec", "new_run_dir", "prepare", "run", "detach", "supervise"]


@dataclass(frozen=True)
class LaunchSpec:
    """What to start. Commands may hold the placeholders {name}, {index}, {config} and {run_dir}."""

    run_dir: str  # the run folder (see the module docstring)
    config: dict[str, Any]  # the cluster configuration in mapping form, every node included
    command: list[str]  # argv of one node
    local: list[str] = field(default_factory=list)  # nodes started on this machine; empty: all
    finish_command: list[str] = field(default_factory=list)  # run once all nodes exited; last line JSON
    pin: bool = True  # one core per node (taskset)
    grace_s: float = 10.0  # between SIGTERM and SIGKILL
    print_every_s: float = 10.0  # plain progress lines when the output is not a terminal
    env: dict[str, str] = field(default_factory=dict)  # added to each node's environment (placeholders filled)
    restarts: int = 0  # times a node that dies (a failure, or chaos) is started again
    chaos_s: float = 0.0  # chaos mode: kill a random training node every this many seconds on average; 0: off
    chaos_seed: int | None = None  # randomness of chaos mode
    dashboard: bool = False  # serve the live web page (dpwa.cluster.dashboard) while the cluster runs
    dashboard_port: int = 0  # its port on 127.0.0.1; 0: a free one
    dashboard_kill: bool = False  # and its kill button, behind a per-run token

    @property
    def names(self) -> list[str]:
        return [n["name"] for n in self.config["nodes"]]

    @property
    def local_names(self) -> list[str]:
        return list(self.local) or self.names

    def argv(self, argv: list[str], name: str | None = None) -> list[str]:
        """`argv` with the placeholders filled in ({name} and {index} only when `name` is given)."""
        values = {"{config}": str(Path(self.run_dir) / "config.yaml"), "{run_dir}": str(self.run_dir)}
        if name is not None:
            values.update({"{name}": name, "{index}": str(self.names.index(name))})
        out = []
        for arg in argv:
            for key, value in values.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def environment(self, name: str | None = None) -> dict[str, str]:
        """`env` with its placeholders filled in, as :meth:`argv` fills them (for node `name`, if given)."""
        return dict(zip(self.env, self.argv(list(self.env.values()), name), strict=True))

    def save(self) -> None:
        write_private(Path(self.run_dir, "launch.json"), json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path) -> LaunchSpec:
        path = Path(run_dir) / "launch.json"
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: cannot read the launch spec: {exc}") from exc


# --------------------------------------------------------------------------- the run folder


def new_run_dir(runs_dir: str | Path) -> Path:
    """A fresh runs_dir/<YYYYmmdd-HHMMSS> (with a suffix if that exists), and runs_dir/latest pointing to it.

    The run folder is made by this call, mode 0700 (runs_dir too, when it is made here).
    """
    runs = Path(runs_dir)
    if not runs.is_dir():
        make_private_dir(runs)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1, 1000):
        path = runs / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            os.mkdir(path, 0o700)  # ours only if we made it: one that exists is never taken over
            break
        except FileExistsError:
            continue
    else:
        raise OSError(f"{runs}: cannot make a new run folder")
    make_private_dir(path)  # exactly 0700, whatever the umask
    latest = runs / "latest"
    tmp = runs / f".latest-{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        tmp.replace(latest)
    except OSError:  # no symlinks here (some file systems): the folder itself is what matters
        tmp.unlink(missing_ok=True)
    return path


def prepare(spec: LaunchSpec) -> LaunchSpec:
    """Check the configuration and write config.yaml and launch.json into the run folder.

    The run folder and its folders are made (or set to) mode 0700; one that belongs to another user, or
    that others may write to, is a NotPrivateError (an OSError) naming it.
    """
    run_dir = Path(spec.run_dir)
    parse_config(spec.config, source=str(run_dir / "config.yaml"))  # a ConfigError names what is wrong
    unknown = [n for n in spec.local if n not in spec.names]
    if unknown:
        raise ConfigError(
            f"{run_dir / 'config.yaml'}: no node named {', '.join(unknown)} (known: {', '.join(spec.names)})"
        )
    make_private_dir(run_dir)
    for sub in ("pids", "logs", "metrics", "models"):
        make_private_dir(run_dir / sub, base=run_dir)
    if (run_dir / "checkpoints").is_dir():  # a resumed run's (made 0644 by an older dpwa, maybe): 0700 now
        make_private_dir(run_dir / "checkpoints", base=run_dir)
    with open_private(run_dir / "config.yaml", "w") as fh:
        fh.write("# written by the dpwa launcher; every node of this run reads it\n")
        yaml.safe_dump(spec.config, fh, sort_keys=False, default_flow_style=None)
    spec.save()
    return spec


# --------------------------------------------------------------------------- foreground run


class _Signals:
    """Records SIGINT, SIGTERM and SIGHUP instead of dying, so the launcher can stop its nodes first."""

    def __init__(self) -> None:
        self.first: int | None = None  # the signal that asked to stop
        self.interrupts = 0  # Ctrl-C presses: the second one means "kill now"
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def _handle(self, signum: int, frame: object) -> None:
        self.first = self.first or signum
        self.interrupts += signum == signal.SIGINT

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run(spec: LaunchSpec, out: TextIO | None = None, tty: bool | None = None) -> int:
    """Run the cluster until every node exits or a signal stops it; then the summary and curves.png.

    Returns 0 when every node exited with 0, 1 when one failed, 2 when the
    dashboard asked for cannot start, 128 + the signal number when stopped by
    a signal. Every started process is stopped before this returns, whatever
    happens, and the dashboard with them.
    """
    out = out or sys.stdout
    run_dir = Path(spec.run_dir)
    if spec.chaos_s > 0 and spec.restarts < 1:
        raise ValueError("chaos mode kills nodes: give --restarts N (N >= 1) so that they are started again")
    write_pid_file(run_dir / "pids" / "launcher.pid", os.getpid())
    path = launcher_path()  # a bare `python` (or torchrun, ...) in the command means this launcher's own
    cluster = Cluster(
        run_dir,
        {name: spec.argv(spec.command, name) for name in spec.local_names},
        pin=spec.pin,
        grace_s=spec.grace_s,
        env={name: {"PATH": path, **spec.environment(name)} for name in spec.local_names},
    )
    metrics = MetricsTail(run_dir, spec.local_names)
    view = LiveView(out, tty=tty, every_s=spec.print_every_s)
    with contextlib.ExitStack() as stack:
        events = stack.enter_context(EventLog(run_dir))
        if spec.dashboard:
            try:
                board = stack.enter_context(_start_dashboard(spec))
            except (OSError, ValueError) as exc:
                view.message(f"dpwa: the dashboard cannot start: {exc}")
                return 2
            view.message(f"dpwa: dashboard: {_dashboard_where(board.url, run_dir)}  (it stops with the cluster)")
        else:
            view.message(f"dpwa: to watch it in a browser: {_python()} -m dpwa dashboard {run_dir}  (prints its URL)")
        signals = _Signals()
        stack.callback(signals.restore)
        try:
            events.write("run_start", nodes=spec.local_names, pid=os.getpid())
            view.message(
                f"dpwa: {len(spec.local_names)} nodes ({', '.join(spec.local_names)}), "
                f"{cluster.pinning()}; run folder {run_dir}"
            )
            view.message(interpreter_line(spec.command, path))
            view.message(f"dpwa: node logs in {run_dir / 'logs'}; stop with Ctrl-C or ./stop.sh {run_dir}")
            cluster.start()
            for name, proc in cluster.procs.items():
                events.write("node_start", name, pid=proc.pid, restart=0)
            _watch(spec, cluster, metrics, view, signals, events)
            _conclude(spec, list(metrics.poll().values()), view, signals, out)
        finally:
            if cluster.alive():  # the launcher itself failed: never leave a node behind
                cluster.stop()
        if signals.first:
            code = 128 + signals.first
        else:
            code = 0 if all(c == 0 for c in cluster.exited().values()) else 1
        events.write("run_end", code=code)
    return code


def launcher_path(environ: dict[str, str] | None = None) -> str:
    """The PATH a node runs with: the folder of the interpreter that runs this launcher first (``.venv/bin``
    under ./run.sh), then the caller's, as ``uv run`` and ``poetry run`` do. So a bare ``python``,
    ``python3``, ``torchrun``, ``accelerate`` or ``lightning`` in the command is the launcher's own
    environment's, with the torch and the dpwa it holds; an explicit path is run as given."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in (os.environ if environ is None else environ).get("PATH", "").split(os.pathsep) if p]
    return os.pathsep.join([here, *(p for p in rest if p != here)])


def _program(command: list[str], path: str) -> tuple[str, str | None, bool]:
    """The command's program; what it runs (as `path` finds a bare name; None: not found); and whether it is
    run as given (a path, or no program)."""
    program = command[0] if command else "?"
    if program == "?" or os.sep in program:
        return program, program, True
    return program, shutil.which(program, path=path), False


def interpreter_line(command: list[str], path: str) -> str:
    """One line: what the nodes' command runs (its program as PATH resolves it)."""
    program, found, given = _program(command, path)
    if given:
        return f"dpwa: the nodes run {program} as given"
    where = str(Path(sys.executable).parent)
    if found is None:
        return f"dpwa: the nodes run {program}, which is not on their PATH ({where} first)"
    return f"dpwa: the nodes run {program} = {found} ({where} first on their PATH)"


_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def import_failure(log: Path, command: list[str], path: str) -> str | None:
    """One line when a node's log ends in a missing module: which module, and which interpreter lacked it."""
    try:
        text = log.read_text(errors="replace")[-20000:]
    except OSError:
        return None
    found = _MISSING_MODULE.findall(text)
    if not found:
        return None
    program, resolved, _ = _program(command, path)
    return (
        f"failed at import: no module named {found[-1]!r} in {resolved or program} (install it there, or run the "
        "command with the interpreter that has it)"
    )


def _dashboard_where(url: str, run_dir: Path) -> str:
    """What the launcher prints for the dashboard at `url`: the URL itself, unless it holds the kill token.

    Then the URL without it, and where the whole one is: RUN_DIR/dashboard.json, which only this user can
    read. The launcher's output may go to a log (logs/launcher.log under --detach, a pipe to tee): the
    token never does.
    """
    if "?" not in url:
        return url
    return (
        f"{url.split('?', 1)[0]} (read-only; the URL with the kill button's token is in {run_dir / 'dashboard.json'})"
    )


@contextlib.contextmanager
def _start_dashboard(spec: LaunchSpec) -> Iterator[Any]:
    """The run's dashboard, serving until the block ends; its URL in RUN_DIR/dashboard.json (mode 0600)."""
    from .dashboard import Dashboard

    run_dir = Path(spec.run_dir)
    record = run_dir / "dashboard.json"
    with Dashboard(run_dir, port=spec.dashboard_port, allow_kill=spec.dashboard_kill) as board:
        # The only place the token is written: mode 0600, in a 0700 folder; whole or not at all for a reader.
        write_private(record, json.dumps({"url": board.url, "pid": os.getpid()}))
        try:
            yield board
        finally:
            record.unlink(missing_ok=True)


def _python() -> str:
    """This interpreter, as a user would type it from the current folder."""
    python = os.path.relpath(sys.executable)
    return sys.executable if python.startswith("..") else python


class _Supervisor:
    """Restarts nodes that die (up to spec.restarts each) and, in chaos mode, kills one now and then."""

    def __init__(
        self, spec: LaunchSpec, cluster: Cluster, metrics: MetricsTail, view: LiveView, events: EventLog
    ) -> None:
        self.spec, self.cluster, self.metrics, self.view, self.events = spec, cluster, metrics, view, events
        self.rng = random.Random(spec.chaos_seed)
        self.restarts: dict[str, int] = dict.fromkeys(cluster.commands, 0)
        self.next_kill = self._next_kill(first=True)

    def _next_kill(self, first: bool = False) -> float:
        if self.spec.chaos_s <= 0:
            return math.inf
        wait = self.rng.expovariate(1.0 / self.spec.chaos_s)
        return time.monotonic() + max(wait, self.spec.chaos_s / 2 if first else 1.0)

    def kill_and_restart_due(self, stopping: bool) -> set[str]:
        """Kill (chaos) and restart as due; returns the nodes started again now."""
        restarted: set[str] = set()
        if stopping:
            return restarted
        nodes = self.metrics.nodes
        if time.monotonic() >= self.next_kill:
            # One failure at a time: only while every node trains (none is starting again), and only a
            # node that may still be started again; so the cluster's state always survives in a peer.
            # The metrics are read again first: a node that has just finished and lingers is not training,
            # and one killed then found its peers gone when it came back (a 2 x 60 s join in a CI run).
            nodes = self.metrics.poll()
            alive = self.cluster.alive()
            up = len(alive) == len(nodes) and all(
                nodes[n].state == "training" and nodes[n].trained_since_start for n in alive
            )
            victims = [n for n in alive if self.restarts[n] < self.spec.restarts]
            if up and victims:
                victim = self.rng.choice(victims)
                if self.cluster.kill(victim):
                    nodes[victim].kills += 1
                    self.events.write("kill", victim, pid=self.cluster.procs[victim].pid, by="chaos")
                    self.view.message(f"dpwa: chaos: SIGKILL to {victim}")
                self.next_kill = self._next_kill()
            elif not victims:
                self.next_kill = self._next_kill()
            # else a kill that is due waits for the cluster to be up again (looked at every tick), rather
            # than being dropped: on a loaded machine a node starting again took longer than the mean
            # interval, and a whole run could pass without one kill.
        for name, code in self.cluster.exited().items():
            finished = code == 0 and nodes[name].end is not None
            if finished or self.restarts[name] >= self.spec.restarts:
                continue
            self.restarts[name] += 1
            nodes[name].restarts += 1
            nodes[name].exit_code = None
            nodes[name].restarted_at = time.time()  # it is not training until it says so again
            self.view.message(
                f"dpwa: {name} exited with code {code}; starting it again "
                f"(restart {self.restarts[name]} of {self.spec.restarts}): it rejoins from its peers"
            )
            self.cluster.restart(name)
            self.events.write("restart", name, restart=self.restarts[name], of=self.spec.restarts)
            self.events.write("node_start", name, pid=self.cluster.procs[name].pid, restart=self.restarts[name])
            restarted.add(name)
        return restarted


def _watch(
    spec: LaunchSpec, cluster: Cluster, metrics: MetricsTail, view: LiveView, signals: _Signals, events: EventLog
) -> None:
    """Show progress until every node has exited; on a signal, SIGTERM them all, SIGKILL after the grace period."""
    stopping_since: float | None = None
    killed: list[str] = []
    reported: set[str] = set()
    supervisor = _Supervisor(spec, cluster, metrics, view, events)
    while cluster.alive() or supervisor.kill_and_restart_due(stopping=stopping_since is not None):
        if signals.first and stopping_since is None:
            view.message(
                f"dpwa: {signal.Signals(signals.first).name}: stopping {len(cluster.alive())} nodes "
                f"(SIGTERM; SIGKILL after {spec.grace_s:g} s or at a second Ctrl-C)"
            )
            events.write("stop", signal=signal.Signals(signals.first).name)
            cluster.signal(signal.SIGTERM)
            stopping_since = time.monotonic()
        if stopping_since is not None and not killed:
            if signals.interrupts > 1:
                killed, why = cluster.alive(), "at the second Ctrl-C"
            elif time.monotonic() - stopping_since > spec.grace_s:
                killed, why = cluster.alive(), f"still running {spec.grace_s:g} s after SIGTERM"
            if killed:
                view.message(f"dpwa: SIGKILL to {', '.join(killed)} ({why})")
                cluster.signal(signal.SIGKILL)
        _report_exits(cluster, metrics, view, reported, Path(spec.run_dir), events)
        reported -= supervisor.kill_and_restart_due(stopping=stopping_since is not None)
        view.update(list(metrics.poll().values()))
        time.sleep(0.25)
    _report_exits(cluster, metrics, view, reported, Path(spec.run_dir), events)
    view.update(list(metrics.poll().values()), force=True, final=True)
    view.close()


def _conclude(spec: LaunchSpec, nodes: list, view: LiveView, signals: _Signals, out: TextIO) -> None:
    """Evaluate the parameter average (unless stopped), write and print the summary, draw curves.png."""
    run_dir = Path(spec.run_dir)
    elapsed = view.elapsed()
    average = None
    if spec.finish_command and not signals.first:
        average = _finish(spec, view, signals)
    elif spec.finish_command:
        average = {"error": f"the run was stopped; to evaluate it anyway: {shlex.join(spec.argv(spec.finish_command))}"}
    summary = summarize(nodes, average, elapsed, run_dir)
    write_private(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    text = format_summary(summary)
    write_private(run_dir / "summary.txt", text + "\n")
    out.write("\n" + text + "\n")
    try:
        from .plot import draw

        out.write(f"curves: {make_private_file(draw(run_dir))}\n")
    except Exception as exc:  # the plot is a convenience: say why it is missing, keep the run's result
        out.write(f"curves.png not drawn: {exc}\n")
    out.flush()


def _report_exits(
    cluster: Cluster, metrics: MetricsTail, view: LiveView, reported: set[str], run_dir: Path, events: EventLog
) -> None:
    for name, code in cluster.exited().items():
        if name in reported:
            continue
        reported.add(name)
        events.write("exit", name, code=code)
        metrics.nodes[name].exit_code = code
        if code != 0 and code != -signal.SIGTERM:
            log = run_dir / "logs" / f"{name}.log"
            view.message(f"dpwa: {name} exited with code {code}; last lines of {log}:\n{tail(log)}")
            why = import_failure(log, cluster.commands[name], launcher_path())
            if why is not None:
                view.message(f"dpwa: {name} {why}")


def _finish(spec: LaunchSpec, view: LiveView, signals: _Signals) -> dict[str, Any]:
    """Run the finish command (the parameter average's evaluation); its last stdout line is JSON.

    It has a PID file (pids/finish.pid) like the nodes, and a stop signal
    ends it (SIGTERM, then SIGKILL after the grace period).
    """
    run_dir = Path(spec.run_dir)
    missing = [n for n in spec.local_names if not (run_dir / "models" / f"{n}.pt").exists()]
    if missing:
        return {"error": f"no final weights from {', '.join(missing)}"}
    view.message("dpwa: evaluating the parameter average of all nodes")
    try:
        proc = subprocess.Popen(
            spec.argv(spec.finish_command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **spec.environment()},
            start_new_session=True,
            umask=PRIVATE_UMASK,
        )
    except OSError as exc:
        return {"error": f"cannot run {spec.finish_command[0]}: {exc}"}
    write_pid_file(run_dir / "pids" / "finish.pid", proc.pid)
    output: list[tuple[str, str]] = []
    communicate = threading.Thread(target=lambda: output.append(proc.communicate()), daemon=True)
    communicate.start()  # reads both pipes, so a chatty command cannot block on a full pipe
    stopped_at = None
    while communicate.is_alive():
        if signals.first and stopped_at is None:
            proc.terminate()
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at > spec.grace_s:
            proc.kill()
        communicate.join(0.1)
    if stopped_at is not None:
        return {"error": "stopped during the evaluation"}
    stdout, stderr = output[0]
    lines = stdout.strip().splitlines()
    try:
        if proc.returncode != 0 or not lines:
            raise ValueError(stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {proc.returncode}")
        return json.loads(lines[-1])
    except ValueError as exc:
        return {"error": str(exc)}


# --------------------------------------------------------------------------- detached


def detach(spec: LaunchSpec, out: TextIO | None = None, timeout_s: float = 60.0) -> int:
    """Start a background supervisor that runs the cluster; return once every node has started."""
    out = out or sys.stdout
    run_dir = Path(spec.run_dir)
    with open_private(run_dir / "logs" / "launcher.log", "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "dpwa.cluster.launch", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            umask=PRIVATE_UMASK,
        )
    pid_files = [run_dir / "pids" / f"{n}.pid" for n in spec.local_names]
    waiting_for = pid_files + ([run_dir / "dashboard.json"] if spec.dashboard else [])
    deadline = time.monotonic() + timeout_s
    try:
        while not all(p.exists() for p in waiting_for):
            if supervisor.poll() is not None or time.monotonic() > deadline:
                log_path = run_dir / "logs" / "launcher.log"
                out.write(
                    f"dpwa: the background launcher did not start the nodes; see {log_path}:\n{tail(log_path, 10)}\n"
                )
                if supervisor.poll() is None:
                    supervisor.terminate()  # it stops whatever it started
                return 1
            time.sleep(0.05)
    except KeyboardInterrupt:
        out.write(f"\ndpwa: the cluster goes on starting in the background; ./stop.sh {run_dir} stops it\n")
        return 130
    python = _python()
    if spec.dashboard:
        try:
            url = json.loads((run_dir / "dashboard.json").read_text())["url"]
            dashboard = "  dashboard: " + _dashboard_where(str(url), run_dir)
        except (OSError, ValueError, KeyError, TypeError):  # it stopped already: the run ended at once
            dashboard = f"  dashboard: see {run_dir / 'logs' / 'launcher.log'}"
    else:
        dashboard = f"  dashboard: {python} -m dpwa dashboard {run_dir}   (prints its URL)"
    out.write(
        f"dpwa: {len(pid_files)} nodes started in the background (launcher pid {supervisor.pid}); "
        f"run folder {run_dir}\n"
        f"  progress:  {python} -m dpwa status {run_dir}   (or: tail -f {run_dir / 'logs' / 'launcher.log'})\n"
        f"{dashboard}\n"
        f"  stop:      ./stop.sh {run_dir}\n"
    )
    out.flush()
    return 0


def supervise(run_dir: str | Path) -> int:
    """The detached launcher: run the cluster described by RUN_DIR/launch.json."""
    return run(LaunchSpec.load(run_dir), tty=False)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dpwa.cluster.launch RUN_DIR   (the background launcher of ./run.sh --detach)")
    sys.exit(supervise(sys.argv[1]))
