"""Another user of the machine against a run folder: it can read, lock or take nothing in it.

The attacks run as an attacker would: commands (cat, ls, flock, mkdir) started as another uid (65534,
nobody), against run folders in a folder every user may enter. That needs root (CI runs as root); the
tests that need it say so when skipped. The rest check the modes themselves, whatever the umask, and
the deadline of the checkpoints' lock against a process of the same user that holds it.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from conftest import HELPERS, ROOT, make_config, wait_until
from dpwa.cluster import launch, processes
from dpwa.cluster.events import EventLog
from dpwa.runfiles.private import NotPrivateError, make_private_dir, open_private, write_private

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("cat") is None,
    reason="runs commands as another user (uid 65534): needs root, and cat",
)


def other_user(*argv: str) -> subprocess.CompletedProcess:
    """Run `argv` as uid and gid 65534 with no other groups, as another user of the machine would."""
    return subprocess.run(
        list(argv),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
        capture_output=True,
        text=True,
        timeout=20,
    )


def modes(root: Path) -> dict[str, str]:
    """Every folder and file under `root` (itself included), relative name -> its mode in octal."""
    found = {".": f"{stat.S_IMODE(root.stat().st_mode):04o}"}
    for path in sorted(root.rglob("*")):
        try:
            st = path.lstat()
        except FileNotFoundError:  # a temporary file renamed meanwhile: its final name is listed
            continue
        if not stat.S_ISLNK(st.st_mode):
            found[str(path.relative_to(root))] = f"{stat.S_IMODE(st.st_mode):04o}"
    return found


def not_private(root: Path) -> dict[str, str]:
    """What under `root` is not a folder of mode 0700 or a file of mode 0600 ({} when all is)."""
    out = {}
    for name, mode in modes(root).items():
        path = root / name
        if mode != ("0700" if path.is_dir() else "0600"):
            out[name] = mode
    return out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder in /tmp that every user may enter and list (0755), as a home or a project folder often is."""
    base = Path(tempfile.mkdtemp(prefix="dpwa-local-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        reached = other_user("ls", str(base))  # else every attack would fail for a reason of no interest
        assert reached.returncode == 0, f"uid {NOBODY} cannot enter {base}: {reached.stderr}"
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def state(k: float) -> dict:
    import torch

    return {"model": {"w": torch.full((4,), k)}, "progress": {"epoch": int(k)}}


# --------------------------------------------------------------------------- modes, whatever the umask


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o777])
def test_a_run_folder_is_0700_and_its_files_0600_whatever_the_umask(tmp_path, umask):
    """Everything the launcher and the checkpoints write into a run folder. Before: the umask decided
    (0755 folders and 0644 files under 022; 0777 and 0666 under 000; the lock file 0644 always)."""
    pytest.importorskip("torch")
    from dpwa.runfiles import checkpoints

    config = make_config(2)
    previous = os.umask(umask)
    try:
        run_dir = launch.new_run_dir(tmp_path / "runs")
        spec = launch.prepare(launch.LaunchSpec(run_dir=str(run_dir), config=config, command=["true"], pin=False))
        processes.write_pid_file(run_dir / "pids" / "launcher.pid", os.getpid())
        with EventLog(run_dir) as events:
            events.write("run_start", nodes=spec.names)
        for node in spec.names:
            checkpoints.save(run_dir, 1, node, state(1.0))
        checkpoints.save(run_dir, checkpoints.LAST, spec.names[0], state(2.0))
        with open_private(run_dir / "logs" / "w.log", "ab") as fh:
            fh.write(b"a line\n")
        write_private(run_dir / "summary.json", "{}\n")
    finally:
        os.umask(previous)
    found = modes(run_dir)
    expected_files = {
        "config.yaml",
        "launch.json",
        "events.jsonl",
        "pids/launcher.pid",
        "logs/w.log",
        "summary.json",
        "checkpoints/epoch-1/manifest.json",
        "checkpoints/epoch-1/manifest.lock",
        "checkpoints/last/manifest.lock",
    }
    assert expected_files | {f"checkpoints/epoch-1/{n}.pt" for n in spec.names} <= set(found)
    assert not_private(run_dir) == {}, found
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700  # made here: private too
    assert checkpoints.load(run_dir, 1, spec.names[1])["progress"]["epoch"] == 1  # and it all still works


@pytest.mark.timeout(120)
@pytest.mark.io
def test_train_py_writes_its_run_folder_privately_under_umask_000(tmp_path):
    """The example's node, started by hand with --run-dir a new folder and umask 000: the run folder,
    metrics/, checkpoints/ and models/ are 0700, its metrics lines, checkpoint, manifest, lock and final
    weights 0600. Before: 0777 folders and 0666 files (the lock file 0644)."""
    pytest.importorskip("torch")
    config = tmp_path / "one.json"
    config.write_text(json.dumps(make_config(1)))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "pytorch-cifar" / "train.py"),
            "--config",
            str(config),
            "--name",
            "w0",
            "--data",
            "digits",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "4",
            "--run-dir",
            str(run_dir),
            "--linger-s",
            "0",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        umask=0o000,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = modes(run_dir)
    assert {
        "metrics/w0.jsonl",
        "checkpoints/epoch-1/w0.pt",
        "checkpoints/epoch-1/manifest.lock",
        "models/w0.pt",
    } <= set(found), found
    assert not_private(run_dir) == {}, found


def test_a_resumed_run_folder_of_an_older_dpwa_is_made_private(tmp_path):
    """A run folder written with 0755 folders and 0644 files: prepare() (./run.sh --resume) sets the run
    folder and its folders to 0700; every file the launcher and the checkpoints write again is 0600."""
    pytest.importorskip("torch")
    from dpwa.runfiles import checkpoints

    run_dir = tmp_path / "old-run"
    for sub in ("pids", "logs", "metrics", "models", "checkpoints/epoch-1"):
        (run_dir / sub).mkdir(parents=True)
    for path in [run_dir, *run_dir.rglob("*")]:
        os.chmod(path, 0o755)
    lock = run_dir / "checkpoints" / "epoch-1" / "manifest.lock"
    lock.write_bytes(b"")
    os.chmod(lock, 0o644)
    launch.prepare(launch.LaunchSpec(run_dir=str(run_dir), config=make_config(2), command=["true"], pin=False))
    checkpoints.save(run_dir, 1, "w1", state(1.0))
    assert not_private(run_dir) == {}, modes(run_dir)


# --------------------------------------------------------------------------- refusals


def test_a_folder_others_may_write_to_is_refused_naming_it(tmp_path):
    shared_dir = tmp_path / "group-writable"
    shared_dir.mkdir()
    os.chmod(shared_dir, 0o775)
    with pytest.raises(NotPrivateError, match=rf"{shared_dir}: others may write to this folder \(mode 0775\)"):
        make_private_dir(shared_dir)
    with pytest.raises(NotPrivateError, match=rf"{shared_dir}: others may write"):
        launch.prepare(launch.LaunchSpec(run_dir=str(shared_dir), config=make_config(2), command=["true"]))
    assert list(shared_dir.iterdir()) == []  # nothing written into it
    assert stat.S_IMODE(shared_dir.stat().st_mode) == 0o775  # and not changed


@needs_root
@pytest.mark.io
def test_another_users_folder_in_a_world_writable_run_folder_is_refused(shared):
    """A run folder in a folder anyone may write to (mode 1777, like /tmp): another user makes its
    checkpoints/ first, to read or plant checkpoints. save() refuses it, naming the folder and its
    owner, and writes nothing there. Before: it wrote w1.pt (0644) into the other user's folder."""
    pytest.importorskip("torch")
    from dpwa.runfiles import checkpoints

    run_dir = shared / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o1777)
    made = other_user("mkdir", "-m", "0777", str(run_dir / "checkpoints"))
    assert made.returncode == 0, made.stderr
    with pytest.raises(checkpoints.CheckpointError) as refused:
        checkpoints.save(run_dir, 1, "w1", state(1.0))
    assert f"{run_dir / 'checkpoints'}: this folder belongs to uid {NOBODY}" in str(refused.value)
    assert list((run_dir / "checkpoints").iterdir()) == []


# --------------------------------------------------------------------------- issue 28, item 1: checkpoints


@needs_root
@pytest.mark.io
def test_another_user_can_neither_read_a_checkpoint_nor_lock_its_manifest(shared):
    """The attack of issue 28: a run folder (mode 0755, as made by hand or by an older dpwa) in a folder
    anyone may enter; another user opens manifest.lock read-only and takes an exclusive flock, which
    froze save() and discard(), and reads w0.pt, the model's weights. Now both get Permission denied:
    checkpoints/ is 0700 and its files 0600."""
    pytest.importorskip("torch")
    from dpwa.runfiles import checkpoints

    run_dir = shared / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    checkpoints.save(run_dir, 1, "w0", state(1.0))
    epoch = checkpoints.checkpoint_dir(run_dir, 1)
    lock, weights = epoch / "manifest.lock", epoch / "w0.pt"
    if shutil.which("flock"):
        taken = other_user("flock", "--exclusive", "--nonblock", str(lock), "true")
    else:
        taken = other_user("cat", str(lock))  # opening it is what a flock needs first
    assert taken.returncode != 0 and "Permission denied" in taken.stderr, (taken.returncode, taken.stderr)
    for path in (lock, weights, epoch / "manifest.json"):
        read = other_user("cat", str(path))
        assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read.stderr)
        assert read.stdout == ""
    listed = other_user("ls", str(run_dir / "checkpoints"))
    assert listed.returncode != 0 and "Permission denied" in listed.stderr
    assert stat.S_IMODE((run_dir / "checkpoints").stat().st_mode) == 0o700
    assert {p.name: f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in epoch.iterdir()} == {
        "manifest.lock": "0600",
        "manifest.json": "0600",
        "w0.pt": "0600",
    }
    checkpoints.save(run_dir, 1, "w1", state(1.0))  # and nothing waits
    checkpoints.discard(run_dir, 1, "w1")
    assert sorted(checkpoints.manifest(run_dir, 1)["files"]) == ["w0"]


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.mark.io
def test_a_held_lock_is_a_checkpoint_error_at_its_deadline_naming_the_file_and_its_holder(tmp_path):
    """Another process of this user holds a manifest's lock and never lets go (hung, or hostile). save()
    and discard() each raise CheckpointError once their deadline has passed, naming the lock file and
    the holder's PID; save() leaves no unlisted file, discard() changes nothing. Before: both waited
    without end."""
    pytest.importorskip("torch")
    from dpwa.runfiles import checkpoints

    checkpoints.save(tmp_path, 1, "w1", state(1.0))
    lock = checkpoints.checkpoint_dir(tmp_path, 1) / "manifest.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        assert ready and holder.stdout.readline() == "locked\n"
        deadline_s = 1.0
        t0 = time.monotonic()
        with pytest.raises(checkpoints.CheckpointError) as saving:
            checkpoints.save(tmp_path, 1, "w2", state(2.0), lock_timeout_s=deadline_s)
        took = time.monotonic() - t0
        assert deadline_s <= took < deadline_s + 3.0, took
        message = str(saving.value)
        assert message.startswith(f"{lock}: still locked after 1 s, by pid {holder.pid} (python"), message
        assert "w2.pt was not listed and was removed" in message
        assert not (lock.parent / "w2.pt").exists()
        t0 = time.monotonic()
        with pytest.raises(checkpoints.CheckpointError, match=rf"{lock}: still locked after 1 s, by pid {holder.pid}"):
            checkpoints.discard(tmp_path, 1, "w1", lock_timeout_s=deadline_s)
        took = time.monotonic() - t0
        assert deadline_s <= took < deadline_s + 3.0, took
        assert sorted(checkpoints.manifest(tmp_path, 1)["files"]) == ["w1"]  # unchanged
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # it lets go and exits
        try:
            holder.wait(20)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait(5)
    checkpoints.save(tmp_path, 1, "w2", state(2.0), lock_timeout_s=deadline_s)  # free again: it works
    assert sorted(checkpoints.manifest(tmp_path, 1)["files"]) == ["w1", "w2"]


# --------------------------------------------------------------------------- issue 28, item 2: the kill token

FAKE = [sys.executable, str(HELPERS / "fake_node.py"), "{run_dir}", "{name}", "wait"]


def stop_by_pid_file(path: Path, sig: int, timeout_s: float) -> bool:
    """Signal the process a PID file names (if it is still that process); True once it has ended."""
    try:
        pid, start = processes.read_pid_file(path)
    except (OSError, ValueError):
        return True
    if processes.process_start(pid) != start:
        return True
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    return wait_until(lambda: processes.process_start(pid) != start, timeout_s, interval_s=0.05)


def files_holding(root: Path, secret: str) -> list[str]:
    """The files under `root` that hold `secret`, relative names."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes():
                found.append(str(path.relative_to(root)))
        except FileNotFoundError:  # a temporary file renamed meanwhile
            continue
    return sorted(found)


@needs_root
@pytest.mark.timeout(120)
@pytest.mark.io
def test_the_kill_token_of_a_detached_dashboard_is_in_dashboard_json_only(shared):
    """The attack of issue 28: ./run.sh --detach --dashboard --allow-kill wrote the URL with its token
    into logs/launcher.log (0644 in a 0755 folder); another user read it, POSTed /api/kill and killed
    a node. Now the token is in dashboard.json (0600) and nowhere else: not in the launcher's output,
    not in launcher.log, in no file of the run folder, which is 0700 with files 0600; another user can
    open none of it."""
    runs = shared / "runs"
    runs.mkdir()
    os.chmod(runs, 0o755)  # a runs/ folder that others may list, as an older dpwa made it
    config = make_config(2)
    for i, node in enumerate(config["nodes"]):
        node["name"] = f"w{i + 1}"
    run_dir = launch.new_run_dir(runs)
    spec = launch.prepare(
        launch.LaunchSpec(
            run_dir=str(run_dir),
            config=config,
            command=FAKE,
            pin=False,
            grace_s=5,
            dashboard=True,
            dashboard_kill=True,
        )
    )
    out = io.StringIO()
    pids = [run_dir / "pids" / f"{name}.pid" for name in ("launcher", "w1", "w2")]
    try:
        assert launch.detach(spec, out=out, timeout_s=60) == 0, out.getvalue()
        record = json.loads((run_dir / "dashboard.json").read_text())
        token = parse_qs(urlsplit(record["url"]).query)["token"][0]
        assert len(token) == 32
        printed = out.getvalue()
        assert token not in printed
        assert f"(read-only; the URL with the kill button's token is in {run_dir / 'dashboard.json'})" in printed
        log = run_dir / "logs" / "launcher.log"
        assert wait_until(lambda: "dpwa: dashboard: http://127.0.0.1:" in log.read_text(), 30)
        assert files_holding(run_dir, token) == ["dashboard.json"]
        for path in (log, run_dir / "dashboard.json", run_dir / "logs" / "w1.log"):
            read = other_user("cat", str(path))
            assert read.returncode != 0 and "Permission denied" in read.stderr, (path, read.stderr)
            assert token not in read.stdout
        listed = other_user("ls", str(run_dir))
        assert listed.returncode != 0 and "Permission denied" in listed.stderr
        assert not_private(run_dir) == {}, modes(run_dir)  # the nodes' own files too (umask 077)
        assert stop_by_pid_file(pids[0], signal.SIGTERM, 60)  # as ./stop.sh does: the launcher stops its nodes
        assert wait_until(lambda: (run_dir / "summary.txt").exists(), 10)
        assert files_holding(run_dir, token) == []  # dashboard.json went with the dashboard
        assert not_private(run_dir) == {}, modes(run_dir)
    finally:
        for path in pids:
            stop_by_pid_file(path, signal.SIGKILL, 10)
        pid = processes.read_pid_file(pids[0])[0] if pids[0].exists() else None
        if pid is not None:
            try:
                os.waitpid(pid, 0)  # our child (detach started it): reap it
            except ChildProcessError:
                pass
