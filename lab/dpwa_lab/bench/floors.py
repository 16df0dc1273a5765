"""The raw floors an exchange is measured against: a memory copy, ZeroMQ and TCP round trips, and their servers.

Each floor is a subject of :func:`.sizes.measure_size`: ``sample()`` times
one round, ``close()`` stops the helper process that serves it, if any
(started as ``python -m dpwa.bench --serve-raw...``, see :mod:`.children`).
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from .children import Child, free_port, set_when_stdin_closes

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
    threading.Thread(target=set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()

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


class CopyFloor:
    """(a): np.copyto of the model's bytes."""

    def __init__(self, size: int) -> None:
        self.src, self.dst = np.ones(size, np.float32), np.empty(size, np.float32)

    def ready(self) -> None:
        pass

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
        self.child = Child("--serve-raw-router" if router else "--serve-raw", str(port), str(size), env=env, wait=False)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        self.sock.connect(f"tcp://127.0.0.1:{port}")  # ZeroMQ connects once the helper serves

    def ready(self) -> None:
        self.child.wait_ready()

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
        from dpwa.gossip.transfer.protocol import MAX_VALUE
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

        self.port = free_port()
        self.child = Child("--serve-raw-tcp", str(self.port), str(size), wait=False)
        self.sock: socket.socket | None = None
        self.buffer = np.empty(size, np.float32)
        self.view = self.buffer.data.cast("B")

    def ready(self) -> None:
        import socket

        self.child.wait_ready()
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def sample(self) -> dict[str, float]:
        assert self.sock is not None, "ready() first"
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
        if self.sock is not None:
            self.sock.close()
        self.child.stop()
