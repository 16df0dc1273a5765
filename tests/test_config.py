"""Configuration: both layouts load, and every mistake is named with its file and key."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from conftest import ROOT, make_config
from dpwa.config import ConfigError, NodeSpec, load_config, parse_config, pointless_settings

ORIGINAL = (ROOT / "samples" / "config.yaml").read_text()


def test_original_list_of_one_key_maps_loads_as_it_is():
    config = load_config(ROOT / "samples" / "config.yaml")
    assert [n.name for n in config.nodes] == ["w1", "w2", "w3", "w4"]
    assert config.nodes[0] == NodeSpec("w1", "localhost", 45000)
    assert config.nodes[3].tcp_endpoint == "tcp://localhost:45003"
    # loopback nodes without keys talk over ipc sockets in this user's private directory
    assert config.transport == "ipc"
    assert config.endpoint(config.nodes[3]).startswith("ipc://")
    assert config.endpoint(config.nodes[3]).endswith(f"/dpwa-{os.getuid()}/node-45003")
    assert config.fetch_probability == 1.0
    assert config.timeout_ms == 2500 and config.timeout_s == 2.5
    assert config.interpolation == "constant"
    assert config.divergence_threshold == 0.2
    assert config.constant.value == 0.5
    assert config.source.endswith("config.yaml")


def test_mapping_form_is_equivalent():
    text = """
nodes:
  - {name: w1, host: localhost, port: 45000}
  - {name: w2, host: localhost, port: 45001}
  - {name: w3, host: localhost, port: 45002}
  - {name: w4, host: localhost, port: 45003}
fetch_probability: 1
timeout_ms: 2500
interpolation: constant
divergence_threshold: 0.2
constant: {value: 0.5}
clock: 0
loss: 0
"""
    mapping = parse_config(text, source="x.yaml")
    original = parse_config(ORIGINAL, source="x.yaml")
    assert mapping == original


def test_defaults_and_immutability():
    config = parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 1}]})
    assert (config.fetch_probability, config.timeout_ms, config.interpolation) == (1.0, 2500, "constant")
    assert config.divergence_threshold == 0.0 and config.constant.value == 0.5
    with pytest.raises(AttributeError):
        config.timeout_ms = 5  # type: ignore[misc]  # frozen: the test checks that assigning fails


def test_peers_and_lookup():
    config = parse_config(ORIGINAL)
    assert [p.name for p in config.peers_of("w2")] == ["w1", "w3", "w4"]
    with pytest.raises(ConfigError, match=r"no node named 'w5'.*known: w1, w2, w3, w4"):
        config.node("w5")


@pytest.mark.parametrize("host", ["127.0.0.999", "10.1.2", "bad_name.example", "-lead.example", "a..b", "1.2.3.4.5"])
def test_a_host_that_is_neither_an_address_nor_a_name_is_refused_as_such(host):
    """Issue 48: ``127.0.0.999`` was taken as a host other machines reach, and the error was about missing
    CURVE keys. A typo is refused as one, naming the key; addresses and names still pass."""
    with pytest.raises(ConfigError, match=rf"nodes\[0\]\.host {re.escape(repr(host))} is neither an IP address nor"):
        parse_config({"nodes": [{"name": "a", "host": host, "port": 5}], "insecure": True}, source="c.yaml")
    for good in ("127.0.0.1", "::1", "[::1]", "node-7.cluster.example", "localhost", "gpu01"):
        parse_config({"nodes": [{"name": "a", "host": good, "port": 5}], "insecure": True})


def test_ipv6_host_and_bind_address():
    config = parse_config({"nodes": [{"name": "a", "host": "::1", "port": 5, "bind": "*"}], "insecure": True})
    assert config.endpoint(config.nodes[0]) == "tcp://[::1]:5"
    assert config.bind_endpoint(config.nodes[0]) == "tcp://*:5"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("*", "*"),
        ("0.0.0.0", "0.0.0.0"),
        ("127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("[::1]", "::1"),
        ("lo", "127.0.0.1"),  # an interface name: its IPv4 address
        ("localhost", "127.0.0.1"),  # a host name: IPv4 first, as ZeroMQ resolves it
    ],
)
@pytest.mark.io
def test_bind_resolves_to_one_address_every_listener_can_bind(value, expected):
    from dpwa.wire.endpoints import bind_address

    assert bind_address(value) == expected
    config = parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 5, "bind": value}], "insecure": True})
    assert config.bind_address(config.nodes[0]) == expected
    assert config.bind_endpoint(config.nodes[0]) == f"tcp://{'[::1]' if ':' in expected else expected}:5"


def test_bind_to_an_interface_this_machine_lacks_is_refused_naming_the_file_key_and_value(tmp_path):
    """The config loads (it is shared by every machine: `bind` names an interface of its node's own
    machine); the node that would bind it is told exactly what is wrong, before it binds anything."""
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n  - {name: a, host: 127.0.0.1, port: 5}\n  - {name: b, host: 127.0.0.1, port: 6, "
        "bind: nosuchif0}\ninsecure: true\n"
    )
    config = load_config(path)
    assert config.bind_address(config.nodes[0]) == "127.0.0.1"
    with pytest.raises(
        ConfigError,
        match=rf"{path}: nodes\[1\]\.bind is 'nosuchif0': .*neither an address, '\*', "
        r"an interface of this machine \(here: .*lo.*\).*Expected an address",
    ):
        config.bind_address(config.nodes[1])


@pytest.mark.parametrize(
    "node",
    [
        {"name": "a", "host": "10.1.2.3", "port": 5},
        {"name": "a", "host": "127.0.0.1", "port": 5, "bind": "*"},
        {"name": "a", "host": "127.0.0.1", "port": 5, "bind": "0.0.0.0"},
    ],
)
def test_a_node_other_machines_can_reach_needs_keys_or_insecure(node):
    nodes = [node, {"name": "b", "host": "127.0.0.1", "port": 6}]
    with pytest.raises(
        ConfigError, match=r"node 'a' listens on .* other machines can reach.*keygen --config.*insecure: true"
    ):
        parse_config({"nodes": nodes})
    config = parse_config({"nodes": nodes, "insecure": True})
    assert config.transport == "tcp" and config.insecure
    assert config.endpoint(config.nodes[1]) == "tcp://127.0.0.1:6"


def test_insecure_must_be_a_boolean():
    with pytest.raises(ConfigError, match="insecure must be true or false, got 'yes'"):
        parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 5}], "insecure": "yes"})


def test_loopback_insecure_config_uses_tcp():
    config = parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 5}], "insecure": True})
    assert config.transport == "tcp" and config.endpoint(config.nodes[0]) == "tcp://127.0.0.1:5"


def replace_line(old: str, new: str) -> str:
    assert old in ORIGINAL
    return ORIGINAL.replace(old, new)


@pytest.mark.parametrize(
    "text, message",
    [
        (replace_line("port: 45001", "port: 70000"), r"nodes\[1\]\.port must be an integer in 1\.\.65535, got 70000"),
        (replace_line("port: 45001", "port: 0"), r"nodes\[1\]\.port must be an integer in 1\.\.65535, got 0"),
        (replace_line("port: 45001", "port: '45001'"), r"nodes\[1\]\.port must be an integer"),
        (replace_line("name: w2", "name: w1"), r"nodes\[1\]\.name 'w1' is used by two nodes"),
        (replace_line("port: 45001", "port: 45000"), r"nodes\[1\] uses localhost:45000, which node 'w1' already uses"),
        (
            replace_line("fetch_probability: 1 ", "fetch_probability: 1.5 "),
            r"fetch_probability must be a number in \[0, 1\], got 1\.5",
        ),
        (
            replace_line("fetch_probability: 1 ", "fetch_probability: -0.1 "),
            r"fetch_probability must be a number in \[0, 1\]",
        ),
        (replace_line("timeout_ms: 2500", "timeout_ms: -5"), r"timeout_ms must be a positive integer, got -5"),
        (replace_line("timeout_ms: 2500", "timeout_ms: 0"), r"timeout_ms must be a positive integer, got 0"),
        (replace_line("timeout_ms: 2500", "timeout_ms: 2.5"), r"timeout_ms must be a positive integer, got 2\.5"),
        (
            replace_line("interpolation: constant", "interpolation: clok"),
            r"interpolation must be one of constant, clock, loss, got 'clok'; did you mean 'clock'\?",
        ),
        (replace_line("{ value: 0.5 }", "{ value: 1.5 }"), r"constant\.value must be a number in \[0, 1\], got 1\.5"),
        (replace_line("{ value: 0.5 }", "{ valeu: 0.5 }"), r"unknown key constant\.'valeu'; did you mean 'value'\?"),
        (replace_line("- loss: 0", "- los: 0"), r"unknown key 'los'; did you mean 'loss'\?"),
        (replace_line("- loss: 0", "- timout_ms: 5"), r"unknown key 'timout_ms'; did you mean 'timeout_ms'\?"),
        (
            replace_line("{name: w2, host: localhost, port: 45001}", "{name: w2, hots: localhost, port: 45001}"),
            r"unknown key nodes\[1\]\.'hots'; did you mean 'host'\?",
        ),
        (
            replace_line("{name: w2, host: localhost, port: 45001}", "{name: w2, port: 45001}"),
            r"nodes\[1\] is missing the key 'host'",
        ),
        (
            replace_line("divergence_threshold: 0.2", "divergence_threshold: -1"),
            r"divergence_threshold must be a number >= 0, got -1",
        ),
        (replace_line("- clock: 0 ", "- clock: {speed: 2} "), r"clock interpolation takes no options"),
        (ORIGINAL + "- snapshot_slots: 3\n", r"snapshot_slots must be 1 or 2, got 3"),
        (ORIGINAL + "- snapshot_slots: true\n", r"snapshot_slots must be 1 or 2, got True"),
        (ORIGINAL + "- timeout_ms: 10\n", r"key 'timeout_ms' is given twice"),
        ("- nodes: []\n", r"'nodes' must be a non-empty list"),
        ("- fetch_probability: 1\n", r"missing key 'nodes'"),
        ("", r"the configuration is empty"),
        ("- [1, 2]\n", r"item 1 of the top-level list must be a map with exactly one key"),
        ("nodes: [\n", r"cfg\.yaml:2:1: not valid YAML"),
        ("timeout_ms: 1\ntimeout_ms: 2\nnodes: []\n", r"key 'timeout_ms' appears twice"),
    ],
)
def test_each_error_names_the_file_the_key_and_what_was_expected(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_config(text, source="cfg.yaml")
    assert str(info.value).startswith("cfg.yaml")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the configuration"):
        load_config(tmp_path / "missing.yaml")


def test_config_errors_come_before_any_socket(nodes):
    # The name is checked before the node binds anything, so a wrong name leaves no port or thread behind.
    import numpy as np

    from dpwa import NumpyParams

    with pytest.raises(ConfigError, match="no node named 'nope'"):
        nodes(parse_config(ORIGINAL), "nope", NumpyParams(np.zeros(4, np.float32)))


def test_pointless_settings_are_reported():
    single = parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 1}]})
    assert any("only one node" in n for n in pointless_settings(single))
    never = parse_config(replace_line("fetch_probability: 1 ", "fetch_probability: 0 "))
    assert any("fetch_probability is 0 with 4 nodes" in n for n in pointless_settings(never))
    zero = parse_config(replace_line("{ value: 0.5 }", "{ value: 0 }"))
    assert any("constant.value is 0" in n for n in pointless_settings(zero))
    assert pointless_settings(parse_config(ORIGINAL)) == []


def test_every_setting_survives_a_round_trip_through_to_mapping(tmp_path):
    # run.sh --config rewrites the user's config into the run folder through to_mapping:
    # nothing may be lost on the way (keys, modes, dtypes).
    text = ORIGINAL.replace(
        "- loss: 0",
        "- loss: 0\n- mode: symmetric\n- rule: delta\n- wire_dtype: bfloat16\n"
        "- same_host: 'off'\n- snapshot_slots: 1\n- max_peer_distance: 3.5",
    )
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    text = text.replace(
        "port: 45000}", f'port: 45000, bind: "*", public_key: "{key}", secret_key_file: keys/w1.key_secret}}'
    )
    for name, port in (("w2", 45001), ("w3", 45002), ("w4", 45003)):
        text = text.replace(
            f"{{name: {name}, host: localhost, port: {port}}}",
            f'{{name: {name}, host: localhost, port: {port}, public_key: "{key}"}}',
        )
    config = parse_config(text, source=str(tmp_path / "c.yaml"))
    again = parse_config(config.to_mapping(), source=config.source)
    assert again == config
    assert again.secure and again.mode == "symmetric" and again.wire_dtype == "bfloat16" and again.snapshot_slots == 1
    assert again.nodes[0].secret_key_file == str(tmp_path / "keys" / "w1.key_secret")


def test_every_sample_config_loads(tmp_path):
    for path in sorted((ROOT / "samples").glob("*.yaml")):
        if path.name == "two-machines.yaml":  # reachable from other machines: it needs keys first
            with pytest.raises(ConfigError, match="keygen --config"):
                load_config(path)
            continue
        config = load_config(path)
        assert config.nodes or config.torchrun, path


def test_keygen_config_keys_every_node_and_the_result_loads(tmp_path):
    from dpwa.cluster.keys import key_config

    config = tmp_path / "two-machines.yaml"
    config.write_text((ROOT / "samples" / "two-machines.yaml").read_text())
    written = key_config(config)
    assert sorted(p.name for p in written) == ["a1.key_secret", "a2.key_secret", "b1.key_secret", "b2.key_secret"]
    keyed = load_config(config)
    assert keyed.secure and keyed.transport == "tcp"
    assert all(n.secret_key_file == str(tmp_path / "keys" / f"{n.name}.key_secret") for n in keyed.nodes)
    assert (tmp_path / "two-machines.yaml.bak").read_text() == (ROOT / "samples" / "two-machines.yaml").read_text()
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in written)


@pytest.mark.io
def test_a_torchrun_config_has_no_node_list_until_the_workers_meet(tmp_path):
    from dpwa import Node, NumpyParams
    from dpwa.gossip.membership.rendezvous import TorchrunEnv, advertised_address

    config = load_config(ROOT / "samples" / "torchrun.yaml")
    assert config.torchrun and not config.resolved and config.secure and config.nodes == ()
    assert config.interface == "auto" and config.to_mapping()["nodes"] == "torchrun"
    with pytest.raises(ConfigError, match="known only once torchrun's workers meet"):
        config.node("rank0")
    with pytest.raises(ConfigError, match="interface is for 'nodes: torchrun'"):
        parse_config({"nodes": [{"name": "a", "host": "127.0.0.1", "port": 5}], "interface": "eth0"})
    with pytest.raises(ConfigError, match="insecure cannot be used with nodes: torchrun"):
        parse_config({"nodes": "torchrun", "insecure": True})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(
        ConfigError,
        match=r"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not set: start the workers "
        r"with torchrun .*accelerate launch --cpu starts one process, and on a CPU machine accelerate launch "
        r"--multi_gpu --num_processes 2 train.py starts two",
    ):
        TorchrunEnv.from_environ(env, "samples/torchrun.yaml")
    with pytest.raises(ConfigError, match="RANK 3 of WORLD_SIZE 2"):
        TorchrunEnv.from_environ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    got = TorchrunEnv.from_environ(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert (got.name, got.restart_count) == ("rank1", 2)
    assert advertised_address("auto", "127.0.0.1", 29500) == "127.0.0.1"
    assert advertised_address("lo", "127.0.0.1", 29500) == "127.0.0.1"
    with pytest.raises(ConfigError, match="interface 'nosuch0': no IPv4 address"):
        advertised_address("nosuch0", "127.0.0.1", 29500)
    if "RANK" not in os.environ:
        with pytest.raises(ConfigError, match="start the workers with torchrun"):
            Node(config, None, NumpyParams(np.zeros(4, np.float32)))
    with pytest.raises(ConfigError, match="which node is this"):
        Node(make_config(2), None, NumpyParams(np.zeros(4, np.float32)))
