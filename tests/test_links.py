"""Slow links: namespaces, veths and tc made and removed on every exit path; refused clearly without root.

The tests that make namespaces need root and iproute2 (they skip otherwise).
Each names its namespaces after this process's PID (dpwa<PID>x<K>-...), so
nothing here can touch another run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import CHECKOUT_PATH, ROOT, wait_until
from dpwa.cluster.processes import process_start, read_pid_file
from dpwa_lab.compare import links
from dpwa_lab.compare.__main__ import main
from dpwa_lab.compare.links import Links, LinkSpec, LinksUnavailable

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc from iproute2"
    probe = f"dpwa{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add is not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


needs_namespaces = pytest.mark.skipif(_usable() is not None, reason=str(_usable()))


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.io
def test_without_root_it_refuses_and_says_why(monkeypatch):
    with pytest.raises(LinksUnavailable, match=r"--link-mbit needs root.*user id 1000.*leave out --link-mbit"):
        links.check_root(euid=1000)
    links_made = Links(["a"], LinkSpec(20))
    monkeypatch.setattr(os, "geteuid", lambda: 65534)  # as the user nobody
    with pytest.raises(LinksUnavailable, match="user id 65534"):
        links_made.start()
    assert links_made._reaper is None  # refused before anything was started or made
    assert not namespaces(links_made.prefix)


def test_the_command_refuses_without_root(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    argv = ["--workload", "charlm", "--link-mbit", "20", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--link-mbit needs root" in err and "user id 1000" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--link-delay-ms", "10"], "--link-delay-ms needs --link-mbit"),
        (["--link-mbit", "0"], "must be positive"),
        (["--workload", "charlm", "--epochs", "3"], "--epochs is for the image workloads"),
        (["--workload", "digits", "--target-loss", "2"], "--target-loss is for --workload charlm"),
        (["--workload", "charlm", "--data", "digits"], "--data must be stdlib or text:PATH"),
        (["--workload", "digits", "--data", "cifar10"], "disagree"),
        (["--data", "text:"], "choose auto"),
        (["--workload", "charlm", "--model", "resnet18"], "--model for charlm"),
    ],
)
def test_bad_link_and_workload_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_link_specs_are_checked():
    with pytest.raises(ValueError, match="link rate must be in"):
        LinkSpec(0.0)
    with pytest.raises(ValueError, match="link delay must be in"):
        LinkSpec(20, delay_ms=-1)
    with pytest.raises(ValueError, match="distinct names"):
        Links(["a", "a"], LinkSpec(20))


RTT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
rtts = []
for i in range(12):
    t = time.monotonic()
    s.sendto(b"x" * 64, (sys.argv[1], 7001))
    s.recvfrom(2048)
    rtts.append(time.monotonic() - t)
print(sorted(rtts)[len(rtts) // 2] * 1000)
"""
ECHO = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 7001))
s.settimeout(30)
print("up", flush=True)
for _ in range(12):
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""


def median_rtt_ms(net: Links, src: str, dst: str) -> float:
    echo = subprocess.Popen(net.run_prefix(dst) + [sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "up"
        done = subprocess.run(
            net.run_prefix(src) + [sys.executable, "-c", RTT, net.address(dst)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return float(done.stdout)
    finally:
        echo.kill()
        echo.wait(10)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_delay_line_makes_a_round_trip_of_twice_the_delay_and_goes_with_the_network():
    """--link-delay-ms 25 on a kernel without netem: the hub holds every packet 25 ms, so a round trip between two
    hosts is 50 ms (within 20%); without a delay it is far below. Every namespace, the delay line included, goes
    at the end."""
    net = Links(["a", "b"], LinkSpec(100, delay_ms=25))
    with net:
        assert net.routed and net.address("b") == "10.99.2.2"
        rtt = median_rtt_ms(net, "a", "b")
        assert 40 <= rtt <= 60, rtt
        assert net._line is not None and net._line.poll() is None
        line_pid = net._line.pid
    assert namespaces(net.prefix) == []
    assert net._line.poll() is not None  # the delay line ended with its namespace
    assert process_start(line_pid) is None
    with Links(["a", "b"], LinkSpec(100)) as plain:
        assert median_rtt_ms(plain, "a", "b") < 10


def test_a_delay_needs_a_tun_device(monkeypatch):
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: False if path == "/dev/net/tun" else real(path))
    with pytest.raises(LinksUnavailable, match=r"needs /dev/net/tun.*leave out --link-delay-ms"):
        links.check_delay(10)
    links.check_delay(0)  # no delay: nothing needed


OWNER_DELAYED = """
import sys, time
sys.path.insert(0, {root!r})
from dpwa_lab.compare.links import Links, LinkSpec
net = Links(["a", "b"], LinkSpec(20, delay_ms=10)).start()
print(net.prefix, net._line.pid, flush=True)
time.sleep(120)
"""


@needs_namespaces
@pytest.mark.slow
def test_a_delayed_network_is_torn_down_when_its_owner_is_sigkilled():
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_DELAYED.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        prefix, line_pid = owner.stdout.readline().split()
        assert len(namespaces(prefix)) == 3 and process_start(int(line_pid)) is not None
        owner.kill()
        owner.wait(10)
        assert wait_until(lambda: namespaces(prefix) == [], 30), namespaces(prefix)
        assert wait_until(lambda: process_start(int(line_pid)) is None, 10)  # the delay line is gone too
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(10)


@needs_namespaces
@pytest.mark.slow
def test_hosts_talk_over_shaped_links_and_everything_goes_even_after_a_sigkill():
    net = Links(["a", "b"], LinkSpec(20))
    procs: list[subprocess.Popen] = []
    with net:
        assert sorted(namespaces(net.prefix)) == sorted(net.namespaces)
        qdiscs = subprocess.run(
            ["tc", "-n", net.namespace("a"), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdiscs and "rate 20Mbit" in qdiscs
        # a TCP connection from a to b, across the bridge
        server = subprocess.Popen(
            net.run_prefix("b")
            + [
                sys.executable,
                "-c",
                (
                    "import socket; s = socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); print('up', flush=True); "
                    "c, _ = s.accept(); c.sendall(c.recv(100)); c.close()"
                ),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(server)
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "up"
        client = subprocess.run(
            net.run_prefix("a")
            + [
                sys.executable,
                "-c",
                (
                    f"import socket; c = socket.create_connection(('{net.address('b')}', 7000), timeout=10); "
                    "c.sendall(b'over the bridge'); print(c.recv(100).decode())"
                ),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert client.stdout.strip() == "over the bridge", client.stderr
        server.wait(10)
        # a process in each namespace; the one in a is SIGKILLed, the one in b is still running at teardown
        victim = subprocess.Popen(net.run_prefix("a") + SLEEPER)
        survivor = subprocess.Popen(net.run_prefix("b") + SLEEPER)
        procs += [victim, survivor]
        assert wait_until(
            lambda: (
                str(victim.pid)
                in subprocess.run(["ip", "netns", "pids", net.namespace("a")], capture_output=True, text=True).stdout
            ),
            10,
        )
        victim.kill()
        assert victim.wait(10) == -signal.SIGKILL
    try:
        assert namespaces(net.prefix) == []
        assert net.prefix not in root_links() and "br0" not in root_links()
        assert survivor.wait(10) == -signal.SIGKILL  # the teardown killed what still ran inside, by PID
        assert net._reaper is not None and net._reaper.poll() == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from dpwa_lab.compare.links import Links, LinkSpec
net = Links(["a", "b"], LinkSpec(20)).start()
print(net.prefix, flush=True)
time.sleep(120)
"""


@needs_namespaces
@pytest.mark.slow
def test_the_reaper_tears_down_when_the_owner_itself_is_sigkilled(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        prefix = owner.stdout.readline().strip()
        assert prefix.startswith(f"dpwa{owner.pid}x") and len(namespaces(prefix)) == 3
        owner.kill()
        owner.wait(10)
        assert wait_until(lambda: namespaces(prefix) == [], 30), namespaces(prefix)
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.wait(10)


def _compare(tmp_path, *extra):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--workload",
        "charlm",
        "--model",
        "tiny",
        "--workers",
        "2",
        "--link-mbit",
        "20",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "report.json"),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_a_shaped_run_completes_at_a_tiny_size(tmp_path):
    proc = _compare(tmp_path, "--steps", "6", "--quick", "--systems", "gossip,diloco,allreduce", "--diloco-period", "3")
    try:
        output, _ = proc.communicate(timeout=160)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, output[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["links"]["rate_mbit"] == 20 and report["metric"] == "val_loss" and report["target_loss"] > 0
    for name in ("gossip", "diloco", "allreduce"):
        system = report["systems"][name]
        assert system["completed"], (name, system["error"])
        assert system["final_val_loss"] > 0 and system["final_bits_per_char"] > 0
        assert system["bytes_per_worker_per_step"] > 0 and system["curve"][0][:2] == [0.0, 0]
        assert system["links"]["addresses"] and system["links"]["namespaces"]
    assert report["systems"]["diloco"]["syncs"] == 2  # 6 steps, a sync every 3
    for name in ("diloco", "allreduce"):
        check = report["link_check"][name]
        assert check["sent_bytes"] > 0 and check["measured_comm_s"] > 0 and check["unit"] in ("step", "synchronisation")
    assert "links: 20 Mbit/s" in output and "allreduce: each rank sends" in output and "per step" in output
    assert report["link_check"]["allreduce"]["consistent"] in (True, False)
    assert namespaces(f"dpwa{proc.pid}x") == []


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_run_leaves_no_namespace_and_no_process(tmp_path, sig):
    proc = _compare(tmp_path, "--steps", "100000", "--systems", "allreduce")
    try:
        run = tmp_path / "out" / "work" / "allreduce"
        assert wait_until(lambda: (run / "go").exists() or proc.poll() is not None, 120) and proc.poll() is None
        prefix = f"dpwa{proc.pid}x"
        assert len(namespaces(prefix)) == 3  # the hub and two ranks
        pid_files = sorted((run / "pids").glob("*.pid"))
        assert len(pid_files) == 2
        os.kill(proc.pid, sig)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, output[-3000:]
        assert "stopped" in output
        assert namespaces(prefix) == []
        assert prefix not in root_links()
        for pid_file in pid_files:
            pid, start = read_pid_file(pid_file)
            assert process_start(pid) != start, f"{pid_file.stem} still runs"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
