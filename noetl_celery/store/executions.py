"""The executions' table: an execution's row, its head (status, pending, state_version), its
counters, its end, its parent and children, and the listing."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, func, select

from noetl_celery.config import secret_registry
from noetl_celery.store import db, kernel
from noetl_celery.store.kernel import EVENTS, EXECUTIONS, HOLDS, JOINS, LEASES, LOOPS, VARIABLES, utcnow

# --- executions ---------------------------------------------------------------------------


def create_execution(
    conn: Connection,
    *,
    execution_id: int,
    plan: dict[str, Any],
    workload: dict[str, Any],
    parent_execution_id: int | None = None,
    parent_event_id: str | None = None,
    parent_task: dict[str, Any] | None = None,
    depth: int = 0,
    timeout: float | None = None,
    pending: int = 0,
    state_version: int = 0,
) -> None:
    """A running execution; `timeout` (seconds) bounds it as a whole (the sweeper enforces it).
    `pending` and `state_version`: its counters as the decision of its start leaves them."""
    dialect = conn.dialect
    now = utcnow()
    values: dict[str, Any] = {
        "execution_id": execution_id,
        "parent_execution_id": parent_execution_id,
        "parent_event_id": parent_event_id,
        "parent_task": parent_task,
        "depth": depth,
        "playbook_name": plan["name"],
        "playbook_path": plan.get("path"),
        "status": "running",
        "plan": plan,
        "workload": workload,
        "pending": pending,
        "state_version": state_version,
        "created_at": now,
        "updated_at": now,
        "deadline_at": now + timedelta(seconds=timeout) if timeout else None,
        "epoch": 0,
    }
    sql = kernel.sql(
        dialect,
        "create",
        f"INSERT INTO noetl_execution ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
    )
    params = [kernel.bound(dialect, EXECUTIONS, name, value) for name, value in values.items()]
    if not db.defer(conn, sql, params):  # in a decision: sent with the decision's rows
        kernel.run(conn, sql, params)


def delete_unpublished_execution(conn: Connection, execution_id: int) -> None:
    """Remove an execution whose start was recorded but whose first messages could not be
    published (the broker is unreachable at submit), with every row of it and of the child
    executions its start created: nothing is left of what the user was told did not start."""
    c = EXECUTIONS.c
    ids = [
        execution_id,
        *(r[0] for r in conn.execute(select(c.execution_id).where(c.parent_execution_id == execution_id))),
    ]
    for table in (EVENTS, VARIABLES, JOINS, LOOPS, LEASES, HOLDS, EXECUTIONS):
        conn.execute(table.delete().where(table.c.execution_id.in_(ids)))


def get_execution(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    row = conn.execute(select(EXECUTIONS).where(EXECUTIONS.c.execution_id == execution_id)).mappings().first()
    return dict(row) if row else None


def count_events(conn: Connection, execution_id: int, event_type: str) -> int:
    """How many rows of `event_type` the execution has."""
    e = EVENTS.c
    query = select(func.count()).where(and_(e.execution_id == execution_id, e.event_type == event_type))
    return int(conn.execute(query).scalar_one())


def execution_head(conn: Connection, execution_id: int, *, deciding: bool = False) -> dict[str, Any] | None:
    """Status, pending and state version (no plan, no workload).

    `deciding`: the row is locked FOR KEY SHARE until the decision commits. Decisions do not block
    each other (nor their own counter updates), but a cancel (`lock_execution`) waits for them, and
    a decision that starts after a cancel sees its status: nothing is dispatched after a cancel."""
    dialect = conn.dialect
    if deciding and dialect.name == "postgresql":
        sql = kernel.sql(dialect, "head.deciding", HEAD_SQL + " FOR KEY SHARE")
    else:  # SQLite: BEGIN IMMEDIATE already holds the only writer's lock
        sql = kernel.sql(dialect, "head", HEAD_SQL)
    row = kernel.run(conn, sql, (execution_id,)).fetchone()
    return {"status": row[0], "pending": row[1], "state_version": row[2]} if row else None


HEAD_SQL = "SELECT status, pending, state_version FROM noetl_execution WHERE execution_id = ?"
# A running execution found by its key. The status is tested with IS TRUE, which no index can
# serve: on PostgreSQL a prepared statement's generic plan made while noetl_execution was small
# costs the key and ix_noetl_execution_status_created the same and may keep the latter for the
# connection's life, and then each such statement reads every running execution's index entry.
RUNNING_BY_KEY = "execution_id = ? AND (status = 'running') IS TRUE"
FINISH_SQL = (
    "UPDATE noetl_execution SET status = ?, error = ?, failed_step = ?, finished_at = ?, updated_at = ? "
    f"WHERE {RUNNING_BY_KEY} RETURNING execution_id"
)


def running_at(head: dict[str, Any] | None, version: int) -> bool:
    """Whether an execution head read for a decision is running at the state version the
    decision assumed (the strict write checks the same in SQL: `_HEAD_MATCHES`)."""
    return head is not None and head["status"] == "running" and head["state_version"] == version


def lock_execution(conn: Connection, execution_id: int) -> str | None:
    """Lock the execution row FOR UPDATE (waits for decisions in flight); returns its status."""
    c = EXECUTIONS.c
    row = conn.execute(select(c.status).where(c.execution_id == execution_id).with_for_update()).first()
    return row[0] if row else None


def bump_execution(conn: Connection, execution_id: int, *, pending: int = 0, version: int = 0) -> tuple[int, int, str]:
    """Atomically add to the pending counter and the state version; returns both new values and
    the execution's status."""
    dialect = conn.dialect
    sql = kernel.sql(
        dialect,
        "bump",
        "UPDATE noetl_execution SET pending = pending + ?, state_version = state_version + ?, updated_at = ? "
        "WHERE execution_id = ? RETURNING pending, state_version, status",
    )
    now = kernel.bound(dialect, EXECUTIONS, "updated_at", utcnow())
    row = kernel.run(conn, sql, (pending, version, now, execution_id)).fetchone()
    if row is None:
        raise LookupError(f"execution {execution_id} not found")
    return int(row[0]), int(row[1]), row[2]


def finish_execution(
    conn: Connection, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
) -> bool:
    """Move a running execution to completed/failed; False if it had already finished."""
    dialect = conn.dialect
    sql = kernel.sql(dialect, "finish", FINISH_SQL)
    now = kernel.bound(dialect, EXECUTIONS, "finished_at", utcnow())
    error = kernel.bound(dialect, EXECUTIONS, "error", secret_registry.mask(error))
    return kernel.run(conn, sql, (status, error, failed_step, now, now, execution_id)).fetchone() is not None


def list_executions(conn: Connection, limit: int = 20, *, top_level: bool = False) -> list[dict[str, Any]]:
    c = EXECUTIONS.c
    query = select(
        c.execution_id, c.playbook_name, c.status, c.created_at, c.finished_at, c.failed_step, c.parent_execution_id
    )
    if top_level:
        query = query.where(c.parent_execution_id.is_(None))
    rows = conn.execute(query.order_by(c.created_at.desc()).limit(limit)).mappings()
    return [dict(r) for r in rows]


# --- sub-playbooks -------------------------------------------------------------------------


def execution_link(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    """parent_execution_id, parent_event_id, parent_task and depth of an execution."""
    c = EXECUTIONS.c
    row = (
        conn.execute(
            select(c.parent_execution_id, c.parent_event_id, c.parent_task, c.depth).where(
                c.execution_id == execution_id
            )
        )
        .mappings()
        .first()
    )
    return dict(row) if row else None


def child_executions(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    c = EXECUTIONS.c
    rows = conn.execute(
        select(
            c.execution_id,
            c.playbook_name,
            c.playbook_path,
            c.status,
            c.parent_event_id,
            c.created_at,
            c.finished_at,
            c.failed_step,
            c.parent_execution_id,
        )
        .where(c.parent_execution_id == execution_id)
        .order_by(c.created_at, c.execution_id)
    ).mappings()
    return [dict(r) for r in rows]


def running_since(conn: Connection, before: datetime) -> list[int]:
    """Top-level executions still running that were created before `before`, oldest first."""
    c = EXECUTIONS.c
    query = select(c.execution_id).where(
        and_(c.status == "running", c.parent_execution_id.is_(None), c.created_at < before)
    )
    return [int(r[0]) for r in conn.execute(query.order_by(c.created_at))]
