"""A training step of the example with dpwa exchanging every step, against the same loop without it and two floors.

The second training node runs in a helper process (``python -m dpwa.bench
--serve-training``, see :mod:`.children`).
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .children import Child, set_when_stdin_closes
from .exchange import write_pair_config
from .sizes import median_ms

WORKLOADS = (  # the training-overhead workloads: label, input shape, batch size, steps, mode
    ("digits, batch 32, run.sh's defaults", (1, 8, 8), 32, 200, "symmetric"),
    ("digits, batch 32, mode pull", (1, 8, 8), 32, 200, "pull"),
    ("CIFAR-sized 3x32x32, batch 128, mode pull", (3, 32, 32), 128, 40, "pull"),
)


def training_setup(shape: tuple[int, ...], batch: int, seed: int):
    """The example's small model, an optimizer, and one fixed batch of the given shape."""
    import torch

    from dpwa_lab.workloads.images import build

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
    threading.Thread(target=set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()
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
    from dpwa.gossip.transfer.protocol import MAX_VALUE
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
                Child("--serve-training", path, geometry, str(batch), env=env) as server,
                DpwaPyTorchAdapter(net, "client", path, rng=random.Random(0)) as conn,
            ):
                loss: float | None = None

                def dpwa_step() -> bool:
                    nonlocal loss
                    conn.update_send(loss)
                    loss = step()
                    return conn.update_wait(loss).averaged

                try:
                    plain, with_dpwa, averaged = _alternate(step, dpwa_step, steps)
                finally:
                    # Each side's last message is answered while the other still serves, not waited out for its
                    # deadline (5 to 10 s), as one to a node that closed would be. Mode pull: the helper's last
                    # fetch from us, so it stops first. Symmetric: our confirm to it, so we close first (the
                    # with's own order).
                    if mode == "pull":
                        server.stop()
            ours, theirs = f"ipc://{tmp}/raw-client", f"ipc://{tmp}/raw-server"
            with Child("--serve-training", path, geometry, str(batch), "--raw", f"{theirs},{ours}", env=env) as peer:
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
                    peer.stop()  # first: its last fetch is answered while ours still serves (it waits on it)
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
