"""The event table: the append-only rows of every attempt and decision, their idempotent insert on
the event's deterministic key (a duplicate is detected by `RETURNING` giving no row, never by
rowcount), the leases written with them (noetl_lease), and the reads of an execution's history."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, select
from sqlalchemy.engine import Dialect

from noetl_celery.config import secret_registry
from noetl_celery.store import kernel
from noetl_celery.store.kernel import EVENTS, LEASES, utcnow

# --- events -------------------------------------------------------------------------------


EVENT_COLUMNS = tuple(c.name for c in EVENTS.c if c.name != "id")
# the unique key of an event row, (execution_id, event_id); each partition of a partitioned event
# table has its own copy, named EVENT_KEY + "_" + the partition's suffix (store/partitions.py)
EVENT_KEY = "uq_noetl_event_key"


def is_event_key(constraint: str | None) -> bool:
    """Whether a unique violation on `constraint` is an event row's key that exists."""
    return constraint is not None and (constraint == EVENT_KEY or constraint.startswith(EVENT_KEY + "_"))


INSERT_ROWS_PER_STATEMENT = 500  # rows of one INSERT (SQLite allows 32,766 bound values)
_insert_sql: dict[tuple[str, int], str] = {}


def events_insert_sql(dialect: Dialect, rows: int) -> str:
    """`INSERT ... VALUES (..), (..) ON CONFLICT DO NOTHING RETURNING event_id` for `rows` rows."""
    key = (dialect.name, rows)
    sql = _insert_sql.get(key)
    if sql is None:
        row = f"({kernel.placeholders(dialect, len(EVENT_COLUMNS))})"
        sql = (
            f"INSERT INTO noetl_event ({', '.join(EVENT_COLUMNS)}) VALUES {', '.join([row] * rows)} "
            "ON CONFLICT (execution_id, event_id) DO NOTHING RETURNING event_id"
        )
        if len(_insert_sql) < 64:
            _insert_sql[key] = sql
    return sql


def event_processors(dialect: Dialect) -> list[Any]:
    return [kernel.PROCESSORS.bind(dialect, EVENTS, c) for c in EVENT_COLUMNS]


_binders: dict[str, list[tuple[str, Any, Any]]] = {}


def _event_binders(dialect: Dialect) -> list[tuple[str, Any, Any]]:
    """Per event column: its name, its bind processor (None: the value goes as is) and what that
    processor makes of None, worked out once (most of a row's JSON columns are None: each would
    be serialized again to the same `null`)."""
    found = _binders.get(dialect.name)
    if found is None:
        found = [
            (c, p, None if p is None else p(None))
            for c, p in zip(EVENT_COLUMNS, event_processors(dialect), strict=True)
        ]
        _binders[dialect.name] = found
    return found


# An event row given with a `deadline_at` (a decision with messages to dispatch) is written with
# its lease: a noetl_lease row on its key, in the same transaction (store/leases.py reads them).
LEASE_KEY = "deadline_at"


def lease_statements(
    dialect: Dialect, rows: list[dict[str, Any]], settles: str | None = None, *, strict: bool = False
) -> list[tuple[str, list[Any]]]:
    """The insert of the leases of the `rows` that have a deadline, and the delete of the lease
    the first row answers (`settles`: the key of the decision row it belongs to, in the same
    execution). A lease that exists is kept (the row it belongs to is a redelivery's, rolled back
    by its caller); `strict`: it cannot exist (its row was just inserted without ON CONFLICT),
    no clause needed."""
    statements: list[tuple[str, list[Any]]] = []
    params: list[Any] = []
    for row in rows:
        deadline = row.get(LEASE_KEY)
        if deadline is not None:
            params += [row["execution_id"], row["event_id"], kernel.bound(dialect, LEASES, "deadline_at", deadline)]
    if params:
        values = ", ".join([f"({kernel.placeholders(dialect, 3)})"] * (len(params) // 3))
        sql = f"INSERT INTO noetl_lease (execution_id, event_id, deadline_at) VALUES {values}"
        if not strict:
            sql += " ON CONFLICT (execution_id, event_id) DO NOTHING"
        statements.append((sql, params))
    if settles is not None:
        sql = kernel.dialect_sql(dialect, "DELETE FROM noetl_lease WHERE execution_id = ? AND event_id = ?")
        statements.append((sql, [rows[0]["execution_id"], settles]))
    return statements


def with_leases(
    conn: Connection, rows: list[dict[str, Any]], sql: str, params: list[Any], settles: str | None = None
) -> tuple[str, list[Any]]:
    """`sql` preceded by the lease statements of `rows` (`lease_statements`): in the same
    statement string on PostgreSQL (no round trip of their own; the statement's own result stays
    the last one), run first, one by one, elsewhere (SQLite runs one statement at a time, in
    process)."""
    statements = lease_statements(conn.dialect, rows, settles)
    if conn.dialect.name != "postgresql":
        for lease_sql, lease_params in statements:
            kernel.run(conn, lease_sql, lease_params)
        return sql, params
    for lease_sql, lease_params in reversed(statements):
        sql, params = f"{lease_sql}; {sql}", lease_params + params
    return sql, params


# Columns that carry what tools and templates produced. The others are the engine's own names,
# keys and numbers (step, run_id, event_id, ...): decisions look rows up by them, so a secret that
# happens to be part of a step name must not rewrite them.
_CONTENT_COLUMNS = ("context", "result", "error", "meta")


def _masked_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Event rows with every secret form masked in their content columns (one masking pass for
    all of them: each pass first checks which secrets are configured)."""
    contents = secret_registry.mask([{k: r[k] for k in _CONTENT_COLUMNS if k in r} for r in rows])
    return [{**r, **content} for r, content in zip(rows, contents, strict=True)]


def _masked(row: dict[str, Any]) -> dict[str, Any]:
    """An event row with every secret form masked in its content columns."""
    return _masked_rows([row])[0]


def insert_events(
    conn: Connection,
    rows: list[dict[str, Any]],
    *,
    first_must_be_new: bool = False,
    new_keys: Sequence[str] = (),
    settles: str | None = None,
) -> bool:
    """Insert event rows, in order, with their leases (and the delete of the lease the first row
    answers, `settles`). With `first_must_be_new`, returns False when the first row's key already
    exists (a redelivered event: the caller rolls back the whole transaction); so it does when a
    key of `new_keys` (the other outcomes of a batch) already exists."""
    if not rows:
        return True
    dialect = conn.dialect
    inserted: set[str] = set()
    chunks = event_chunks(dialect, rows)
    for start, (chunk, params) in zip(range(0, len(rows), INSERT_ROWS_PER_STATEMENT), chunks, strict=True):
        answered = settles if start == 0 else None
        sql, params = with_leases(
            conn, rows[start : start + chunk], events_insert_sql(dialect, chunk), params, answered
        )
        cursor = kernel.run(conn, sql, params)
        inserted.update(row[0] for row in cursor.fetchall())
    return all_new(rows, inserted, first_must_be_new, new_keys)


def event_chunks(dialect: Dialect, rows: list[dict[str, Any]]) -> list[tuple[int, list[Any]]]:
    """Event rows masked and bound, as (rows, parameters) of one INSERT each."""
    now = utcnow()
    binders = _event_binders(dialect)
    masked_rows = _masked_rows([{c: r.get(c) for c in EVENT_COLUMNS} for r in rows])
    chunks = []
    for start in range(0, len(rows), INSERT_ROWS_PER_STATEMENT):
        chunk = masked_rows[start : start + INSERT_ROWS_PER_STATEMENT]
        params: list[Any] = []
        for masked in chunk:
            masked["created_at"] = masked["created_at"] or now
            params += [
                masked[c] if p is None else null if masked[c] is None else p(masked[c]) for c, p, null in binders
            ]
        chunks.append((len(chunk), params))
    return chunks


def all_new(rows: list[dict[str, Any]], inserted: set[str], first_must_be_new: bool, new_keys: Sequence[str]) -> bool:
    if first_must_be_new and rows[0]["event_id"] not in inserted:
        return False
    return all(key in inserted for key in new_keys)


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


def event_meta(conn: Connection, execution_id: int, event_id: str) -> dict[str, Any]:
    """The `meta` of one event row, found by its key ({} when there is no such row or it has none)."""
    c = EVENTS.c
    meta = conn.execute(select(c.meta).where(and_(c.execution_id == execution_id, c.event_id == event_id))).scalar()
    return meta if isinstance(meta, dict) else {}


def list_events(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    rows = conn.execute(select(EVENTS).where(EVENTS.c.execution_id == execution_id).order_by(EVENTS.c.id)).mappings()
    return [dict(r) for r in rows]


def last_event_id(conn: Connection, execution_id: int) -> int:
    """The id of the execution's last event row (0: none)."""
    c = EVENTS.c
    return int(conn.execute(select(func.max(c.id)).where(c.execution_id == execution_id)).scalar() or 0)


def events_after(conn: Connection, execution_id: int, after_id: int) -> list[dict[str, Any]]:
    """The execution's rows written after row `after_id` (its id), in order."""
    c = EVENTS.c
    rows = conn.execute(
        select(EVENTS).where(and_(c.execution_id == execution_id, c.id > after_id)).order_by(c.id)
    ).mappings()
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


ENDS_PAGE = 10_000  # end rows of a loop's iterations read at a time
_ENDS = (
    "SELECT iteration, event_type, CASE WHEN event_type = ? THEN error ELSE result END FROM noetl_event "
    "WHERE execution_id = ? AND run_id = ? AND event_type IN (?, ?) AND iteration IS NOT NULL "
    "ORDER BY iteration, id"
)
_cursor_names = itertools.count()


def iteration_ends(
    conn: Connection, execution_id: int, run_id: str, completed: str, failed: str
) -> Iterator[tuple[int, bool, Any]]:
    """Each iteration's last end row (of type `completed` or `failed`, the one of the highest id),
    in iteration order, as (iteration, failed?, its result, or its error when it failed). Read
    ENDS_PAGE rows at a time (on PostgreSQL through a cursor of the transaction), never the
    run's rows at once; only each iteration's last end is decoded."""
    dialect = conn.dialect
    sql = kernel.sql(dialect, "events.iteration_ends", _ENDS)
    last: tuple[int, str, Any] | None = None
    for page in _pages(conn, sql, (failed, execution_id, run_id, completed, failed)):
        for iteration, kind, payload in page:
            if last is not None and last[0] != iteration:
                yield _iteration_end(dialect, last, failed)
            last = (iteration, kind, payload)
    if last is not None:
        yield _iteration_end(dialect, last, failed)


def _iteration_end(dialect: Dialect, row: tuple[int, str, Any], failed: str) -> tuple[int, bool, Any]:
    iteration, kind, payload = row
    return int(iteration), kind == failed, kernel.read(dialect, EVENTS, "result", payload)


def _pages(conn: Connection, sql: str, params: tuple[Any, ...]) -> Iterator[list[Any]]:
    """The rows of `sql`, ENDS_PAGE at a time. PostgreSQL (psycopg2) sends a query's every row at
    once: there, a cursor declared in the transaction is fetched from instead (and closed after,
    or when the reader stops early). SQLite steps its statement as rows are fetched."""
    if conn.dialect.name != "postgresql":
        cursor = kernel.run_text(conn, sql, params)
        try:
            while rows := cursor.fetchmany(ENDS_PAGE):
                yield rows
        finally:
            cursor.close()
        return
    name = f"noetl_ends_{next(_cursor_names)}"
    kernel.run_text(conn, f"DECLARE {name} NO SCROLL CURSOR FOR {sql}", params)
    try:
        while rows := kernel.run_text(conn, f"FETCH FORWARD {ENDS_PAGE} FROM {name}", None).fetchall():
            yield rows
    except GeneratorExit:
        kernel.run_text(conn, f"CLOSE {name}", None)
        raise
    kernel.run_text(conn, f"CLOSE {name}", None)
