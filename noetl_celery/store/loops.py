"""The loops' table (a loop's run: its counters, max_in_flight, collection and status; iterations
claimed by index) and the cursor holds of claimed rows.

`max_in_flight` is the column `cap` (models.py LoopState): its rows are read under the Python
name (`_named`), and SQL text names the column."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, select, update
from sqlalchemy.engine import Dialect

from noetl_celery.store import executions, kernel
from noetl_celery.store.executions import HEAD_SQL
from noetl_celery.store.kernel import EVENTS, HOLDS, LOOPS, utcnow

# --- loops --------------------------------------------------------------------------------


def create_loop(conn: Connection, values: dict[str, Any]) -> None:
    now = utcnow()
    conn.execute(
        kernel.insert(conn, LOOPS)
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


def hold_claim(conn: Connection, execution_id: int, run_id: str, slot: int, claim: int, rows: list[Any]) -> None:
    """Keep the rows a cursor slot's claim took (noetl_cursor_hold), over its previous claim's."""
    values = {"execution_id": execution_id, "run_id": run_id, "slot": slot, "claim": claim, "rows": rows}
    stmt = kernel.insert(conn, HOLDS).values(**values)
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["execution_id", "run_id", "slot"], set_={"claim": claim, "rows": stmt.excluded.rows}
        )
    )


def held_claim(conn: Connection, execution_id: int, run_id: str, slot: int, claim: int) -> list[Any] | None:
    """The rows the `claim`-th claim of a cursor slot took and kept (None: it kept none)."""
    h = HOLDS.c
    row = conn.execute(
        select(h.rows).where(and_(h.execution_id == execution_id, h.run_id == run_id, h.slot == slot, h.claim == claim))
    ).first()
    return None if row is None else list(row[0] or [])


def run_results(conn: Connection, execution_id: int, run_id: str, event_type: str) -> list[Any]:
    """The results of a run's rows of one type (a cursor loop's done rows), in recorded order."""
    e = EVENTS.c
    query = (
        select(e.result)
        .where(and_(e.execution_id == execution_id, e.run_id == run_id, e.event_type == event_type))
        .order_by(e.id)
    )
    return [row[0] for row in conn.execute(query)]


def _named(columns: Any) -> list[Any]:
    """`columns` of the loops' table, each read back under its Python name (`max_in_flight`, not
    the column's `cap`)."""
    return [col.label(col.key) if col.key != col.name else col for col in columns]


def get_loop(conn: Connection, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
    c = LOOPS.c
    cols = _named(col for col in LOOPS.c if with_collection or col.name != "collection")
    row = conn.execute(select(*cols).where(c.run_id == run_id)).mappings().first()
    return dict(row) if row else None


def loop_iteration_done(conn: Connection, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]:
    """Count one finished iteration; returns the counters after the update (done, total,
    max_in_flight, ...)."""
    dialect = conn.dialect
    sql = kernel.sql(dialect, "loop.done", LOOP_DONE_SQL + " RETURNING " + _RETURNED)
    row = kernel.run(conn, sql, loop_done_params(dialect, run_id, ok, tolerated)).fetchone()
    if row is None:
        raise LookupError(f"loop {run_id} not found")
    return loop_counters(dialect, row)


_LOOP_COUNTERS = ("done", "succeeded", "failed", "tolerated", "total", "max_in_flight", "status", "context")
_RETURNED = ", ".join(LOOPS.c[name].name for name in _LOOP_COUNTERS)  # their columns (`cap` for max_in_flight)
# The counters only: an iteration's update leaves the row's later columns as they were, so its
# WAL record carries the changed counters, not the row from them to `updated_at` (130 bytes an
# iteration). `updated_at` is set when the loop completes (`complete_loop`).
LOOP_DONE_SQL = (
    "UPDATE noetl_loop SET done = done + 1, succeeded = succeeded + ?, failed = failed + ?, "
    "tolerated = tolerated + ? WHERE run_id = ?"
)


def loop_done_params(dialect: Dialect, run_id: str, ok: bool, tolerated: bool) -> tuple[Any, ...]:
    return (1 if ok else 0, 0 if ok else 1, 1 if tolerated else 0, run_id)


def loop_counters(dialect: Dialect, row: Any) -> dict[str, Any]:
    counters = dict(zip(_LOOP_COUNTERS, row, strict=False))
    counters["context"] = kernel.read(dialect, LOOPS, "context", counters["context"])
    return counters


def loop_iteration_done_checked(
    conn: Connection, execution_id: int, run_id: str, *, ok: bool, tolerated: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`loop_iteration_done` with the decision's execution head folded in: (counters, head).

    On PostgreSQL one statement locks the execution row FOR KEY SHARE (as `execution_head(deciding=
    True)` does, before the loop row), and counts the iteration only if the execution is running;
    the head comes back with the counters. (None, None) when it is not running (or unknown): the
    caller decides again the classic way. On SQLite the two statements run one after the other
    (BEGIN IMMEDIATE already excludes every other writer)."""
    dialect = conn.dialect
    if dialect.name != "postgresql":
        head = executions.execution_head(conn, execution_id, deciding=True)
        if head is None or head["status"] != "running":
            return None, head
        return loop_iteration_done(conn, run_id, ok=ok, tolerated=tolerated), head
    sql = kernel.sql(
        dialect,
        "loop.done.checked",
        f"WITH head AS ({HEAD_SQL} FOR KEY SHARE) {LOOP_DONE_SQL} AND (SELECT status FROM head) = 'running' "
        f"RETURNING {_RETURNED}, (SELECT pending FROM head), (SELECT state_version FROM head)",
    )
    row = kernel.run(conn, sql, (execution_id, *loop_done_params(dialect, run_id, ok, tolerated))).fetchone()
    if row is None:
        return None, None
    n = len(_LOOP_COUNTERS)
    return loop_counters(dialect, row[:n]), {"status": "running", "pending": row[n], "state_version": row[n + 1]}


def execution_loops(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    """Every loop instance of the execution (without collections), oldest first."""
    c = LOOPS.c
    cols = _named(col for col in LOOPS.c if col.name != "collection")
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
            .returning(
                c.slots_ended,
                c.max_in_flight.label("max_in_flight"),
                c.done,
                c.succeeded,
                c.failed,
                c.tolerated,
                c.status,
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise LookupError(f"loop {run_id} not found")
    return dict(row)
