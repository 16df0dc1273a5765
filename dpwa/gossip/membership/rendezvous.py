"""``nodes: torchrun``: the node list comes from torchrun's rendezvous, not from the config file.

torchrun (``torch.distributed.run``) starts the workers, gives each ``RANK``,
``WORLD_SIZE`` and the address of its store (``MASTER_ADDR``, ``MASTER_PORT``),
and restarts them on failure. A dpwa worker of a ``nodes: torchrun`` config,
before its node starts:

1. picks the address its peers reach it at (``interface: auto``: the address
   this machine reaches the store from; or an address, or an interface name)
   and a free TCP port on it;
2. makes a CURVE key pair in memory (the secret never touches a disk);
3. publishes ``{name, host, port, public_key}`` in torchrun's store, under a
   prefix of this run and this restart round (a restarted group meets anew);
4. waits, within a deadline, until all ``WORLD_SIZE`` workers have published;
5. starts with that node list: every connection encrypted and authenticated
   with the keys just swapped;
6. once it has joined (taken rank 0's initial parameters) and published its
   own, arrives at a start barrier in the store (:meth:`Rendezvous.start_barrier`):
   like DDP's constructor, the node's returns on every rank once every rank
   holds the same initial state, so nobody trains alone because it started first.

Names default to ``rank<RANK>``. The store, the rendezvous and process
supervision all remain torchrun's. Trusting the store is trusting the
cluster: whoever can write to it can publish a key and join.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from ...config import Config, ConfigError, NodeSpec, parse_config
from ...wire.curve import KeyPair, valid_public_key

__all__ = ["Rendezvous", "StartTimeout", "TorchrunEnv", "advertised_address", "rendezvous"]

STORE_TIMEOUT_S = 300.0  # how long a worker waits for the others to publish


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells a worker, from the environment."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, source: str = "<config>") -> TorchrunEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ConfigError(
                f"{source}: nodes: torchrun, but {', '.join(missing)} is not set: start the workers with torchrun "
                "(e.g. torchrun --standalone --nproc-per-node 4 train.py ...); accelerate launch --cpu starts one "
                "process, and on a CPU machine accelerate launch --multi_gpu --num_processes 2 train.py starts two"
            )
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            port = int(env["MASTER_PORT"])
        except ValueError:
            raise ConfigError(f"{source}: RANK, WORLD_SIZE and MASTER_PORT must be integers") from None
        if not 0 <= rank < world or not 1 <= port <= 65535:
            raise ConfigError(f"{source}: RANK {rank} of WORLD_SIZE {world}, MASTER_PORT {port}: out of range")
        return cls(
            rank=rank,
            world_size=world,
            master_addr=env["MASTER_ADDR"],
            master_port=port,
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        )

    @property
    def name(self) -> str:
        return f"rank{self.rank}"


def advertised_address(interface: str, master_addr: str, master_port: int) -> str:
    """The address peers reach this worker at.

    ``auto``: the local address of the route to the store (loopback when the
    store is on loopback); an IP address: that address; else an interface
    name, whose IPv4 address is read from the kernel.
    """
    if interface == "auto":
        infos = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: no packet is sent; the kernel only picks the route
            return str(probe.getsockname()[0])
    try:
        ipaddress.ip_address(interface)
        return interface
    except ValueError:
        pass
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            raise ConfigError(f"interface {interface!r}: no IPv4 address ({exc.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def _reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port on `host`, held (not listening) until every worker has published its own:
    while it is held, the kernel hands that port to no other worker of this host (a port drawn and let go at
    once could be drawn again by the next; CI saw two ranks publish the same one)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
    except OSError as exc:
        s.close()
        raise ConfigError(f"cannot bind a port on {host} ({exc.strerror}): is it an address of this machine?") from None
    return s


class StartTimeout(TimeoutError):
    """Ranks did not reach the start barrier in time; `missing` names them."""

    def __init__(self, missing: list[str], timeout_s: float) -> None:
        super().__init__(
            f"{len(missing)} worker(s) did not reach the start barrier within {timeout_s:.0f} s: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} (did they fail to join, or crash?)"
        )
        self.missing = missing


@dataclass(frozen=True)
class Rendezvous:
    """What the rendezvous gives a worker: the whole config, its name, its key pair (in memory)."""

    config: Config
    name: str
    keys: KeyPair
    env: TorchrunEnv
    store: Any = field(default=None, repr=False, compare=False)  # this round's prefix of torchrun's store

    def start_barrier(self, timeout_s: float = STORE_TIMEOUT_S) -> None:
        """Say this rank is ready to train; wait until every rank of this round is (StartTimeout if not)."""
        if self.store is None:
            return
        self.store.set(f"started/{self.env.rank}", "1")
        keys = [f"started/{rank}" for rank in range(self.env.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception:
            missing = [f"rank{k.split('/')[1]}" for k in keys if not self.store.check([k])]
            raise StartTimeout(missing, timeout_s) from None


def rendezvous(
    config: Config, timeout_s: float = STORE_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> Rendezvous:
    """Meet the other workers through torchrun's store; returns the config with every node filled in."""
    import torch.distributed as dist

    env = TorchrunEnv.from_environ(environ, config.source)
    host = advertised_address(config.interface, env.master_addr, env.master_port)
    with _reserve_port(host) as reserved:  # let go once every worker has published: the node binds it next
        port = int(reserved.getsockname()[1])
        public, secret = zmq.curve_keypair()
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
        except Exception as exc:  # torch raises RuntimeError (or DistStoreError) with the reason
            raise ConfigError(
                f"{config.source}: cannot reach torchrun's store at {env.master_addr}:{env.master_port}: {exc}"
            ) from None
        prefix = dist.PrefixStore(f"dpwa/{env.run_id}/{env.restart_count}/", store)
        entry = {"name": env.name, "host": host, "port": port, "public_key": public.decode()}
        prefix.set(f"node/{env.rank}", json.dumps(entry))
        keys = [f"node/{rank}" for rank in range(env.world_size)]
        try:
            prefix.wait(keys, timeout)
        except Exception:
            missing = [k for k in keys if not prefix.check([k])]
            raise ConfigError(
                f"{config.source}: {len(missing)} of {env.world_size} workers did not publish their endpoint within "
                f"{timeout_s:.0f} s ({', '.join(k.split('/')[1] for k in missing[:8])} ...)"
            ) from None
    nodes = []
    for rank, key in enumerate(keys):
        try:
            published = json.loads(prefix.get(key))
        except ValueError:
            raise ConfigError(f"{config.source}: rank {rank} published an unreadable entry in the store") from None
        if not (isinstance(published, dict) and valid_public_key(published.get("public_key"))):
            raise ConfigError(f"{config.source}: rank {rank} published a bad entry in the store: {published!r:.200}")
        nodes.append(published)
    # parse_config checks every entry as if it were written in the file (names, hosts, ports, unique)
    mapping = {**config.to_mapping(), "nodes": nodes}
    mapping.pop("interface", None)
    resolved = parse_config(mapping, source=f"{config.source} (torchrun rendezvous)")
    resolved = dataclasses.replace(resolved, torchrun=True, interface=config.interface, source=config.source)
    if resolved.node(env.name) != NodeSpec(env.name, host, port, public_key=public.decode()):
        raise ConfigError(f"{config.source}: the store's entry for {env.name} is not the one this worker published")
    return Rendezvous(resolved, env.name, KeyPair(public, secret), env, store=prefix)
