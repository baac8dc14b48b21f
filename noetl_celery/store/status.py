"""What the store says of one execution, read without the compiler or the engine: its status
(results, ctx and vars, children, where a rerun or a schedule made it) and its event rows. The
commands that only read (`status`, `events`) and the REST API answer from here, so they start
without importing what running a playbook needs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import ExecutionNotFound
from noetl_celery.store import schedules as schedule_store
from noetl_celery.store.db import ensure_schema, transaction
from noetl_celery.store.events import find_event, list_events
from noetl_celery.store.executions import child_executions, execution_head, get_execution
from noetl_celery.store.urls import safe_url
from noetl_celery.store.variables import load_variables

RERUN_KEYS = ("rerun_of", "from_step", "plan", "registered_at", "seeded")


def rerun_origin(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    """{rerun_of, from_step, plan, registered_at, seeded} of an execution made by a rerun (its
    `execution.started` row's meta, engine/recovery/rerun.py); None otherwise."""
    row = find_event(conn, execution_id, ev.START_KEY)
    meta = (row or {}).get("meta") or {}
    if meta.get("rerun_of") is None:
        return None
    return {k: meta.get(k) for k in RERUN_KEYS}


def not_found(database_url: str, execution_id: int) -> ExecutionNotFound:
    return ExecutionNotFound(f"no execution {execution_id} in {safe_url(database_url)}")


def execution_status(database_url: str, execution_id: int) -> dict[str, Any]:
    """{execution_id, status, error, failed_step, results: {step: result}, ...} from the store."""
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        row = get_execution(conn, execution_id)
        if row is None:
            raise not_found(database_url, execution_id)
        variables = load_variables(conn, execution_id)
        made_from = rerun_origin(conn, execution_id) or {}
        scheduled = schedule_store.started_by(conn, execution_id)
        webhook = webhook_state(schedule_store.notification(conn, execution_id))
        children = [
            {
                "execution_id": c["execution_id"],
                "status": c["status"],
                "playbook": c["playbook_name"],
                "path": c["playbook_path"],
                "parent_event_id": c["parent_event_id"],
            }
            for c in child_executions(conn, execution_id)
        ]
    return {
        "execution_id": execution_id,
        "playbook": row["playbook_name"],
        "status": row["status"],
        "error": row["error"],
        "failed_step": row["failed_step"],
        "parent_execution_id": row["parent_execution_id"],
        "children": children,
        "rerun_of": made_from.get("rerun_of"),
        "from_step": made_from.get("from_step"),
        "results": variables.get("result", {}),
        "ctx": variables.get("ctx", {}),
        "vars": variables.get("vars", {}),
        "created_at": row["created_at"].isoformat() if row["created_at"] else None,
        "finished_at": row["finished_at"].isoformat() if row["finished_at"] else None,
        "scheduled": scheduled,
        "webhook": webhook,
    }


def webhook_state(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """An execution's webhook delivery (noetl_celery/observe/webhooks.py) as `status` shows it: `state`
    (pending, retrying, delivered, gave_up, not_chosen), attempts, the last error, the next try."""
    if row is None:
        return None
    if row["delivered_at"] is not None:
        state = "delivered"
    elif row["gave_up_at"] is not None:
        state = "not_chosen" if (row["last_error"] or "").startswith("not chosen") else "gave_up"
    else:
        state = "retrying" if row["attempts"] else "pending"

    def stamp(value: Any) -> str | None:
        return value.isoformat() if value is not None else None

    return {
        "state": state,
        "attempts": row["attempts"],
        "url": row["url"],
        "last_error": row["last_error"],
        "next_at": stamp(row["next_at"]),
        "delivered_at": stamp(row["delivered_at"]),
        "gave_up_at": stamp(row["gave_up_at"]),
    }


def execution_events(database_url: str, execution_id: int) -> list[dict[str, Any]]:
    """Every event row of the execution, in order."""
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        if execution_head(conn, execution_id) is None:
            raise not_found(database_url, execution_id)
        return list_events(conn, execution_id)
