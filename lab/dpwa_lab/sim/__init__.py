"""``python -m dpwa.sim``: gossip mixing and training without sockets, on the node's own mixing code."""

from .simulate import (
    RULES,
    Digits,
    Gossip,
    Rule,
    consensus,
    disagreement,
    main,
    rounds,
    study,
    symmetric_decay,
    train_run,
)

__all__ = [
    "RULES",
    "Digits",
    "Gossip",
    "Rule",
    "consensus",
    "disagreement",
    "main",
    "rounds",
    "study",
    "symmetric_decay",
    "train_run",
]
