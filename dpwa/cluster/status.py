"""Ask every node of a config for its status over its own socket, and show the answers as one table.

    python -m dpwa status cluster.yaml                  # one table; exit status 1 if a node did not answer
    python -m dpwa status cluster.yaml --json           # {"nodes": [{"name": ..., "state": ..., ...}, ...]}
    python -m dpwa status cluster.yaml --watch          # redraw every 2 s until Ctrl-C
    python -m dpwa status cluster.yaml --key w3         # under CURVE: ask with w3's key pair

Each node is sent one ``status`` request (:mod:`dpwa.gossip.reporting`), all at
once, each on its own client thread, so dead nodes cost one ``timeout_ms``
in all, not one each. A node that does not answer in time is shown as
``unreachable``, with the reason under the table.

Under CURVE a node only talks to listed keys, and a request's ``from`` must
be the name its key belongs to. So the tool asks with one node's key pair:
the first node of the config whose secret key file is usable on this
machine, or the one named by ``--key``. Without CURVE it says it is the
first node of the config (a node only answers names of its cluster).

**Open membership** (a config with ``bootstrap:``, issue 32): the cluster is
whoever is in the members' view, not the config's list. Each round first
sends one ``members`` request (without announcing the tool: it asks, it does
not join) to every bootstrap address and every listed node, all at once,
each within ``timeout_ms``; the answers' digests name the members and their
endpoints. Then every member found, and every listed node, is asked its
status as above: two steps of one ``timeout_ms`` each. A digest carries at
most 16 entries (the answering node and a sample of its view), so in a
cluster of more members one round may miss some: each answer adds its own
sample, and ``--watch`` rounds find the others (a member found stays asked
until a round finds it in no answer after it did not answer itself).

A ``nodes: torchrun`` config cannot be asked from outside: its node list,
endpoints and keys exist only in torchrun's store, for the job's life, and
each worker's secret key only in its memory. :class:`StatusClient` refuses
it at once (:func:`reachable`), and says what to look at instead.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import zmq

from ..config import Config, ConfigError
from ..gossip.membership.members import MembersTask, member_spec
from ..gossip.membership.view import check_entry
from ..gossip.reporting import STATUS_REPORT, StatusTask
from ..gossip.setup import key_pair
from ..wire.calls import Call
from ..wire.client import ClientThread
from ..wire.curve import CurveKeys, KeyFileError

__all__ = ["UNREACHABLE", "StatusClient", "asker", "format_table", "reachable", "watch"]

UNREACHABLE = "unreachable"
GRACE_S = 1.0  # how long past the deadline a client thread may take to report a timeout
# every field of a report, in the order the JSON rows give them (peers_omitted: 0 when the table is whole)
FIELDS = (*STATUS_REPORT.fields, "peers_omitted")
WIDTH = 120  # the peers section wraps at this many columns


def reachable(config: Config) -> None:
    """Raise ConfigError, one line naming the config, when `config` lists no nodes to ask (``nodes: torchrun``)."""
    if config.torchrun and not config.resolved:
        raise ConfigError(
            f"{config.source}: nodes: torchrun: status cannot ask this cluster from outside: its node list, "
            "endpoints and keys live only in torchrun's store for the job's life (each worker's secret key only "
            "in its memory). Instead: each rank's stats() in its own code, the metrics lines train.py --run-dir "
            "DIR writes to DIR/metrics/rank<RANK>.jsonl (python -m dpwa plot DIR draws them), or the workers' "
            "output (torchrun --log-dir, --tee)"
        )


def asker(config: Config, key: str | None = None) -> tuple[str, CurveKeys | None]:
    """Who asks: a node's name and, under CURVE, that node's key pair (as client keys).

    Under CURVE `key` names the node whose key pair to use; None takes the
    first node whose secret key file is usable here. Raises ConfigError
    naming the config, and every key file tried, when none is.
    """
    if key is not None:
        spec = config.node(key)
        if not config.secure:
            return spec.name, None
        try:
            return spec.name, key_pair(spec)
        except KeyFileError as exc:
            raise ConfigError(f"{config.source}: --key {spec.name}: {exc}") from None
    if not config.secure:
        return config.nodes[0].name, None
    tried = []
    for spec in config.nodes:
        try:
            return spec.name, key_pair(spec)
        except KeyFileError as exc:
            tried.append(f"  {spec.name}: {exc}")
    raise ConfigError(
        f"{config.source}: the nodes use CURVE, so status must ask with one node's key pair, and no node's "
        "secret key file is usable here. Tried:\n" + "\n".join(tried) + "\nCopy one node's NAME.key_secret "
        "to the path this config gives for it (mode 0600), and run status again"
    )


class StatusClient:
    """Asks every node of `config` for its status; one client thread per node, so all at once.

    Sockets stay open between rounds (:meth:`ask` may be called again, as
    ``--watch`` does). Use it as a context manager: :meth:`close` stops the
    threads, which close their sockets with linger 0, and ends the context.
    With ``bootstrap:`` (open membership) each round asks the members' view
    first (see the module docstring), and the nodes asked are its members.

    Args:
        config: the cluster to ask.
        key: which node to ask as (see :func:`asker`); None picks one.
    """

    def __init__(self, config: Config, key: str | None = None) -> None:
        reachable(config)
        self.config = config
        self.name, self._curve = asker(config, key)
        self._ctx = zmq.Context()
        self._clients: dict[str, ClientThread] = {}  # by endpoint
        self._keys: dict[str, str] = {}  # endpoint -> the peer name its client knows it by
        self._unanswered: set[str] = set()  # the nodes that did not answer the last round
        self._named: dict[str, str] = {}  # node name -> its endpoint (the config's, and open membership's members)
        try:
            for spec in config.nodes:
                self._named[spec.name] = self._client(spec.name, config.endpoint(spec), spec.public_key)
        except BaseException:
            self.close()
            raise

    def _client(self, name: str, endpoint: str, public_key: str | None = None) -> str:
        """A client thread for `endpoint` (its peer named `name` there), made once; returns the endpoint."""
        if endpoint not in self._clients:
            self._keys[endpoint] = name
            curve = self._curve
            options = {name: curve.client_options((public_key or "").encode())} if curve else None
            self._clients[endpoint] = ClientThread(
                self._ctx,
                {name: endpoint},
                name="status",
                max_reply_bytes=STATUS_REPORT.max_header_bytes,
                socket_options=options,
            ).start()
        return endpoint

    def ask(self, timeout_s: float) -> list[dict[str, Any]]:
        """One status round: a row per node, in config order (open membership: by name).

        A node that answered gives ``{"name", "state", ...every field of its
        report}``; one that did not gives ``{"name", "state": "unreachable",
        "reason"}``. Returns within about `timeout_s` plus a second (open
        membership: twice that, the view asked first).
        """
        if self.config.bootstrap:
            self._find_members(timeout_s)
        deadline = time.monotonic() + timeout_s
        names = sorted(self._named) if self.config.bootstrap else list(self._named)
        calls = {}
        for name in names:
            endpoint = self._named[name]
            calls[name] = self._clients[endpoint].submit(StatusTask(self._keys[endpoint], deadline, self.name))
        rows = [self._row(name, call, deadline) for name, call in calls.items()]
        self._unanswered = {row["name"] for row in rows if row["state"] == UNREACHABLE}
        return rows

    def _find_members(self, timeout_s: float) -> None:
        """Open membership: ask the bootstrap addresses and the listed nodes for the members (one ``members``
        request each, all at once, without announcing ourselves); the members found are asked from now on."""
        deadline = time.monotonic() + timeout_s
        config = self.config
        asked = {config.endpoint(spec): spec for spec in (*config.bootstrap_specs, *config.nodes)}
        calls = {}
        for endpoint, spec in asked.items():
            self._client(spec.name, endpoint, spec.public_key)
            calls[endpoint] = self._clients[endpoint].submit(MembersTask(self._keys[endpoint], deadline, None))
        found: dict[str, tuple[str, str | None]] = {}  # name -> (endpoint, its key: a keyed cluster's)
        for call in calls.values():
            if not call.wait(max(0.0, deadline - time.monotonic()) + GRACE_S):
                call.abandon()
                continue
            if call.outcome != "ok":
                continue
            digest, _ = call.take()
            for raw in digest:
                try:
                    info = check_entry(raw)
                except ValueError:
                    continue  # a malformed entry names nobody
                member = member_spec(info.name, info.endpoint)
                if member is not None and info.name not in found and len(found) < config.members_max:
                    found[info.name] = (config.endpoint(member), info.key)
        listed = {spec.name for spec in config.nodes}
        for name in [n for n in self._named if n not in listed and n not in found and n in self._unanswered]:
            del self._named[name]  # in no answer, and it did not answer itself: gone
        for name, (endpoint, key) in found.items():
            if name not in listed and (name in self._named or len(self._named) < len(listed) + config.members_max):
                self._named[name] = self._client(name, endpoint, key)
        used = set(asked) | set(self._named.values())
        for endpoint in [e for e in self._clients if e not in used]:  # members gone: their clients too
            self._clients.pop(endpoint).close()
            self._keys.pop(endpoint, None)

    def _row(self, name: str, call: Call, deadline: float) -> dict[str, Any]:
        if not call.wait(max(0.0, deadline - time.monotonic()) + GRACE_S):
            call.abandon()
            return {"name": name, "state": UNREACHABLE, "reason": "no answer in time"}
        if call.outcome != "ok":
            return {"name": name, "state": UNREACHABLE, "reason": f"{call.outcome}: {call.reason}"}
        report = call.take()
        if report["name"] != name:  # another cluster's node on this address
            endpoint = self._named[name]
            return {"name": name, "state": UNREACHABLE, "reason": f"{endpoint} answered as {report['name']!r}"}
        return {key: report.get(key, 0 if key == "peers_omitted" else None) for key in FIELDS}

    def close(self) -> None:
        """Stop every client thread (each closes its sockets, linger 0), then end the context."""
        stopped = all([client.close() for client in self._clients.values()])
        self._clients.clear()
        self._keys.clear()
        if stopped:
            self._ctx.term()  # every socket is closed, so this returns at once
        else:  # a thread still holds a socket: term() would wait for it
            self._ctx.destroy(linger=0)

    def __enter__(self) -> StatusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- the table


def _bytes(n: int) -> str:
    if n < 1000:
        return f"{n}B"
    value = float(n)
    for unit in ("kB", "MB", "GB"):
        value /= 1000
        if value < 1000:
            return f"{value:.1f}{unit}"
    return f"{value / 1000:.1f}TB"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{1000 * s:.1f}ms"
    return f"{s:.2f}s"


def _uptime(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _peer(name: str, peer: dict[str, Any]) -> str:
    text = f"{name} {peer['score']:.2f}/{_seconds(peer.get('latency_s'))}"
    return text + (f" ({peer['failures']} failed)" if peer.get("failures") else "")


def _wrap(head: str, items: Sequence[str], width: int) -> list[str]:
    """`head`, then `items` two spaces apart; a line that would pass `width` goes on under the first item."""
    lines, line = [], head + items[0]
    for item in items[1:]:
        if len(line) + 2 + len(item) > width:
            lines.append(line)
            line = " " * len(head) + item
        else:
            line += "  " + item
    lines.append(line)
    return lines


def format_table(rows: Sequence[dict[str, Any]], width: int = WIDTH) -> list[str]:
    """The table of :meth:`StatusClient.ask`'s rows; then each node's peers, and why a node is unreachable."""
    head = ("node", "state", "epoch", "clock", "loss", "exch/s", "failed", "in", "out", "pending", "up")
    table: list[tuple[str, ...]] = [head]
    for row in rows:
        if row["state"] == UNREACHABLE:
            table.append((row["name"], UNREACHABLE) + ("-",) * (len(head) - 2))
            continue
        loss = row.get("loss")
        table.append(
            (
                row["name"],
                row["state"].replace("_", " "),
                str(row["epoch"]),
                f"{row['clock']:.1f}",
                "-" if loss is None else f"{loss:.4f}",
                f"{row['exchanges_per_s']:.1f}",
                str(row["failures"]),
                _bytes(row["bytes_in"]),
                _bytes(row["bytes_out"]),
                str(row["pending"]),
                _uptime(row.get("uptime_s")),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table]
    name_width = widths[0]
    answered = [row for row in rows if row["state"] != UNREACHABLE]
    if any(row["peers"] for row in answered):
        lines += ["", "peers: score/last latency, as each node sees them"]
        for row in answered:
            peers = row["peers"]
            items = [_peer(name, peers[name]) for name in sorted(peers)] or ["-"]
            if row.get("peers_omitted"):
                items.append(f"(and {row['peers_omitted']} more, left out to fit the reply)")
            lines += _wrap(row["name"].ljust(name_width) + "  ", items, width)
    missing = [row for row in rows if row["state"] == UNREACHABLE]
    if missing:
        lines.append("")
        lines += [f"{row['name']}: unreachable: {row.get('reason', '')}".rstrip() for row in missing]
    return lines


# --------------------------------------------------------------------------- the command


def watch(
    config: Config,
    *,
    key: str | None = None,
    timeout_s: float | None = None,
    as_json: bool = False,
    every_s: float | None = None,
    count: int | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Ask every node once (or every `every_s` seconds, `count` times or until Ctrl-C) and print the answers.

    Prints the table (or, with `as_json`, one ``{"nodes": [...]}`` document
    per round, one a line). On a terminal each round redraws the screen;
    otherwise tables follow each other. Returns 0 if every node answered in
    the last round, 1 if some did not, 130 on Ctrl-C.
    """
    timeout_s = config.timeout_s if timeout_s is None else timeout_s
    tty = out.isatty()
    rounds = 0
    status = 0
    try:
        with StatusClient(config, key) as client:
            while True:
                started = time.monotonic()
                rows = client.ask(timeout_s)
                rounds += 1
                status = 0 if all(row["state"] != UNREACHABLE for row in rows) else 1
                if as_json:
                    out.write(json.dumps({"nodes": rows}) + "\n")
                else:
                    if every_s is not None and tty:
                        out.write("\x1b[H\x1b[2J")  # home, clear the screen
                    elif rounds > 1:
                        out.write("\n")
                    lines = format_table(rows)
                    answered = sum(row["state"] != UNREACHABLE for row in rows)
                    stamp = time.strftime("%H:%M:%S")
                    note = f"{answered} of {len(rows)} nodes answered at {stamp} (asked as {client.name})"
                    if every_s is not None:
                        note += f"; every {every_s:g} s, Ctrl-C stops"
                    out.write("".join(line + "\n" for line in lines + ["", note]))
                out.flush()
                if every_s is None or (count is not None and rounds >= count):
                    return status
                time.sleep(max(0.0, every_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 130
