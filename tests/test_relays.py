"""Nodes nobody can dial, reached through a relay (issue 43), on real nodes over 127.0.0.1 with CURVE keys.

w0 can be dialled and relays (``relay_port``); w1 and w2 say ``reachable: false`` and register at w0's relay.
So every exchange with w1 or w2 goes through w0's relay, the one between w1 and w2 included. Checked:

- every pair averages, and the symmetric exchange's kept sum holds (no node trains: the sum of the three models
  is what it was, to float32 rounding, after hundreds of relayed exchanges);
- the relay moves only ciphertext: every byte its pipes moved is recorded, and no 16-byte run of any node's
  parameters is in it (the same recording on a cluster without keys finds them: the check has teeth);
- every value stays within the starting values' range (convex mixes only);
- in mode pull too, every pair fetches from each other through the relay.

Not tested here: a relay that changes bytes. CURVE refuses a changed message, but libzmq 4.3.5 then sometimes
aborts the receiving process (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``, seen with a
relay that flipped one byte every 64 KB), so a relay, or anyone on the path, that alters bytes can stop a node
(docs/security.md, "Relays").
- a member without the cluster's consent cannot register, and says why at start.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_keyed_membership import Cluster

from conftest import close_together, free_port, make_config, wait_until
from dpwa import Node, NumpyParams
from dpwa.wire import relay as relay_module

SIZE = 4096  # values per model: 16 KB, small enough to be quick, big enough to span several relay reads
START = (1000.0, 2000.0, 3000.0)  # each node's value: a run of it is easy to look for in bytes


class Recorder:
    """What every relay pipe read, through recording sockets (patched into _Pipe)."""

    def __init__(self) -> None:
        self.moved = bytearray()
        self._lock = threading.Lock()

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every pipe made from now on reads through a recording socket."""
        original = relay_module._Pipe.__init__
        recorder = self

        def init(pipe: Any, a: Any, b: Any, bucket: Any, to_a: bytes = b"") -> None:
            original(pipe, _Recording(a, recorder), _Recording(b, recorder), bucket, to_a)  # type: ignore[arg-type]

        monkeypatch.setattr(relay_module._Pipe, "__init__", init)

    def record(self, data: bytes) -> bytes:
        with self._lock:
            self.moved += data
        return data

    def holds_values_of(self, values: tuple[float, ...]) -> bool:
        with self._lock:
            data = bytes(self.moved)
        return any(np.full(4, v, np.float32).tobytes() in data for v in values)


class _Recording:
    """A socket whose reads go through a Recorder; everything else is the socket's."""

    def __init__(self, sock: Any, recorder: Recorder) -> None:
        self._sock, self._recorder = sock, recorder

    def recv(self, n: int) -> bytes:
        return self._recorder.record(self._sock.recv(n))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def relayed_cluster(tmp_path: Path, keyed: bool) -> tuple[list[dict[str, Any]], Cluster | None]:
    """Configs for w0 (reachable, relays) and w1, w2 (reachable: false, through w0's relay)."""
    base = make_config(3, suspect_after_ms=3000, dead_after_ms=3000)
    relay_port = free_port()
    cluster = Cluster(tmp_path) if keyed else None
    specs = [cluster.member(s) if cluster is not None else dict(s) for s in base["nodes"]]
    relay_ports = sorted({free_port() for _ in range(8)})
    configs = []
    for i, spec in enumerate(specs):
        settings: dict[str, Any] = {}
        if i == 0:
            settings = {"relay_port": relay_port, "relay_ports": f"{relay_ports[0]}-{relay_ports[0] + 3}"}
        else:
            spec["reachable"] = False
            address = f"127.0.0.1:{relay_port}"
            settings = {"relays": [{"address": address, "public_key": specs[0]["public_key"]} if keyed else address]}
        if cluster is not None:
            config = cluster.config(spec, [specs[0]], timeout_ms=1000, **settings)
        else:
            config = {
                "nodes": [spec],
                "bootstrap": [f"127.0.0.1:{specs[0]['port']}"],
                "insecure": True,
                "timeout_ms": 1000,
                "join": "never",
                "suspect_after_ms": 3000,
                "dead_after_ms": 3000,
                **settings,
            }
        configs.append(config)
    return configs, cluster


def start(nodes: Any, configs: list[dict[str, Any]]) -> list[Node]:
    made = []
    for i, config in enumerate(configs):
        params = NumpyParams(np.full(SIZE, START[i], dtype=np.float32))
        made.append(nodes(config, f"w{i}", params))
    return made


def averaged_pairs(made: list[Node]) -> dict[str, dict[str, int]]:
    return {node.name: {peer: row.get("averaged", 0) for peer, row in node.stats()["peers"].items()} for node in made}


def every_pair(made: list[Node]) -> bool:
    pairs = averaged_pairs(made)
    return all(len(row) == 2 and all(count > 0 for count in row.values()) for row in pairs.values())


def stepping(made: list[Node], steppers: Any, done: Any, within_s: float = 40.0) -> None:
    """Each node steps (update_send, update_wait: no training) until `done()` holds (asserted); then all stop
    and close together, each settling what it has pending with the others."""
    for node in made:
        steppers.start(node)
    try:
        assert wait_until(done, within_s, 0.1), averaged_pairs(made)
    finally:
        steppers.stop()
        close_together(made)


def total(made: list[Node]) -> np.ndarray:
    return np.sum([node.params.array.astype(np.float64) for node in made], axis=0)  # type: ignore[attr-defined]


@pytest.mark.io
@pytest.mark.timeout(90)
def test_relayed_members_average_every_pair_keep_the_sum_and_the_relay_reads_nothing(
    nodes, steppers, tmp_path, monkeypatch
):
    recorder = Recorder()
    recorder.patch(monkeypatch)
    configs, _ = relayed_cluster(tmp_path, keyed=True)
    made = start(nodes, configs)
    relay_port = configs[0]["relay_port"]
    endpoints = {node.name: node.members.digest()[0]["endpoint"] for node in made}  # type: ignore[union-attr]
    assert endpoints["w0"] == f"tcp://127.0.0.1:{configs[0]['nodes'][0]['port']}"
    for name in ("w1", "w2"):  # reached at a port of w0's relay, not where it listens
        assert endpoints[name].startswith("tcp://127.0.0.1:") and endpoints[name] != f"tcp://127.0.0.1:{relay_port}"
    before = total(made)
    stepping(made, steppers, lambda: every_pair(made))
    relay_stats = made[0].stats()
    assert relay_stats.get("relay.registered", 0) >= 2, relay_stats  # each relayed member (again if it lost it)
    assert relay_stats.get("relay.streams_opened", 0) >= 2
    after = total(made)
    assert np.allclose(after, before, rtol=0, atol=1e-6 * before.max() * 50), (after - before).max()
    for node in made:
        values = node.params.array  # type: ignore[attr-defined]
        assert np.all(np.isfinite(values)) and values.min() >= min(START) - 1e-3 and values.max() <= max(START) + 1e-3
    assert len(recorder.moved) > 10 * SIZE * 4  # the relay did carry the exchanges
    assert not recorder.holds_values_of(START), "the relay moved parameters in the clear"


@pytest.mark.io
@pytest.mark.timeout(60)
def test_without_keys_the_relay_can_read_what_it_moves(nodes, steppers, tmp_path, monkeypatch):
    """The control of the test above: the same recording on a cluster without keys finds the values."""
    recorder = Recorder()
    recorder.patch(monkeypatch)
    configs, _ = relayed_cluster(tmp_path, keyed=False)
    made = start(nodes, configs)
    stepping(made, steppers, lambda: recorder.holds_values_of(START), within_s=30.0)


@pytest.mark.io
@pytest.mark.timeout(60)
def test_a_member_without_the_clusters_consent_is_refused_by_the_relay(nodes, tmp_path):
    configs, cluster = relayed_cluster(tmp_path, keyed=True)
    assert cluster is not None
    made = start(nodes, configs[:1])
    other = Cluster(tmp_path / "other", name="other")  # another cluster key signs w1's certificate
    spec = other.member({k: v for k, v in configs[1]["nodes"][0].items() if k in ("name", "host", "port")})
    spec["reachable"] = False
    bad = {**configs[1], "nodes": [spec], "cluster_key": str(other.public_path)}
    with pytest.raises(ConnectionError, match=r"no relay gave it a port: 127\.0\.0\.1:\d+: .*wrong_cluster"):
        nodes(bad, "w1", NumpyParams(np.zeros(SIZE, np.float32)))
    assert made[0].stats().get("relay.refused.wrong_cluster", 0) >= 1


NODE = {"name": "w1", "host": "127.0.0.1", "port": 45001}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nodes": [{**NODE, "reachable": False}], "insecure": True}, "reachable: false, which needs bootstrap"),
        (
            {"nodes": [{**NODE, "reachable": False}], "bootstrap": ["127.0.0.1:45000"], "insecure": True},
            "relays lists no relay",
        ),
        (
            {"nodes": [{**NODE, "reachable": False}], "bootstrap": ["127.0.0.1:45000"], "relays": ["127.0.0.1:45100"]},
            "relays run over TCP",
        ),
        ({"nodes": [NODE], "relay_port": 45100, "insecure": True}, "relay_port is for open membership"),
        (
            {
                "nodes": [{**NODE, "reachable": False}],
                "bootstrap": ["127.0.0.1:45000"],
                "relays": ["127.0.0.1:45100"],
                "relay_port": 45200,
                "insecure": True,
            },
            "nobody could dial the relay",
        ),
        (
            {"nodes": [NODE], "bootstrap": ["127.0.0.1:45000"], "relays": ["127.0.0.1:45100"], "insecure": True},
            "relays is for a node with reachable: false",
        ),
        (
            {
                "nodes": [NODE],
                "bootstrap": ["127.0.0.1:45000"],
                "relay_port": 45100,
                "relay_ports": "45099-45101",
                "insecure": True,
            },
            "relay_ports must not include relay_port",
        ),
        ({"nodes": [NODE], "relay_ports": "45101-45100", "insecure": True}, r"relay_ports must be FIRST-LAST"),
        ({"nodes": [NODE], "relay_port": 70000}, r"relay_port must be a TCP port in 1\.\.65535, or 0"),
        ({"nodes": [{**NODE, "reachable": "no"}]}, r"nodes\[0\]\.reachable must be true or false"),
    ],
)
def test_relay_settings_that_cannot_work_are_refused_naming_the_key(settings, message):
    from dpwa.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(settings, source="relays.yaml")


@pytest.mark.io
@pytest.mark.timeout(60)
def test_in_mode_pull_relayed_members_fetch_from_each_other(nodes, steppers, tmp_path):
    """Mode pull through the relay too: each relayed member fetches from the other and from w0, and is fetched from."""
    configs, _ = relayed_cluster(tmp_path, keyed=True)
    made = start(nodes, [{**config, "mode": "pull"} for config in configs])
    stepping(made, steppers, lambda: every_pair(made))
    for node in made:
        values = node.params.array  # type: ignore[attr-defined]
        assert np.all(np.isfinite(values)) and values.min() >= min(START) - 1e-3 and values.max() <= max(START) + 1e-3


def test_the_benchs_relay_tables_name_each_path_and_its_ratio():
    from dpwa_lab.bench.relays import PATHS, format_loss, format_relayed, interval, path_of

    assert [path_of("w0", "w1", ()), path_of("w0", "w1", ("w1",)), path_of("w1", "w0", ("w1",))] == list(PATHS[:3])
    assert path_of("w1", "w2", ("w1", "w2")) == PATHS[3]
    row = {
        "size": 100,
        "mb": 0.0004,
        **{p: {"median_ms": ms, "n": 5} for p, ms in zip(PATHS, (2.0, 3.0, 2.0, 5.0), strict=True)},
    }
    table = format_relayed([row])
    assert "1.50" in table and "2.50" in table  # to a relayed node / direct, relayed to relayed / direct
    mean, half = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.30 * 1.0 / 3**0.5)
    loss: dict[str, Any] = {"runs": 3, "epochs": 10}
    for label in ("all dialled", "w2, w3 behind a relay"):
        loss[label] = {"accuracy": (0.9, 0.01), "last_loss": (0.2, 0.02), "averaged": (100.0, 5.0)}
    assert "0.9000 ± 0.0100" in format_loss(loss)
