"""Celery task events for the attempts a message runs itself (eager attempts, eager.py), so that
Flower shows each of them as a task of its own, as it shows a published attempt.

An eager attempt is not a Celery task: no worker main process receives it, so no task event
would name it. With NOETL_EAGER_TASK_EVENTS=1 (off by default: it costs about a quarter of a
plain loop's rate, docs/benchmarks.md), when the worker sends task events (NOETL_TASK_EVENTS,
on by default), the pool process sends one event for each eager attempt: its last,
`task-succeeded` with the outcome line, `task-retried` or `task-failed` with the error and, for
python code, the code's own traceback (verdict.py). It carries as well what `task-received` and
`task-started` carry for a published attempt: its `playbook:step` name, the same args line, when
it was received and started, the message that ran it as parent. Celery's event state, which
Flower keeps, builds the whole task from that one event. The uuid is new per attempt (the event
rows keep the message's task id as `queue_id`).

Best effort, as Celery's own task events are: an event that cannot be sent is dropped (logged at
debug) and the attempt goes on. One dispatcher per pool process, made at first use and again
after a fork or a failed send.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from noetl_celery.core.errors import AttemptFailed
from noetl_celery.engine.messages import Dispatch
from noetl_celery.engine.transport import verdict

log = logging.getLogger(__name__)

_dispatchers: dict[int, Any] = {}  # pid -> this process's EventDispatcher


def ending(payload: dict[str, Any], decided: list[Dispatch] | None) -> tuple[str, dict[str, Any]]:
    """The last task event of an attempt and its fields, as Celery sends them for run_task."""
    try:
        line = verdict.conclude(payload, decided)
    except verdict.AttemptRetried as retried:
        return "task-retried", {"exception": repr(retried.exc), "traceback": f"AttemptFailed: {retried.message}"}
    except AttemptFailed as failed:
        shown = getattr(failed, "user_traceback", None) or f"{type(failed).__name__}: {failed}"
        return "task-failed", {"exception": repr(failed), "traceback": shown}
    return "task-succeeded", {"result": repr(line)}


def announce(
    app: Any,
    request: Any,
    *,
    name: str,
    args: str,
    kwargs: str,
    started: float,
    runtime: float,
    end: tuple[str, dict[str, Any]],
) -> None:
    """Send the task event of one eager attempt run by `request`'s message (`started`: its
    time.time() at the start, `runtime`: seconds)."""
    if not app.conf.worker_send_task_events:
        return
    parent = getattr(request, "id", None)
    kind, fields = end
    if kind == "task-succeeded":
        fields = {**fields, "runtime": runtime}
    try:
        _dispatcher(app, getattr(request, "hostname", None)).send(
            kind,
            uuid=str(uuid.uuid4()),
            name=name,
            args=args,
            kwargs=kwargs,
            root_id=getattr(request, "root_id", None) or parent,
            parent_id=parent,
            retries=0,
            received=started,
            started=started,
            **fields,
        )
    except Exception as exc:  # as Celery's: an event is never worth an attempt
        log.debug("task events of an eager attempt not sent: %s", exc)
        _drop(os.getpid())


def _dispatcher(app: Any, hostname: str | None) -> Any:
    pid = os.getpid()
    found = _dispatchers.get(pid)
    if found is None:
        _dispatchers.clear()  # a forked child drops its parent's (never closes its connection)
        connection = app.connection_for_write()
        found = app.events.Dispatcher(connection, hostname=hostname, enabled=True)
        _dispatchers[pid] = found
    return found


def _drop(pid: int) -> None:
    found = _dispatchers.pop(pid, None)
    if found is not None:
        try:
            found.close()
            found.connection.release()
        except Exception:  # a broken connection: nothing more to release
            pass
