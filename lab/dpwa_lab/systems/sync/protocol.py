"""Synchronous SGD's message kinds: one request kind for each call of the master, with bounded fields.

=======================  =====================  ==============================================
kind                     direction              meaning
=======================  =====================  ==============================================
sync_get_task            worker -> master       GetTask
sync_task                master -> worker       a task, its lease token and the model version
sync_wait                master -> worker       no task now; others hold the rest; ask again
sync_no_more_task        master -> worker       NO_MORE_TASK: training is complete
sync_update_model        worker -> master       UpdateModelIfOutOfDate(version)
sync_model               master -> worker       the model: parameters and buffers (2 frames)
sync_up_to_date          master -> worker       the worker's version is current
sync_report_gradients    worker -> master       ReportGradients(version, grads): 2 frames,
                                                gradients and buffer deltas
sync_accepted            master -> worker       the gradients were taken
sync_report_task         worker -> master       ReportTask(task, done | failed)
sync_task_recorded       master -> worker       the report was recorded
sync_status              anyone -> master       counts, for monitors and tests
sync_status_reply        master -> anyone       the counts
=======================  =====================  ==============================================

Every request names its sender (``from``) and the model's layout fingerprint
(``fp``). Refusals travel as the transport's ``error`` kind with a reason:
``stale_version``, ``not_held`` (ordinary) or ``unknown_task``, ``bad_seq``,
``bad_version``, ``bad_batch``, ``bad_values``, ``bad_fingerprint`` (a worker
no honest worker would send).
"""

from __future__ import annotations

from dpwa.wire.schema import MAX_ID, NAME_PATTERN, Blob, Choice, Flag, Integer, ListOf, MapOf, Text, message_kind

__all__ = [
    "ACCEPTED",
    "GET_TASK",
    "MODEL",
    "MODEL_REPLIES",
    "NO_MORE_TASK",
    "REPORT_GRADIENTS",
    "REPORT_TASK",
    "STATUS",
    "STATUS_REPLY",
    "TASK",
    "TASK_RECORDED",
    "TASK_REPLIES",
    "UPDATE_MODEL",
    "UP_TO_DATE",
    "WAIT",
]

MAX_TASKS = 10_000_000
MAX_VERSION = 2**53  # steps; a version beyond this is a lie
NAME = Text(64, NAME_PATTERN)
FINGERPRINT = Blob(length=16)
TASK_ID = Integer(0, MAX_TASKS - 1)
TOKEN = Integer(1, MAX_ID)
VERSION = Integer(0, MAX_VERSION)
COUNT = Integer(0, MAX_ID)

GET_TASK = message_kind("sync_get_task", {"from": NAME, "fp": FINGERPRINT})
TASK = message_kind(
    "sync_task",
    {
        "task": TASK_ID,
        "epoch": Integer(0, MAX_TASKS),
        "segment": Integer(0, MAX_TASKS),
        "token": TOKEN,
        "version": VERSION,
    },
)
WAIT = message_kind("sync_wait", {"retry_ms": Integer(1, 60_000)})
NO_MORE_TASK = message_kind("sync_no_more_task", {"version": VERSION})
TASK_REPLIES = {k.name: k for k in (TASK, WAIT, NO_MORE_TASK)}

# version -1: the worker holds no model yet
UPDATE_MODEL = message_kind("sync_update_model", {"from": NAME, "fp": FINGERPRINT, "version": Integer(-1, MAX_VERSION)})
MODEL = message_kind("sync_model", {"version": VERSION, "params_bytes": COUNT, "buffers_bytes": COUNT}, payload=2)
UP_TO_DATE = message_kind("sync_up_to_date", {"version": VERSION})
MODEL_REPLIES = {k.name: k for k in (MODEL, UP_TO_DATE)}

REPORT_GRADIENTS = message_kind(
    "sync_report_gradients",
    {
        "from": NAME,
        "fp": FINGERPRINT,
        "task": TASK_ID,
        "token": TOKEN,
        "seq": Integer(1, MAX_TASKS),
        "version": VERSION,
        "batch": Integer(1, 1 << 16),
    },
    payload=2,
)
ACCEPTED = message_kind("sync_accepted", {"version": VERSION, "stepped": Flag(), "duplicate": Flag()})

REPORT_TASK = message_kind(
    "sync_report_task",
    {"from": NAME, "fp": FINGERPRINT, "task": TASK_ID, "token": TOKEN, "status": Choice(("done", "failed"))},
)
TASK_RECORDED = message_kind("sync_task_recorded", {"complete": Flag()})

STATUS = message_kind("sync_status", {"from": NAME})
_COUNTS = ("version", "steps", "samples", "total", "todo", "doing", "done", "retried", "expired", "failed")
STATUS_REPLY = message_kind(
    "sync_status_reply",
    {
        **{key: COUNT for key in _COUNTS},
        "done_twice": COUNT,
        "complete": Flag(),
        "live": ListOf(NAME, 1024),
        "sufficient": COUNT,
        "pending_gradients": COUNT,
        "holders": MapOf(NAME, ListOf(ListOf(COUNT, 2), 16), 1024),
        "refused": MapOf(Text(64, NAME_PATTERN), COUNT, 64),
    },
    max_header_bytes=1 << 16,
)
