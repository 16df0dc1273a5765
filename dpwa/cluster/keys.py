"""Key a multi-machine config: CURVE keys for every node, written beside the config.

``python -m dpwa keygen --config cluster.yaml`` writes ``keys/NAME.key`` (public)
and ``keys/NAME.key_secret`` (mode 0600) for every node that has no key yet,
and rewrites the config with each node's ``public_key`` and
``secret_key_file`` (relative to the config, so the same file works on every
machine). The original is kept as ``cluster.yaml.bak``. Copy each node's
``.key_secret`` to that node's machine only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, load_config, read_config_data
from ..wire.curve import generate

__all__ = ["key_config", "key_nodes"]


def key_nodes(nodes: list[dict[str, Any]], directory: Path, relative_to: Path | None = None) -> list[Path]:
    """Give every node entry (mapping form) without a public key a fresh key pair in `directory`.

    Sets its ``public_key`` and ``secret_key_file`` (relative to `relative_to`
    when given, else absolute). Returns the secret key files written.
    """
    written = []
    for node in nodes:
        if node.get("public_key"):
            continue
        _, secret, pair = generate(str(node["name"]), directory)
        node["public_key"] = pair.public.decode()
        node["secret_key_file"] = os.path.relpath(secret, relative_to) if relative_to else str(secret.resolve())
        written.append(secret)
    return written


def key_config(path: str | os.PathLike[str], key_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Give every node of the config at `path` a key pair; returns the secret key files written.

    Nodes that already have a public key keep it. The config must be valid
    once keyed (a ConfigError says what is not).
    """
    path = Path(path)
    data = read_config_data(path)
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, dict) and "name" in n for n in nodes):
        raise ConfigError(f"{path}: 'nodes' must be a list of {{name, host, port}} to key it")
    directory = Path(key_dir) if key_dir is not None else path.parent / "keys"
    if not directory.is_absolute():
        directory = Path.cwd() / directory
    written = key_nodes(nodes, directory, relative_to=path.parent.resolve())
    backup = path.with_name(path.name + ".bak")
    backup.write_bytes(path.read_bytes())
    text = f"# keyed by python -m dpwa keygen --config (the original is in {backup.name})\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    tmp.replace(path)
    load_config(path)  # what we wrote must load
    return written
