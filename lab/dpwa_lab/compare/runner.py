"""Run one system of the comparison: write its run description, start its processes, open the gate, wait, collect.

With slow links (``RunOptions.link_mbit``) every process of the run gets its
own network namespace and shaped link (:mod:`.links`), made before the
processes start and removed after they stopped; the processes then reach each
other at their namespaces' addresses (gossip over TCP with ``insecure: true``,
the master and the servers over TCP, gloo over the namespace's link).

A run is bounded: the processes must be ready within ``startup_s`` and done
within ``time_limit_s`` of the start; past either, every process is stopped
(SIGTERM to its group, SIGKILL after a grace) and the run is reported as
not completed. A process that exits with an error stops the run too, unless
it is the victim of the run's fault. Nothing is left behind: every process,
and every all-reduce rank, is stopped by PID before :func:`run_system` returns.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dpwa.cluster.processes import free_ports
from dpwa.mixing.outer import OuterSettings
from dpwa.wire.endpoints import private_dir

from ..systems.diloco import DEFAULT_PERIOD
from .byzantine import ATTACKS, byzantine_names
from .links import INTERFACE, Links, LinkSpec
from .recorder import open_gate
from .spawning import Processes
from .workload import WorkloadSpec

__all__ = [
    "KNOWN_SYSTEMS",
    "gossip_keys",
    "is_gossip",
    "OPT_IN_SYSTEMS",
    "SYSTEMS",
    "Fault",
    "RunOptions",
    "SystemRun",
    "open_config",
    "run_system",
]

# The gossip systems: dpwa as a user gets it (its defaults), and one key away from them: the low-bandwidth
# preset, the original's rule (pull, state, a random peer), push-sum (pull, pushsum; the defaults'
# pairing: a hypercube at 2 and 4 nodes), and NoLoCo (Kolehmainen et al. 2025): an exchange with one peer every
# H = 10 steps (DiLoCo's H here) and NoLoCo's outer step at its authors' settings, outer learning rate 0.7 and
# momentum 0.3 (their configs, e.g. configs/no_reduce_exp/C4/c4_noloco_100m_8.yaml in jkolehm/noloco).
GOSSIP_SYSTEMS: dict[str, dict[str, Any]] = {
    "gossip": {},
    "gossip-lowbw": {"preset": "low_bandwidth"},
    "gossip-original": {"preset": "original"},
    "gossip-pushsum": {"mode": "pull", "rule": "pushsum"},
    "gossip-noloco": {"period": 10, "outer": "noloco", "outer_lr": 0.7, "outer_momentum": 0.3},
}
OPT_IN_SYSTEMS = ("gossip-pushsum", "gossip-noloco")  # run only when --systems names them
SYSTEMS = (  # the default --systems
    *(s for s in GOSSIP_SYSTEMS if s not in OPT_IN_SYSTEMS),
    "sync-master",
    "async-ps",
    "allreduce",
    "diloco",
)
KNOWN_SYSTEMS = (*SYSTEMS, *OPT_IN_SYSTEMS)  # every built-in system --systems accepts
VARIANT_PREFIX = "gossip-"  # --variant NAME=...: the gossip system gossip-NAME, with the variant's keys


def is_gossip(system: str) -> bool:
    """A gossip system: a built-in one, or a variant of the comparison's (``--variant NAME=...``: gossip-NAME)."""
    return system == "gossip" or system.startswith(VARIANT_PREFIX)


def gossip_keys(system: str, options: RunOptions) -> dict[str, Any]:
    """The dpwa config keys gossip system `system` runs with: a built-in system's own with ``--gossip-set``'s
    over them; a variant's over ``--gossip-set``'s (the variant is the more specific)."""
    variants = dict(options.variants)
    if system in GOSSIP_SYSTEMS:
        return {**GOSSIP_SYSTEMS[system], **dict(options.gossip_settings)}
    if system in variants:
        return {**dict(options.gossip_settings), **dict(variants[system])}
    raise ValueError(f"unknown gossip system {system!r}; choose from {', '.join([*GOSSIP_SYSTEMS, *variants])}")


COLLECTIVE = ("allreduce", "diloco")  # one process per rank, in one gloo group: a dead rank stops the others
POLL_S = 0.05
PORT = 29600  # with slow links: every host has its own address, so one port serves them all


@dataclass(frozen=True)
class RunOptions:
    """How the systems are set up (the same for every run of a comparison)."""

    lease_s: float = 5.0  # sync: a task held this long without a call returns to todo
    sufficient: int | None = None  # sync: gradients per step (None: the live workers)
    max_retries: int = 3  # sync: refused reports computed again before a task fails
    ps_servers: int = 2  # async-ps: K
    ps_timeout_s: float = 1.0  # async-ps: deadline of a pull or push
    gossip_timeout_ms: int = 1000  # gossip: deadline of a fetch
    gossip_settings: tuple[tuple[str, Any], ...] = ()  # gossip: config keys set for every gossip system
    # gossip variants, each a system of its own (gossip-NAME) with its config keys: (system, ((key, value), ...))
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    gloo_timeout_s: float = 30.0  # all-reduce, DiLoCo: a collective that waits longer fails
    diloco_period: int = DEFAULT_PERIOD  # DiLoCo: H, inner steps between two synchronisations
    outer_lr: float = 0.7  # DiLoCo: the outer Nesterov step's learning rate
    outer_momentum: float = 0.9  # DiLoCo: and its momentum
    link_mbit: float = 0.0  # each process's link, Mbit/s each way (0: loopback, no namespaces)
    link_delay_ms: float = 0.0  # one way between two hosts: the hub's delay line (lab/dpwa_lab/compare/delayline.py)
    startup_s: float = 120.0  # every process ready within this
    time_limit_s: float = 600.0  # training done within this of the start
    grace_s: float = 10.0  # between SIGTERM and SIGKILL
    byzantine: int = 0  # gossip: the last K workers publish wrong snapshots (lab/dpwa_lab/compare/byzantine.py)
    attack: str = "offset"  # gossip: what a Byzantine worker publishes (byzantine.ATTACKS)
    churn: int = 0  # workers that leave during the run, each replaced by a newcomer (lab/dpwa_lab/compare/churn.py)

    def __post_init__(self) -> None:
        if self.lease_s <= 0 or self.ps_timeout_s <= 0 or self.gossip_timeout_ms < 1 or self.gloo_timeout_s <= 0:
            raise ValueError("lease_s, ps_timeout_s, gossip_timeout_ms and gloo_timeout_s must be positive")
        if self.diloco_period < 1:
            raise ValueError(f"diloco_period must be at least 1, got {self.diloco_period}")
        OuterSettings(self.outer_lr, self.outer_momentum)  # checks both
        if self.link_mbit:
            LinkSpec(self.link_mbit, self.link_delay_ms)  # checks both
        elif self.link_delay_ms:
            raise ValueError("a link delay needs shaped links (link_mbit)")
        if self.sufficient is not None and self.sufficient < 1:
            raise ValueError(f"num_gradients_sufficient must be at least 1, got {self.sufficient}")
        if self.ps_servers < 1 or self.max_retries < 0:
            raise ValueError("ps_servers must be at least 1 and max_retries at least 0")
        if self.byzantine < 0:
            raise ValueError(f"byzantine must be at least 0, got {self.byzantine}")
        if self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose from {', '.join(ATTACKS)}")
        if self.churn < 0:
            raise ValueError(f"churn must be at least 0, got {self.churn}")
        if self.churn and (self.link_mbit or self.byzantine):
            raise ValueError("churn runs over loopback without Byzantine workers (not with link_mbit or byzantine)")
        for system, _ in self.variants:
            if not system.startswith(VARIANT_PREFIX) or system in KNOWN_SYSTEMS:
                raise ValueError(f"a variant's system is {VARIANT_PREFIX}NAME, not a built-in one; got {system!r}")

    @property
    def known_systems(self) -> tuple[str, ...]:
        """Every system these options can run: the built-in ones and the variants."""
        return (*KNOWN_SYSTEMS, *(system for system, _ in self.variants))


class Fault(Protocol):
    """Something done to a run while it trains (kill a process). Polled by the runner every 50 ms."""

    def poll(self, run: LiveRun) -> None: ...

    def report(self) -> dict[str, Any]: ...


@dataclass
class SystemRun:
    """What one run left: its processes' results and snapshots, and how it ended."""

    system: str
    workdir: Path
    go: float  # the start (Unix time); 0 if it never started
    completed: bool
    error: str | None
    results: dict[str, dict[str, Any]]
    snapshots: dict[str, list[dict[str, Any]]]
    exit_codes: dict[str, int | None]
    workers: list[str]  # the training processes' names
    fault: dict[str, Any] | None = None
    ended: float = 0.0  # Unix time the last process ended
    failed_at_s: float | None = None  # when the runner saw the run fail, from the start
    extra: dict[str, Any] = field(default_factory=dict)
    byzantine: list[str] = field(default_factory=list)  # gossip: the workers that published wrong snapshots


@dataclass
class LiveRun:
    """A run in progress, as a fault sees it."""

    system: str
    workdir: Path
    run: dict[str, Any]
    procs: Processes
    go: float
    workers: list[str]  # the training processes' names (a fault that starts a newcomer adds it)
    env: dict[str, str] = field(default_factory=dict)  # what the processes' environment adds (a restart's too)

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.go


def _endpoints(tag: str, names: list[str], links: Links | None) -> dict[str, str]:
    if links is not None:
        return {name: f"tcp://{links.address(name)}:{PORT}" for name in names}
    base = private_dir()
    return {name: f"ipc://{base / f'cmp-{tag}-{name}'}" for name in names}


def process_names(system: str, spec: WorkloadSpec, options: RunOptions) -> list[str]:
    """The names of `system`'s processes, in start order (each is a host when links are shaped)."""
    workers = [f"w{i}" for i in range(spec.workers)]
    if is_gossip(system):
        return workers
    if system == "sync-master":
        return ["master", *workers]
    if system == "async-ps":
        return [f"ps{k}" for k in range(options.ps_servers)] + workers
    if system in COLLECTIVE:
        return [f"rank{i}" for i in range(spec.workers)]
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(KNOWN_SYSTEMS)}")


def byzantine_workers(system: str, spec: WorkloadSpec, options: RunOptions) -> list[str]:
    """The workers of `system` that publish wrong snapshots: the last ``options.byzantine`` of a gossip
    system, none otherwise."""
    if not is_gossip(system) or not options.byzantine:
        return []
    if 2 * options.byzantine >= spec.workers:
        raise ValueError(f"{options.byzantine} Byzantine workers of {spec.workers}: they must be fewer than half")
    return byzantine_names(spec.workers, options.byzantine)


def plan_processes(
    system: str, spec: WorkloadSpec, options: RunOptions, tag: str, workdir: Path, links: Links | None = None
) -> tuple[dict, list, list]:
    """(the system's options for the run description, [(name, role, index)] to start, names that must be ready)."""
    workers = [f"w{i}" for i in range(spec.workers)]
    if is_gossip(system):
        if links is not None:
            hosts = [(links.address(n), PORT) for n in workers]
        else:
            hosts = [("127.0.0.1", p) for p in free_ports(spec.workers)]
        config = {
            "nodes": [{"name": n, "host": h, "port": p} for n, (h, p) in zip(workers, hosts, strict=True)],
            "timeout_ms": options.gossip_timeout_ms,
            "same_host": "off",  # parameters travel over the socket, as they do for every other system
            "join": "never",  # every node starts from the same seed already
            **gossip_keys(system, options),
        }
        if links is not None:
            # Reachable addresses: dpwa refuses them without keys unless told. The namespaces are the run's own,
            # and gloo, the master and the servers talk in the clear too.
            config["insecure"] = True
        gossip_opts = {"byzantine": byzantine_workers(system, spec, options), "attack": options.attack}
        starts = [(n, "gossip", i) for i, n in enumerate(workers)]
        described: dict[str, Any] = {"gossip_config": config, "options": gossip_opts}
        if options.churn:  # open membership: each node lists itself, and joins through the first workers
            described["gossip_configs"] = {n: open_config(config, n) for n in workers}
            described["joiners"] = {}
        return described, starts, workers
    if system == "sync-master":
        endpoint = _endpoints(tag, ["master"], links)["master"]
        sync_opts = {
            "endpoint": endpoint,
            "lease_s": options.lease_s,
            "sufficient": options.sufficient,
            "max_retries": options.max_retries,
            "time_limit_s": options.time_limit_s,
            "unreachable_s": max(30.0, 3 * options.lease_s),
        }
        starts = [("master", "sync-master", 0)] + [(n, "sync-worker", i) for i, n in enumerate(workers)]
        return {"options": sync_opts}, starts, ["master", *workers]
    if system == "async-ps":
        servers = [f"ps{k}" for k in range(options.ps_servers)]
        endpoints = _endpoints(tag, servers, links)
        ps_opts = {
            "servers": options.ps_servers,
            "endpoints": [endpoints[s] for s in servers],
            "timeout_s": options.ps_timeout_s,
            "io_threads": max(2, 2 * options.ps_servers),
            "time_limit_s": options.time_limit_s,
        }
        starts = [(s, "ps-server", k) for k, s in enumerate(servers)]
        starts += [(n, "ps-trainer", i) for i, n in enumerate(workers)]
        return {"options": ps_opts}, starts, servers + workers
    if system in COLLECTIVE:
        ranks = [f"rank{i}" for i in range(spec.workers)]
        opts: dict[str, Any] = {"store": str(workdir / "gloo.rendezvous"), "gloo_timeout_s": options.gloo_timeout_s}
        if options.churn:
            opts["elastic"] = True  # checkpoints, and a restarted group resumes from the last (roles/allreduce.py)
        if system == "diloco":
            opts.update(period=options.diloco_period, outer_lr=options.outer_lr, outer_momentum=options.outer_momentum)
        return {"options": opts}, [(r, system, i) for i, r in enumerate(ranks)], ranks
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(KNOWN_SYSTEMS)}")


BOOTSTRAP_NODES = 3  # --churn: the first workers, whose addresses every node's bootstrap list names


def open_config(config: dict[str, Any], name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """--churn: node `name`'s open-membership config: the run's gossip config listing only this node (`extra`:
    a newcomer's own entry), with the first workers' addresses to join through, and join: auto (a newcomer
    takes a member's state)."""
    nodes = config["nodes"]
    own = extra if extra is not None else next(n for n in nodes if n["name"] == name)
    bootstrap = [f"{n['host']}:{n['port']}" for n in nodes[:BOOTSTRAP_NODES]]
    return {**config, "nodes": [own], "bootstrap": bootstrap, "join": "auto" if extra is not None else "never"}


def run_system(
    system: str,
    spec: WorkloadSpec,
    options: RunOptions,
    workdir: Path,
    *,
    fault: Fault | None = None,
    log: Callable[[str], None] = print,
) -> SystemRun:
    """Run `system` on `spec` in `workdir` (created; must be new). Always stops every process it started,
    and removes the run's namespaces when links are shaped (raises LinksUnavailable if they cannot be made)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=False)
    tag = f"{int(time.time() * 1000) % 10**9:09d}-{system}"
    links = None
    if options.link_mbit:
        links = Links(process_names(system, spec, options), LinkSpec(options.link_mbit, options.link_delay_ms))
    with links if links is not None else contextlib.nullcontext():
        system_options, starts, ready = plan_processes(system, spec, options, tag, workdir, links)
        run_file = workdir / "run.json"
        run = {
            "system": system,
            "workdir": str(workdir),
            "run_file": str(run_file),
            "workload": spec.as_dict(),
            "options": {},
            **system_options,
        }
        run_file.write_text(json.dumps(run, indent=1))
        procs = Processes(workdir)
        workers = [n for n in ready if n.startswith(("w", "rank"))]
        interface = INTERFACE if links is not None else "lo"
        env = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if system in COLLECTIVE else {}
        go, error, completed, failed_at_s = 0.0, None, False, None
        try:
            for name, role, index in starts:
                prefix = links.run_prefix(name) if links is not None else []
                procs.start(name, role, run_file, index, prefix=prefix, env=env)
            error = _wait_ready(procs, workdir, ready, options.startup_s)
            if error is None:
                go = open_gate(workdir)
                log(f"  {system}: {len(starts)} processes started, training")
                live = LiveRun(system, workdir, run, procs, go, workers, env)
                completed, error = _wait_done(system, live, options, fault)
                failed_at_s = None if completed else time.time() - go
        finally:
            leftover = procs.stop_all(options.grace_s)
            for path in private_dir().glob(f"cmp-{tag}-*"):  # this run's ipc sockets and locks (a killed server's too)
                path.unlink(missing_ok=True)
            if leftover and error is None and not completed:
                error = f"stopped: {', '.join(leftover)}"
    ended = time.time()
    result = _collect(system, workdir, go, completed, error, procs, workers, fault, ended)
    result.failed_at_s = failed_at_s
    result.byzantine = byzantine_workers(system, spec, options)
    if links is not None:
        result.extra["links"] = {**links.describe(), "setup_s": round(links.setup_s, 3)}
    return result


def _wait_ready(procs: Processes, workdir: Path, ready: list[str], limit_s: float) -> str | None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all((workdir / "ready" / name).exists() for name in ready):
            return None
        for name, code in procs.exit_codes().items():
            if code is not None:
                return f"{name} exited with status {code} while starting:\n{procs.log_tail(name)}"
        time.sleep(POLL_S)
    missing = [n for n in ready if not (workdir / "ready" / n).exists()]
    return f"not ready within {limit_s:.0f} s: {', '.join(missing)}"


def _training_names(system: str, live: LiveRun) -> list[str]:
    return [n for n in live.procs.procs if n.startswith(("w", "rank"))]


def _wait_done(system: str, live: LiveRun, options: RunOptions, fault: Fault | None) -> tuple[bool, str | None]:
    procs = live.procs
    deadline = time.monotonic() + options.time_limit_s
    while time.monotonic() < deadline:
        if fault is not None:
            fault.poll(live)
        training = _training_names(system, live)  # read again: a fault may have started a newcomer
        for name, code in procs.exit_codes().items():
            if code not in (None, 0) and name not in procs.killed:
                if system in COLLECTIVE and fault is not None and procs.killed:
                    return False, f"{name} exited with status {code} after a rank was killed"
                return False, f"{name} exited with status {code}:\n{procs.log_tail(name)}"
        if all(not procs.running(n) for n in training):
            break
        time.sleep(POLL_S)
    else:
        return False, f"not done within {options.time_limit_s:.0f} s"
    if system == "sync-master":  # the master ends by itself once every task is done
        end = time.monotonic() + options.lease_s + 5.0
        while procs.running("master") and time.monotonic() < end:
            time.sleep(POLL_S)
        if procs.running("master"):
            return False, "the master did not finish after every worker ended"
        if procs.exit_codes()["master"] != 0:
            return False, f"master exited with status {procs.exit_codes()['master']}"
    if system == "async-ps":  # servers run until told: every trainer is done
        servers = [n for n in procs.procs if n.startswith("ps")]
        procs.stop(servers, options.grace_s)
    return True, None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    return out


def _collect(
    system: str,
    workdir: Path,
    go: float,
    completed: bool,
    error: str | None,
    procs: Processes,
    workers: list[str],
    fault: Fault | None,
    ended: float,
) -> SystemRun:
    results = {}
    for path in sorted((workdir / "results").glob("*.json")) if (workdir / "results").exists() else []:
        try:
            results[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue
    snapshots = {}
    for path in sorted((workdir / "snapshots").glob("*.jsonl")) if (workdir / "snapshots").exists() else []:
        snapshots[path.stem] = _read_jsonl(path)
    return SystemRun(
        system=system,
        workdir=workdir,
        go=go,
        completed=completed,
        error=error,
        results=results,
        snapshots=snapshots,
        exit_codes=procs.exit_codes(),
        workers=workers,
        fault=fault.report() if fault is not None else None,
        ended=ended,
        extra={"killed": dict(procs.killed)},
    )
