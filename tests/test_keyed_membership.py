"""Open membership with CURVE keys (issue 32): nobody joins a keyed cluster without its consent.

Every node holds a member certificate that the cluster key signed for its name and CURVE key
(dpwa.wire.certs); digests carry each member's key and certificate; the ZAP handler and each request's
identity follow the view (CurveKeys.open). Checked here, on real nodes over 127.0.0.1:

- three keyed nodes find each other through one bootstrap address and average beyond it;
- a node whose certificate another cluster key signed is refused, and said why (certs_refused.*);
- a raw client with a key of its own is refused at every step: at a node that takes no newcomers, in the
  handshake; at the bootstrap node, on every route but the three that take newcomers, and there it cannot
  announce itself without a certificate for its own key, nor speak for a member, nor forge, replay or alter
  a certificate; no honest view changes;
- a member's certificate that expires removes it, and its key is no longer allowed;
- news of a member with a certificate that does not verify keeps the one the view had;
- every configuration keyed open membership refuses, with its message.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from test_open_membership import RawClient

from conftest import make_config, wait_until
from dpwa import NumpyParams
from dpwa.cluster.status import StatusClient
from dpwa.config import ConfigError, parse_config
from dpwa.gossip.membership.members import Members
from dpwa.gossip.membership.view import MemberInfo
from dpwa.gossip.setup import identify, open_membership
from dpwa.wire import certs
from dpwa.wire.curve import CurveKeys, generate

SUSPECT_MS, DEAD_MS = 1000, 1000
TIMEOUT_MS = 500


class Cluster:
    """A cluster key, and for each node a CURVE key pair and a certificate, in one folder."""

    def __init__(self, root: Path, name: str = "cluster") -> None:
        self.root = root
        self.public_path, self.secret_path = certs.generate_cluster_key(root / "ca", name)
        self.secret = certs.load_cluster_secret(self.secret_path)

    def member(self, spec: dict[str, Any], valid_s: int = 3600, now: float | None = None) -> dict[str, Any]:
        """`spec` with a fresh key pair, and a certificate of this cluster for it."""
        _, secret, pair = generate(spec["name"], self.root / "keys" / str(spec["port"]))
        cert = certs.sign(self.secret, spec["name"], pair.public.decode(), valid_s, now=now)
        path = certs.write_cert(self.root / "keys" / str(spec["port"]) / f"{spec['name']}.cert", cert)
        return {**spec, "public_key": pair.public.decode(), "secret_key_file": str(secret), "cert_file": str(path)}

    def config(self, spec: dict[str, Any], bootstrap: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
        return {
            "nodes": [spec],
            "bootstrap": [{"address": f"{b['host']}:{b['port']}", "public_key": b["public_key"]} for b in bootstrap],
            "cluster_key": str(self.public_path),
            "timeout_ms": TIMEOUT_MS,
            "join": "never",
            "suspect_after_ms": SUSPECT_MS,
            "dead_after_ms": DEAD_MS,
            **settings,
        }


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return Cluster(tmp_path)


def start(nodes, steppers, cluster: Cluster, n: int) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
    """`n` keyed nodes joining through the first, stepping; returned once every view holds them all."""
    specs = [cluster.member(spec) for spec in make_config(n)["nodes"]]
    made = []
    for i, spec in enumerate(specs):
        params = NumpyParams(np.full(100, float(i), dtype=np.float32))
        made.append(nodes(cluster.config(spec, [specs[0]]), spec["name"], params))
    for node in made:
        steppers.start(node)
    names = sorted(s["name"] for s in specs)
    assert wait_until(lambda: all(v == names for v in views(made).values()), 30.0, 0.05), views(made)
    return specs, made, names


def views(made: list[Any]) -> dict[str, list[str]]:
    return {node.name: node.members.names() for node in made}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_keyed_nodes_find_each_other_through_one_address_and_average(nodes, steppers, cluster):
    specs, made, names = start(nodes, steppers, cluster, 3)

    def beyond_bootstrap(node: Any) -> bool:
        return any(row["averaged"] > 0 for peer, row in node.stats()["peers"].items() if peer != "w0")

    assert wait_until(lambda: all(beyond_bootstrap(node) for node in made), 30.0, 0.05), {
        node.name: node.stats()["peers"] for node in made
    }
    for node in made:
        assert node.config.secure and node.config.transport == "tcp"
        assert not any(key.startswith("certs_refused") for key in node.stats()), node.stats()
    # status follows the view in a keyed cluster too: asked with w2's config (which lists only w2, and w0's
    # address and key), as w2, it finds every member and their keys through the bootstrap node
    with StatusClient(made[2].config) as client:
        rows = client.ask(2.0)
    assert sorted(row["name"] for row in rows) == names
    assert all(row["state"] == "training" for row in rows), rows


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_node_certified_by_another_cluster_key_is_refused(nodes, steppers, cluster, tmp_path):
    specs, made, _ = start(nodes, steppers, cluster, 2)
    other = Cluster(tmp_path / "other")
    spec = other.member({"name": "intruder", "host": "127.0.0.1", "port": make_config(1)["nodes"][0]["port"]})
    config = other.config(spec, [specs[0]], bootstrap_alone=False)
    with pytest.raises(ConnectionError, match="no bootstrap address answered"):
        nodes(config, "intruder", NumpyParams(np.zeros(100, dtype=np.float32)))
    stats = made[0].stats()
    assert stats["certs_refused.wrong_cluster"] >= 1 and stats["members.refused.untrusted_key"] >= 1, stats
    assert views(made) == {"w0": ["w0", "w1"], "w1": ["w0", "w1"]}


# --------------------------------------------------------------------------- a hostile client


class KeyedClient(RawClient):
    """A raw REQ socket with a CURVE key pair of its own, to one node: sends any header, returns the reply."""

    def __init__(self, context: zmq.Context, endpoint: str, server_key: str) -> None:
        self.public, self.secret = zmq.curve_keypair()
        self._server_key = server_key.encode()
        super().__init__(context, endpoint)

    @property
    def key(self) -> str:
        return self.public.decode()

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self._server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.connect(self._endpoint)
        return sock


def entry(name: str, port: int, key: str, cert: str | None = None, inc: int = 1, beat: int = 1) -> dict[str, Any]:
    out = {"name": name, "endpoint": f"tcp://127.0.0.1:{port}", "key": key, "inc": inc, "beat": beat}
    return {**out, "cert": cert} if cert is not None else out


def refused(reply: dict[str, Any] | None, reason: str) -> bool:
    return reply is not None and reply["kind"] == "error" and reply["reason"] == reason


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_key_without_the_clusters_consent_gets_nowhere(nodes, steppers, cluster, zctx):
    specs, made, names = start(nodes, steppers, cluster, 3)
    honest = {node.name: node.members.peers() for node in made}
    boot, other = made[0], made[1]
    port = specs[2]["port"] + 1000
    # 1. a node no bootstrap entry names takes no newcomers: the handshake itself is refused
    outsider = KeyedClient(zctx, other.config.endpoint(other.spec), specs[1]["public_key"])
    try:
        assert outsider.ask("members", timeout_s=1.0) is None
        assert wait_until(lambda: other.stats().get("auth_denied", 0) >= 1, 5.0, 0.02)
    finally:
        outsider.close()
    client = KeyedClient(zctx, boot.config.endpoint(boot.spec), specs[0]["public_key"])
    try:
        # 2. the bootstrap node lets the key in, to announce itself; every route but three refuses it
        for kind, fields in (
            ("status", {"from": "w1"}),
            ("join_info", {"from": "w1", "offer": True, "extra": True}),
            ("known", {"from": "w1", "xids": []}),
            ("confirm", {"from": "w1", "xid": 1}),
        ):
            reply = client.ask(kind, **fields)
            assert reply is not None and refused(reply, "bad_identity"), (kind, reply)
            assert "announces itself first" in reply["detail"], reply
        # 3. announcements: no certificate; another cluster's; one altered; one for another key; a member's
        #    replayed with its own key (which this client does not hold)
        stranger = certs.sign(certs.Ed25519PrivateKey.generate(), "mallory", client.key, 3600)
        good = certs.sign(cluster.secret, "mallory", client.key, 3600)
        raw = bytearray(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
        raw[-1] ^= 1  # one bit of the signature
        altered = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
        other_key = zmq.curve_keypair()[0].decode()
        w1_cert = Path(specs[1]["cert_file"]).read_text().strip()
        for claim in (
            entry("mallory", port, client.key),
            entry("mallory", port, client.key, stranger),
            entry("mallory", port, client.key, altered),
            entry("mallory", port, client.key, certs.sign(cluster.secret, "mallory", other_key, 3600)),
            entry("mallory", port, other_key, certs.sign(cluster.secret, "mallory", other_key, 3600)),
            entry("w1", specs[1]["port"], specs[1]["public_key"], w1_cert, inc=2**52),
        ):
            reply = client.ask("members", me=claim)
            assert reply is not None and reply["kind"] == "members_reply" and not reply["admitted"], (claim, reply)
            assert [e["name"] for e in reply["members"]] == ["w0"]  # who answered, not the view
        # 4. a fetch and a barrier in a member's name, with this client's key: bad_identity
        fetch: dict[str, Any] = {"from": "w1", "fp": b"\0" * 16, "dtype": "float32"}
        assert refused(client.ask("fetch", **fetch), "bad_identity")
        barrier: dict[str, Any] = {"from": "w1", "counters": {}}
        assert refused(client.ask("barrier", **barrier), "bad_identity")
        stats = boot.stats()
        for reason in ("no_cert", "wrong_cluster", "bad_signature", "key_mismatch"):
            assert stats.get(f"certs_refused.{reason}", 0) >= 1, (reason, stats)
        assert stats["members.refused.wrong_key"] >= 2, stats
        assert views(made) == {node.name: names for node in made}
        assert {node.name: node.members.peers() for node in made} == honest
        # 5. with a certificate for its own key and name, the same client is admitted: consent, not luck
        reply = client.ask("members", me=entry("mallory", port, client.key, good))
        assert reply is not None and reply["admitted"] is True, reply
        assert {"w0", "w1", "w2"} <= {e["name"] for e in reply["members"]}  # now it is told the view
        assert "mallory" in boot.members.names()
    finally:
        client.close()


# --------------------------------------------------------------------------- the view's keys, on its own


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def keyed_members(cluster: Cluster, wall: Clock) -> tuple[Members, dict[str, Any]]:
    specs = [cluster.member(s, valid_s=100, now=wall.now) for s in make_config(2)["nodes"]]
    config = parse_config(cluster.config(specs[0], [specs[0]]))
    certifier = certs.Certifier(certs.load_cluster_public(cluster.public_path), clock=wall)
    own = certs.read_cert(specs[0]["cert_file"])
    members = Members(
        config,
        config.node("w0"),
        clock=lambda: 0.0,
        cert=own,
        certifier=certifier,
        client_options=lambda key: {zmq.CURVE_SERVERKEY: key},
        wall_clock=wall,
    )
    return members, specs[1]


def test_an_expired_certificate_removes_its_member_and_its_key(cluster) -> None:
    wall = Clock(time.time())
    members, w1 = keyed_members(cluster, wall)
    cert = certs.read_cert(w1["cert_file"])
    info = MemberInfo("w1", f"tcp://127.0.0.1:{w1['port']}", w1["public_key"], 1, 1, cert)
    assert members.merge("w1", [info.entry()]) == ["w1"]
    raw_key = zmq.utils.z85.decode(w1["public_key"].encode())
    assert members.keys.get(raw_key) == "w1"
    assert members.options_for(w1["public_key"]) == {zmq.CURVE_SERVERKEY: w1["public_key"].encode()}
    wall.now += 101  # past not_after
    members._ticked = -1.0  # noqa: SLF001 - the tick's own pacing is not what is tested
    changed = members.tick()
    assert ("w1", "removed (its certificate expired)") in changed
    assert "w1" not in members and raw_key not in members.keys
    assert members.report()["members.refused.cert_expired"] == 1
    # the same certificate, even with later news, is refused now: expired
    later = MemberInfo("w1", info.endpoint, info.key, 2, 1, cert)
    assert members.merge("w1", [later.entry()]) == []
    assert members.report()["certs_refused.expired"] >= 1


def test_news_with_a_certificate_that_does_not_verify_keeps_the_one_the_view_had(cluster) -> None:
    wall = Clock(time.time())
    members, w1 = keyed_members(cluster, wall)
    cert = certs.read_cert(w1["cert_file"])
    info = MemberInfo("w1", f"tcp://127.0.0.1:{w1['port']}", w1["public_key"], 1, 1, cert)
    members.merge("w1", [info.entry()])
    forged = certs.sign(certs.Ed25519PrivateKey.generate(), "w1", w1["public_key"], 3600)
    members.merge("w2", [MemberInfo("w1", info.endpoint, info.key, 1, 5, forged).entry()])
    entry_now = [e for e in members.digest() if e["name"] == "w1"]
    assert entry_now and entry_now[0]["cert"] == cert and entry_now[0]["beat"] == 5
    assert members.report()["members.refused.untrusted_cert"] == 1


# --------------------------------------------------------------------------- configuration


def test_keyed_bootstrap_configs_are_refused_with_what_is_missing(cluster, tmp_path) -> None:
    specs = [cluster.member(s) for s in make_config(2)["nodes"]]
    good = cluster.config(specs[0], [specs[1]])
    parsed = parse_config(good, source="open.yaml")
    assert parsed.bootstrap_specs[0].public_key == specs[1]["public_key"]
    assert parse_config(parsed.to_mapping(), source="again.yaml") == parse_config(
        {**parsed.to_mapping()}, source="again.yaml"
    )
    address = f"127.0.0.1:{specs[1]['port']}"
    cases: list[tuple[dict[str, Any], str]] = [
        ({**good, "bootstrap": [address]}, "has no public_key; in a cluster with keys"),
        ({k: v for k, v in good.items() if k != "cluster_key"}, "bootstrap with keys needs cluster_key"),
        ({**good, "bootstrap": [{"address": address, "public_key": "short"}]}, "40-character Z85"),
        ({**good, "bootstrap": [{"address": address, "key": "x"}]}, "unknown key"),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config(config, source="open.yaml")
    unkeyed = make_config(1)
    with pytest.raises(ConfigError, match="has a public_key, but the nodes have none"):
        parse_config({**unkeyed, "bootstrap": [f"{address} {specs[1]['public_key']}"]}, source="open.yaml")
    with pytest.raises(ConfigError, match="cluster_key is for a cluster with keys"):
        parse_config({**unkeyed, "bootstrap": [address], "cluster_key": "c.pub"}, source="open.yaml")


def test_a_node_checks_its_own_certificate_before_it_opens_a_socket(cluster, tmp_path) -> None:
    spec = cluster.member(make_config(1)["nodes"][0])
    curve = CurveKeys(public=spec["public_key"].encode(), secret=b"")
    no_cert = {k: v for k, v in spec.items() if k != "cert_file"}
    with pytest.raises(ConfigError, match="has no cert_file"):
        open_membership(identify(cluster.config(no_cert, [spec]), spec["name"]), curve, None)
    other = cluster.member({**spec, "name": "w9", "port": spec["port"] + 1})
    wrong = {**spec, "cert_file": other["cert_file"]}
    with pytest.raises(ConfigError, match=r"refused here \(name_mismatch: it is for another name\)"):
        open_membership(identify(cluster.config(wrong, [spec]), spec["name"]), curve, None)
    members, keys = open_membership(identify(cluster.config(spec, [spec]), spec["name"]), curve, None)
    assert members is not None and keys is not None and keys.open and keys.newcomers  # it is the bootstrap node
    assert keys.allowed is members.keys
    members, keys = open_membership(identify(cluster.config(spec, [other]), spec["name"]), curve, None)
    assert keys is not None and keys.open and not keys.newcomers


@pytest.mark.io
def test_the_operations_guides_keyed_commands_and_config_make_a_node_that_starts(tmp_path) -> None:
    """docs/operations.md, "With keys": its commands run as written, and its config (the keys put in) is one
    a node accepts, its certificate checked."""
    import re
    import subprocess
    import sys

    import yaml
    import zmq.auth

    page = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text(encoding="utf-8")

    def block(marker: str, lang: str) -> str:
        found = re.search(rf"<!-- keyed open: {marker} -->\n```{lang}\n(.*?)```", page, re.S)
        assert found, marker
        return found.group(1)

    script = block("keys", "bash").replace("python -m dpwa", f"{sys.executable} -m dpwa")
    done = subprocess.run(["bash", "-euc", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cert_file: keys/w2.cert" in done.stdout
    keys = {n: zmq.auth.load_certificate(tmp_path / "keys" / f"{n}.key")[0].decode() for n in ("w1", "w2")}
    text = block("config", "yaml").replace("W2_PUBLIC_KEY", keys["w2"]).replace("W1_PUBLIC_KEY", keys["w1"])
    config_path = tmp_path / "w2.yaml"
    config_path.write_text(text)
    config = parse_config(yaml.safe_load(text), source=str(config_path))
    who = identify(config, "w2")
    curve = CurveKeys(public=keys["w2"].encode(), secret=b"")
    members, opened = open_membership(who, curve, None)
    assert members is not None and opened is not None and opened.open and not opened.newcomers
    assert members.own_entry()["cert"] == (tmp_path / "keys" / "w2.cert").read_text().strip()
