"""Which parameter server holds which variable: a plan balanced by size, pure and deterministic.

Every variable of the model (a parameter, or a floating-point buffer) is one
*block*: the unit a server queues and applies updates to, with its own
optimizer state. :func:`make_plan` assigns blocks to ``K`` servers with the
longest-processing-time rule: largest first, each to the server holding the
fewest bytes so far (ties to the lower index). The heaviest server then
holds at most the lightest's bytes plus the largest block, and at most 4/3
of the best possible maximum (Graham 1969).

The plan is a map from each gradient variable to the block (server and
position) that updates its parameter. A trainer and a server make the same
plan from the same layout, and every request carries its fingerprint, so a
mismatch is refused rather than applied to the wrong tensor.

    >>> from dpwa_lab.systems.layout import ModelLayout
    >>> plan = make_plan(ModelLayout([("a", (6,), "param"), ("b", (4,), "param"), ("c", (3,), "param")]), 2)
    >>> [[b.variable.name for b in server] for server in plan.servers]
    [['a'], ['b', 'c']]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpwa.mixing.params import fingerprint

from ..layout import ModelLayout, Variable

__all__ = ["Block", "ShardPlan", "make_plan"]

MAX_SERVERS = 1024


@dataclass(frozen=True)
class Block:
    """One variable as a server holds it: its place in that server's flat vector."""

    server: int
    index: int  # position among the server's blocks
    variable: Variable
    offset: int  # first element in the server's flat vector

    @property
    def size(self) -> int:
        return self.variable.size


@dataclass(frozen=True)
class ShardPlan:
    """Blocks per server, and the map from each variable's name to its block."""

    servers: tuple[tuple[Block, ...], ...]
    fingerprint: bytes  # of the layout and the assignment: equal plans, equal fingerprints

    def size(self, server: int) -> int:
        """Elements server `server` holds."""
        return sum(b.size for b in self.servers[server])

    def block(self, name: str) -> Block:
        for blocks in self.servers:
            for b in blocks:
                if b.variable.name == name:
                    return b
        raise KeyError(f"no variable named {name!r} in the plan")

    @property
    def count(self) -> int:
        return len(self.servers)

    def state_index(self, server: int, param_size: int) -> np.ndarray:
        """Where each element of server `server`'s vector sits in a model's full state (parameters, then buffers).

        `param_size` is the layout's; ``state[plan.state_index(k, n)]`` is server k's shard of a full state.
        """
        parts = []
        for b in self.servers[server]:
            v = b.variable
            start = v.offset if v.kind == "param" else param_size + v.offset
            parts.append(np.arange(start, start + v.size))
        return np.concatenate(parts)

    def join(self, shards: list[np.ndarray], param_size: int) -> np.ndarray:
        """The full state (parameters, then buffers) from every server's shard, in server order."""
        size = sum(self.size(k) for k in range(self.count))
        if len(shards) != self.count or any(s.shape != (self.size(k),) for k, s in enumerate(shards)):
            raise ValueError(f"expected {self.count} shards of sizes {[self.size(k) for k in range(self.count)]}")
        state = np.empty(size, np.float32)
        for k, shard in enumerate(shards):
            state[self.state_index(k, param_size)] = shard
        return state


def make_plan(layout: ModelLayout, servers: int) -> ShardPlan:
    """Assign each variable of `layout` to one of `servers` servers, balanced by size (largest first)."""
    if not 1 <= servers <= MAX_SERVERS:
        raise ValueError(f"the number of parameter servers must be in 1..{MAX_SERVERS}, got {servers}")
    if servers > len(layout):
        raise ValueError(f"{servers} servers for {len(layout)} variables: some servers would hold nothing")
    variables = layout.variables
    order = sorted(range(len(variables)), key=lambda i: (-variables[i].size, i))
    load = [0] * servers
    owner: dict[int, int] = {}
    for i in order:
        target = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = target
        load[target] += variables[i].size
    per_server: list[list[Block]] = [[] for _ in range(servers)]
    offsets = [0] * servers
    for i, v in enumerate(variables):  # within a server, blocks keep the layout's order
        s = owner[i]
        per_server[s].append(Block(s, len(per_server[s]), v, offsets[s]))
        offsets[s] += v.size
    digest = fingerprint(
        (f"{b.server}/{b.index}/{b.variable.kind}/{b.variable.name}", b.variable.shape, "float32")
        for blocks in per_server
        for b in blocks
    )
    return ShardPlan(tuple(tuple(blocks) for blocks in per_server), digest)
