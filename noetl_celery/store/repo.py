"""The few queries the engine needs, in SQLAlchemy Core (the hot path stays lean).

Every write that must happen once per event is either an idempotent insert on the event's
deterministic key (a duplicate is detected by `RETURNING` giving no row, never by rowcount) or an
atomic `UPDATE ... RETURNING` in the same transaction as that insert.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from noetl_celery import limits, secret_registry
from noetl_celery.store.models import CatalogEntry, Event, Execution, Join, LoopState, Variable

EVENTS = cast(Table, Event.__table__)
EXECUTIONS = cast(Table, Execution.__table__)
VARIABLES = cast(Table, Variable.__table__)
JOINS = cast(Table, Join.__table__)
LOOPS = cast(Table, LoopState.__table__)
CATALOG = cast(Table, CatalogEntry.__table__)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _insert(conn: Connection, table):  # type: ignore[no-untyped-def]
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"event store on {dialect} is not supported (use PostgreSQL or SQLite)")


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
) -> None:
    """A running execution; `timeout` (seconds) bounds it as a whole (the sweeper enforces it)."""
    now = utcnow()
    conn.execute(
        EXECUTIONS.insert().values(
            execution_id=execution_id,
            parent_execution_id=parent_execution_id,
            parent_event_id=parent_event_id,
            parent_task=parent_task,
            depth=depth,
            playbook_name=plan["name"],
            playbook_path=plan.get("path"),
            status="running",
            plan=plan,
            workload=workload,
            pending=0,
            state_version=0,
            created_at=now,
            updated_at=now,
            deadline_at=now + timedelta(seconds=timeout) if timeout else None,
            epoch=0,
        )
    )


def delete_unstarted_execution(conn: Connection, execution_id: int) -> None:
    """Remove an execution that never started (its start could not be enqueued)."""
    c = EXECUTIONS.c
    conn.execute(EXECUTIONS.delete().where(and_(c.execution_id == execution_id, c.pending == 0)))


def get_execution(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    row = conn.execute(select(EXECUTIONS).where(EXECUTIONS.c.execution_id == execution_id)).mappings().first()
    return dict(row) if row else None


def execution_head(conn: Connection, execution_id: int, *, deciding: bool = False) -> dict[str, Any] | None:
    """Status, pending and state version (no plan, no workload).

    `deciding`: the row is locked FOR KEY SHARE until the decision commits. Decisions do not block
    each other (nor their own counter updates), but a cancel (`lock_execution`) waits for them, and
    a decision that starts after a cancel sees its status: nothing is dispatched after a cancel."""
    c = EXECUTIONS.c
    query = select(c.status, c.pending, c.state_version).where(c.execution_id == execution_id)
    if deciding:
        query = query.with_for_update(read=True, key_share=True)
    row = conn.execute(query).mappings().first()
    return dict(row) if row else None


def lock_execution(conn: Connection, execution_id: int) -> str | None:
    """Lock the execution row FOR UPDATE (waits for decisions in flight); returns its status."""
    c = EXECUTIONS.c
    row = conn.execute(select(c.status).where(c.execution_id == execution_id).with_for_update()).first()
    return row[0] if row else None


def bump_execution(conn: Connection, execution_id: int, *, pending: int = 0, version: int = 0) -> tuple[int, int]:
    """Atomically add to the pending counter and the state version; returns both new values."""
    c = EXECUTIONS.c
    row = conn.execute(
        update(EXECUTIONS)
        .where(c.execution_id == execution_id)
        .values(pending=c.pending + pending, state_version=c.state_version + version, updated_at=utcnow())
        .returning(c.pending, c.state_version)
    ).first()
    if row is None:
        raise LookupError(f"execution {execution_id} not found")
    return int(row[0]), int(row[1])


def finish_execution(
    conn: Connection, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
) -> bool:
    """Move a running execution to completed/failed; False if it had already finished."""
    c = EXECUTIONS.c
    now = utcnow()
    row = conn.execute(
        update(EXECUTIONS)
        .where(and_(c.execution_id == execution_id, c.status == "running"))
        .values(
            status=status, error=secret_registry.mask(error), failed_step=failed_step, finished_at=now, updated_at=now
        )
        .returning(c.execution_id)
    ).first()
    return row is not None


def list_executions(conn: Connection, limit: int = 20, *, top_level: bool = False) -> list[dict[str, Any]]:
    c = EXECUTIONS.c
    query = select(
        c.execution_id, c.playbook_name, c.status, c.created_at, c.finished_at, c.failed_step, c.parent_execution_id
    )
    if top_level:
        query = query.where(c.parent_execution_id.is_(None))
    rows = conn.execute(query.order_by(c.created_at.desc()).limit(limit)).mappings()
    return [dict(r) for r in rows]


# --- events -------------------------------------------------------------------------------


EVENT_COLUMNS = tuple(c.name for c in EVENTS.c if c.name != "id")
_insert_statements: dict[str, Any] = {}


def _events_insert(conn: Connection):  # type: ignore[no-untyped-def]
    """One cached statement for every batch (executemany keeps its compiled form)."""
    stmt = _insert_statements.get(conn.dialect.name)
    if stmt is None:
        stmt = (
            _insert(conn, EVENTS)
            .on_conflict_do_nothing(index_elements=["execution_id", "event_id"])
            .returning(EVENTS.c.event_id, sort_by_parameter_order=True)
        )
        _insert_statements[conn.dialect.name] = stmt
    return stmt


# Columns that carry what tools and templates produced. The others are the engine's own names,
# keys and numbers (step, run_id, event_id, ...): decisions look rows up by them, so a secret that
# happens to be part of a step name must not rewrite them.
_CONTENT_COLUMNS = ("context", "result", "error", "meta")


def _masked(row: dict[str, Any]) -> dict[str, Any]:
    """An event row with every secret form masked in its content columns."""
    return {**row, **secret_registry.mask({k: row[k] for k in _CONTENT_COLUMNS if k in row})}


def insert_events(conn: Connection, rows: list[dict[str, Any]], *, first_must_be_new: bool = False) -> bool:
    """Insert event rows, in order. With `first_must_be_new`, returns False when the first row's
    key already exists (a redelivered event: the caller rolls back the whole transaction)."""
    if not rows:
        return True
    now = utcnow()
    batch = [_masked({c: r.get(c) for c in EVENT_COLUMNS}) for r in rows]
    for r in batch:
        r["created_at"] = r["created_at"] or now
    inserted = {row[0] for row in conn.execute(_events_insert(conn), batch)}
    return not first_must_be_new or rows[0]["event_id"] in inserted


def find_event(conn: Connection, execution_id: int, event_id: str) -> dict[str, Any] | None:
    c = EVENTS.c
    row = (
        conn.execute(select(EVENTS).where(and_(c.execution_id == execution_id, c.event_id == event_id)))
        .mappings()
        .first()
    )
    return dict(row) if row else None


def event_exists(conn: Connection, execution_id: int, event_id: str) -> bool:
    c = EVENTS.c
    return (
        conn.execute(select(c.id).where(and_(c.execution_id == execution_id, c.event_id == event_id))).first()
        is not None
    )


def list_events(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    rows = conn.execute(select(EVENTS).where(EVENTS.c.execution_id == execution_id).order_by(EVENTS.c.id)).mappings()
    return [dict(r) for r in rows]


def run_events(
    conn: Connection,
    execution_id: int,
    run_id: str,
    event_type: str,
    columns: tuple[str, ...] = ("iteration", "status", "result", "error"),
) -> list[dict[str, Any]]:
    c = EVENTS.c
    rows = conn.execute(
        select(*[c[name] for name in columns])
        .where(and_(c.execution_id == execution_id, c.run_id == run_id, c.event_type == event_type))
        .order_by(c.id)
    ).mappings()
    return [dict(r) for r in rows]


# --- variables (ctx, vars, step results) --------------------------------------------------


def put_variables(conn: Connection, execution_id: int, scope: str, values: dict[str, Any]) -> None:
    if not values:
        return
    now = utcnow()
    rows = [
        {
            "execution_id": execution_id,
            "scope": scope,
            "name": k,
            "value": limits.cap(secret_registry.mask(v)),
            "updated_at": now,
        }
        for k, v in values.items()
    ]
    stmt = _insert(conn, VARIABLES)
    stmt = stmt.on_conflict_do_update(
        index_elements=["execution_id", "scope", "name"],
        set_={"value": stmt.excluded.value, "updated_at": stmt.excluded.updated_at},
    )
    conn.execute(stmt, rows)


def load_variables(conn: Connection, execution_id: int) -> dict[str, dict[str, Any]]:
    c = VARIABLES.c
    scopes: dict[str, dict[str, Any]] = {}
    for scope, name, value in conn.execute(select(c.scope, c.name, c.value).where(c.execution_id == execution_id)):
        scopes.setdefault(scope, {})[name] = value
    return scopes


# --- joins --------------------------------------------------------------------------------


def open_join(conn: Connection, execution_id: int, fork_id: str, join_step: str, width: int) -> None:
    conn.execute(
        _insert(conn, JOINS)
        .values(execution_id=execution_id, fork_id=fork_id, join_step=join_step, width=width, settled=0, arrived=0)
        .on_conflict_do_nothing(index_elements=["execution_id", "fork_id"])
    )


def settle_join(conn: Connection, execution_id: int, fork_id: str, *, arrived: bool) -> tuple[int, int, int]:
    """One branch of the fork settled (arrived at the join, or ended); returns (settled, arrived, width)."""
    c = JOINS.c
    row = conn.execute(
        update(JOINS)
        .where(and_(c.execution_id == execution_id, c.fork_id == fork_id))
        .values(settled=c.settled + 1, arrived=c.arrived + (1 if arrived else 0))
        .returning(c.settled, c.arrived, c.width)
    ).first()
    if row is None:
        raise LookupError(f"fork {fork_id} of execution {execution_id} not found")
    return int(row[0]), int(row[1]), int(row[2])


# --- loops --------------------------------------------------------------------------------


def create_loop(conn: Connection, values: dict[str, Any]) -> None:
    now = utcnow()
    conn.execute(
        _insert(conn, LOOPS)
        .values(
            created_at=now,
            updated_at=now,
            status="running",
            dispatched=0,
            done=0,
            succeeded=0,
            failed=0,
            tolerated=0,
            slots_ended=0,
            **values,
        )
        .on_conflict_do_nothing(index_elements=["run_id"])
    )


def run_results(conn: Connection, execution_id: int, run_id: str, event_type: str) -> list[Any]:
    """The results of a run's rows of one type (a cursor loop's done rows), in recorded order."""
    e = EVENTS.c
    query = (
        select(e.result)
        .where(and_(e.execution_id == execution_id, e.run_id == run_id, e.event_type == event_type))
        .order_by(e.id)
    )
    return [row[0] for row in conn.execute(query)]


def get_loop(conn: Connection, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
    c = LOOPS.c
    cols = [col for col in LOOPS.c if with_collection or col.name != "collection"]
    row = conn.execute(select(*cols).where(c.run_id == run_id)).mappings().first()
    return dict(row) if row else None


def loop_iteration_done(conn: Connection, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]:
    """Count one finished iteration; returns the counters after the update (done, total, cap, ...)."""
    c = LOOPS.c
    row = (
        conn.execute(
            update(LOOPS)
            .where(c.run_id == run_id)
            .values(
                done=c.done + 1,
                succeeded=c.succeeded + (1 if ok else 0),
                failed=c.failed + (0 if ok else 1),
                tolerated=c.tolerated + (1 if tolerated else 0),
                updated_at=utcnow(),
            )
            .returning(c.done, c.succeeded, c.failed, c.tolerated, c.total, c.cap, c.status, c.context)
        )
        .mappings()
        .first()
    )
    if row is None:
        raise LookupError(f"loop {run_id} not found")
    return dict(row)


def execution_loops(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    """Every loop instance of the execution (without collections), oldest first."""
    c = LOOPS.c
    cols = [col for col in LOOPS.c if col.name != "collection"]
    rows = conn.execute(select(*cols).where(c.execution_id == execution_id).order_by(c.created_at)).mappings()
    return [dict(r) for r in rows]


def reopen_loop(conn: Connection, run_id: str, *, rerun: int, context: dict[str, Any]) -> None:
    """A resumed loop: `rerun` failed iterations are uncounted, and it runs again with `context`."""
    c = LOOPS.c
    conn.execute(
        update(LOOPS)
        .where(c.run_id == run_id)
        .values(
            done=c.done - rerun,
            failed=c.failed - rerun,
            status="running",
            context=context,
            updated_at=utcnow(),
        )
    )


def claim_loop_indexes(conn: Connection, run_id: str, count: int) -> int:
    """Add `count` to dispatched (loop start); returns the new value."""
    c = LOOPS.c
    row = conn.execute(
        update(LOOPS).where(c.run_id == run_id).values(dispatched=c.dispatched + count).returning(c.dispatched)
    ).first()
    return int(row[0]) if row else 0


def complete_loop(conn: Connection, run_id: str) -> bool:
    """Mark the loop completed exactly once; True only for the caller that did it."""
    c = LOOPS.c
    row = conn.execute(
        update(LOOPS)
        .where(and_(c.run_id == run_id, c.status == "running"))
        .values(status="completed", updated_at=utcnow())
        .returning(c.run_id)
    ).first()
    return row is not None


def end_loop_slot(conn: Connection, run_id: str) -> dict[str, Any]:
    """Count one cursor slot that saw an empty claim; returns the counters after the update."""
    c = LOOPS.c
    row = (
        conn.execute(
            update(LOOPS)
            .where(c.run_id == run_id)
            .values(slots_ended=c.slots_ended + 1, updated_at=utcnow())
            .returning(c.slots_ended, c.cap, c.done, c.succeeded, c.failed, c.tolerated, c.status)
        )
        .mappings()
        .first()
    )
    if row is None:
        raise LookupError(f"loop {run_id} not found")
    return dict(row)


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
            c.parent_execution_id,
        )
        .where(c.parent_execution_id == execution_id)
        .order_by(c.created_at, c.execution_id)
    ).mappings()
    return [dict(r) for r in rows]


def register_playbook(conn: Connection, *, path: str, name: str, content: str, source_file: str | None) -> None:
    """Add or replace the catalog entry of `path`."""
    values = {"path": path, "name": name, "content": content, "source_file": source_file, "registered_at": utcnow()}
    stmt = _insert(conn, CATALOG).values(**values)
    conn.execute(
        stmt.on_conflict_do_update(index_elements=["path"], set_={k: v for k, v in values.items() if k != "path"})
    )


def find_playbook(conn: Connection, path: str) -> dict[str, Any] | None:
    row = conn.execute(select(CATALOG).where(CATALOG.c.path == path)).mappings().first()
    return dict(row) if row else None
