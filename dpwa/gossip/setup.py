"""Who a starting node is: its configuration, its name, and its CURVE keys, all checked before any socket opens.

A config may be a file, parsed YAML or a :class:`~dpwa.config.Config`; with
``nodes: torchrun`` the node list and keys come from torchrun's rendezvous
(:mod:`dpwa.gossip.membership.rendezvous`). Keys come from the rendezvous or from the
node's secret key file (:func:`key_pair`, which ``python -m dpwa status``
uses too).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zmq.utils import z85

from ..config import Config, ConfigError, NodeSpec, load_config, parse_config
from ..logs import logger
from ..wire.certs import PROBLEMS as CERT_PROBLEMS
from ..wire.certs import Certifier, load_cluster_public, read_cert
from ..wire.curve import CurveKeys, KeyFileError, KeyPair, load_secret
from .membership.members import Members
from .membership.rendezvous import Rendezvous, rendezvous

__all__ = ["Identity", "identify", "key_pair", "node_keys", "open_membership"]

ConfigSource = Config | str | os.PathLike[str] | Mapping[str, Any] | list


@dataclass(frozen=True)
class Identity:
    """A node's config (torchrun's node list filled in), its name and entry, and the rendezvous if any."""

    config: Config
    name: str
    spec: NodeSpec
    met: Rendezvous | None  # under torchrun: the store this round met in (its start barrier) and our keys


def as_config(config: ConfigSource) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    if isinstance(config, (Mapping, list)):
        return parse_config(config, source="<dict>")
    raise ConfigError(f"config must be a Config, a file path or parsed YAML data, got {type(config).__name__}")


def identify(config: ConfigSource, name: str | None) -> Identity:
    """Which node of which cluster this is; under torchrun, after meeting the other workers."""
    resolved = as_config(config)
    met = None
    if not resolved.resolved:  # nodes: torchrun: meet the other workers through torchrun's store
        met = rendezvous(resolved)
        if name is not None and name != met.name:
            raise ConfigError(f"{resolved.source}: under torchrun this worker is {met.name!r}, not {name!r}")
        resolved, name = met.config, met.name
    if name is None:
        raise ConfigError(f"{resolved.source}: which node is this? give its name (None only with nodes: torchrun)")
    return Identity(resolved, name, resolved.node(name), met)


def open_membership(
    identity: Identity, curve: CurveKeys | None, rng: random.Random | None
) -> tuple[Members | None, CurveKeys | None]:
    """With ``bootstrap:``, this node's view of the members; and its keys, which then follow the view: a
    member's key is allowed while it is a member (``CurveKeys.open``), and a node that a bootstrap entry names
    lets newcomers complete the handshake, to announce themselves. Without ``bootstrap:``: (None, `curve`).

    In a keyed cluster this node's certificate is read and checked here (ConfigError naming the file and
    what is wrong), before any socket exists."""
    config, spec = identity.config, identity.spec
    if not config.bootstrap:
        return None, curve
    if curve is None:
        return Members(config, spec, rng=rng), None
    if spec.cert_file is None:
        raise ConfigError(
            f"{config.source}: node {spec.name!r} has no cert_file: in a keyed cluster with bootstrap each node "
            f"presents a certificate of the cluster key (python -m dpwa keygen {spec.name} --dir keys --sign-with "
            "cluster.secret writes keys/NAME.cert)"
        )
    try:
        cluster = load_cluster_public(config.cluster_key)
        cert = read_cert(spec.cert_file)
    except KeyFileError as exc:
        raise ConfigError(f"{config.source}: node {spec.name!r}: {exc}") from None
    certifier = Certifier(cluster)
    verdict = certifier.check(spec.name, spec.public_key, cert)
    if verdict != "ok":
        raise ConfigError(
            f"{config.source}: node {spec.name!r}: {spec.cert_file}: the certificate is refused here "
            f"({verdict}: {CERT_PROBLEMS[verdict]}); the cluster would refuse it too"
        )
    members = Members(config, spec, rng=rng, cert=cert, certifier=certifier, client_options=curve.client_options)
    own = {(spec.host.lower(), spec.port)}
    newcomers = any((b.host.lower(), b.port) in own for b in config.bootstrap_specs)
    return members, dataclasses.replace(curve, allowed=members.keys, open=True, newcomers=newcomers)


def key_pair(spec: NodeSpec) -> CurveKeys:
    """A node's CURVE key pair from its secret key file (KeyFileError if it cannot be used here)."""
    if spec.secret_key_file is None:
        raise KeyFileError(f"node {spec.name!r} lists no secret_key_file")
    pair = load_secret(spec.secret_key_file, spec.public_key or "")
    return CurveKeys(public=pair.public, secret=pair.secret)


def node_keys(identity: Identity) -> CurveKeys | None:
    """Our CURVE keys, allowing every node of the config: made at the rendezvous, or read from our key file."""
    config, spec = identity.config, identity.spec
    allowed = {z85.decode(s.public_key.encode()): s.name for s in config.nodes if s.public_key}
    made: KeyPair | None = identity.met.keys if identity.met is not None else None
    if made is not None:
        return CurveKeys(public=made.public, secret=made.secret, allowed=allowed)
    if not config.secure:
        if config.insecure:
            logger.warning(
                "%s: insecure: true: serving %s without CURVE; anyone who reaches it can read "
                "this node's parameters and offer it theirs",
                identity.name,
                config.bind_endpoint(spec),
            )
        return None
    if spec.secret_key_file is None:
        raise ConfigError(
            f"{config.source}: node {identity.name!r} has a public_key but no secret_key_file: it cannot prove who it is"
        )
    try:
        pair = key_pair(spec)
    except KeyFileError as exc:
        raise ConfigError(f"{config.source}: node {identity.name!r}: {exc}") from None
    return CurveKeys(public=pair.public, secret=pair.secret, allowed=allowed)
