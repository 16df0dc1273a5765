"""The live dashboard: one web page of a running cluster, served by the standard library on 127.0.0.1.

    python -m dpwa dashboard runs/latest                  # a run folder: status, curves, graph, events
    python -m dpwa dashboard runs/latest/config.yaml      # any config: status and the mixing graph only
    python -m dpwa dashboard runs/latest --allow-kill     # and a kill button, behind a secret token
    ./run.sh --dashboard                                  # started and stopped with the cluster

It prints its URL. The page (``dashboard.html``, beside this module) asks
``GET /api/state`` every second and draws what it gets; the state is gathered
in the background (:mod:`.observe`), so a request never waits for a node and
an unreachable node never blocks the page.

Routes:

* ``GET /``: the page. Its script runs under a Content-Security-Policy nonce;
  it writes every value into the page as text, never as markup.
* ``GET /api/state``: everything the page shows, as JSON.
* ``POST /api/kill?node=NAME&token=TOKEN``: SIGKILL one node of a local run by
  the PID its launcher recorded (``RUN_DIR/pids/NAME.pid``, start time
  checked), as ``--chaos`` does. Only with ``allow_kill``, only on a loopback
  address, and only with the token of this dashboard (``secrets.token_urlsafe``,
  compared with ``hmac.compare_digest``). Anything else is refused with an
  HTTP error that says why.

Every request must name this dashboard's own address in its ``Host`` header
(a page of another site that rebinds its name to 127.0.0.1 is refused), and a
``POST`` that carries an ``Origin`` must come from the dashboard's own page.

Each request is bounded as a whole (:class:`_Server`): its line, headers and
body must all come within REQUEST_DEADLINE_S of its accept and within
MAX_REQUEST_BYTES (+ MAX_BODY_BYTES); they are read without a thread, so
connections that trickle bytes (slowloris) never keep a whole request, such as
the owner's page's, from being answered; and connections still sending their
request are capped per client address and in all, a newcomer closing the
oldest.
"""

from __future__ import annotations

import hmac
import http.server
import io
import json
import logging
import os
import queue
import re
import secrets
import selectors
import signal
import socket
import struct
import threading
import time
from http import HTTPStatus
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..config import Config, ConfigError, load_config
from ..wire.endpoints import is_loopback
from .launch import LaunchSpec
from .observe import EventBoard, RunWatcher, StatusPoller, jsonable
from .processes import process_start, read_pid_file

__all__ = ["Dashboard", "Refused", "DEFAULT_HOST", "shown_names"]

logger = logging.getLogger("dpwa.dashboard")

DEFAULT_HOST = "127.0.0.1"
# What one client can cost the dashboard (see _Server, and docs/dashboard.md's threat model).
REQUEST_DEADLINE_S = 5.0  # a request's line, headers and body must all have come this long after its accept
RESPONSE_DEADLINE_S = 5.0  # and its answer must be taken (written to the socket) within this
MAX_REQUEST_BYTES = 16 * 1024  # the request line and headers, at most
MAX_BODY_BYTES = 1024  # a request body, at most (no route reads one); a larger one is refused unread
MAX_PENDING = 256  # connections whose request has not come whole; beyond, a newcomer closes the oldest
MAX_PENDING_PER_ADDRESS = 64  # the same, per client address (the oldest of that address goes first)
MAX_QUEUED = 64  # whole requests waiting for a worker; more are closed unanswered
HTTP_WORKERS = 4  # threads that answer whole requests
MAX_QUERY_BYTES = 1024  # a longer query string is refused


class Refused(Exception):
    """A request the dashboard refuses: the HTTP status, and why in words."""

    def __init__(self, status: HTTPStatus, message: str, allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.allow = allow  # the methods a 405 names


def shown_names(config: Config, names: list[str], rows: list[dict[str, Any]]) -> list[str]:
    """The nodes the page shows: the config's; with ``bootstrap:`` (open membership) also every member the
    last status round found (its rows), by name, so members show as they come and go."""
    if not config.bootstrap:
        return names
    return sorted(set(names) | {row["name"] for row in rows if isinstance(row.get("name"), str)})


class Dashboard:
    """Serves the page of one run folder (or config) until :meth:`close`; a context manager.

    Args:
        target: a run folder (its ``config.yaml``, ``metrics/``, ``events.jsonl``, ``pids/``), or a
            cluster config file (status only).
        host: the address to listen on; 127.0.0.1 unless you mean to show the page to other machines.
        port: the TCP port; 0 picks a free one (see :attr:`url`).
        allow_kill: serve the kill button (a run folder and a loopback `host` only).
        key: under CURVE, ask status as this node (see ``python -m dpwa status --key``).
        timeout_s: how long one status round waits for the nodes (default: min(timeout_ms, 2 s)).
        every_s: seconds between status rounds, and between reads of the run folder.
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        allow_kill: bool = False,
        key: str | None = None,
        timeout_s: float | None = None,
        every_s: float = 1.0,
    ) -> None:
        target = Path(target)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.run_dir: Path | None = None
        if target.is_dir():
            self.run_dir = target.resolve()
            config_path = self.run_dir / "config.yaml"
            if not config_path.is_file():
                raise FileNotFoundError(f"{target}: not a run folder (no config.yaml in it)")
        elif target.is_file():
            config_path = target
        else:
            raise FileNotFoundError(f"{target}: no such config file or run folder")
        self.config: Config = load_config(config_path)
        if not self.config.resolved:
            raise ConfigError(f"{config_path}: nodes: torchrun: the nodes are known only once the workers meet")
        self.names = [spec.name for spec in self.config.nodes]
        self.local_names = self._local_names()
        if allow_kill and self.run_dir is None:
            raise ValueError(f"{target}: the kill button needs a run folder (its pids/ say which process is which)")
        if allow_kill and not is_loopback(host):
            raise ValueError(f"the kill button is only served on a loopback address such as 127.0.0.1, not {host}")
        self.allow_kill = allow_kill
        self.token = secrets.token_urlsafe(24) if allow_kill else None
        self.title = str(self.run_dir) if self.run_dir is not None else str(config_path)
        self.events = EventBoard()
        self._status = StatusPoller(self.config, self.events, key=key, timeout_s=timeout_s, every_s=every_s)
        self._files = RunWatcher(self.run_dir, self.names, self.events, every_s) if self.run_dir else None
        self._page = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
        self._server = _Server((host, port), self)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._serve, name="dpwa-dashboard-http", daemon=True)
        self._started = False
        self._closed = False

    def _local_names(self) -> list[str]:
        if self.run_dir is None:
            return []
        if (self.run_dir / "launch.json").exists():
            try:
                return LaunchSpec.load(self.run_dir).local_names
            except ValueError:
                pass
        return [n for n in self.names if (self.run_dir / "pids" / f"{n}.pid").exists()]

    @property
    def url(self) -> str:
        """The page's address; with the kill button, it carries the token (keep it to yourself)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    def start(self) -> Dashboard:
        """Start gathering and serving; returns self. The port is bound already (by the constructor)."""
        if self._started:
            return self
        self._started = True
        try:
            self._status.start()
            if self._files is not None:
                self._files.start()
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        """Stop serving (the port is free when this returns), then stop both watchers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()  # joins the answering threads (each answer ends within RESPONSE_DEADLINE_S)
        self._status.close()
        if self._files is not None:
            self._files.close()

    def __enter__(self) -> Dashboard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- what the handlers serve

    def page(self, nonce: str) -> bytes:
        return self._page.replace("{{NONCE}}", nonce).encode("utf-8")

    def state(self) -> dict[str, Any]:
        """Everything the page shows (the latest snapshots; never waits)."""
        files = self._files.snapshot() if self._files is not None else {}
        status = self._status.snapshot()
        return {
            "title": self.title,
            "now": round(time.time(), 3),
            "nodes": shown_names(self.config, self.names, status["rows"]),
            "local": self.local_names,
            "kill": self.allow_kill,
            "status": status,
            "run": files or None,
            "events": self.events.snapshot(),
        }

    def state_json(self) -> bytes:
        return json.dumps(jsonable(self.state()), allow_nan=False, separators=(",", ":")).encode()

    def check_token(self, given: str | None) -> None:
        """Refused unless the kill button is on and `given` is its token."""
        if not self.allow_kill or self.token is None:
            raise Refused(HTTPStatus.NOT_FOUND, "the kill button is off: start the dashboard with --allow-kill")
        if not given:
            raise Refused(HTTPStatus.FORBIDDEN, "no token: open the URL the dashboard printed (it ends in ?token=...)")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            raise Refused(HTTPStatus.FORBIDDEN, "wrong token: open the URL the dashboard printed")

    def kill(self, name: str) -> dict[str, Any]:
        """SIGKILL node `name` of this run by its recorded PID, if that process still runs; else Refused."""
        assert self.run_dir is not None  # allow_kill needs a run folder
        if name not in self.local_names:
            known = ", ".join(self.local_names) or "none"
            raise Refused(HTTPStatus.NOT_FOUND, f"no node {name[:64]!r} started on this machine (known: {known})")
        path = self.run_dir / "pids" / f"{name}.pid"
        try:
            pid, start = read_pid_file(path)
        except (OSError, ValueError) as exc:
            raise Refused(HTTPStatus.CONFLICT, f"{name}: no usable PID file ({exc})") from None
        try:
            _kill_exactly(pid, start)
        except ProcessLookupError:
            raise Refused(HTTPStatus.CONFLICT, f"{name} (pid {pid}) is not running") from None
        self.events.add(time.time(), "kill", name, f"SIGKILL from the dashboard's kill button (pid {pid})")
        logger.warning("dashboard: SIGKILL to %s (pid %d), from the kill button", name, pid)
        return {"killed": name, "pid": pid}


def _kill_exactly(pid: int, start: str) -> None:
    """SIGKILL process `pid` if it is still the one that started at `start`; else ProcessLookupError.

    Where the system has pidfds, the process is pinned before its start time is
    checked, so the signal cannot reach a process that took its PID meanwhile.
    """
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            raise ProcessLookupError(pid) from exc
        try:
            if process_start(pid) != start:
                raise ProcessLookupError(pid)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
        return
    if process_start(pid) != start:
        raise ProcessLookupError(pid)
    os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- HTTP


class _Pending:
    """A connection whose request has not all come yet: what came, and when it must have come by."""

    __slots__ = ("sock", "address", "deadline", "data", "need")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock, self.address, self.deadline = sock, address, deadline
        self.data = bytearray()
        self.need = 0  # once the headers are in: the bytes of the whole request (headers and body)


class _Server:
    """The dashboard's HTTP server: requests are read whole before any thread works on them.

    One thread (:meth:`serve_forever`) accepts connections and reads every
    request's line, headers and body (at most MAX_BODY_BYTES) without blocking,
    through a selector, within REQUEST_DEADLINE_S of the connection's accept
    for all of it together, and within MAX_REQUEST_BYTES. A connection that
    misses its deadline, or sends more, is closed unanswered. So a client that
    trickles bytes (slowloris) holds a buffer and a file descriptor, never a
    thread: a request that has come whole is answered by one of HTTP_WORKERS
    threads at once, however many slow ones are still coming in.

    Connections still coming in are capped: MAX_PENDING_PER_ADDRESS per client
    address and MAX_PENDING in all; a new connection beyond a cap closes the
    oldest one still coming in (of its address, then of all), so a newcomer,
    such as the owner's page, always gets in. Whole requests wait for a worker
    in a queue of at most MAX_QUEUED (more are closed unanswered), and each
    answer must be written within RESPONSE_DEADLINE_S (a client that does not
    read it is dropped).
    """

    def __init__(self, address: tuple[str, int], dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.request_deadline_s = REQUEST_DEADLINE_S
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except OSError as exc:
            self.socket.close()
            raise OSError(f"cannot serve the dashboard on {address[0]}:{address[1]}: {exc.strerror or exc}") from exc
        self.server_address = self.socket.getsockname()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._pending: dict[socket.socket, _Pending] = {}  # in the order they were accepted
        self._queue: queue.Queue[tuple[socket.socket, Any, bytes] | None] = queue.Queue(MAX_QUEUED)
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._closed = False

    # ----------------------------------------------------------------- the loop

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        """Accept and read requests until :meth:`shutdown`; whole requests go to the workers."""
        for i in range(HTTP_WORKERS):
            worker = threading.Thread(target=self._work, name=f"dpwa-dashboard-http-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._expire(now)
                first = next(iter(self._pending.values()), None)  # the oldest has the nearest deadline
                wait = poll_interval if first is None else min(poll_interval, max(0.0, first.deadline - now))
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
        finally:
            self._stopped.set()

    def _accept(self) -> None:
        for _ in range(64):  # at most this many per round: reading the others goes on meanwhile
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: try again at the next round
                logger.warning("dashboard: cannot accept a connection: %s", exc)
                return
            host = address[0]
            mine = [p for p in self._pending.values() if p.address[0] == host]
            if len(mine) >= MAX_PENDING_PER_ADDRESS:
                self._drop(mine[0].sock)  # the oldest of this address still coming in
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending)))  # the oldest of all
            sock.setblocking(False)
            self._pending[sock] = _Pending(sock, address, time.monotonic() + self.request_deadline_s)
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        pending = self._pending.get(sock)
        if pending is None:
            return
        try:
            chunk = sock.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client gave up (or reset)
            self._drop(sock)
            return
        start = max(0, len(pending.data) - 3)
        pending.data += chunk
        if not pending.need:
            end = _end_of_headers(pending.data, start)
            if end < 0:
                if len(pending.data) > MAX_REQUEST_BYTES:  # headers that never end: closed unanswered
                    self._drop(sock)
                return
            if end > MAX_REQUEST_BYTES:
                self._drop(sock)
                return
            body = _content_length(pending.data[:end])
            pending.need = end + (body if 0 < body <= MAX_BODY_BYTES else 0)  # a larger body: refused unread
        if len(pending.data) < pending.need:
            return
        self._selector.unregister(sock)
        del self._pending[sock]
        try:
            self._queue.put_nowait((sock, pending.address, bytes(pending.data)))
        except queue.Full:  # more whole requests than the workers take: closed unanswered
            _close(sock)

    def _expire(self, now: float) -> None:
        """Close every connection whose request has not come whole by its deadline."""
        for _ in range(len(self._pending)):
            first = next(iter(self._pending.values()), None)
            if first is None or first.deadline > now:
                return
            self._drop(first.sock)

    def _drop(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        _close(sock, reset=True)

    # ----------------------------------------------------------------- the workers

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sock, address, data = item
            try:
                sock.setblocking(True)
                _Handler(sock, address, self, data, time.monotonic() + RESPONSE_DEADLINE_S)
            except Exception as exc:  # a client gone, a write past its deadline: that request only
                logger.debug("dashboard: a request from %s failed: %r", address[0], exc)
            finally:
                _close(sock)

    # ----------------------------------------------------------------- stopping

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (it returns within its poll interval); returns once it has."""
        self._stop.set()
        self._stopped.wait(10.0)

    def server_close(self) -> None:
        """Close the port and every connection; join the workers (each ends within RESPONSE_DEADLINE_S)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for sock in list(self._pending):
            self._drop(sock)
        self._selector.close()
        self.socket.close()
        for _ in self._workers:
            self._queue.put(None)  # after any request still queued: each is answered or fails in time
        for worker in self._workers:
            worker.join(RESPONSE_DEADLINE_S * (MAX_QUEUED // HTTP_WORKERS + 2))


def _end_of_headers(data: bytearray, start: int) -> int:
    """Where the request's headers end (just past the blank line), or -1 if they have not yet."""
    ends = [(i + n) for i, n in ((data.find(b"\r\n\r\n", start), 4), (data.find(b"\n\n", start), 2)) if i >= 0]
    return min(ends) if ends else -1


def _content_length(head: bytes | bytearray) -> int:
    """The Content-Length a request's headers give (0 if none; -1 if it is not a number, or chunked)."""
    length = 0
    for raw in bytes(head).split(b"\n")[1:]:
        name, _, value = raw.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return -1
        if name == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                return -1
    return length


def _close(sock: socket.socket, reset: bool = False) -> None:
    """Close a client's connection: after the answer, its end first; unanswered, at once (a reset)."""
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


class _DeadlineWriter:
    """The handler's wfile: every write must be done by one deadline (the answer's, in all)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def write(self, data: bytes) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer was not taken in time")
        self._sock.settimeout(left)
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    """One request, read whole already (by :class:`_Server`); the answer is written within its deadline."""

    server: _Server  # type: ignore[assignment]
    server_version = "dpwa-dashboard"
    sys_version = ""

    def __init__(self, sock: socket.socket, address: Any, server: _Server, data: bytes, deadline: float) -> None:
        self._data, self._deadline = data, deadline
        super().__init__(sock, address, server)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = io.BytesIO(self._data)
        self.wfile = _DeadlineWriter(self.request, self._deadline)  # type: ignore[assignment]

    def finish(self) -> None:
        pass

    def log_message(self, format: str, *args: Any) -> None:
        # the query string may hold the kill token: it never goes into a log
        logger.debug("%s %s", self.address_string(), re.sub(r"\?\S*", "?...", format % args))

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._send_error(Refused(HTTPStatus.METHOD_NOT_ALLOWED, "HEAD is not served: use GET", allow="GET"))

    def _dispatch(self, method: str) -> None:
        try:
            self._check_host()
            self._check_body()
            path, query = self._split()
            if path in ("/", "/index.html"):
                self._only(method, "GET")
                nonce = secrets.token_urlsafe(16)
                self._send(HTTPStatus.OK, self.server.dashboard.page(nonce), "text/html; charset=utf-8", nonce)
            elif path == "/api/state":
                self._only(method, "GET")
                self._send(HTTPStatus.OK, self.server.dashboard.state_json(), "application/json")
            elif path == "/api/kill":
                self._only(method, "POST")
                self._check_origin()
                dashboard = self.server.dashboard
                dashboard.check_token(_one(query, "token"))
                name = _one(query, "node")
                if not name:
                    raise Refused(HTTPStatus.BAD_REQUEST, "which node? give ?node=NAME")
                body = json.dumps(dashboard.kill(name)).encode()
                self._send(HTTPStatus.OK, body, "application/json")
            else:
                raise Refused(HTTPStatus.NOT_FOUND, "no such page: the dashboard serves / and /api/state")
        except Refused as exc:
            self._send_error(exc)
        except Exception:  # a bug: say so, keep serving
            logger.exception("dashboard: %s %s failed", method, self.path.split("?")[0][:200])
            self._send_error(Refused(HTTPStatus.INTERNAL_SERVER_ERROR, "the dashboard failed; see its log"))

    def _split(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        if len(parts.query) > MAX_QUERY_BYTES:
            raise Refused(HTTPStatus.REQUEST_URI_TOO_LONG, f"the query is longer than {MAX_QUERY_BYTES} bytes")
        try:
            return parts.path, parse_qs(parts.query, max_num_fields=8)
        except ValueError as exc:
            raise Refused(HTTPStatus.BAD_REQUEST, f"a bad query: {exc}") from None

    def _only(self, method: str, allowed: str) -> None:
        if method != allowed:
            path = self.path.split("?")[0][:200]
            raise Refused(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {allowed} only", allow=allowed)

    def _check_host(self) -> None:
        """The Host header must name this server: a page whose name was rebound to 127.0.0.1 is refused."""
        dashboard = self.server.dashboard
        if not is_loopback(dashboard.host):
            return  # served to other machines on purpose: they may know it by any name
        host = self.headers.get("Host", "")
        allowed = {f"{name}:{dashboard.port}" for name in ("127.0.0.1", "localhost", "[::1]", dashboard.host)}
        if host not in allowed:
            raise Refused(HTTPStatus.FORBIDDEN, f"Host {host[:100]!r} is not this dashboard's address")

    def _check_body(self) -> None:
        """No route reads a body: one of at most MAX_BODY_BYTES was read with the request and is ignored;
        a larger or chunked one is refused (it was never read)."""
        if self.headers.get("Transfer-Encoding") is not None:
            raise Refused(HTTPStatus.LENGTH_REQUIRED, "a chunked body is not taken: no route reads a body")
        given = self.headers.get_all("Content-Length") or []
        try:
            lengths = {int(value) for value in given}
        except ValueError:
            raise Refused(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if len(lengths) > 1 or any(not 0 <= n <= MAX_BODY_BYTES for n in lengths):
            raise Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body of at most {MAX_BODY_BYTES} bytes is taken")

    def _check_origin(self) -> None:
        origin = self.headers.get("Origin")
        if origin is None:
            return  # not from a browser page (curl, a script of the user's)
        host = self.headers.get("Host", "")
        if origin != f"http://{host}":
            raise Refused(HTTPStatus.FORBIDDEN, f"a request from another page ({origin[:100]!r}) is refused")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, nonce: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # the token in the URL goes nowhere
        self.send_header("X-Frame-Options", "DENY")
        script = f"'nonce-{nonce}'" if nonce else "'none'"
        self.send_header(
            "Content-Security-Policy",
            f"default-src 'none'; script-src {script}; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        )
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, exc: Refused) -> None:
        body = json.dumps({"error": str(exc), "status": int(exc.status)}).encode()
        self.send_response(exc.status)
        if exc.allow:
            self.send_header("Allow", exc.allow)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _one(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise Refused(HTTPStatus.BAD_REQUEST, f"{key} is given {len(values)} times")
    return values[0]
