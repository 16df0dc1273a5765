"""dpwa's exchange between two processes: a node here fetching from a node in a helper process, and a raw client of it.

A subject of :func:`.sizes.measure_size` each, as the floors are (:mod:`.floors`).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .children import Child, free_port, set_when_stdin_closes

# A node refuses "busy" while 3 payload replies to a sender are unsent: it learns that ZeroMQ let go of one
# from pyzmq's garbage-collector thread, which lags on a loaded machine (two samplers here share one sender
# name). Such a sample is asked again after these pauses (None: give up), and counted in "busy_retries".
BUSY_PAUSES_S = (0.001, 0.002, 0.004, None)


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
        threading.Thread(target=set_when_stdin_closes, args=(stdin_closed,), daemon=True).start()
        while not stdin_closed.is_set():  # bounded: each linger returns within its limit
            node.linger(idle_s=3600.0, limit_s=60.0, stop=stdin_closed.is_set)


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
    on. Mode symmetric: the defaults as run.sh's cluster has them (rule delta; pairing hypercube, which
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
        "rule": "state" if mode == "pull" else "delta",
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
        from dpwa.gossip.services import BULK_MIN_BYTES
        from dpwa.mixing.params import NumpyParams

        self.same_host = same_host
        self.busy = 0  # samples asked again after a "busy" refusal
        nbytes = size * (4 if wire_dtype == "float32" else 2)  # float16 and bfloat16: 2 bytes
        # by dpwa.wire.bulk (in mode symmetric both snapshots stream: the requester's is offered with its request)
        self.streams = not same_host and bulk == "auto" and nbytes >= BULK_MIN_BYTES
        path = write_pair_config(
            directory, same_host=same_host, wire_dtype=wire_dtype, bulk=bulk, curve=curve, mode=mode
        )
        self.child = Child("--serve-node", path, str(size), wait=False)
        try:
            self.node = Node(path, "client", NumpyParams(np.zeros(size, np.float32)), rng=random.Random(0))
        except BaseException:
            self.child.stop()
            raise

    def ready(self) -> None:
        self.child.wait_ready()

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

        from dpwa.gossip.transfer.protocol import FETCH
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
        self.pair = pair

    def ready(self) -> None:
        self.pair.ready()

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
