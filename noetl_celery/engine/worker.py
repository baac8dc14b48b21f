"""One attempt of one task on a worker: render, run the tool, run its sink, report the outcome.

The worker never decides what runs next: it returns the outcome for on_event. It reads the plan
and the execution state (cached per process) and writes nothing to the event store.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import UTC, datetime
from typing import Any

from noetl_celery import credentials
from noetl_celery.dsl.plan import Sink, Task
from noetl_celery.engine.context import STATE, Scope, render_context
from noetl_celery.engine.ids import attempt_key
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.errors import CredentialError, TemplateError
from noetl_celery.jsonable import to_jsonable
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from noetl_celery.templating import as_step_result, plain, render_value, response_view
from noetl_celery.tools.base import Outcome, ToolCall, get_tool, run_tool

CALL_OVERRIDES = ("params", "body", "payload", "json", "headers", "args", "data")  # merged by next_call
WORKER_NAME = f"{socket.gethostname()}:{os.getpid()}"


def apply_call(config: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    """A pagination `next_call` applied to a task's configuration (merged, or replaced for url)."""
    if not call:
        return config
    merged = dict(config)
    for key, value in call.items():
        target = "url" if key == "endpoint" else key
        if target in CALL_OVERRIDES and isinstance(value, dict) and isinstance(merged.get(target), dict):
            merged[target] = {**merged[target], **value}
        else:
            merged[target] = value
    return merged


def _credential(auth: Any, context: dict[str, Any]) -> Any:
    if auth is None:
        return None
    return credentials.resolve(plain(render_value(auth, context)))


def _call(kind: str, config: dict[str, Any], auth: Any, context: dict[str, Any], execution_id: int,
          secrets: set[str]) -> Outcome:
    spec = get_tool(kind)
    raw = spec.raw_fields if spec else frozenset()
    try:
        rendered = plain(render_value(config, context, raw_keys=raw))
        credential = _credential(auth, context)
    except TemplateError as exc:
        return Outcome.fail("template", str(exc))
    except CredentialError as exc:
        return Outcome.fail("credential", str(exc))
    secrets |= credentials.secret_values(credential) if credential is not None else set()
    timeout = rendered.get("timeout") if isinstance(rendered.get("timeout"), (int, float)) else None
    return run_tool(ToolCall(kind=kind, config=rendered, credential=credential, context=context,
                             execution_id=execution_id, timeout=timeout))


def _run_sink(sink: Sink, outcome: Outcome, context: dict[str, Any], execution_id: int,
              secrets: set[str]) -> Outcome:
    scope = {**context, "result": as_step_result(outcome.data), "response": response_view(outcome.data),
             "data": outcome.data}
    return _call(sink.kind, sink.config, sink.auth, scope, execution_id, secrets)


def already_done(url: str, message: TaskMessage) -> bool:
    key = attempt_key(message.run_id, message.iteration, message.seq, message.attempt) + ".done"
    with transaction(url) as conn:
        return repo.event_exists(conn, message.execution_id, key)


def execute(url: str, message: TaskMessage, *, queue_id: str | None = None) -> dict[str, Any] | None:
    """Run one attempt; returns the on_event payload (None for a replay of a finished attempt)."""
    if message.replay and already_done(url, message):
        return None
    started = time.time()
    state = STATE.get(url, message.execution_id, min_version=message.version)
    step = state.plan.steps[message.step]
    task: Task = step.tasks[message.task_index]
    scope = Scope(iteration=message.iteration, element=message.element,
                  iterator=step.loop.iterator if step.loop else None, iter_vars=message.iter_vars,
                  prev=message.prev, args=message.args, attempt=message.attempt, step=step.name,
                  task_results=message.task_results)
    context = render_context(state, scope)
    secrets: set[str] = set()
    outcome = _call(task.kind, apply_call(task.config, message.call), task.auth, context,
                    message.execution_id, secrets)
    if outcome.status == "ok" and task.sink is not None:
        sink_outcome = _run_sink(task.sink, outcome, context, message.execution_id, secrets)
        outcome.meta["sink"] = {"kind": task.sink.kind, "status": sink_outcome.status,
                                "data": sink_outcome.data, "error": sink_outcome.error}
        if sink_outcome.status != "ok":
            error = dict(sink_outcome.error or {})
            error["message"] = f"sink ({task.sink.kind}) failed: {error.get('message', '')}"
            error["kind"] = "sink"
            outcome = Outcome(status="error", data=outcome.data, error=error, http=outcome.http,
                              pg=sink_outcome.pg, meta=outcome.meta)
    body = to_jsonable(outcome.to_dict())
    if secrets:
        body = credentials.scrub(body, secrets)
    report = {
        "queue_id": queue_id,
        "worker": WORKER_NAME,
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_ms": round((time.time() - started) * 1000, 3),
    }
    return {"kind": "outcome", "execution_id": message.execution_id, "task": message.to_dict(),
            "outcome": body, "report": report}
