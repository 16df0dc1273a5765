"""CURVE: only listed keys get in; nothing travels in the clear; unsafe key files are refused."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import zmq

from conftest import ORIGINAL, filled, make_config, port_is_free, secure_config, serving_only, wait_until
from dpwa import ConfigError, Node, NumpyParams, parse_config
from dpwa.gossip.transfer.protocol import FETCH
from dpwa.wire.curve import KeyFileError, generate, load_secret, valid_public_key
from dpwa.wire.schema import decode, encode
from helpers.proxy import Proxy


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    public, secret, pair = generate("w1", tmp_path)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public).st_mode) == 0o644
    assert valid_public_key(pair.public.decode())
    assert "secret-key" not in public.read_text() and pair.secret.decode() not in public.read_text()
    loaded = load_secret(secret, pair.public.decode())
    assert loaded == pair
    assert zmq.auth.load_certificate(public) == (pair.public, None)  # the standard format
    with pytest.raises(FileExistsError, match="exists"):
        generate("w1", tmp_path)


def test_unsafe_or_wrong_key_files_are_refused(tmp_path):
    public, secret, pair = generate("w1", tmp_path)
    os.chmod(secret, 0o644)
    with pytest.raises(KeyFileError, match=r"can be read by others \(mode -rw-r--r--\); run: chmod 600"):
        load_secret(secret, pair.public.decode())
    os.chmod(secret, 0o600)
    _, _, other = generate("w2", tmp_path)
    with pytest.raises(KeyFileError, match="is not the one the config lists"):
        load_secret(secret, other.public.decode())
    with pytest.raises(KeyFileError, match="holds no secret-key"):
        os.chmod(public, 0o600)
        load_secret(public, pair.public.decode())
    with pytest.raises(KeyFileError, match="cannot read the secret key file"):
        load_secret(tmp_path / "nope.key_secret", pair.public.decode())


def test_config_rules_for_keys(tmp_path):
    cfg = secure_config(tmp_path, 2)
    config = parse_config(cfg, source=str(tmp_path / "c.yaml"))
    assert config.secure
    bad = {**cfg, "nodes": [dict(cfg["nodes"][0], public_key="not-a-key"), cfg["nodes"][1]]}
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.public_key must be a 40-character Z85 CURVE key"):
        parse_config(bad)
    partial = {
        **cfg,
        "nodes": [
            cfg["nodes"][0],
            {k: v for k, v in cfg["nodes"][1].items() if k not in ("public_key", "secret_key_file")},
        ],
    }
    with pytest.raises(ConfigError, match="public_key on every node or on none; missing on w1"):
        parse_config(partial)
    relative = {**cfg, "nodes": [dict(cfg["nodes"][0], secret_key_file="keys/w0.key_secret"), cfg["nodes"][1]]}
    resolved = parse_config(relative, source=str(tmp_path / "cluster.yaml"))
    assert resolved.nodes[0].secret_key_file == str(tmp_path / "keys" / "w0.key_secret")


@pytest.mark.io
def test_a_readable_secret_key_stops_the_node_before_it_opens_a_socket(tmp_path):
    cfg = secure_config(tmp_path, 2)
    os.chmod(cfg["nodes"][0]["secret_key_file"], 0o640)
    with pytest.raises(ConfigError, match=r"node 'w0': .*can be read by others"):
        Node(cfg, "w0", NumpyParams(filled(0)))
    assert port_is_free(cfg["nodes"][0]["port"])


@pytest.mark.parametrize("same_host", ["off", "auto"])
def test_a_curve_cluster_averages(nodes, tmp_path, same_host):
    cfg = secure_config(tmp_path, 3, **ORIGINAL, same_host=same_host)
    size = 300_000  # 1.2 MB: encrypted frames are larger than the payload, and must still fit the size limit
    for k in (1, 2):
        peer = nodes(serving_only(cfg), f"w{k}", NumpyParams(filled(4, size)))
        peer.update_send()
    mine = filled(0, size)
    node = nodes(cfg, "w0", NumpyParams(mine))
    node.update_send()
    assert node.update_wait().averaged
    assert np.all(mine == 2.0)
    assert node.stats().get("auth_denied", 0) == 0


def raw_fetch(ctx, port, fp, timeout_ms, sender="intruder", **curve):
    """Send one fetch; the reply's header, or None if none came."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in curve.items():
        sock.setsockopt(getattr(zmq, option), value)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(encode(FETCH, 1, **{"from": sender}, fp=fp, dtype="float32"))
    got = sock.poll(timeout_ms)
    reply = decode(sock.recv_multipart()[0]) if got else None
    sock.close(0)
    return reply


def test_an_unlisted_key_and_a_plain_client_get_nothing_and_are_counted(nodes, tmp_path):
    cfg = secure_config(tmp_path, 2, **ORIGINAL)
    server = nodes(serving_only(cfg), "w0", NumpyParams(filled(7)))
    server.update_send()
    server_key = cfg["nodes"][0]["public_key"].encode()
    port = cfg["nodes"][0]["port"]
    ctx = zmq.Context()
    try:
        intruder_public, intruder_secret = zmq.curve_keypair()
        assert not raw_fetch(
            ctx,
            port,
            server.params.fingerprint,
            1000,
            CURVE_SERVERKEY=server_key,
            CURVE_PUBLICKEY=intruder_public,
            CURVE_SECRETKEY=intruder_secret,
        )
        assert wait_until(lambda: server.stats().get("auth_denied", 0) >= 1, 5)
        assert not raw_fetch(ctx, port, server.params.fingerprint, 1000)  # no CURVE at all
        assert wait_until(lambda: server.stats().get("handshakes_failed", 0) >= 1, 5)
        assert server.stats()["requests_served"] == 0  # neither reached a handler
        # an intruder that claims a listed node's public key cannot finish the handshake without its secret
        assert not raw_fetch(
            ctx,
            port,
            server.params.fingerprint,
            1000,
            CURVE_SERVERKEY=server_key,
            CURVE_PUBLICKEY=cfg["nodes"][1]["public_key"].encode(),
            CURVE_SECRETKEY=intruder_secret,
        )
        assert server.stats()["requests_served"] == 0
        # a listed node still gets through
        member = nodes(cfg, "w1", NumpyParams(filled(1)))
        member.update_send()
        assert member.update_wait().averaged
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("secure", [True, False])
def test_parameters_cross_the_network_encrypted(nodes, tmp_path, secure):
    """A proxy records the bytes between two nodes. The served model holds a recognisable
    pattern; in the clear it shows up on the wire, with CURVE it does not."""
    cfg = secure_config(tmp_path, 2, same_host="off") if secure else make_config(2, same_host="off", insecure=True)
    pattern = np.tile(np.array([1234.5, -8765.25, 3.0e-7, 42.0], np.float32), 2500)
    server = nodes(serving_only(cfg), "w1", NumpyParams(pattern.copy()))
    server.update_send()
    proxy = Proxy(cfg["nodes"][1]["port"], capture=True)
    try:
        client_cfg = {**cfg, "nodes": [cfg["nodes"][0], dict(cfg["nodes"][1], port=proxy.port)]}
        mine = filled(0, pattern.size)
        client = nodes(client_cfg, "w0", NumpyParams(mine))
        client.update_send()
        assert client.update_wait().averaged
        assert np.allclose(mine, pattern / 2)
        needle = pattern[:16].tobytes()
        assert proxy.captured is not None  # capture=True
        assert (needle in bytes(proxy.captured)) is (not secure)
        assert len(proxy.captured) >= pattern.nbytes
    finally:
        proxy.close()


def test_the_from_field_is_bound_to_the_authenticated_key(nodes, tmp_path):
    """A listed node may fetch as itself, but not claim to be another node."""
    cfg = secure_config(tmp_path, 3)
    server = nodes(serving_only(cfg), "w0", NumpyParams(filled(7)))
    server.update_send()
    w1 = cfg["nodes"][1]
    _, w1_secret = zmq.auth.load_certificate(w1["secret_key_file"])
    curve = dict(
        CURVE_SERVERKEY=cfg["nodes"][0]["public_key"].encode(),
        CURVE_PUBLICKEY=w1["public_key"].encode(),
        CURVE_SECRETKEY=w1_secret,
    )
    ctx = zmq.Context()
    try:
        port = cfg["nodes"][0]["port"]
        assert raw_fetch(ctx, port, server.params.fingerprint, 3000, sender="w1", **curve).kind == "params"
        lie = raw_fetch(ctx, port, server.params.fingerprint, 3000, sender="w2", **curve)
        assert lie.kind == "error" and lie["reason"] == "bad_identity"
        assert "says it is from 'w2', but its key is 'w1'" in lie["detail"]
        assert server.stats()["rejected.bad_identity"] == 1
    finally:
        ctx.destroy(linger=0)


def test_without_curve_the_from_field_must_name_a_node_of_the_cluster(nodes):
    cfg = make_config(2, insecure=True)
    server = nodes(serving_only(cfg), "w0", NumpyParams(filled(7)))
    server.update_send()
    ctx = zmq.Context()
    try:
        port = cfg["nodes"][0]["port"]
        reply = raw_fetch(ctx, port, server.params.fingerprint, 3000, sender="intruder")
        assert reply.kind == "error" and reply["reason"] == "bad_identity"
        assert raw_fetch(ctx, port, server.params.fingerprint, 3000, sender="w1").kind == "params"
    finally:
        ctx.destroy(linger=0)


def test_a_loopback_cluster_without_keys_listens_on_no_tcp_port(nodes):
    """Secure by default: no other user of this machine can even connect (ipc in a 0700 directory)."""
    cfg = make_config(2)
    node = nodes(cfg, "w0", NumpyParams(filled(7)))
    node.update_send()
    assert port_is_free(cfg["nodes"][0]["port"])  # nothing listens on the TCP port
    path = node.config.endpoint(node.spec)[len("ipc://") :]
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
