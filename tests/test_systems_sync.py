"""Synchronous SGD with a master: the pure state (queues, leases, versions), the service over the wire, the worker.

The multi-process test (a worker killed with SIGKILL while it holds a task)
is at the end; it runs the comparison's runner on a small workload.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from dpwa.wire.calls import Response
from dpwa.wire.curve import CurveKeys
from dpwa.wire.endpoints import private_dir
from dpwa.wire.errors import TransportError
from dpwa.wire.schema import decode, encode, error_header
from dpwa_lab.systems.layout import ModuleView
from dpwa_lab.systems.optim import SGDSettings
from dpwa_lab.systems.sync import protocol as m
from dpwa_lab.systems.sync.client import MasterClient, MasterUnreachable
from dpwa_lab.systems.sync.master import (
    Assignment,
    BadRequest,
    Holding,
    Master,
    NoMoreTask,
    Refusal,
    Segment,
    TaskBoard,
    Wait,
    make_tasks,
)
from dpwa_lab.systems.sync.model import GlobalModel
from dpwa_lab.systems.sync.service import MasterService
from dpwa_lab.systems.sync.worker import SyncWorker

G = np.ones(4, np.float32)  # a gradient
D = np.zeros(0, np.float32)  # no buffers


class Sums:
    """An aggregator that remembers the mean of each step (values known in advance)."""

    def __init__(self) -> None:
        self.count = 0
        self._added: list[np.ndarray] = []
        self.steps: list[np.ndarray] = []

    def add(self, grads, deltas, batch):
        self._added.append(grads.copy())
        self.count += 1

    def step(self):
        self.steps.append(np.mean(self._added, axis=0))
        self._added.clear()
        self.count = 0


def master(tasks=4, **kwargs) -> Master:
    return Master(make_tasks(1, tasks), Sums(), **{"lease_s": 10.0, **kwargs})


def assigned(mst: Master, worker: str, now: float) -> Assignment:
    """The task `mst` leases to `worker`, which the test expects to be there."""
    job = mst.get_task(worker, now)
    assert isinstance(job, Assignment), job
    return job


def take(board: TaskBoard, worker: str, now: float) -> tuple[Segment, Holding]:
    """The next task and its lease, which the test expects to be there."""
    taken = board.take(worker, now)
    assert taken is not None
    return taken


# --------------------------------------------------------------------------- the task board


def test_tasks_flow_from_todo_to_doing_to_done_once():
    board = TaskBoard(make_tasks(2, 2), lease_s=5.0)
    assert [t.id for t in board.tasks.values()] == [0, 1, 2, 3]
    task, lease = take(board, "w1", now=0.0)
    assert task == Segment(0, 0, 0) and lease.worker == "w1" and lease.expires_at == 5.0
    assert board.finish(0, "w1", lease.token, "done", now=1.0) is True
    assert board.done == {0: ("w1", lease.token)} and board.done_twice == 0
    assert board.finish(0, "w1", lease.token, "done", now=1.1) is False  # a resent report: answered, not counted
    assert board.completions[0] == 1
    with pytest.raises(Refusal, match="not_held"):
        board.finish(0, "w2", lease.token, "done", now=1.2)  # another worker cannot complete it
    with pytest.raises(BadRequest, match="unknown_task"):
        board.finish(99, "w1", 1, "done", now=1.3)


def test_an_expired_lease_returns_the_task_to_the_front_of_todo_and_its_holder_loses_it():
    board = TaskBoard(make_tasks(1, 3), lease_s=5.0)
    _, first = take(board, "w1", now=0.0)
    board.holding(0, "w1", first.token, now=4.0)  # a call renews the lease to 9.0
    assert board.expire(now=8.9) == []
    assert board.expire(now=9.0) == [0]
    assert list(board.todo) == [0, 1, 2] and board.retried == 1 and board.expired == 1
    task, second = take(board, "w2", now=9.0)
    assert task.id == 0 and second.token != first.token
    with pytest.raises(Refusal, match="not_held"):  # the stalled first holder comes back: refused
        board.finish(0, "w1", first.token, "done", now=9.5)
    board.finish(0, "w2", second.token, "done", now=10.0)
    assert board.completions[0] == 1 and board.done_twice == 0


def test_a_failed_task_goes_back_to_todo_first():
    board = TaskBoard(make_tasks(1, 3), lease_s=5.0)
    _, lease = take(board, "w1", now=0.0)
    board.finish(0, "w1", lease.token, "failed", now=1.0)
    assert list(board.todo) == [0, 1, 2] and board.failed == 1 and board.retried == 1 and not board.done


# --------------------------------------------------------------------------- the master


def test_get_task_waits_while_others_hold_the_rest_and_ends_with_no_more_task():
    mst = master(tasks=1)
    job = mst.get_task("w1", now=0.0)
    assert isinstance(job, Assignment) and job.version == 0
    assert isinstance(mst.get_task("w2", now=0.1), Wait)
    mst.report_task("w1", job.task.id, job.token, "done", now=0.2)
    assert isinstance(mst.get_task("w2", now=0.3), NoMoreTask)
    assert mst.live_workers(now=0.3) == ["w1"]  # w2 was told: no longer counted


def test_enough_gradients_step_the_model_and_old_versions_are_refused():
    mst = master(sufficient=2)
    a, b = mst.get_task("w1", 0.0), mst.get_task("w2", 0.0)
    assert isinstance(a, Assignment) and isinstance(b, Assignment)
    assert not mst.report_gradients("w1", a.task.id, a.token, 1, 0, 32, 1 * G, D, now=0.1).stepped
    accepted = mst.report_gradients("w2", b.task.id, b.token, 1, 0, 32, 3 * G, D, now=0.2)
    assert accepted.stepped and accepted.version == 1 and mst.version == 1
    assert isinstance(mst.aggregator, Sums) and np.array_equal(mst.aggregator.steps[0], 2 * G)  # the mean of the two
    with pytest.raises(Refusal) as refused:  # w1 computed its next gradient on version 0: refused
        mst.report_gradients("w1", a.task.id, a.token, 2, 0, 32, G, D, now=0.3)
    assert refused.value.reason == "stale_version" and type(refused.value) is Refusal
    with pytest.raises(BadRequest, match="bad_version"):  # a version from the future is a lie
        mst.report_gradients("w1", a.task.id, a.token, 2, 5, 32, G, D, now=0.4)
    assert mst.model_out_of_date("w1", 0, now=0.5) is True
    assert mst.model_out_of_date("w1", 1, now=0.5) is False
    assert mst.report_gradients("w1", a.task.id, a.token, 2, 1, 32, G, D, now=0.6).version == 1
    assert mst.samples == 96 and mst.refused == {"stale_version": 1, "bad_version": 1}


def test_by_default_a_step_needs_one_gradient_per_live_worker():
    mst = master(tasks=4, lease_s=5.0)
    jobs = {w: assigned(mst, w, now=0.0) for w in ("w1", "w2", "w3")}
    assert mst.sufficient(now=0.0) == 3
    for i, w in enumerate(("w1", "w2")):
        assert not mst.report_gradients(w, jobs[w].task.id, jobs[w].token, 1, 0, 8, G, D, now=1.0 + i).stepped
    assert mst.report_gradients("w3", jobs["w3"].task.id, jobs["w3"].token, 1, 0, 8, G, D, now=3.0).stepped
    # w3 goes silent; once its lease time passed it is not live, and two gradients make a step
    for now in (4.0, 7.5):  # w1 and w2 keep calling (each call renews their leases)
        assert mst.model_out_of_date("w1", 0, now=now) and mst.model_out_of_date("w2", 0, now=now)
    assert mst.sufficient(now=7.9) == 3
    assert mst.sufficient(now=8.1) == 2 and mst.live_workers(now=8.1) == ["w1", "w2"]
    assert not mst.report_gradients("w1", jobs["w1"].task.id, jobs["w1"].token, 2, 1, 8, G, D, now=8.1).stepped
    assert mst.report_gradients("w2", jobs["w2"].task.id, jobs["w2"].token, 2, 1, 8, G, D, now=8.2).stepped


def test_a_resent_report_is_not_counted_twice_and_sequence_numbers_must_follow():
    mst = master(sufficient=3)
    job = assigned(mst, "w1", 0.0)
    mst.report_gradients("w1", job.task.id, job.token, 1, 0, 32, G, D, now=0.1)
    again = mst.report_gradients("w1", job.task.id, job.token, 1, 0, 32, G, D, now=0.2)
    assert again.duplicate and mst.aggregator.count == 1 and mst.samples == 32
    with pytest.raises(BadRequest, match="bad_seq"):
        mst.report_gradients("w1", job.task.id, job.token, 3, 0, 32, G, D, now=0.3)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"grads": np.array([1, np.nan, 0, 0], np.float32)}, "bad_values"),
        ({"grads": np.array([1, np.inf, 0, 0], np.float32)}, "bad_values"),
        ({"batch": 0}, "bad_batch"),
        ({"batch": 1 << 17}, "bad_batch"),
        ({"task": 99}, "unknown_task"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(change, reason):
    mst = master()
    job = assigned(mst, "w1", 0.0)
    args = {"task": job.task.id, "batch": 32, "grads": G, **change}
    with pytest.raises(BadRequest, match=reason):
        mst.report_gradients("w1", args["task"], job.token, 1, 0, args["batch"], args["grads"], D, now=0.1)
    assert mst.aggregator.count == 0 and mst.samples == 0 and mst.version == 0


def test_reports_for_a_task_not_held_are_refused():
    mst = master()
    job = assigned(mst, "w1", 0.0)
    for worker, token in (("w2", job.token), ("w1", job.token + 1)):
        with pytest.raises(Refusal, match="not_held"):
            mst.report_gradients(worker, job.task.id, token, 1, 0, 32, G, D, now=0.1)
    with pytest.raises(Refusal, match="not_held"):  # a task still in todo
        mst.report_task("w1", 3, job.token, "done", now=0.2)


def test_the_last_partial_step_is_taken_when_training_completes():
    mst = master(tasks=1, sufficient=4)
    job = assigned(mst, "w1", 0.0)
    mst.report_gradients("w1", job.task.id, job.token, 1, 0, 32, 2 * G, D, now=0.1)
    assert mst.report_task("w1", job.task.id, job.token, "done", now=0.2) is True
    assert mst.version == 1 and isinstance(mst.aggregator, Sums) and np.array_equal(mst.aggregator.steps[0], 2 * G)
    status = mst.status(now=0.3)
    assert status["complete"] and status["done"] == status["total"] == 1 and status["done_twice"] == 0


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="num_gradients_sufficient"):
        Master(make_tasks(1, 1), Sums(), sufficient=0)
    with pytest.raises(ValueError, match="lease_s"):
        Master(make_tasks(1, 1), Sums(), lease_s=0)
    with pytest.raises(ValueError, match="epochs and segments"):
        make_tasks(0, 3)


# --------------------------------------------------------------------------- the global model


def test_global_model_applies_the_sample_weighted_mean_and_the_mean_buffer_delta():
    params, buffers = np.zeros(2, np.float32), np.ones(1, np.float32)
    from dpwa_lab.systems.layout import ModelLayout

    layout = ModelLayout([("w", (2,), "param"), ("rm", (1,), "buffer")])
    model = GlobalModel(layout, params, buffers, SGDSettings(lr=1.0, momentum=0.0, nesterov=False, weight_decay=0))
    model.add(np.array([1, 1], np.float32), np.array([0.5], np.float32), batch=10)
    model.add(np.array([4, 4], np.float32), np.array([1.5], np.float32), batch=30)
    before = model.published
    model.step()
    assert np.allclose(model.params, [-3.25, -3.25])  # (1 * 10 + 4 * 30) / 40
    assert np.allclose(model.buffers, [2.0]) and model.samples == 40
    assert np.array_equal(before[0], [0, 0]) and not before[0].flags.writeable  # published copies never change


# --------------------------------------------------------------------------- over the wire


def tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def service():
    """A master on a fresh ipc endpoint with workers w1, w2 (and tests' own clients), closed afterwards."""
    made = []

    def make(tasks=4, sufficient=None, lease_s=10.0, curve=None, workers=("w1", "w2", "obs")):
        view = ModuleView(tiny_net())
        model = GlobalModel(view.layout, view.params(), view.buffers(), SGDSettings(lr=0.1))
        mst = Master(make_tasks(1, tasks), model, lease_s=lease_s, sufficient=sufficient)
        endpoint = f"ipc://{private_dir()}/test-sync-{uuid.uuid4().hex[:12]}"
        svc = MasterService(mst, model, endpoint, workers=list(workers), curve=curve).start()
        made.append(svc)
        return svc, view.layout

    before = {t.ident for t in threading.enumerate()}
    yield make
    for svc in made:
        assert svc.close()
        path = Path(svc.endpoint[len("ipc://") :])
        assert not path.exists() and not Path(f"{path}.lock").exists()  # the endpoint's files are removed
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dpwa-")]
    assert not leftover, f"threads left behind: {leftover}"


@pytest.mark.io
def test_a_second_master_on_the_same_endpoint_is_refused(service):
    svc, layout = service()
    model = GlobalModel(
        layout, np.zeros(layout.param_size, np.float32), np.zeros(layout.buffer_size, np.float32), SGDSettings()
    )
    second = MasterService(Master(make_tasks(1, 1), model), model, svc.endpoint)
    with pytest.raises(TransportError, match="in use by another process"):
        second.start()
    assert svc.server.alive


@pytest.mark.io
def test_a_report_with_an_old_version_is_refused_over_the_wire(service):
    svc, layout = service(sufficient=1)
    grads, deltas = np.zeros(layout.param_size, np.float32), np.zeros(layout.buffer_size, np.float32)
    with MasterClient(svc.endpoint, "w1", layout, timeout_s=2.0) as client:
        got = client.update_model(-1)
        assert got is not None and got[0] == 0 and got[1].size == layout.param_size
        assert client.update_model(0) is None  # current: nothing sent
        job = client.get_task()
        assert isinstance(job, Assignment)
        assert client.report_gradients(job, 1, 0, 32, grads, deltas).stepped  # one is sufficient: version 1
        with pytest.raises(Refusal) as refused:
            client.report_gradients(job, 2, 0, 32, grads, deltas)
        assert refused.value.reason == "stale_version"
        got = client.update_model(0)
        assert got is not None and got[0] == 1
        accepted = client.report_gradients(job, 2, 1, 32, grads, deltas)
        assert accepted.stepped and accepted.version == 2
    status = svc.status()
    assert status["refused"] == {"stale_version": 1} and status["version"] == 2


@pytest.mark.io
def test_a_busy_refusal_is_asked_again_and_the_call_succeeds(service, monkeypatch):
    """The master refuses a worker ``busy`` while its ZeroMQ still holds earlier replies to it (CI saw a worker
    die of one on a loaded machine): the client asks again after a short pause, and the call succeeds."""
    svc, layout = service()
    with MasterClient(svc.endpoint, "w1", layout, timeout_s=2.0) as client:
        real = client._channel.request
        refusals = iter(["busy", "busy"])

        def request(frames, request_id, deadline, accept=None):
            if next(refusals, None):
                header = decode(error_header(request_id, "busy", "2 replies to you are still unsent"))
                return Response(header, [])
            return real(frames, request_id, deadline, accept=accept)

        monkeypatch.setattr(client._channel, "request", request)
        got = client.update_model(-1)
        assert got is not None and got[0] == 0 and got[1].size == layout.param_size
        assert client.busy_retries == 2


@pytest.mark.io
def test_bad_requests_are_rejected_over_the_wire_and_the_master_serves_on(service):
    svc, layout = service(sufficient=2)
    grads, deltas = np.zeros(layout.param_size, np.float32), np.zeros(layout.buffer_size, np.float32)
    nan = grads.copy()
    nan[5] = np.nan
    with MasterClient(svc.endpoint, "w1", layout) as client:
        job = client.get_task()
        assert isinstance(job, Assignment)
        with pytest.raises(Refusal, match="bad_values"):
            client.report_gradients(job, 1, 0, 32, nan, deltas)
        wrong = Assignment(job.task, job.token + 1, 0)
        with pytest.raises(Refusal, match="not_held"):
            client.report_gradients(wrong, 1, 0, 32, grads, deltas)
        # frames of the wrong size, sent by hand
        fields = {
            "from": "w1",
            "fp": layout.fingerprint,
            "task": job.task.id,
            "token": job.token,
            "seq": 1,
            "version": 0,
            "batch": 32,
        }
        with pytest.raises(Refusal, match="bad_size"):
            client._request(
                lambda rid: [encode(m.REPORT_GRADIENTS, rid, **fields), grads[:-1], deltas],
                {m.ACCEPTED.name: m.ACCEPTED},
                "a short frame",
            )
        assert svc.status()["pending_gradients"] == 0
        client.report_gradients(job, 1, 0, 32, grads, deltas)  # still served
    other = ModuleView(torch.nn.Linear(4, 2)).layout
    with MasterClient(svc.endpoint, "w2", other) as client, pytest.raises(Refusal, match="bad_fingerprint"):
        client.get_task()
    with MasterClient(svc.endpoint, "intruder", layout) as client, pytest.raises(Refusal, match="bad_identity"):
        client.get_task()
    assert svc.server.alive and svc.status()["pending_gradients"] == 1


@pytest.mark.io
def test_a_stalled_holder_is_refused_after_its_lease_and_the_task_is_done_once(service):
    svc, layout = service(tasks=1, sufficient=1, lease_s=0.3)
    grads, deltas = np.zeros(layout.param_size, np.float32), np.zeros(layout.buffer_size, np.float32)
    with MasterClient(svc.endpoint, "w1", layout) as slow, MasterClient(svc.endpoint, "w2", layout) as fast:
        first = slow.get_task()
        assert isinstance(first, Assignment)
        assert isinstance(fast.get_task(), Wait)
        # w1 stalls past its lease; the next call for work finds the task back in todo
        deadline = threading.Event()
        deadline.wait(0.35)
        second = fast.get_task()
        assert isinstance(second, Assignment) and second.task == first.task and second.token != first.token
        with pytest.raises(Refusal, match="not_held"):
            slow.report_gradients(first, 1, 0, 32, grads, deltas)
        fast.report_gradients(second, 1, 0, 32, grads, deltas)
        assert fast.report_task(second, "done") is True
        with pytest.raises(Refusal, match="not_held"):
            slow.report_task(first, "done")
    status = svc.status()
    assert status["done"] == 1 and status["done_twice"] == 0 and status["expired"] == 1
    assert svc.complete


@pytest.mark.io
def test_curve_keys_admit_the_listed_worker_only(service):
    server_pub, server_sec = zmq.curve_keypair()
    worker_pub, worker_sec = zmq.curve_keypair()
    allowed = {zmq.utils.z85.decode(worker_pub): "w1"}
    svc, layout = service(curve=CurveKeys(server_pub, server_sec, allowed), workers=("w1",))
    good = CurveKeys(worker_pub, worker_sec).client_options(server_pub)
    with MasterClient(svc.endpoint, "w1", layout, socket_options=good) as client:
        assert isinstance(client.get_task(), Assignment)
    stranger_pub, stranger_sec = zmq.curve_keypair()
    bad = CurveKeys(stranger_pub, stranger_sec).client_options(server_pub)
    stranger = MasterClient(svc.endpoint, "w1", layout, socket_options=bad, timeout_s=0.2, unreachable_s=0.5)
    with stranger, pytest.raises(MasterUnreachable):
        stranger.get_task()
    assert svc.status()["holders"] == {"w1": [[0, 0]]}


@pytest.mark.io
def test_workers_train_a_tiny_model_through_the_master(service):
    """Two worker threads, real gradients: every task done once, and the global model learned the task."""
    svc, layout = service(tasks=8)
    x = torch.randn(512, 4, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long()

    def work(name: str, out: dict) -> None:
        view = ModuleView(tiny_net())

        def compute(batch):
            loss = torch.nn.functional.cross_entropy(view.module(batch[0]), batch[1])
            loss.backward()
            return loss.item(), len(batch[1])

        def batches(task):
            idx = torch.arange(task.segment * 64, (task.segment + 1) * 64)
            return [(x[idx[i : i + 16]], y[idx[i : i + 16]]) for i in range(0, 64, 16)]

        with MasterClient(svc.endpoint, name, layout) as client:
            out[name] = SyncWorker(client, view, compute, batches).run()

    stats: dict = {}
    threads = [threading.Thread(target=work, args=(n, stats)) for n in ("w1", "w2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert svc.wait_complete(5.0)
    status = svc.status()
    assert status["done"] == 8 and status["done_twice"] == 0 and status["todo"] == status["doing"] == 0
    assert {s.finished for s in stats.values()} == {"no_more_task"}
    assert sum(s.tasks_done for s in stats.values()) + status["failed"] >= 8
    view = ModuleView(tiny_net())
    view.load_state(svc.model.state())
    view.module.eval()
    with torch.no_grad():
        accuracy = (view.module(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85


# --------------------------------------------------------------------------- a worker killed mid-task


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_worker_killed_mid_task_loses_no_task_and_none_is_done_twice(tmp_path):
    from dpwa_lab.compare.faults import KillSyncWorkerMidTask
    from dpwa_lab.compare.runner import RunOptions, run_system
    from dpwa_lab.compare.workload import WorkloadSpec, load_workload

    # 4 epochs (44 tasks), not 2: under load the master answers a status look in up to a second, and in 2 epochs
    # a CI run's 5 looks all came while w2 held no task with a report (here 1 run in 5 beside six busy loops
    # missed so, then 0 in 14 with 4 epochs beside six and eight); a kill is what the test is about
    spec = WorkloadSpec(
        data="digits", data_dir=str(tmp_path), workers=3, epochs=4, batch_size=32, lr=0.05, eval_points=4
    )
    layout = ModuleView(load_workload(spec).build_model()).layout
    fault = KillSyncWorkerMidTask("w2", 0.5, layout)
    run = run_system(
        "sync-master",
        spec,
        RunOptions(lease_s=2.0, time_limit_s=100),
        tmp_path / "run",
        fault=fault,
        log=lambda line: None,
    )
    report = fault.report()
    assert report["killed_at_s"] is not None and report["killed_at_s"] > 0, report
    assert report["held_task"]["reports_accepted"] >= 1  # it was mid-task
    # The lease (2 s) runs from the victim's last call, made shortly before it was frozen and killed:
    # the task goes back to todo about a lease after the kill, never at once.
    assert "requeued_after_s" in report, report
    assert 1.0 <= report["requeued_after_s"] < 6.0, report
    assert run.completed, run.error
    tasks = run.results["master"]["tasks"]
    assert tasks["done"] == tasks["total"] == spec.epochs * load_workload(spec).segments_per_epoch
    assert tasks["done_twice"] == 0 and tasks["expired"] >= 1
    assert run.exit_codes["w2"] == -9 and all(code == 0 for n, code in run.exit_codes.items() if n != "w2")
