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
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import os
import secrets
import signal
import socket
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

__all__ = ["Dashboard", "Refused", "DEFAULT_HOST"]

logger = logging.getLogger("dpwa.dashboard")

DEFAULT_HOST = "127.0.0.1"
MAX_CONNECTIONS = 32  # requests handled at once; more are closed unanswered
REQUEST_TIMEOUT_S = 5.0  # a client that sends nothing for this long is dropped
MAX_QUERY_BYTES = 1024  # a longer query string is refused


class Refused(Exception):
    """A request the dashboard refuses: the HTTP status, and why in words."""

    def __init__(self, status: HTTPStatus, message: str, allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.allow = allow  # the methods a 405 names


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
        self._server.server_close()  # joins the request threads still running (each within REQUEST_TIMEOUT_S)
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
        return {
            "title": self.title,
            "now": round(time.time(), 3),
            "nodes": self.names,
            "local": self.local_names,
            "kill": self.allow_kill,
            "status": self._status.snapshot(),
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


class _Server(http.server.ThreadingHTTPServer):
    """A threading HTTP server that handles at most MAX_CONNECTIONS requests at once."""

    daemon_threads = False  # server_close() joins them; each ends within REQUEST_TIMEOUT_S
    block_on_close = True

    def __init__(self, address: tuple[str, int], dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        try:
            super().__init__(address, _Handler)
        except OSError as exc:
            raise OSError(f"cannot serve the dashboard on {address[0]}:{address[1]}: {exc.strerror or exc}") from exc

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    server_version = "dpwa-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._send_error(Refused(HTTPStatus.METHOD_NOT_ALLOWED, "HEAD is not served: use GET", allow="GET"))

    def _dispatch(self, method: str) -> None:
        try:
            self._check_host()
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
            logger.exception("dashboard: %s %s failed", method, self.path[:200])
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
