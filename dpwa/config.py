"""Cluster configuration: YAML in, typed and immutable objects out.

Two YAML layouts load to the same :class:`Config`:

* the original list of one-key maps::

      ---
      - nodes:
        - {name: w1, host: localhost, port: 45000}
        - {name: w2, host: localhost, port: 45001}
      - fetch_probability: 1
      - timeout_ms: 2500
      - interpolation: constant
      - constant: { value: 0.5 }

* a plain mapping with the same keys.

Everything is checked here, once, before any socket is opened. Every error is a
:class:`ConfigError` that names the file, the key and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from .mixing import codecs, rules
from .mixing.outer import OUTER_RULES
from .mixing.pairing import PAIRINGS
from .wire.curve import valid_public_key
from .wire.endpoints import BindError, bind_address, ipc_endpoint, is_loopback
from .wire.relaying import parse_ports

__all__ = [
    "Config",
    "ConfigError",
    "ConstantOptions",
    "NodeSpec",
    "INTERPOLATIONS",
    "load_config",
    "parse_config",
    "read_config_data",
]

INTERPOLATIONS = ("constant", "clock", "loss")
WIRE_DTYPES = codecs.names()  # the wire codecs, one module each in dpwa.mixing.codecs
OUTERS = ("none", *OUTER_RULES)  # the named outer steps are listed once, in dpwa.mixing.outer
PRESETS = ("none", "low_bandwidth", "original")
# What a preset sets, for the keys the file does not give itself (docs/configuration.md#presets).
PRESET_SETTINGS: dict[str, dict[str, Any]] = {
    "low_bandwidth": {"period": 8, "outer": "none", "wire_dtype": "int8"},
    "original": {"mode": "pull", "rule": "state", "pairing": "random"},
}
SAME_HOST_MODES = ("auto", "off")
SNAPSHOT_SLOTS = (1, 2)  # snapshot_slots: the most a node publishes into (docs/design.md#memory)
BULK_MODES = ("auto", "off")
MODES = ("pull", "symmetric")
JOINS = ("auto", "never")
BROKEN_RULE = ("raise", "alone")  # what a node does once a rule of its own broke (dpwa.gossip.exchange.guard)

BULK_HELP = (
    "`auto`: over TCP, snapshots of 4 MiB or more (a fetch's; in mode symmetric, both of an exchange's) stream "
    "over raw TCP from an extra port each node picks free: "
    "plain with `insecure: true`, sealed per transfer with CURVE keys ([the bulk path](design.md#large-snapshots-"
    "over-raw-tcp-the-bulk-path)); `off`: everything over the node's one port"
)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class ConfigError(ValueError):
    """A configuration file or value is invalid. The message says where and why."""


# --------------------------------------------------------------------------- the key table
#
# Every key is declared once, as a field of Config below: its default, how it is checked and what it means.
# Parsing, to_mapping, describe and the table in docs/configuration.md (key_table) are all derived from it.


Check = Callable[[Any, str, str], Any]  # (value as written, key, source) -> the value to keep; ConfigError if bad


@dataclass(frozen=True)
class Setting:
    """How one top-level key is checked and documented."""

    check: Check
    help: str  # one markdown cell: what the key does (docs/configuration.md)
    shown: str | None = None  # the default as the docs show it (None: from the field's default)


def setting(default: Any, check: Check, help: str, *, shown: str | None = None) -> Any:
    """A Config field that is a top-level key of the file."""
    meta = {"setting": Setting(check, help, shown)}
    if isinstance(default, (str, int, float, bool)):
        return field(default=default, metadata=meta)
    return field(default_factory=default, metadata=meta)


def _expected_number(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"a number in [{lo:g}, {hi:g}]"
    if lo is not None:
        return f"a number >= {lo:g}"
    return "a number"


def number(lo: float | None = None, hi: float | None = None) -> Check:
    def check(value: Any, key: str, source: str) -> float:
        if not (_is_number(value) and (lo is None or value >= lo) and (hi is None or value <= hi)):
            raise ConfigError(f"{source}: {key} must be {_expected_number(lo, hi)}, got {value!r}")
        return float(value)

    return check


def positive_int() -> Check:
    def check(value: Any, key: str, source: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
        return value

    return check


def slot_count() -> Check:
    def check(value: Any, key: str, source: str) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value in SNAPSHOT_SLOTS:
            return value
        raise ConfigError(f"{source}: {key} must be 1 or 2, got {value!r}")

    return check


def port_or_zero() -> Check:
    def check(value: Any, key: str, source: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
            raise ConfigError(f"{source}: {key} must be a TCP port in 1..65535, or 0 for none, got {value!r}")
        return value

    return check


def _port_range(value: Any, key: str, source: str) -> str:
    try:
        parse_ports(str(value))
    except ValueError as exc:
        raise ConfigError(f"{source}: {key} {exc}") from None
    return str(value).strip()


def flag() -> Check:
    def check(value: Any, key: str, source: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
        return value

    return check


def one_of(choices: tuple[str, ...]) -> Check:
    def check(value: Any, key: str, source: str) -> str:
        if value is False and "off" in choices:  # YAML reads a bare `off` as false
            return "off"
        if value not in choices:
            raise ConfigError(
                f"{source}: {key} must be one of {', '.join(choices)}, got {value!r}" + _suggest(str(value), choices)
            )
        return str(value)

    return check


def _constant_options(value: Any, key: str, source: str) -> ConstantOptions:
    if value == 0:
        return ConstantOptions()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: constant must be a map like {{value: 0.5}}, got {value!r}")
    _reject_unknown(value, _CONSTANT_KEYS, source, where="constant.")
    raw = value.get("value")
    return ConstantOptions() if raw is None else ConstantOptions(value=number(0.0, 1.0)(raw, "constant.value", source))


def _rule(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {key} must be a rule's name or module.path:ClassName, got {value!r}")
    try:
        rules.rule_class(value)  # imported now: a rule that cannot be used fails at load, named
    except rules.RuleError as exc:
        raise ConfigError(f"{source}: {key}: {exc}") from None
    return value


def _options(example: str) -> Callable[[Any, str, str], tuple[tuple[str, Any], ...]]:
    """A check for a map of settings (rule_options, wire_options); the rule or codec checks each value."""

    def check(value: Any, key: str, source: str) -> tuple[tuple[str, Any], ...]:
        if value == 0 or value == {}:
            return ()
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{source}: {key} must be a map of settings, like {example}, got {value!r}")
        return tuple(sorted(value.items()))

    return check


BOOTSTRAP_MAX = 64  # bootstrap addresses a config may list
_OPEN_KEYS = ("bootstrap_alone", "cluster_key", "members_max", "suspect_after_ms", "dead_after_ms")  # only bootstrap
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def valid_host(host: str) -> bool:
    """Is `host` an IP address (v4, or v6 with or without brackets) or a well-formed host name? A string of
    numbers and dots must be an IPv4 address: ``127.0.0.999`` is a typo, not a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if all(label.isdigit() for label in labels):
        return False
    return len(host) <= 253 and all(_HOST_LABEL.match(label) for label in labels)


_HOST_PORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})$")


def split_host_port(entry: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``) as (host, port), or None if it is not one (the port must be in 1..65535)."""
    match = _HOST_PORT_RE.match(entry)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        return None
    return match.group(1).strip("[]"), int(match.group(2))


def _bootstrap(value: Any, key: str, source: str) -> tuple[str, ...]:
    """At most BOOTSTRAP_MAX addresses, each ``host:port``, none twice; in a keyed cluster each with the
    node's public key: ``{address: HOST:PORT, public_key: KEY}``, kept as ``"HOST:PORT KEY"``."""
    return _addresses(value, key, source, what="node")


def _addresses(value: Any, key: str, source: str, *, what: str) -> tuple[str, ...]:
    """:func:`_bootstrap`'s check, for addresses of any kind of node (`what`, in messages)."""
    if not isinstance(value, (list, tuple)) or not value or len(value) > BOOTSTRAP_MAX:
        raise ConfigError(
            f"{source}: {key} must be a list of 1 to {BOOTSTRAP_MAX} addresses like 'localhost:45000', got {value!r:.120}"
        )
    seen: set[str] = set()
    out = []
    for index, entry in enumerate(value):
        where = f"{source}: {key}[{index}]"
        if isinstance(entry, Mapping):
            _reject_unknown(entry, ("address", "public_key"), source, where=f"{key}[{index}].")
            address, public_key = entry.get("address"), entry.get("public_key")
        elif isinstance(entry, str):
            address, _, public_key = entry.strip().partition(" ")
            public_key = public_key.strip() or None
        else:
            address = public_key = None
        if not isinstance(address, str) or split_host_port(address.strip()) is None:
            raise ConfigError(
                f"{where} must be HOST:PORT (a host name, an IPv4 address or [an IPv6 one], and a port in "
                f"1..65535), or {{address: HOST:PORT, public_key: KEY}} in a cluster with keys, got {entry!r:.80}"
            )
        if public_key is not None and not valid_public_key(public_key):
            raise ConfigError(
                f"{where}.public_key must be the {what}'s 40-character Z85 CURVE public key, got {public_key!r:.60}"
            )
        address = address.strip()
        if address.lower() in seen:
            raise ConfigError(f"{where} {address!r} is listed twice")
        seen.add(address.lower())
        out.append(f"{address} {public_key}" if public_key else address)
    return tuple(out)


def _path(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: {key} must be a path, got {value!r:.80}")
    return value.strip()


def _interface(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{source}: interface must be auto, an address or an interface name, got {value!r}")
    return value.strip()


@dataclass(frozen=True)
class NodeSpec:
    """One node of the cluster."""

    name: str  # unique; used in logs, metrics and file names
    host: str  # where peers connect to this node
    port: int  # TCP port the node's Rx thread listens on
    bind: str | None = None  # address, interface name or host name to bind; None binds `host`; "*" every interface
    public_key: str | None = None  # Z85 CURVE public key; set on every node or on none
    secret_key_file: str | None = None  # where this node finds its secret key (absolute path)
    cert_file: str | None = None  # with bootstrap and keys: this node's member certificate (absolute path)
    reachable: bool = True  # False: nobody can dial it; peers reach it through a relay (`relays`)

    @property
    def tcp_endpoint(self) -> str:
        """The TCP address peers connect to, as a ZeroMQ endpoint."""
        return f"tcp://{_bracket(self.host)}:{self.port}"

    @property
    def tcp_bind_endpoint(self) -> str:
        """The TCP address this node binds, as a ZeroMQ endpoint."""
        return f"tcp://{_bracket(self.bind or self.host)}:{self.port}"

    @property
    def loopback(self) -> bool:
        """True if only this machine can reach the node (its host and bind address are loopback)."""
        return is_loopback(self.host) and is_loopback(self.bind or self.host)


@dataclass(frozen=True)
class ConstantOptions:
    """Options of the constant interpolation."""

    value: float = 0.5  # f in params = f * peer + (1 - f) * params


@dataclass(frozen=True)
class Config:
    """A validated cluster configuration. Build it with :func:`load_config`."""

    nodes: tuple[NodeSpec, ...]  # every node of the cluster, this one included (its own parser: _parse_nodes)
    fetch_probability: float = setting(
        1.0,
        number(0.0, 1.0),
        "chance, in [0, 1], that an `update_send` starts an exchange (mode pull: a fetch; mode symmetric: an "
        "exchange request, in the steps its [pairing](design.md#pairing) lets it start one)",
        shown="1",
    )
    timeout_ms: int = setting(
        2500,
        positive_int(),
        "the least time a request (a fetch, or an exchange with its confirm) is given, in ms (positive integer). "
        "Each peer's deadline follows its link: a smoothed request time plus four times its variation, never below "
        "`timeout_ms` and never above 4 × `timeout_ms`, doubled after a timeout "
        "([Deadlines that follow the link](#deadlines-that-follow-the-link)); `update_wait` waits at most that "
        "long. A timeout lowers the peer's score",
    )
    interpolation: str = setting(
        "constant",
        one_of(INTERPOLATIONS),
        "how `f` is chosen: `constant`, `clock` or `loss` ([Interpolation](#interpolation))",
    )
    divergence_threshold: float = setting(
        0.0,
        number(0.0),
        "when > 0 and this node's loss is below it, `f` is scaled by `loss / threshold`; 0 disables",
        shown="0",
    )
    constant: ConstantOptions = setting(
        ConstantOptions, _constant_options, "`value` in [0, 1]: `f` for constant interpolation", shown="{value: 0.5}"
    )
    mode: str = setting(
        "symmetric",
        one_of(MODES),
        "`symmetric`: both sides of an exchange move, and the mean of all nodes is kept; `pull`: only the requester "
        "moves (the original's) ([Mixing modes](design.md#mixing-modes))",
    )
    rule: str = setting(
        "delta",
        _rule,
        "the mixing rule: "
        + "; ".join(f"`{name}`: {cls.summary}" for name, cls in sorted(rules.builtin().items()))
        + "; or `module.path:ClassName`, a rule of your own, imported when the config loads "
        "([Writing a rule](rules.md)). `blend` is its older name",
    )
    rule_options: tuple[tuple[str, Any], ...] = setting(
        tuple,
        _options("{radius: 1.0}"),
        "the rule's own settings, a map checked by the rule: "
        + "; ".join(
            f"`{name}`: " + ", ".join(f"`{key}` ({option.help})" for key, option in cls.options.items())
            for name, cls in sorted(rules.builtin().items())
            if cls.options
        ),
        shown="{}",
    )
    broken_rule: str = setting(
        "raise",
        one_of(BROKEN_RULE),
        "what a node does when a rule of your own breaks: raises, returns other than one finite weight, or writes "
        "NaN, Inf or a value beyond 1e18 into the model. Either way the model is set back to the snapshot that "
        "half started from, nothing broken is published, and the node closes its gossip. `raise`: the call that "
        "ran the rule (`update_wait`, mostly) raises the error, naming the rule and its file; `alone`: the node "
        "logs it and trains on alone "
        "([A broken rule](rules.md#a-broken-rule))",
    )
    wire_dtype: str = setting(
        "auto",
        one_of(("auto", *WIRE_DTYPES)),
        "the wire codec. `auto`: the model's own dtype when every tensor it blends is float16 or every one "
        "bfloat16 (no float32 copy of a half-precision model, and nothing lost), else float32. "
        "`float32`, `float16` or `bfloat16`: parameters travel (and snapshots are kept) in this "
        "dtype; `int8`: they travel as blocks of 1,024 signed bytes with a float32 scale each (3.98 times fewer "
        "bytes than float32), and what rounding leaves out is sent with the next snapshot (error feedback); "
        "`topk` (mode pull): the largest 5% (`wire_options`) of the change since what the requester holds, as "
        "index and value (10 times fewer bytes; the rest follows later: CHOCO-SGD, docs/rules.md#codecs); "
        "blending is float32",
    )
    wire_options: tuple[tuple[str, Any], ...] = setting(
        tuple,
        _options("{fraction: 0.05}"),
        "the wire codec's own settings, a map checked by the codec: "
        + "; ".join(
            f"`{name}`: " + ", ".join(f"`{key}` ({option.help})" for key, option in cls.options.items())
            for name, cls in codecs.builtin().items()
            if cls.options
        ),
        shown="{}",
    )
    same_host: str = setting(
        "auto",
        one_of(SAME_HOST_MODES),
        "`auto`: peers on this machine exchange parameters through shared memory; `off`: over the socket for everyone",
    )
    snapshot_slots: int = setting(
        2,
        slot_count(),
        "snapshot slots a node publishes into, each a copy of the model ([Memory](design.md#memory)); `1` saves "
        "a copy, but while a reader holds the slot the node's publishes are skipped and its peers get an older "
        "snapshot (in mode symmetric over TCP, fewer exchanges)",
    )
    max_peer_distance: float = setting(
        0.0,
        number(0.0),
        "when > 0, reject a peer whose parameters are farther than this from ours, as `‖peer − ours‖ / ‖ours‖`; "
        "0 disables",
        shown="0",
    )
    insecure: bool = setting(
        False,
        flag(),
        "`true`: serve plain TCP without keys, so anyone who reaches a port can talk to the node "
        "([Security](security.md)); logged at start",
    )
    pairing: str = setting(
        "auto",
        one_of(PAIRINGS),
        "whom an exchange goes to: `random`, a peer drawn by flow-control score (in mode symmetric a node starts "
        "an exchange in half its steps, by a coin, and serves in the others); `hypercube`, node i (in config order) pairs with i XOR 2^(t mod log2 n) at "
        "its t-th exchange, for a power of two of nodes (a partner that cannot be reached: a peer by score); "
        "`auto`: `hypercube` for 2, 4, 8, ... nodes, else `random` ([Pairing](design.md#pairing))",
    )
    bulk: str = setting(
        "auto",
        one_of(BULK_MODES),
        BULK_HELP,
    )
    period: int = setting(
        1,
        positive_int(),
        "start an exchange every `period` steps (`update_send` calls) instead of every step; a failed one is "
        "tried again at the next step",
    )
    outer: str = setting(
        "none",
        one_of(OUTERS),
        "after each blend, an outer step on the pseudo-gradient (the parameters at the last exchange minus now): "
        "`none`; `nesterov` (DiLoCo's); `noloco` (NoLoCo's: momentum on the pair's mean, which also pulls the "
        "node toward its peer) ([Outer steps](design.md#local-steps-and-an-outer-step))",
    )
    outer_lr: float = setting(0.7, number(1e-6, 10.0), "the outer step's learning rate, in (0, 10]")
    outer_momentum: float = setting(0.9, number(0.0, 0.999), "the outer step's momentum, in [0, 0.999]")
    preset: str = setting(
        "none",
        one_of(PRESETS),
        "`low_bandwidth`: `period: 8`, `outer: none`, `wire_dtype: int8`; `original`: the 2017 rule, `mode: pull`, "
        "`rule: state`, `pairing: random`; each for the keys the file does not set itself ([Presets](#presets))",
    )
    join: str = setting(
        "auto",
        one_of(JOINS),
        "`auto`: a node that starts late or again takes the cluster's state from a peer before its constructor "
        "returns, and at a fresh start every node takes the first node's initial parameters; `never`: keep the "
        "state given ([Joining and rejoining](operations.md#joining-and-rejoining))",
    )
    bootstrap: tuple[str, ...] = setting(
        tuple,
        _bootstrap,
        "open membership: up to 64 `host:port` addresses of nodes (any one may answer) through which this node "
        "joins the cluster; `nodes` then lists this node (and maybe others: its first view), and `pairing: auto` "
        "is `random`. With keys each entry is `{address: HOST:PORT, public_key: KEY}`, and `cluster_key` and the "
        "node's `cert_file` are needed. Refused with `nodes: torchrun`, `pairing: hypercube` and `wire_dtype: "
        "topk` ([Joining through a bootstrap address](operations.md#joining-through-a-bootstrap-address))",
        shown="none",
    )
    cluster_key: str = setting(
        "",
        _path,
        "with `bootstrap` and keys: the cluster's public key file (`python -m dpwa keygen --cluster-key`), whose "
        "signature on a member's certificate admits it ([Who may join a keyed "
        "cluster](security.md#who-may-join-a-keyed-cluster)); relative to the config's folder",
        shown="none",
    )
    bootstrap_alone: bool = setting(
        True,
        flag(),
        "with `bootstrap`: when no address answers (3 rounds, `timeout_ms` each), `true` starts alone, the first "
        "node others join (logged); `false` raises",
    )
    members_max: int = setting(
        1024,
        positive_int(),
        "with `bootstrap`: the most members a node's view holds, itself included; newcomers beyond it are refused",
    )
    suspect_after_ms: int = setting(
        5000,
        positive_int(),
        "with `bootstrap`: a member not heard from (directly, or by its heartbeat in a peer's digest) for this "
        "long is suspect",
    )
    dead_after_ms: int = setting(
        10000,
        positive_int(),
        "with `bootstrap`: a member suspect for this long is removed (it is admitted again if it comes back)",
    )
    relays: tuple[str, ...] = setting(
        tuple,
        functools.partial(_addresses, what="relay"),
        "for a node with `reachable: false`: up to 64 `host:port` addresses of relays (another node's "
        "`relay_port`), asked in order until one gives this node a port there; peers reach the node at that "
        "port. With keys each entry is `{address: HOST:PORT, public_key: KEY}` (the relay node's key) "
        "([Nodes nobody can dial](operations.md#nodes-nobody-can-dial))",
        shown="none",
    )
    relay_port: int = setting(
        0,
        port_or_zero(),
        "the TCP port where this node relays for members that nobody can dial (`0`: it relays for none); each "
        "relayed member gets a port of `relay_ports`, and peers' connections to it are spliced, unread, to the "
        "member's own connection out",
    )
    relay_ports: str = setting(
        "",
        _port_range,
        "with `relay_port`: the ports relayed members get, `FIRST-LAST`, one each (default: the 8 after "
        "`relay_port`); so at most that many members are relayed here",
        shown="relay_port+1 to +8",
    )
    relay_streams_max: int = setting(
        32, positive_int(), "with `relay_port`: the connections relayed at once for one member (more are closed)"
    )
    relay_mbit: float = setting(
        100.0,
        number(0.0, 1e6),
        "with `relay_port`: what one relayed member's connections may move together, in Mbit/s (`0`: no bound)",
    )
    interface: str = setting(
        "auto",
        _interface,
        "with `nodes: torchrun`: the address peers reach a worker at (`auto`: the route to torchrun's store; an "
        "address; or an interface name)",
    )
    torchrun: bool = (
        False  # `nodes: torchrun`: the node list comes from torchrun's rendezvous (dpwa.gossip.membership.rendezvous)
    )
    source: str = "<config>"  # where this configuration came from, for messages

    @property
    def secure(self) -> bool:
        """True when the nodes authenticate and encrypt with CURVE (every node lists a public key).

        A torchrun config is: its nodes make their keys at start and swap them through the store."""
        return self.torchrun or self.nodes[0].public_key is not None

    @property
    def relay_port_range(self) -> range:
        """The ports this node gives the members it relays for (``relay_ports``, or the 8 after ``relay_port``)."""
        if self.relay_ports:
            return parse_ports(self.relay_ports)
        return range(self.relay_port + 1, min(self.relay_port + 9, 65536)) if self.relay_port else range(0)

    @property
    def relay_addresses(self) -> tuple[tuple[str, int, str | None], ...]:
        """``relays`` as (host, port, public key or None)."""
        out = []
        for entry in self.relays:
            address, _, key = entry.partition(" ")
            host_port = split_host_port(address)
            assert host_port is not None  # checked at load
            out.append((host_port[0], host_port[1], key or None))
        return tuple(out)

    @property
    def resolved(self) -> bool:
        """False for a ``nodes: torchrun`` config before the rendezvous filled in its nodes."""
        return bool(self.nodes)

    @property
    def bootstrap_specs(self) -> tuple[NodeSpec, ...]:
        """The bootstrap addresses as node entries (named ``@0``, ``@1``, ...: no node's name has an ``@``)."""
        out = []
        for index, entry in enumerate(self.bootstrap):
            address, _, key = entry.partition(" ")
            host_port = split_host_port(address)
            assert host_port is not None  # checked at load
            out.append(NodeSpec(name=f"@{index}", host=host_port[0], port=host_port[1], public_key=key or None))
        return tuple(out)

    def bootstrap_for(self, name: str) -> list[NodeSpec]:
        """The bootstrap addresses node `name` asks: all but its own (the first node may list itself)."""
        own = self.endpoint(self.node(name))
        return [spec for spec in self.bootstrap_specs if self.endpoint(spec) != own]

    @functools.cached_property
    def transport(self) -> str:
        """``ipc`` for a cluster on loopback addresses without keys (only this user can connect), else ``tcp``
        (with ``bootstrap``, its addresses count too). Worked out once per config: it resolves every node's
        host, and :meth:`endpoint` asks it for each node (700 nodes once took a minute to start)."""
        specs = (*self.nodes, *self.bootstrap_specs)
        if self.secure or self.insecure or not self.nodes or not all(spec.loopback for spec in specs):
            return "tcp"
        return "ipc"

    def endpoint(self, spec: NodeSpec) -> str:
        """Where peers connect to node `spec`."""
        return ipc_endpoint(spec.port) if self.transport == "ipc" else spec.tcp_endpoint

    def bind_endpoint(self, spec: NodeSpec, address: str | None = None) -> str:
        """Where node `spec` listens (over TCP: at `address`, else at :meth:`bind_address`)."""
        if self.transport == "ipc":
            return ipc_endpoint(spec.port)
        return f"tcp://{_bracket(address or self.bind_address(spec))}:{spec.port}"

    def bind_address(self, spec: NodeSpec) -> str:
        """The numeric address node `spec` binds over TCP, with every listener it has (ZeroMQ, bulk).

        Its ``bind`` (else its ``host``), resolved on this machine, where the node runs: an interface
        name becomes its IPv4 address, a host name its address. The config is shared by every machine,
        so this is never done at load time for other nodes. ConfigError if it cannot be bound here.
        """
        key = "bind" if spec.bind is not None else "host"
        value = spec.bind if spec.bind is not None else spec.host
        try:
            return bind_address(value)
        except BindError as exc:
            index = next((i for i, other in enumerate(self.nodes) if other.name == spec.name), "?")
            raise ConfigError(
                f"{self.source}: nodes[{index}].{key} is {value!r}: {exc}. Expected an address of this machine, "
                "'*', an interface name with an IPv4 address, or a host name"
            ) from None

    @property
    def timeout_s(self) -> float:
        """timeout_ms in seconds: the unit used inside the code."""
        return self.timeout_ms / 1000.0

    def node(self, name: str) -> NodeSpec:
        """The node called `name`, or a ConfigError listing the known names."""
        if not self.resolved:
            raise ConfigError(f"{self.source}: nodes: torchrun: the nodes are known only once torchrun's workers meet")
        for spec in self.nodes:
            if spec.name == name:
                return spec
        known = ", ".join(spec.name for spec in self.nodes)
        raise ConfigError(
            f"{self.source}: no node named {name!r} in 'nodes' (known: {known})"
            + _suggest(name, [spec.name for spec in self.nodes])
        )

    def peers_of(self, name: str) -> tuple[NodeSpec, ...]:
        """Every node but `name`."""
        self.node(name)
        return tuple(spec for spec in self.nodes if spec.name != name)

    def wire_of(self, natural: str) -> str:
        """The wire codec for a model whose own wire dtype is `natural` (FlatParams.natural_wire)."""
        return natural if self.wire_dtype == "auto" else self.wire_dtype

    def to_mapping(self) -> dict[str, Any]:
        """Every setting as plain data that :func:`parse_config` reads back to an equal Config
        (secret key paths are absolute, so the mapping can be written anywhere)."""
        nodes: Any = [
            {key: value for key, value in dataclasses.asdict(node).items() if value is not None} for node in self.nodes
        ]
        if self.torchrun and not self.resolved:
            nodes = "torchrun"
        out: dict[str, Any] = {"nodes": nodes}
        for name, _ in settings():
            if name == "interface" and not (self.torchrun and not self.resolved):
                continue  # a key of torchrun configs only
            value = getattr(self, name)
            if name in ("rule_options", "wire_options"):
                value = dict(value)
            if name in ("bootstrap", "relays"):
                if not value:
                    continue  # no open membership (no relays): the key is absent
                value = list(value)
            if name in ("cluster_key", "relay_ports") and not value:
                continue
            out[name] = {"value": value.value} if isinstance(value, ConstantOptions) else value
        return out

    def describe(self) -> str:
        """One line with every resolved setting, for the start-up log."""
        nodes = ", ".join(f"{n.name}@{n.host}:{n.port}" for n in self.nodes) or "torchrun"
        values = []
        for name, _ in settings():
            value = getattr(self, name)
            values.append(f"constant.value={value.value}" if isinstance(value, ConstantOptions) else f"{name}={value}")
        return f"nodes=[{nodes}] {' '.join(values)} transport={self.transport} curve={'on' if self.secure else 'off'}"


def settings() -> Iterator[tuple[str, Setting]]:
    """Every top-level key but `nodes`, in the order Config declares them, with how it is checked."""
    for spec in dataclasses.fields(Config):
        if "setting" in spec.metadata:
            yield spec.name, spec.metadata["setting"]


def _shown(spec: dataclasses.Field[Any], meta: Setting) -> str:
    if meta.shown is not None:
        return meta.shown
    default = spec.default
    return str(default).lower() if isinstance(default, bool) else str(default)


def key_table() -> str:
    """The table of every key for docs/configuration.md, made from Config's fields (a test checks the page has it)."""
    rows = [
        "| Key | Default | Meaning |",
        "|---|---|---|",
        "| `nodes` | required | list of `{name, host, port}` (`host`: an IP address or a host name; a typo such as "
        "`127.0.0.999` is refused); optional `bind` (address to listen on, default `host`; "
        '`"*"` for every interface; an interface name such as `eth0` is resolved to its address when the node starts). '
        "Names and `host:port` pairs must be unique. Or the string `torchrun`: the list comes from torchrun's "
        "rendezvous ([Multi-machine use](operations.md#with-torchrun)) |",
        "| `nodes[].public_key`, `nodes[].secret_key_file` | none | CURVE authentication and encryption: every node's "
        "public key, and where that node finds its secret key ([Security](security.md)); on every node or on none |",
        "| `nodes[].cert_file` | none | with `bootstrap` and keys: the node's member certificate (`python -m dpwa keygen "
        "NAME --sign-with cluster.secret` writes `NAME.cert`), checked at start and carried in its digest entries |",
        "| `nodes[].reachable` | `true` | `false`: nobody can dial this node (a home router, a firewall); with "
        "`bootstrap` and `relays`, peers reach it at a port a relay gives it ([Nodes nobody can "
        "dial](operations.md#nodes-nobody-can-dial)) |",
    ]
    by_name = {spec.name: spec for spec in dataclasses.fields(Config)}
    for name, meta in settings():
        rows.append(f"| `{name}` | `{_shown(by_name[name], meta)}` | {meta.help} |")
        if name == "constant":
            rows.append("| `clock`, `loss` | `0` | these methods take no options; `0` (or nothing) says so |")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- loading

_PLACEHOLDERS = ("clock", "loss")  # interpolations without options: accepted, checked, not kept
_NODE_KEYS = ("name", "host", "port", "bind", "public_key", "secret_key_file", "cert_file", "reachable")
_CONSTANT_KEYS = ("value",)
_OLD_NAMES = {"blend": "rule"}  # keys renamed: still read, under the new name


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML configuration file."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the configuration: {exc.strerror or exc}") from exc
    return parse_config(text, source=source)


def read_config_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's settings as one plain mapping (either layout), not yet validated."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the configuration: {exc.strerror or exc}") from exc
    return _flatten(_parse_yaml(text, source), source)


def parse_config(data: str | Mapping[str, Any] | list[Any], source: str = "<config>") -> Config:
    """Validate configuration given as YAML text or as already-parsed data."""
    if isinstance(data, str):
        data = _parse_yaml(data, source)
    raw = _flatten(data, source)
    known = ("nodes", *(name for name, _ in settings()), *_PLACEHOLDERS, *_OLD_NAMES)
    _reject_unknown(raw, known, source, where="")
    for old, new in _OLD_NAMES.items():
        if old in raw:
            if new in raw:
                raise ConfigError(f"{source}: {old} is the older name of {new}: give one of them")
            raw[new] = raw.pop(old)

    torchrun = raw.get("nodes") == "torchrun"
    nodes = () if torchrun else _parse_nodes(raw.get("nodes"), source, base_dir=_base_dir(source))
    if "interface" in raw and not torchrun:
        raise ConfigError(f"{source}: interface is for 'nodes: torchrun'; here each node's host says where it is")
    values = {name: meta.check(raw[name], name, source) for name, meta in settings() if raw.get(name) is not None}
    for key, value in PRESET_SETTINGS.get(values.get("preset", "none"), {}).items():
        values.setdefault(key, value)  # a key the file gives wins over its preset
    for key in _PLACEHOLDERS:
        _parse_no_options(raw, key, source)
    if values.get("cluster_key"):
        values["cluster_key"] = os.path.join(_base_dir(source), os.path.expanduser(values["cluster_key"]))
    config = Config(nodes=nodes, torchrun=torchrun, source=source, **values)
    rule = rules.rule_class(config.rule)
    try:
        rules.check_mode(rule, config.mode, rule.checked_options(dict(config.rule_options)))
    except rules.RuleError as exc:
        raise ConfigError(f"{source}: rule_options: {exc}") from None
    codec = codecs.codec_class(config.wire_of("float32"))  # auto: a plain dtype, whichever the model's
    try:
        codec.checked_options(dict(config.wire_options))
    except ValueError as exc:
        raise ConfigError(f"{source}: wire_options: {exc}") from None
    if config.mode not in codec.modes:
        raise ConfigError(
            f"{source}: wire_dtype: {config.wire_dtype} runs in mode {' or '.join(codec.modes)}, "
            f"not mode {config.mode} (docs/rules.md#codecs)"
        )
    if config.bootstrap:
        config = _checked_bootstrap(config)
    _check_relays(config)
    if config.pairing == "hypercube" and nodes and (len(nodes) < 2 or len(nodes) & (len(nodes) - 1)):
        raise ConfigError(
            f"{source}: pairing: hypercube needs a power of two of nodes (2, 4, 8, ...), got {len(nodes)}"
        )
    if config.insecure and torchrun:
        raise ConfigError(f"{source}: insecure cannot be used with nodes: torchrun, whose nodes make and swap keys")
    if not config.insecure and nodes and nodes[0].public_key is None:
        exposed = [spec for spec in nodes if not spec.loopback]
        if exposed:
            spec = exposed[0]
            raise ConfigError(
                f"{source}: node {spec.name!r} listens on {spec.bind or spec.host}, which other machines can "
                "reach, and the config has no CURVE keys: anyone who reaches the port could read and change "
                "the model. Add keys (python -m dpwa keygen --config FILE), or set 'insecure: true' on a "
                "network you trust"
            )
    return config


def _check_relays(config: Config) -> None:
    """A node nobody can dial needs open membership and relays; relaying runs over TCP only."""
    source = config.source
    hidden = [spec.name for spec in config.nodes if not spec.reachable]
    if hidden and not config.bootstrap:
        raise ConfigError(
            f"{source}: node {hidden[0]!r} has reachable: false, which needs bootstrap (open membership): its "
            "address, at a relay, reaches the others by gossip"
        )
    if hidden and not config.relays:
        raise ConfigError(
            f"{source}: node {hidden[0]!r} has reachable: false but relays lists no relay (another node's "
            "relay_port) through which peers reach it"
        )
    keyed = bool(config.nodes) and config.nodes[0].public_key is not None
    for entry in config.relays:
        address, _, key = entry.partition(" ")
        if keyed and not key:
            raise ConfigError(
                f"{source}: relays entry {address} has no public_key; in a cluster with keys a relay proves "
                "nothing without it: {address: HOST:PORT, public_key: KEY}"
            )
        if not keyed and key:
            raise ConfigError(f"{source}: relays entry {address} has a public_key, but the nodes have none")
    if (hidden or config.relay_port) and config.transport == "ipc":
        raise ConfigError(
            f"{source}: relays run over TCP, and this loopback cluster without keys talks over ipc sockets: add "
            "keys, or set insecure: true"
        )
    if config.relay_port and not config.bootstrap:
        raise ConfigError(
            f"{source}: relay_port is for open membership (bootstrap): the members it relays for are reached at "
            "its ports by gossip, and a fixed node list has no such members"
        )
    if config.relay_port and config.nodes and len(hidden) == len(config.nodes):
        raise ConfigError(
            f"{source}: relay_port on node {hidden[0]!r}, which has reachable: false: nobody could dial the relay"
        )
    if config.relays and not hidden:
        raise ConfigError(f"{source}: relays is for a node with reachable: false; this config's nodes can be dialled")
    if config.relay_ports and not config.relay_port:
        raise ConfigError(f"{source}: relay_ports is for a relay: set relay_port too")
    if config.relay_port and config.relay_port in config.relay_port_range:
        raise ConfigError(f"{source}: relay_ports must not include relay_port ({config.relay_port})")


def _checked_bootstrap(config: Config) -> Config:
    """Open membership's limits for now; ``pairing: auto`` resolved to ``random`` (no fixed indices)."""
    source = config.source
    if config.torchrun:
        raise ConfigError(
            f"{source}: bootstrap cannot be used with nodes: torchrun (elastic torchrun is not built yet)"
        )
    keyed = config.nodes[0].public_key is not None
    for spec in config.bootstrap_specs:
        if keyed and spec.public_key is None:
            raise ConfigError(
                f"{source}: bootstrap entry {spec.host}:{spec.port} has no public_key; in a cluster with keys a "
                "node is reached only with its key: {address: HOST:PORT, public_key: KEY}"
            )
        if not keyed and spec.public_key is not None:
            raise ConfigError(
                f"{source}: bootstrap entry {spec.host}:{spec.port} has a public_key, but the nodes have none "
                "(a cluster without keys)"
            )
    if keyed and not config.cluster_key:
        raise ConfigError(
            f"{source}: bootstrap with keys needs cluster_key: the cluster's public key file, whose signature "
            "on a member's certificate admits it (python -m dpwa keygen --cluster-key --dir DIR writes DIR/cluster.pub)"
        )
    if not keyed and config.cluster_key:
        raise ConfigError(
            f"{source}: cluster_key is for a cluster with keys (public_key on its nodes); these have none"
        )
    if config.pairing == "hypercube":
        raise ConfigError(
            f"{source}: pairing: hypercube needs fixed indices of a fixed node list, and with bootstrap members come "
            "and go; use pairing: random (or auto, which is random with bootstrap)"
        )
    if config.wire_dtype == "topk":
        raise ConfigError(
            f"{source}: wire_dtype: topk keeps a copy of each peer's model, sized for a fixed node list; with "
            "bootstrap use another wire_dtype"
        )
    if config.dead_after_ms < config.timeout_ms:
        raise ConfigError(
            f"{source}: dead_after_ms ({config.dead_after_ms}) must be at least timeout_ms ({config.timeout_ms}): "
            "a member would be removed before one request to it can time out"
        )
    if len(config.nodes) > config.members_max:
        raise ConfigError(
            f"{source}: nodes lists {len(config.nodes)} nodes, more than members_max ({config.members_max})"
        )
    return dataclasses.replace(config, pairing="random")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping", mark)
        seen[key] = loader.construct_object(value_node, deep=deep)
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{where}: not valid YAML: {problem}") from exc


def _flatten(data: Any, source: str) -> dict[str, Any]:
    """Turn either layout into one mapping, refusing keys given twice."""
    if data is None:
        raise ConfigError(f"{source}: the configuration is empty; expected at least a 'nodes' list")
    if isinstance(data, Mapping):
        items = list(data.items())
    elif isinstance(data, list):
        items = []
        for index, entry in enumerate(data):
            if not isinstance(entry, Mapping) or len(entry) != 1:
                raise ConfigError(
                    f"{source}: item {index + 1} of the top-level list must be a map with "
                    f"exactly one key (like '- timeout_ms: 2500'), got {entry!r}"
                )
            items.extend(entry.items())
    else:
        raise ConfigError(
            f"{source}: expected a mapping or a list of one-key maps at the top level, got {type(data).__name__}"
        )
    flat: dict[str, Any] = {}
    for key, value in items:
        if not isinstance(key, str):
            raise ConfigError(f"{source}: keys must be strings, got {key!r}")
        if key in flat:
            raise ConfigError(f"{source}: key {key!r} is given twice")
        flat[key] = value
    return flat


def _reject_unknown(raw: Mapping[str, Any], known: tuple[str, ...], source: str, where: str) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{source}: unknown key {where}{key!r}"
                + _suggest(str(key), known)
                + f" (known keys: {', '.join(known)})"
            )


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _base_dir(source: str) -> str:
    """Relative paths in a config file are relative to the file's directory."""
    if source.startswith("<"):
        return os.getcwd()
    return os.path.dirname(os.path.abspath(source))


def _parse_nodes(value: Any, source: str, base_dir: str) -> tuple[NodeSpec, ...]:
    if value is None:
        raise ConfigError(f"{source}: missing key 'nodes': expected a list of {{name, host, port}}")
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{source}: 'nodes' must be a non-empty list of {{name, host, port}}, got {value!r}")
    specs: list[NodeSpec] = []
    names: set[str] = set()
    addresses: dict[tuple[str, int], str] = {}
    for index, entry in enumerate(value):
        where = f"nodes[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{source}: {where} must be a map like {{name: w1, host: localhost, port: 45000}}, got {entry!r}"
            )
        _reject_unknown(entry, _NODE_KEYS, source, where=f"{where}.")
        for key in ("name", "host", "port"):
            if key not in entry:
                raise ConfigError(f"{source}: {where} is missing the key {key!r}")
        name, host, port, bind = entry["name"], entry["host"], entry["port"], entry.get("bind")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(
                f"{source}: {where}.name must be a non-empty string of letters, digits, '_', '.', '-', got {name!r}"
            )
        if not isinstance(host, str) or not host.strip():
            raise ConfigError(f"{source}: {where}.host must be a host name or address, got {host!r}")
        if not valid_host(host):
            raise ConfigError(
                f"{source}: {where}.host {host!r} is neither an IP address nor a host name (an IPv4 address is "
                "four numbers in 0..255, a name letters, digits and '-' between dots)"
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"{source}: {where}.port must be an integer in 1..65535, got {port!r}")
        if bind is not None and (not isinstance(bind, str) or not bind.strip()):
            raise ConfigError(f"{source}: {where}.bind must be an address or '*', got {bind!r}")
        public_key, secret_file = entry.get("public_key"), entry.get("secret_key_file")
        if public_key is not None and not valid_public_key(public_key):
            raise ConfigError(
                f"{source}: {where}.public_key must be a 40-character Z85 CURVE key "
                f"(from 'python -m dpwa keygen {name}'), got {str(public_key)[:60]!r}"
            )
        if secret_file is not None:
            if not isinstance(secret_file, str) or not secret_file.strip():
                raise ConfigError(f"{source}: {where}.secret_key_file must be a path, got {secret_file!r}")
            if public_key is None:
                raise ConfigError(f"{source}: {where} has a secret_key_file but no public_key")
            secret_file = os.path.join(base_dir, os.path.expanduser(secret_file))
        cert_file = entry.get("cert_file")
        if cert_file is not None:
            if not isinstance(cert_file, str) or not cert_file.strip():
                raise ConfigError(f"{source}: {where}.cert_file must be a path, got {cert_file!r}")
            if public_key is None:
                raise ConfigError(f"{source}: {where} has a cert_file but no public_key (a certificate is for a key)")
            cert_file = os.path.join(base_dir, os.path.expanduser(cert_file.strip()))
        reachable = entry.get("reachable", True)
        if not isinstance(reachable, bool):
            raise ConfigError(f"{source}: {where}.reachable must be true or false, got {reachable!r}")
        if name in names:
            raise ConfigError(f"{source}: {where}.name {name!r} is used by two nodes; names must be unique")
        address = (host.strip().lower(), port)
        if address in addresses:
            raise ConfigError(f"{source}: {where} uses {host}:{port}, which node {addresses[address]!r} already uses")
        names.add(name)
        addresses[address] = name
        specs.append(
            NodeSpec(
                name=name,
                host=host.strip(),
                port=port,
                bind=bind.strip() if bind else None,
                public_key=public_key,
                secret_key_file=secret_file,
                cert_file=cert_file,
                reachable=reachable,
            )
        )
    keyed = [spec.name for spec in specs if spec.public_key is not None]
    if keyed and len(keyed) != len(specs):
        missing = [spec.name for spec in specs if spec.public_key is None]
        raise ConfigError(
            f"{source}: CURVE needs a public_key on every node or on none; missing on {', '.join(missing)}"
        )
    return tuple(specs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse_no_options(raw: Mapping[str, Any], key: str, source: str) -> None:
    value = raw.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)) or value == {}:
        return
    raise ConfigError(f"{source}: {key} interpolation takes no options; write '{key}: 0', got {value!r}")


def _bracket(host: str) -> str:
    """IPv6 literals go in brackets inside an endpoint."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def pointless_settings(config: Config) -> list[str]:
    """Settings that are legal but make averaging do nothing, each with the reason."""
    notes = []
    if len(config.nodes) == 1 and not config.bootstrap:
        notes.append(f"{config.source}: only one node is configured, so this node never averages")
    elif config.fetch_probability == 0:
        notes.append(
            f"{config.source}: fetch_probability is 0 with {len(config.nodes)} nodes: "
            "no node ever starts an exchange, so the nodes train independently"
        )
    if not config.bootstrap:
        defaults = {f.name: f.default for f in dataclasses.fields(Config)}
        unused = [key for key in _OPEN_KEYS if getattr(config, key) != defaults[key]]
        if unused:
            notes.append(
                f"{config.source}: {', '.join(unused)} apply only with bootstrap (open membership); unused here"
            )
    if config.mode == "symmetric" and config.rule == "state":
        notes.append(
            f"{config.source}: mode symmetric with rule state keeps the nodes' mean only when nothing "
            "trains between update_send and update_wait; use rule: delta to keep it while training"
        )
    if config.interpolation == "constant" and config.constant.value == 0:
        notes.append(
            f"{config.source}: constant.value is 0: every exchange blends with weight 0, "
            "so peers' parameters are never used"
        )
    return notes
