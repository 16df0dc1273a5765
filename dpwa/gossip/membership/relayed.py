"""A node's relay parts, from its config: the relay it runs for others (``relay_port``), and its own way in
when nobody can dial it (``reachable: false``, through ``relays``).

The relay's protocol and sockets are :mod:`dpwa.wire.relay`'s; this module only decides who is admitted and
where things are.
"""

from __future__ import annotations

from zmq.utils import z85

from ...config import Config, ConfigError, NodeSpec
from ...stats import Counters
from ...wire.certs import Certifier, read_cert
from ...wire.curve import CurveKeys, KeyFileError
from ...wire.relay import Admit, Local, RelayAddress, RelayClient, RelayServer
from ...wire.relaying import Hello, proof_holds

__all__ = ["GRANT_WAIT_S", "admit", "relay_client", "relay_server", "reached_at"]

GRANT_WAIT_S = 10.0  # at start, how long a node nobody can dial waits for a relay to give it a port (at least)


def admit(certifier: Certifier | None, secret: bytes | None) -> Admit:
    """Who a relay serves. Without keys, anyone (the cluster is `insecure`: its traffic is readable anyway).
    With keys, a member whose certificate the cluster key signed for its name and key, and who proves it
    holds that key's secret (a relay keeps no other list: members it never heard of may register)."""

    def check(hello: Hello, challenge: bytes) -> str | None:
        if certifier is None or secret is None:
            return None
        if hello.key is None or hello.cert is None:
            return "no_cert"
        verdict = certifier.check(hello.name, hello.key, hello.cert)
        if verdict != "ok":
            return verdict
        try:
            public = z85.decode(hello.key.encode("ascii"))
        except (ValueError, KeyError, UnicodeEncodeError):
            return "bad_key"
        if not proof_holds(secret, public, challenge, hello.name, hello.proof):
            return "bad_proof"
        return None

    return check


def relay_server(
    config: Config, address: str, curve: CurveKeys | None, certifier: Certifier | None, counters: Counters, name: str
) -> RelayServer | None:
    """The relay this node runs for members nobody can dial (``relay_port``), started; None without one."""
    if not config.relay_port:
        return None
    secret = z85.decode(curve.secret) if curve is not None else None
    return RelayServer(
        address,
        config.relay_port,
        config.relay_port_range,
        name=name,
        streams_max=config.relay_streams_max,
        rate_bytes_s=config.relay_mbit * 1e6 / 8,
        admit=admit(certifier, secret),
        counters=counters,
    ).start()


def relay_client(
    config: Config, spec: NodeSpec, address: str, curve: CurveKeys | None, counters: Counters
) -> RelayClient | None:
    """This node's way in through a relay (``reachable: false``), started; None for a node peers can dial."""
    if spec.reachable:
        return None
    secret = None
    if curve is not None:
        assert spec.public_key is not None and spec.cert_file is not None  # checked at load and by open_membership
        try:
            cert = read_cert(spec.cert_file)
        except KeyFileError as exc:
            raise ConfigError(f"{config.source}: node {spec.name!r}: {exc}") from None
        secret = (z85.decode(curve.secret), spec.public_key, cert)
    relays = [
        RelayAddress(host, port, z85.decode(key.encode("ascii")) if key else None)
        for host, port, key in config.relay_addresses
    ]
    own = Local(host="127.0.0.1" if address in ("0.0.0.0", "*", "") else address, port=spec.port)
    return RelayClient(spec.name, relays, own, secret=secret, counters=counters).start()


def reached_at(client: RelayClient, config: Config, name: str) -> str:
    """Wait until a relay gives this node a port; the endpoint peers reach it at (``tcp://RELAY:PORT``).
    ConnectionError naming every relay's answer if none did in time."""
    granted = client.wait_granted(max(GRANT_WAIT_S, 3 * config.timeout_s))
    if granted is None:
        raise ConnectionError(
            f"{config.source}: node {name!r} has reachable: false, and no relay gave it a port: "
            + "; ".join(client.refusals or ["no answer"])
        )
    return NodeSpec(name, *granted).tcp_endpoint
