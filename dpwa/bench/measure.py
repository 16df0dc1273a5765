"""Benchmark: dpwa's exchange against the raw floors it is built on, measured in one run.

Commands (they run as written from the repository root)::

    python -m dpwa.bench                         # the full table (about two minutes on 2 cores)
    python -m dpwa.bench --json bench.json       # the same, also written as JSON
    python -m dpwa.bench --quick                 # small sizes and one that streams, few repetitions: a smoke test
    python -m dpwa.bench --log bench.log         # the benchmark's own nodes' log lines go here
    python -m dpwa.bench --training              # only the digits model's training-step rows (about a minute)

The benchmark's own nodes log what any node logs (its configurations are
deliberately odd: ``fetch_probability: 0`` for a node that only serves, plain
TCP with ``insecure: true`` on 127.0.0.1). Those lines, and the helper
processes' error output, go to a log file that the benchmark names at its
start and in its summary (default: ``dpwa-bench-PID.log`` in the temporary
folder), so that standard output holds only the tables and a short summary.

For each model size it measures, in the same run and on the same machine:

(a) ``copy``: ``np.copyto`` of the model's bytes (a memory-copy floor);
(b) ``zmq``: a raw pyzmq REQ/REP round trip over tcp://127.0.0.1 between two
    processes, the reply carrying the model's bytes (``copy=False`` on both
    sides): the ZeroMQ floor;
(t) ``tcp``: the same round trip over a raw TCP socket, the reply written with
    ``sendall`` and read with ``recv_into`` a preallocated buffer: the socket floor;
(r) ``router``: (b) from a ROUTER socket on a thread, its reply tracked, as a
    node's server must answer: the floor of the serving socket;
(w) ``router_work``: (r) plus the work any exchange does on the requesting side,
    with dpwa's own kernels and no protocol: copy its parameters into a snapshot,
    check the reply's values, blend them in: the floor of an exchange;
(k) ``zmq_curve``: (b) under CURVE keys: the floor of a keyed exchange over ZeroMQ;
(s) ``node_served``: a raw pyzmq REQ client sending a dpwa node the fetch a node
    sends, and reading the reply: the serving side's share of an exchange
    (what it adds to (b)); the rest of (c) is the requesting side's;
(c) dpwa between two processes: ``update_send`` alone, ``update_wait`` alone
    and the full exchange, over TCP (large models by stream, dpwa.wire.bulk;
    and all over ZeroMQ, ``bulk: off``), under CURVE keys (large models by a
    stream sealed per transfer; and all over ZeroMQ, ``bulk: off``), and over
    the same-host path, in mode pull and in mode symmetric (``run.sh``'s default; also over TCP, with and
    without keys, where a large model's two snapshots stream both ways).

It also times a training step of the example (``examples/pytorch-cifar``,
the small ResNet, one torch thread per process as ``run.sh`` runs it) with
dpwa exchanging every step against a second training node, and the same loop
without dpwa, alternating one step of each so both see the same machine; then
the same against two floors: the peer's bytes fetched every step over plain
ZeroMQ, with nothing copied, checked or blended; and that plus the work any
exchange does on the training thread (publish, check, blend), without a protocol.

Every figure is a median over repetitions, and the ratios to (a), (b) and (t) are
printed beside it. Machines are shared and noisy: compare ratios taken in one
run, not absolute times across runs. A second table scales the number of
nodes (threads in one process, small model) and reports exchanges per second
and per-node cost.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SMALL = 100_000  # parameters of the small model
STREAMED = 1 << 20  # parameters of the smallest model that streams (4 MiB in float32: BULK_MIN_BYTES), for --quick
RESNET18 = 11_173_962  # parameters of torchvision's ResNet-18 (44.7 MB in float32)
# A node refuses "busy" while 3 payload replies to a sender are unsent: it learns that ZeroMQ let go of one
# from pyzmq's garbage-collector thread, which lags on a loaded machine (two samplers here share one sender
# name). Such a sample is asked again after these pauses (None: give up), and counted in "busy_retries".
BUSY_PAUSES_S = (0.001, 0.002, 0.004, None)
WORKLOADS = (  # the training-overhead workloads: label, input shape, batch size, steps, mode
    ("digits, batch 32, run.sh's defaults", (1, 8, 8), 32, 200, "symmetric"),
    ("digits, batch 32, mode pull", (1, 8, 8), 32, 200, "pull"),
    ("CIFAR-sized 3x32x32, batch 128, mode pull", (3, 32, 32), 128, 40, "pull"),
)


# --------------------------------------------------------------------------- helpers


def _set_when_stdin_closes(event: threading.Event) -> None:
    sys.stdin.read()  # returns when the parent closes our stdin
    event.set()


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def free_port() -> int:
    from dpwa.cluster.processes import free_ports

    return free_ports(1)[0]


LOG_ENV = "DPWA_BENCH_LOG"  # the log file, handed to the helper processes


class Child:
    """A helper process of this module; stopped by PID, never by name. Its stderr goes to the bench's log."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        log_path = os.environ.get(LOG_ENV)
        log = open(log_path, "ab") if log_path else None  # noqa: SIM115  (closed below; the child keeps a copy)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dpwa.bench", *args],
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
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.stop()
            where = f"; see {log_path}" if log_path else ""
            raise RuntimeError(f"benchmark helper {args} failed to start (said {line!r}){where}")

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


# --------------------------------------------------------------------------- helper processes


CURVE_ENV = "DPWA_BENCH_CURVE_SERVER"  # a raw floor's throwaway server key pair ("public,secret", Z85)


def serve_raw(port: int, size: int, router: bool = False) -> None:
    """REP socket that answers every request with `size` float32s, without a copy.

    With a key pair in the environment (:data:`CURVE_ENV`) it is a CURVE server: the keyed floor (k).

    `router`: the socket a dpwa node serves with instead, a ROUTER (one socket for every peer, never stuck
    on one), whose replies are tracked until ZeroMQ has sent them (so a peer that never reads pins a
    bounded number of them), answering from a thread; nothing is checked or decoded.
    """
    import zmq

    ctx = zmq.Context()
    stdin_closed = threading.Event()
    threading.Thread(target=_set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()

    def serve() -> None:
        sock = ctx.socket(zmq.ROUTER if router else zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        keys = os.environ.get(CURVE_ENV)
        if keys:
            public, secret = keys.split(",")
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
        sock.bind(f"tcp://127.0.0.1:{port}")
        payload = np.ones(size, np.float32)
        print("ready", flush=True)
        while not stdin_closed.is_set():
            if not sock.poll(100):
                continue
            if router:
                envelope = sock.recv_multipart(copy=False)
                sock.send_multipart([envelope[0], b"", b"params"], zmq.SNDMORE)
                sock.send(payload.data, 0, copy=False, track=True)
            else:
                sock.recv()
                sock.send(payload.data, 0, copy=False)
        sock.close(0)

    if router:  # on a thread, as a node's Rx thread serves
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join()
    else:
        serve()
    ctx.term()


def serve_raw_tcp(port: int, size: int) -> None:
    """A TCP server that answers every byte it reads with `size` float32s (sendall), until stdin closes."""
    import socket

    payload = np.ones(size, np.float32).data.cast("B")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        print("ready", flush=True)
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                conn.sendall(payload)


def serve_node(config_path: str, size: int) -> None:
    """A dpwa node that publishes `size` float32s and serves them until stdin closes.

    In mode symmetric it lingers: it applies each exchange its peer confirms and publishes a fresh snapshot
    (a snapshot serves one exchange), as a node that makes no steps does.
    """
    import dataclasses

    from dpwa.config import load_config
    from dpwa.gossip.node import Node
    from dpwa.mixing.params import NumpyParams

    config = dataclasses.replace(load_config(config_path), fetch_probability=0)  # it only serves
    with Node(config, "server", NumpyParams(np.ones(size, np.float32))) as node:
        node.update_send()
        node.update_wait()
        print("ready", flush=True)
        if config.mode != "symmetric":
            sys.stdin.read()
            return
        stdin_closed = threading.Event()
        threading.Thread(target=_set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()
        while not stdin_closed.is_set():  # bounded: each linger returns within its limit
            node.linger(idle_s=3600.0, limit_s=60.0, stop=stdin_closed.is_set)


def training_setup(shape: tuple[int, ...], batch: int, seed: int):
    """The example's small model, an optimizer, and one fixed batch of the given shape."""
    import torch

    from dpwa.workloads.images import build

    torch.manual_seed(seed)
    net = build("small", in_channels=shape[0])
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))

    def step() -> float:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return net, step


class RawExchange:
    """The training floor's transport: a REP thread serving a fixed buffer of the model's bytes, and a
    REQ socket fetching the peer's, over ipc. Nothing is copied into the buffer, checked or blended:
    only the bytes move, with a thread per process serving them as a node's Rx thread does."""

    def __init__(self, nbytes: int, serve_at: str, fetch_from: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.payload = np.ones(nbytes // 4, np.float32)
        self.req = self.ctx.socket(zmq.REQ)  # the caller's thread's
        self.req.setsockopt(zmq.LINGER, 0)
        self.req.connect(fetch_from)
        self._stop, self._bound = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(serve_at,), name="raw-rx", daemon=True)
        self._thread.start()
        if not self._bound.wait(10):
            self.close()
            raise RuntimeError(f"the raw training floor could not serve at {serve_at}")

    def _serve(self, serve_at: str) -> None:
        import zmq

        rep = self.ctx.socket(zmq.REP)  # made, used and closed on this thread only
        try:
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(serve_at)
            self._bound.set()
            while not self._stop.is_set():
                if rep.poll(100):
                    if rep.recv() == b"confirm":  # the second round trip of a two-phase exchange: a small reply
                        rep.send(b"ok")
                    else:
                        rep.send(self.payload.data, 0, copy=False)
        finally:
            rep.close(0)

    def send(self, what: bytes = b"fetch") -> None:
        self.req.send(what)

    def wait(self) -> Any:
        """The peer's bytes, as the frame they arrived in."""
        if not self.req.poll(30_000):
            raise RuntimeError("the raw training peer did not answer")
        return self.req.recv(copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.req.close(0)
        self.ctx.term()


def _wire_bytes(net: Any) -> int:
    """The bytes of `net`'s snapshot as dpwa sends it: parameters and floating-point buffers, float32."""
    from dpwa.adapters.pytorch import TorchParams

    return 4 * TorchParams(net).size


def serve_training(config_path: str, shape: str, batch: int, raw: str | None = None) -> None:
    """A second training node: trains the example's model and exchanges every step until stdin closes:
    through dpwa, or (`raw` = "SERVE_AT,FETCH_FROM") over :class:`RawExchange`."""
    import torch

    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    torch.set_num_threads(1)
    net, step = training_setup(tuple(int(d) for d in shape.split("x")), batch, seed=1)
    stdin_closed = threading.Event()
    threading.Thread(target=_set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()
    if raw is not None:
        serve_at, fetch_from = raw.split(",")
        exchange = RawExchange(_wire_bytes(net), serve_at, fetch_from)
        try:
            print("ready", flush=True)
            while not stdin_closed.is_set():
                exchange.send()
                step()
                exchange.wait()
        finally:
            exchange.close()
        return
    with DpwaPyTorchAdapter(net, "server", config_path) as conn:
        loss = None
        conn.update_send(loss)  # publish; its fetch (the client is not up yet) is dropped by the next step
        print("ready", flush=True)
        while not stdin_closed.is_set():
            conn.update_send(loss)
            loss = step()
            conn.update_wait(loss)


def _alternate(step: Any, with_exchange: Any, steps: int) -> tuple[list[float], list[float], list[Any]]:
    """Step times without and with an exchange, one of each in turn (the first 3 pairs warm up), and
    what each counted `with_exchange()` returned."""
    plain, exchanged, results = [], [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        result = with_exchange()
        t2 = time.perf_counter()
        if i >= 3:
            plain.append(t1 - t0)
            exchanged.append(t2 - t1)
            results.append(result)
    return plain, exchanged, results


def _work_floor(net: Any, mode: str) -> Any:
    """The least work any exchange does on the training thread, without a protocol: copy our parameters
    into a snapshot, check the peer's values (finite, within bounds), blend them in as `mode` does
    (pull: towards the peer's state; symmetric: by the difference of the two snapshots)."""
    from dpwa.adapters.pytorch import TorchParams
    from dpwa.gossip.protocol import MAX_VALUE
    from dpwa.mixing import kernels

    params = TorchParams(net)
    snapshot = np.empty(params.size, np.float32)

    def work(frame: Any) -> None:
        peer = np.frombuffer(frame.buffer, np.float32)
        if not kernels.within(peer, MAX_VALUE):
            raise RuntimeError("the raw peer sent values out of bounds")
        if mode == "pull":
            params.lerp_from(peer, 0.5)
        else:
            params.add_scaled_diff_from(peer, snapshot, 0.5)

    return params, snapshot, work


def bench_training(shape: tuple[int, ...], batch: int, steps: int, mode: str = "pull") -> dict[str, Any] | None:
    """Median step time of the example with and without dpwa, alternating one step of each; then the
    same against two floors: the same bytes fetched every step over plain ZeroMQ (RawExchange), and
    that plus the work any exchange must do on the training thread (:func:`_work_floor`)."""
    import torch

    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run.sh runs a node: one core each
    env = {"OMP_NUM_THREADS": "1"}
    geometry = "x".join(map(str, shape))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_pair_config(tmp, same_host=True, mode=mode)
            net, step = training_setup(shape, batch, seed=0)
            with (
                Child("--serve-training", path, geometry, str(batch), env=env),
                DpwaPyTorchAdapter(net, "client", path, rng=random.Random(0)) as conn,
            ):
                loss: float | None = None

                def dpwa_step() -> bool:
                    nonlocal loss
                    conn.update_send(loss)
                    loss = step()
                    return conn.update_wait(loss).averaged

                plain, with_dpwa, averaged = _alternate(step, dpwa_step, steps)
            ours, theirs = f"ipc://{tmp}/raw-client", f"ipc://{tmp}/raw-server"
            with Child("--serve-training", path, geometry, str(batch), "--raw", f"{theirs},{ours}", env=env):
                exchange = RawExchange(_wire_bytes(net), ours, theirs)
                try:

                    def raw_step() -> None:
                        exchange.send()
                        step()
                        exchange.wait()

                    plain_raw, with_raw, _ = _alternate(step, raw_step, steps)
                    params, snapshot, work = _work_floor(net, mode)

                    def work_step() -> None:
                        params.copy_to(snapshot)  # publish
                        exchange.send()
                        step()
                        work(exchange.wait())  # check and blend

                    plain_work, with_work, _ = _alternate(step, work_step, steps)
                    confirming = False

                    def two_trips_step() -> None:
                        # mode symmetric's floor: the work, and a second round trip (its confirm) sent once the
                        # blend is done, whose small reply is taken before the next fetch: both overlap a step
                        nonlocal confirming
                        if confirming:
                            exchange.wait()
                        params.copy_to(snapshot)
                        exchange.send()
                        step()
                        work(exchange.wait())
                        exchange.send(b"confirm")
                        confirming = True

                    plain_two, with_two, _ = (
                        _alternate(step, two_trips_step, steps) if mode == "symmetric" else ([], [], [])
                    )
                    if confirming:
                        exchange.wait()
                finally:
                    exchange.close()
    finally:
        torch.set_num_threads(threads)
    a, b = median_ms(plain), median_ms(with_dpwa)
    c, d = median_ms(plain_raw), median_ms(with_raw)
    e, g = median_ms(plain_work), median_ms(with_work)
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in net.parameters()),
        "batch": batch,
        "shape": list(shape),
        "steps": steps,
        "step_ms": a,
        "step_with_dpwa_ms": b,
        "overhead": b / a - 1.0,
        "averaged_fraction": sum(averaged) / len(averaged),
        "raw_step_ms": c,
        "step_with_raw_ms": d,
        "raw_overhead": d / c - 1.0,
        "work_step_ms": e,
        "step_with_work_ms": g,
        "work_overhead": g / e - 1.0,
        # mode symmetric only: +work with a second round trip (the protocol's confirm), the floor of two phases
        **({"two_trips_overhead": median_ms(with_two) / median_ms(plain_two) - 1.0} if mode == "symmetric" else {}),
    }


def write_pair_config(
    directory: str,
    *,
    same_host: bool,
    wire_dtype: str = "float32",
    bulk: str = "auto",
    curve: bool = False,
    mode: str = "pull",
) -> str:
    """Two nodes exchanging every step. Mode pull: one fetch per exchange, the transfer every mode is built
    on. Mode symmetric: the defaults as run.sh's cluster has them (blend delta; pairing hypercube, which
    `auto` picks from 4 nodes: each exchange is started by one side, as in a larger cluster)."""
    import yaml

    from dpwa.wire.curve import generate

    nodes: list[dict[str, Any]] = [
        {"name": "client", "host": "127.0.0.1", "port": free_port()},
        {"name": "server", "host": "127.0.0.1", "port": free_port()},
    ]
    config = {
        "nodes": nodes,
        "fetch_probability": 1,
        "timeout_ms": 10_000,
        "same_host": "auto" if same_host else "off",
        "wire_dtype": wire_dtype,
        # TCP rows measure TCP (loopback clusters otherwise use ipc sockets); same-host rows use the
        # default: ipc for the requests, shared memory for the parameters
        "insecure": not same_host and not curve,
        "join": "never",  # each side starts from its own values; joining is not what is measured
        "bulk": bulk,
        # (the exchange rows' serving node publishes once: a symmetric server would refuse "busy" after that)
        "mode": mode,
        "blend": "state" if mode == "pull" else "delta",
        "pairing": "random" if mode == "pull" else "hypercube",
    }
    tag = f"{'shm' if same_host else 'tcp'}-{wire_dtype}-{bulk}{'-curve' if curve else ''}-{mode}"
    if curve:  # TCP, authenticated and encrypted
        for node in nodes:
            _, secret, pair = generate(f"{node['name']}-{tag}", Path(directory) / "keys")
            node["public_key"], node["secret_key_file"] = pair.public.decode(), str(secret)
    path = os.path.join(directory, f"pair-{tag}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    return path


# --------------------------------------------------------------------------- measurements


class CopyFloor:
    """(a): np.copyto of the model's bytes."""

    def __init__(self, size: int) -> None:
        self.src, self.dst = np.ones(size, np.float32), np.empty(size, np.float32)

    def sample(self) -> dict[str, float]:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return {"ms": time.perf_counter() - t0}

    def close(self) -> None:
        pass


class ZmqFloor:
    """(b): a raw pyzmq REQ/REP round trip whose reply carries the model's bytes; (r) with `router`, the same
    from a ROUTER socket whose reply is tracked, as a node's server must answer (see :func:`serve_raw`);
    (k) with `curve`, the same REQ/REP under CURVE keys: the floor of a keyed exchange over ZeroMQ."""

    def __init__(self, size: int, router: bool = False, curve: bool = False) -> None:
        import zmq

        port = free_port()
        env = None
        if curve:  # (k): both ends with throwaway CURVE keys
            server_public, server_secret = zmq.curve_keypair()
            env = {CURVE_ENV: f"{server_public.decode()},{server_secret.decode()}"}
        self.child = Child("--serve-raw-router" if router else "--serve-raw", str(port), str(size), env=env)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def sample(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.sock.send(b"fetch")
        if not self.sock.poll(30_000):
            raise RuntimeError("raw zmq server did not answer")
        frame = self.sock.recv_multipart(copy=False)[-1]
        np.frombuffer(frame.buffer, np.float32)
        del frame
        return {"ms": time.perf_counter() - t0}

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.child.stop()


class WorkFloor(ZmqFloor):
    """(w): (r) plus the work any exchange does on the requesting side, with dpwa's own kernels and no
    protocol: copy our parameters into a snapshot (the publish), check the reply's values (finite, within
    bounds), blend them in. The requester's threads, headers, checks of ids and outcomes are not in it."""

    def __init__(self, size: int) -> None:
        from dpwa.mixing.params import NumpyParams

        super().__init__(size, router=True)
        self.params, self.snapshot = NumpyParams(np.zeros(size, np.float32)), np.empty(size, np.float32)

    def sample(self) -> dict[str, float]:
        from dpwa.gossip.protocol import MAX_VALUE
        from dpwa.mixing import kernels

        t0 = time.perf_counter()
        self.sock.send(b"fetch")
        self.params.copy_to(self.snapshot)  # as a node publishes: while the request is out
        if not self.sock.poll(30_000):
            raise RuntimeError("raw zmq server did not answer")
        frame = self.sock.recv_multipart(copy=False)[-1]
        peer = np.frombuffer(frame.buffer, np.float32)
        if not kernels.within(peer, MAX_VALUE):
            raise RuntimeError("the raw server sent values out of bounds")
        self.params.lerp_from(peer, 0.5)
        del peer, frame
        return {"ms": time.perf_counter() - t0}


class RawTcpFloor:
    """(t): a raw TCP round trip whose reply carries the model's bytes, read into a preallocated buffer."""

    def __init__(self, size: int) -> None:
        import socket

        port = free_port()
        self.child = Child("--serve-raw-tcp", str(port), str(size))
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = np.empty(size, np.float32)
        self.view = self.buffer.data.cast("B")

    def sample(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.sock.sendall(b"x")
        got, total = 0, self.view.nbytes
        while got < total:
            n = self.sock.recv_into(self.view[got:], total - got)
            if not n:
                raise RuntimeError("raw TCP server closed the connection")
            got += n
        return {"ms": time.perf_counter() - t0}

    def close(self) -> None:
        self.sock.close()
        self.child.stop()


class DpwaPair:
    """(c): a dpwa node here fetching from a dpwa node in another process."""

    def __init__(
        self,
        size: int,
        directory: str,
        *,
        same_host: bool,
        wire_dtype: str = "float32",
        bulk: str = "auto",
        curve: bool = False,
        mode: str = "pull",
    ) -> None:
        from dpwa.gossip.node import Node
        from dpwa.gossip.parts import BULK_MIN_BYTES
        from dpwa.mixing.params import NumpyParams

        self.same_host = same_host
        self.busy = 0  # samples asked again after a "busy" refusal
        nbytes = size * (4 if wire_dtype == "float32" else 2)  # float16 and bfloat16: 2 bytes
        # by dpwa.wire.bulk (in mode symmetric both snapshots stream: the requester's is offered with its request)
        self.streams = not same_host and bulk == "auto" and nbytes >= BULK_MIN_BYTES
        path = write_pair_config(
            directory, same_host=same_host, wire_dtype=wire_dtype, bulk=bulk, curve=curve, mode=mode
        )
        self.child = Child("--serve-node", path, str(size))
        try:
            self.node = Node(path, "client", NumpyParams(np.zeros(size, np.float32)), rng=random.Random(0))
        except BaseException:
            self.child.stop()
            raise

    def sample(self) -> dict[str, float]:
        for pause in BUSY_PAUSES_S:
            t0 = time.perf_counter()
            self.node.update_send()
            t1 = time.perf_counter()
            update = self.node.update_wait()
            t2 = time.perf_counter()
            if update.averaged:
                return {"update_send": t1 - t0, "update_wait": t2 - t1, "exchange": t2 - t0}
            if update.outcome != "refused" or not update.reason.startswith("busy") or pause is None:
                raise RuntimeError(f"benchmark exchange failed: {update}")
            self.busy += 1  # see BUSY_PAUSES_S
            time.sleep(pause)
        raise AssertionError("unreachable: the last pause is None")

    def close(self) -> None:
        stats = self.node.stats()
        used_same_host = stats.get("same_host_fetches", 0) > 0
        streamed = stats.get("bulk_fetches", 0) > 0 and not stats.get("bulk_fallbacks", 0)
        self.node.close()
        self.child.stop()
        if used_same_host != self.same_host:
            raise RuntimeError(f"expected the {'same-host' if self.same_host else 'TCP'} path; the node used the other")
        if streamed != self.streams:
            raise RuntimeError(f"expected {'every' if self.streams else 'no'} fetch by stream; stats: {stats}")


class RawClientOfNode:
    """(s): a raw pyzmq REQ client fetching from `pair`'s serving node: the serving side's share of (c).

    The same fetch request the dpwa node sends, from a client that only reads the reply: the
    difference to (b) is what the serving node adds; the rest of (c) is the requesting side's.
    """

    def __init__(self, pair: DpwaPair) -> None:
        import zmq

        from dpwa.gossip.protocol import FETCH
        from dpwa.wire.schema import decode, encode

        config = pair.node.config
        self._encode = lambda rid: encode(
            FETCH, rid, **{"from": "client", "fp": pair.node.params.fingerprint, "dtype": "float32"}
        )
        self._decode = decode
        self._request_id = 0
        self.busy = 0  # samples asked again after a "busy" refusal
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(config.endpoint(config.node("server")))

    def sample(self) -> dict[str, float]:
        for pause in BUSY_PAUSES_S:
            self._request_id += 1
            t0 = time.perf_counter()
            self.sock.send(self._encode(self._request_id))
            if not self.sock.poll(30_000):
                raise RuntimeError("the dpwa node did not answer")
            frames = self.sock.recv_multipart(copy=False)
            elapsed = time.perf_counter() - t0
            header = self._decode(frames[0].buffer)
            if header.kind == "params":
                return {"ms": elapsed}
            if header.kind != "error" or header["reason"] != "busy" or pause is None:
                raise RuntimeError(f"the dpwa node answered {header.kind}: {dict(header.fields)}")
            self.busy += 1
            time.sleep(pause)
        raise AssertionError("unreachable: the last pause is None")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def measure_size(size: int, reps: int, wire_dtypes: list[str], warmup: int = 3) -> dict[str, Any]:
    """Every measurement for one model size, interleaved: one sample of each per repetition."""
    from dpwa.gossip.parts import BULK_MIN_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        subjects: dict[str, Any] = {}
        try:
            subjects["copy"] = CopyFloor(size)
            subjects["zmq"] = ZmqFloor(size)
            subjects["router"] = ZmqFloor(size, router=True)
            subjects["router_work"] = WorkFloor(size)
            subjects["zmq_curve"] = ZmqFloor(size, curve=True)
            subjects["raw_tcp"] = RawTcpFloor(size)
            subjects["tcp"] = DpwaPair(size, tmp, same_host=False)
            subjects["node_served"] = RawClientOfNode(subjects["tcp"])
            if size * 4 >= BULK_MIN_BYTES:  # smaller models never stream: tcp is already all ZeroMQ
                subjects["tcp_zmq"] = DpwaPair(size, tmp, same_host=False, bulk="off")
            subjects["curve"] = DpwaPair(size, tmp, same_host=False, curve=True)
            if size * 4 >= BULK_MIN_BYTES:  # with keys: the sealed stream above, and all over ZeroMQ here
                subjects["curve_zmq"] = DpwaPair(size, tmp, same_host=False, curve=True, bulk="off")
            subjects["same_host"] = DpwaPair(size, tmp, same_host=True)
            subjects["same_host_symmetric"] = DpwaPair(size, tmp, same_host=True, mode="symmetric")
            # run.sh's default mode between hosts: large snapshots stream both ways, small ones go over ZeroMQ
            subjects["tcp_symmetric"] = DpwaPair(size, tmp, same_host=False, mode="symmetric")
            subjects["curve_symmetric"] = DpwaPair(size, tmp, same_host=False, curve=True, mode="symmetric")
            for dtype in wire_dtypes:
                subjects[f"tcp_{dtype}"] = DpwaPair(size, tmp, same_host=False, wire_dtype=dtype)
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in subjects}
            for rep in range(warmup + reps):
                for name, subject in subjects.items():
                    sample = subject.sample()
                    if rep >= warmup:
                        samples[name].append(sample)
        finally:
            for subject in subjects.values():
                subject.close()
    row: dict[str, Any] = {"parameters": size, "mbytes": size * 4 / 1e6, "reps": reps}
    row["busy_retries"] = {name: s.busy for name, s in subjects.items() if getattr(s, "busy", 0)}
    for name, rows in samples.items():
        medians = {key: median_ms([r[key] for r in rows]) for key in rows[0]}
        floors = ("copy", "zmq", "router", "router_work", "zmq_curve", "raw_tcp", "node_served")
        row[f"{name}_ms" if name in floors else name] = medians.get("ms", medians)
    return row


def bench_scale(n: int, size: int, steps: int) -> dict[str, Any]:
    """n nodes as threads in one process, each running `steps` exchanges as fast as it can."""
    from dpwa.config import parse_config
    from dpwa.gossip.node import Node
    from dpwa.mixing.params import NumpyParams

    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    config = parse_config(
        {
            "nodes": [{"name": f"n{i}", "host": "127.0.0.1", "port": p} for i, p in enumerate(sorted(ports))],
            "fetch_probability": 1,
            "timeout_ms": 10_000,
            "same_host": "off",
            "insecure": True,  # TCP, as the table in docs/performance.md says
            "join": "never",
            "mode": "pull",  # the fetch path, as in the pair rows (the table was measured so)
            "pairing": "random",
        }
    )
    arrays = [np.full(size, float(i), np.float32) for i in range(n)]
    nodes = [Node(config, f"n{i}", NumpyParams(arrays[i]), rng=random.Random(i)) for i in range(n)]
    try:
        for node in nodes:  # first snapshots, so no fetch finds a peer "not ready"
            node.update_send()
        for node in nodes:
            node.update_wait()
        barrier = threading.Barrier(n + 1)
        failures: list[collections.Counter[str]] = [collections.Counter() for _ in range(n)]

        def run(i: int) -> None:
            barrier.wait()
            for _ in range(steps):
                nodes[i].update_send()
                update = nodes[i].update_wait()
                if not update.averaged:
                    refused = update.outcome == "refused"
                    failures[i][f"refused {update.reason.split(':')[0]}" if refused else update.outcome] += 1

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        t0, cpu0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.join(600)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if any(t.is_alive() for t in threads):
            raise RuntimeError(f"scale benchmark with {n} nodes did not finish: deadlock?")
    finally:
        for node in nodes:
            node.close()
    why = sum(failures, collections.Counter())
    exchanges = n * steps - why.total()
    return {
        "nodes": n,
        "exchanges_per_s": exchanges / elapsed,
        "failed": why.total(),
        "failed_by": dict(why),  # outcome (or the peer's refusal) -> count
        # CPU time of this process per exchange: both sides' work (publish, serve, fetch, blend).
        # Pairwise gossip costs O(1) per exchange, so this stays flat as the cluster grows.
        "cpu_ms_per_exchange": cpu / max(1, exchanges) * 1e3,
    }


# --------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    import zmq

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
        "torch": torch_version,
    }


def run(
    sizes: list[int],
    reps_small: int,
    reps_large: int,
    scale_sizes: list[int],
    scale_steps: int,
    wire_dtypes: list[str],
    training_steps: float = 1.0,
    workloads: tuple = WORKLOADS,
) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "sizes": [], "scale": [], "training": []}
    for size in sizes:
        row = measure_size(size, reps_small if size <= 1_000_000 else reps_large, wire_dtypes)
        results["sizes"].append(row)
        print(format_size_row(row), flush=True)
    for n in scale_sizes:
        results["scale"].append(bench_scale(n, SMALL, scale_steps))
    for label, shape, batch, steps, mode in workloads:
        trained = bench_training(shape, batch, max(2, int(steps * training_steps)), mode)
        if trained is not None:
            results["training"].append({"workload": label, **trained})
    return results


def format_size_row(row: dict[str, Any]) -> str:
    a, b, t = row["copy_ms"], row["zmq_ms"], row["raw_tcp_ms"]
    lines = [
        f"\n{row['parameters']:,} parameters ({row['mbytes']:.1f} MB), medians of {row['reps']} runs",
        f"  {'measurement':<42}{'ms':>9}{'x copy':>9}{'x zmq':>9}{'x tcp':>9}",
        f"  {'(a) numpy copy':<42}{a:>9.2f}{1:>9.2f}{a / b:>9.2f}{a / t:>9.2f}",
        f"  {'(b) raw pyzmq REQ/REP, tcp':<42}{b:>9.2f}{b / a:>9.2f}{1:>9.2f}{b / t:>9.2f}",
        f"  {'(t) raw TCP sendall -> recv_into':<42}{t:>9.2f}{t / a:>9.2f}{t / b:>9.2f}{1:>9.2f}",
    ]
    r = row["router_ms"]
    lines.append(f"  {'(r) raw pyzmq ROUTER, tracked reply, tcp':<42}{r:>9.2f}{r / a:>9.2f}{r / b:>9.2f}{r / t:>9.2f}")
    w = row["router_work_ms"]
    lines.append(f"  {'(w) (r) + publish, check, blend':<42}{w:>9.2f}{w / a:>9.2f}{w / b:>9.2f}{w / t:>9.2f}")
    k = row["zmq_curve_ms"]
    lines.append(f"  {'(k) raw pyzmq REQ/REP, tcp, CURVE':<42}{k:>9.2f}{k / a:>9.2f}{k / b:>9.2f}{k / t:>9.2f}")
    s = row["node_served_ms"]
    lines.append(f"  {'(s) raw REQ client <- dpwa node, tcp':<42}{s:>9.2f}{s / a:>9.2f}{s / b:>9.2f}{s / t:>9.2f}")
    labels = {
        "tcp": "tcp",
        "tcp_zmq": "tcp, bulk: off",
        "curve": "tcp, CURVE",
        "curve_zmq": "tcp, CURVE, bulk: off",
        "same_host": "same-host",
        "same_host_symmetric": "same-host, symmetric",
        "tcp_symmetric": "tcp, symmetric",
        "curve_symmetric": "tcp, CURVE, symmetric",
    }
    for path in [k for k in row if k in labels or k.startswith("tcp_") or k.startswith("curve_")]:
        label = labels.get(path, path.replace("tcp_", "tcp, wire "))
        for key in ("update_send", "update_wait", "exchange"):
            v = row[path][key]
            lines.append(f"  {'(c) dpwa ' + key + ', ' + label:<42}{v:>9.2f}{v / a:>9.2f}{v / b:>9.2f}{v / t:>9.2f}")
    if row.get("busy_retries"):  # see BUSY_PAUSES_S
        retried = ", ".join(f"{path} {n}" for path, n in row["busy_retries"].items())
        lines.append(f"  samples asked again after a busy refusal (unsent replies not yet released): {retried}")
    return "\n".join(lines)


def format_training(rows: list[dict[str, Any]]) -> str:
    lines = [
        "\nTraining step of the example (small ResNet, one thread per process), exchanging every step;",
        "raw: the same bytes fetched every step over plain ZeroMQ, nothing copied, checked or blended (the floor);",
        "+work: raw, plus what any exchange does on the training thread: publish, check and blend (no protocol);",
        "2 trips: +work and a second small round trip after the blend, as a two-phase exchange's confirm (symmetric)",
        f"  {'workload':<38}{'params':>9}{'plain ms':>10}{'dpwa ms':>10}{'overhead':>10}{'averaged':>10}"
        f"{'plain ms':>10}{'raw ms':>10}{'raw':>8}{'+work':>8}{'2 trips':>9}",
    ]
    for r in rows:
        lines.append(
            f"  {r['workload']:<38}{r['parameters']:>9,}{r['step_ms']:>10.2f}{r['step_with_dpwa_ms']:>10.2f}"
            f"{100 * r['overhead']:>9.1f}%{100 * r['averaged_fraction']:>9.0f}%"
            f"{r['raw_step_ms']:>10.2f}{r['step_with_raw_ms']:>10.2f}{100 * r['raw_overhead']:>7.1f}%"
            f"{100 * r['work_overhead']:>7.1f}%"
            + (f"{100 * r['two_trips_overhead']:>8.1f}%" if "two_trips_overhead" in r else f"{'-':>9}")
        )
    return "\n".join(lines)


def format_scale(rows: list[dict[str, Any]]) -> str:
    lines = [
        "\nScale: nodes as threads in one process, 100,000 parameters, fetch every step, TCP",
        f"  {'nodes':>5}{'exchanges/s':>14}{'CPU ms per exchange':>22}{'failed':>8}",
    ]
    for r in rows:
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(r["failed_by"].items()))
        lines.append(
            f"  {r['nodes']:>5}{r['exchanges_per_s']:>14.0f}{r['cpu_ms_per_exchange']:>22.2f}{r['failed']:>8}"
            + (f"  ({why})" if why else "")
        )
    return "\n".join(lines)


def format_summary(results: dict[str, Any], log_path: Path) -> str:
    """A few lines: what an exchange costs against its floors, how it scales, what it adds to training."""
    lines = ["\nSummary"]
    for row in results["sizes"]:
        tcp, zmq_ms = row["tcp"]["exchange"], row["zmq_ms"]
        # (w) is the floor of an exchange over ZeroMQ; larger snapshots stream instead (dpwa.wire.bulk)
        floor = f" (the floor with the work: {row['router_work_ms'] / zmq_ms:.2f}x)" if "tcp_zmq" not in row else ""
        text = (
            f"  {row['parameters']:,} parameters ({row['mbytes']:.1f} MB): an exchange over TCP takes "
            f"{tcp:.2f} ms, {tcp / zmq_ms:.2f}x a raw ZeroMQ round trip{floor}; "
            f"same-host {row['same_host']['exchange']:.2f} ms"
        )
        if "curve" in row:
            curve = row["curve"]["exchange"]
            text += f"; CURVE {curve / tcp:.2f}x TCP, {curve / row['zmq_curve_ms']:.2f}x a raw CURVE round trip"
        lines.append(text)
    if results["scale"]:
        scale = results["scale"]
        cpu = [r["cpu_ms_per_exchange"] for r in scale]
        lines.append(
            f"  scale: {scale[0]['nodes']} to {scale[-1]['nodes']} nodes, {min(cpu):.2f} to {max(cpu):.2f} CPU ms "
            f"per exchange, {sum(r['failed'] for r in scale)} failed"
        )
    for r in results["training"]:
        lines.append(
            f"  training, {r['workload']}: dpwa adds {100 * r['overhead']:.1f}% to a step "
            f"(the raw floor: {100 * r['raw_overhead']:.1f}%, with the work: {100 * r['work_overhead']:.1f}%"
            + (f", two round trips: {100 * r['two_trips_overhead']:.1f}%" if "two_trips_overhead" in r else "")
            + f"), averaging in {100 * r['averaged_fraction']:.0f}% of steps"
        )
    lines.append(f"  the benchmark's own nodes' log: {log_path} ({_count_lines(log_path)} lines)")
    return "\n".join(lines)


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def log_to(path: Path) -> None:
    """Send every log record and Python warning of this process to `path` instead of the terminal."""
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--log",
        metavar="FILE",
        type=Path,
        help="where the benchmark's own nodes log (default: dpwa-bench-PID.log in the temporary folder)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions for large models (default 30)")
    parser.add_argument(
        "--training",
        action="store_true",
        help="only the training-step rows of the digits model (run.sh's default mode, and mode pull)",
    )
    parser.add_argument("--serve-raw", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw-router", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-raw-tcp", nargs=2, metavar=("PORT", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-node", nargs=2, metavar=("CONFIG", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--serve-training", nargs=3, metavar=("CONFIG", "SHAPE", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--raw", metavar="SERVE_AT,FETCH_FROM", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    helper = args.serve_raw or args.serve_raw_router or args.serve_raw_tcp or args.serve_node or args.serve_training
    if helper and os.environ.get(LOG_ENV):
        log_to(Path(os.environ[LOG_ENV]))
    if not helper:
        log_path = (args.log or Path(tempfile.gettempdir()) / f"dpwa-bench-{os.getpid()}.log").resolve()
        log_to(log_path)
        os.environ[LOG_ENV] = str(log_path)  # the helper processes log there too
        print(f"dpwa.bench: the benchmark's own nodes log to {log_path}", flush=True)
    if args.serve_raw:
        serve_raw(int(args.serve_raw[0]), int(args.serve_raw[1]))
        return 0
    if args.serve_raw_router:
        serve_raw(int(args.serve_raw_router[0]), int(args.serve_raw_router[1]), router=True)
        return 0
    if args.serve_raw_tcp:
        serve_raw_tcp(int(args.serve_raw_tcp[0]), int(args.serve_raw_tcp[1]))
        return 0
    if args.serve_node:
        serve_node(args.serve_node[0], int(args.serve_node[1]))
        return 0
    if args.serve_training:
        serve_training(args.serve_training[0], args.serve_training[1], int(args.serve_training[2]), args.raw)
        return 0
    if args.training:  # the digits rows alone, with their floors (--quick: a few steps)
        results = run([], 0, 0, [], 0, [], training_steps=0.02 if args.quick else 1.0, workloads=WORKLOADS[:2])
    elif args.quick:  # STREAMED runs the bulk rows (plain and sealed), with few repetitions
        results = run(
            [1_000, SMALL, STREAMED], 5, 3, [2, 4], 5, ["float16"], training_steps=0.02, workloads=WORKLOADS[:2]
        )
    else:
        results = run([SMALL, RESNET18], 200, args.reps or 30, [2, 4, 8, 16], 200, ["float16", "bfloat16"])
    if results["scale"]:
        print(format_scale(results["scale"]))
    if results["training"]:
        print(format_training(results["training"]))
    print(format_summary(results, log_path))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return 0
