"""The few queries the engine needs, in SQLAlchemy Core; the per-event ones on the DBAPI cursor.

Every write that must happen once per event is either an idempotent insert on the event's
deterministic key (a duplicate is detected by `RETURNING` giving no row, never by rowcount, or, in
a decision's strict write, by the unique key's error, which fails the whole statement) or an
atomic `UPDATE ... RETURNING` in the same transaction as that insert.

The statements every decision makes (the execution head, the execution and loop counters, the
insert of the event rows) are written once per dialect as SQL text and run on the transaction's
own DBAPI cursor (`_run`): building them as Core constructs cost about 4x their client CPU. They
bind their values through the same SQLAlchemy type processors as Core would (JSON, timestamps
on SQLite), so rows read the same either way, and driver errors still surface as SQLAlchemy's
DBAPIError (what the callers retry on).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, NoReturn, cast

from sqlalchemy import Connection, Table, and_, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from noetl_celery import limits, secret_registry
from noetl_celery.store import clock, db, prepared
from noetl_celery.store.models import (
    Blob,
    CatalogEntry,
    CursorHold,
    Event,
    Execution,
    Join,
    Lease,
    LoopState,
    Variable,
)

EVENTS = cast(Table, Event.__table__)
EXECUTIONS = cast(Table, Execution.__table__)
VARIABLES = cast(Table, Variable.__table__)
JOINS = cast(Table, Join.__table__)
LOOPS = cast(Table, LoopState.__table__)
CATALOG = cast(Table, CatalogEntry.__table__)
LEASES = cast(Table, Lease.__table__)
BLOBS = cast(Table, Blob.__table__)
HOLDS = cast(Table, CursorHold.__table__)


def utcnow() -> datetime:
    """The store's time (store/clock.py: this process's clock corrected by its measured skew)."""
    return clock.now()


def _insert(conn: Connection, table):  # type: ignore[no-untyped-def]
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"event store on {dialect} is not supported (use PostgreSQL or SQLite)")


# --- the hot path: SQL text on the DBAPI cursor --------------------------------------------


def _run(conn: Connection, sql: str, params: Any) -> Any:
    """Execute `sql` (in the driver's paramstyle) on the transaction's DBAPI connection; returns
    the cursor. In a `db.decision_transaction` the first statement carries the BEGIN. Driver
    errors are raised as SQLAlchemy's DBAPIError, and a lost connection is
    invalidated, as Core would do."""
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = dbapi_connection.cursor()
    prefix = db.begin_prefix(conn, bound=params is not None)
    session = prepared.session_of(conn.connection.info, conn.engine) if params is not None else None
    if session is None:
        return _send(conn, cursor, prefix + sql, params)
    idle = dbapi_connection.info.transaction_status == db.IDLE  # before the batch: nothing to lose
    batch, params = session.rewrite(sql, params)
    try:
        cursor.execute(prefix + batch, params)
    except Exception as exc:
        if batch == sql:  # nothing prepared, deallocated or executed by name: the text's own error
            session.succeeded()
        elif prepared.pooler_error(exc):
            prepared.turn_off(conn.engine, exc)
            session.failed()
        elif not prepared.plain_again(exc):  # the statement's own error (a key, a lock, a timeout)
            session.failed()
        elif idle and not dbapi_connection.closed:
            return _as_text(conn, cursor, session, prefix, sql, params)
        else:  # in a transaction opened before: its caller runs the unit of work again, as text
            session.refused(sql)
        _raise(conn, cursor, prefix + batch, params, exc)
    session.succeeded()
    return cursor


def _as_text(conn: Connection, cursor: Any, session: prepared.Session, prefix: str, sql: str, params: Any) -> Any:
    """A batch that prepared or executed by name failed with an error its preparation may cause,
    and it had opened its transaction: roll it back and send the text itself. If the text runs,
    the preparation was at fault (a type the server cannot infer, a syntax EXECUTE cannot carry,
    a limit, a plan whose result type changed): the text is not prepared again on this
    connection. If it fails too, its error is the caller's."""
    session.failed()  # what the batch prepared or deallocated is unknown: DEALLOCATE ALL next
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    if dbapi_connection.info.transaction_status != db.IDLE:
        if dbapi_connection.autocommit:
            cursor.execute("ROLLBACK")
        else:
            dbapi_connection.rollback()
    _send(conn, cursor, prefix + sql, params)
    session.refused(sql)
    return cursor


def _send(conn: Connection, cursor: Any, sql: str, params: Any) -> Any:
    try:
        cursor.execute(sql, params)
    except Exception as exc:
        _raise(conn, cursor, sql, params, exc)
    return cursor


def _raise(conn: Connection, cursor: Any, sql: str, params: Any, exc: Exception) -> NoReturn:
    """A driver error as SQLAlchemy's DBAPIError; a lost connection is invalidated, as Core
    would do. Any other exception is raised as it is."""
    dialect = conn.dialect
    base = dialect.loaded_dbapi.Error
    if not isinstance(exc, base):
        raise exc
    dbapi_connection = conn.connection.dbapi_connection
    lost = dialect.is_disconnect(exc, dbapi_connection, cursor)
    if lost:  # as Core does: this connection, and the pooled ones of the same age, are dropped
        conn.invalidate(exc)
        conn.engine.dispose(close=False)
    wrapped = DBAPIError.instance(sql, params, exc, base, connection_invalidated=lost, dialect=dialect)
    raise wrapped from exc


def _placeholders(dialect: Dialect, count: int) -> str:
    mark = "?" if dialect.paramstyle == "qmark" else "%s"
    return ", ".join([mark] * count)


def _dialect_sql(dialect: Dialect, sql: str) -> str:
    """`sql` written with `?` placeholders, in the driver's paramstyle."""
    if dialect.paramstyle == "qmark":
        return sql
    return sql.replace("%", "%%").replace("?", "%s")


class _Processors:
    """Per dialect: the bind and result processors SQLAlchemy applies to some columns."""

    def __init__(self) -> None:
        self._bind: dict[tuple[str, str, str], Any] = {}
        self._result: dict[tuple[str, str, str], Any] = {}

    def bind(self, dialect: Dialect, table: Table, column: str) -> Any:
        key = (dialect.name, table.name, column)
        if key not in self._bind:
            type_ = table.c[column].type.dialect_impl(dialect)
            self._bind[key] = type_.bind_processor(dialect)
        return self._bind[key]

    def result(self, dialect: Dialect, table: Table, column: str) -> Any:
        key = (dialect.name, table.name, column)
        if key not in self._result:
            type_ = table.c[column].type.dialect_impl(dialect)
            self._result[key] = type_.result_processor(dialect, None)
        return self._result[key]


_PROCESSORS = _Processors()
_sql_cache: dict[tuple[str, str], str] = {}


def _sql(dialect: Dialect, name: str, text: str) -> str:
    key = (dialect.name, name)
    found = _sql_cache.get(key)
    if found is None:
        found = _sql_cache[key] = _dialect_sql(dialect, text)
    return found


def _bound(dialect: Dialect, table: Table, column: str, value: Any) -> Any:
    process = _PROCESSORS.bind(dialect, table, column)
    return process(value) if process is not None else value


def _read(dialect: Dialect, table: Table, column: str, value: Any) -> Any:
    process = _PROCESSORS.result(dialect, table, column)
    return process(value) if process is not None else value


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
    sql = _sql(
        dialect,
        "create",
        f"INSERT INTO noetl_execution ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
    )
    params = [_bound(dialect, EXECUTIONS, name, value) for name, value in values.items()]
    if not db.defer(conn, sql, params):  # in a decision: sent with the decision's rows
        _run(conn, sql, params)


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
        sql = _sql(dialect, "head.deciding", _HEAD_SQL + " FOR KEY SHARE")
    else:  # SQLite: BEGIN IMMEDIATE already holds the only writer's lock
        sql = _sql(dialect, "head", _HEAD_SQL)
    row = _run(conn, sql, (execution_id,)).fetchone()
    return {"status": row[0], "pending": row[1], "state_version": row[2]} if row else None


_HEAD_SQL = "SELECT status, pending, state_version FROM noetl_execution WHERE execution_id = ?"


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
    sql = _sql(
        dialect,
        "bump",
        "UPDATE noetl_execution SET pending = pending + ?, state_version = state_version + ?, updated_at = ? "
        "WHERE execution_id = ? RETURNING pending, state_version, status",
    )
    now = _bound(dialect, EXECUTIONS, "updated_at", utcnow())
    row = _run(conn, sql, (pending, version, now, execution_id)).fetchone()
    if row is None:
        raise LookupError(f"execution {execution_id} not found")
    return int(row[0]), int(row[1]), row[2]


def finish_execution(
    conn: Connection, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
) -> bool:
    """Move a running execution to completed/failed; False if it had already finished."""
    dialect = conn.dialect
    sql = _sql(
        dialect,
        "finish",
        "UPDATE noetl_execution SET status = ?, error = ?, failed_step = ?, finished_at = ?, updated_at = ? "
        "WHERE execution_id = ? AND status = 'running' RETURNING execution_id",
    )
    now = _bound(dialect, EXECUTIONS, "finished_at", utcnow())
    error = _bound(dialect, EXECUTIONS, "error", secret_registry.mask(error))
    return _run(conn, sql, (status, error, failed_step, now, now, execution_id)).fetchone() is not None


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
# the unique key of an event row, (execution_id, event_id); each partition of a partitioned event
# table has its own copy, named EVENT_KEY + "_" + the partition's suffix (store/partitions.py)
EVENT_KEY = "uq_noetl_event_key"


def is_event_key(constraint: str | None) -> bool:
    """Whether a unique violation on `constraint` is an event row's key that exists."""
    return constraint is not None and (constraint == EVENT_KEY or constraint.startswith(EVENT_KEY + "_"))


INSERT_ROWS_PER_STATEMENT = 500  # rows of one INSERT (SQLite allows 32,766 bound values)
_insert_sql: dict[tuple[str, int], str] = {}


def _events_insert_sql(dialect: Dialect, rows: int) -> str:
    """`INSERT ... VALUES (..), (..) ON CONFLICT DO NOTHING RETURNING event_id` for `rows` rows."""
    key = (dialect.name, rows)
    sql = _insert_sql.get(key)
    if sql is None:
        row = f"({_placeholders(dialect, len(EVENT_COLUMNS))})"
        sql = (
            f"INSERT INTO noetl_event ({', '.join(EVENT_COLUMNS)}) VALUES {', '.join([row] * rows)} "
            "ON CONFLICT (execution_id, event_id) DO NOTHING RETURNING event_id"
        )
        if len(_insert_sql) < 64:
            _insert_sql[key] = sql
    return sql


def _event_processors(dialect: Dialect) -> list[Any]:
    return [_PROCESSORS.bind(dialect, EVENTS, c) for c in EVENT_COLUMNS]


# An event row given with a `deadline_at` (a decision with messages to dispatch) is written with
# its lease: a noetl_lease row on its key, in the same transaction (store/leases.py reads them).
LEASE_KEY = "deadline_at"


def _lease_statements(
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
            params += [row["execution_id"], row["event_id"], _bound(dialect, LEASES, "deadline_at", deadline)]
    if params:
        values = ", ".join([f"({_placeholders(dialect, 3)})"] * (len(params) // 3))
        sql = f"INSERT INTO noetl_lease (execution_id, event_id, deadline_at) VALUES {values}"
        if not strict:
            sql += " ON CONFLICT (execution_id, event_id) DO NOTHING"
        statements.append((sql, params))
    if settles is not None:
        sql = _dialect_sql(dialect, "DELETE FROM noetl_lease WHERE execution_id = ? AND event_id = ?")
        statements.append((sql, [rows[0]["execution_id"], settles]))
    return statements


def _with_leases(
    conn: Connection, rows: list[dict[str, Any]], sql: str, params: list[Any], settles: str | None = None
) -> tuple[str, list[Any]]:
    """`sql` preceded by the lease statements of `rows` (`_lease_statements`): in the same
    statement string on PostgreSQL (no round trip of their own; the statement's own result stays
    the last one), run first, one by one, elsewhere (SQLite runs one statement at a time, in
    process)."""
    statements = _lease_statements(conn.dialect, rows, settles)
    if conn.dialect.name != "postgresql":
        for lease_sql, lease_params in statements:
            _run(conn, lease_sql, lease_params)
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
    chunks = _event_chunks(dialect, rows)
    for start, (chunk, params) in zip(range(0, len(rows), INSERT_ROWS_PER_STATEMENT), chunks, strict=True):
        answered = settles if start == 0 else None
        sql, params = _with_leases(
            conn, rows[start : start + chunk], _events_insert_sql(dialect, chunk), params, answered
        )
        cursor = _run(conn, sql, params)
        inserted.update(row[0] for row in cursor.fetchall())
    return _all_new(rows, inserted, first_must_be_new, new_keys)


def _event_chunks(dialect: Dialect, rows: list[dict[str, Any]]) -> list[tuple[int, list[Any]]]:
    """Event rows masked and bound, as (rows, parameters) of one INSERT each."""
    now = utcnow()
    processors = _event_processors(dialect)
    masked_rows = _masked_rows([{c: r.get(c) for c in EVENT_COLUMNS} for r in rows])
    chunks = []
    for start in range(0, len(rows), INSERT_ROWS_PER_STATEMENT):
        chunk = masked_rows[start : start + INSERT_ROWS_PER_STATEMENT]
        params: list[Any] = []
        for masked in chunk:
            masked["created_at"] = masked["created_at"] or now
            params.extend(
                p(masked[c]) if p is not None else masked[c] for c, p in zip(EVENT_COLUMNS, processors, strict=True)
            )
        chunks.append((len(chunk), params))
    return chunks


def _all_new(rows: list[dict[str, Any]], inserted: set[str], first_must_be_new: bool, new_keys: Sequence[str]) -> bool:
    if first_must_be_new and rows[0]["event_id"] not in inserted:
        return False
    return all(key in inserted for key in new_keys)


class Conflict(Exception):
    """A decision's strict write (see `record_decision`) found a row of its keys written already,
    or the execution head other than the decision assumed. Nothing was written: decide again the
    classic way, which tells a redelivery from a row that may legitimately exist."""


def record_decision(
    conn: Connection,
    rows: list[dict[str, Any]],
    variables: dict[str, dict[str, Any]],
    *,
    new_keys: Sequence[str] = (),
    last: bool = False,
    head_version: int | None = None,
    count: IterationCount | None = None,
    bump: Bump | None = None,
    settles: str | None = None,
) -> Recorded:
    """A decision's event rows (`insert_events`, the first one must be new) and the variables it
    set, by scope (`put_variables`). Returns whether the rows were new and, when they were, the
    variables as stored (`Recorded`). On PostgreSQL one statement does both when the rows fit one
    insert (a data-modifying WITH): a round trip less for every decision that sets variables.

    `head_version`: the decision has not read the execution head yet; it must be running at this
    state version (locked FOR KEY SHARE as `execution_head(deciding=True)` does), else Conflict.

    `last`: nothing follows in the transaction. In a `db.decision_transaction` a decision that
    sets no variables (a loop iteration's, a retry's) is then written by one strict statement
    that also commits: the head check rides on it and its rows are inserted without ON CONFLICT,
    so a key that exists, or a head that moved, fails the statement (Conflict) and nothing is
    written. With the BEGIN sent with the first statement, a retry's decision is one round trip.

    `count`: a loop iteration the decision counted on the assumption that it is not the loop's
    last (orchestrator `Decider.count_iteration`). The strict statement counts it, and refuses
    (Conflict) when it is the last, or the loop is not as assumed: an iteration's decision is
    then one statement, which holds the loop row's lock only while it runs.

    `bump`: the execution counters' update (`bump_execution`) the decision left to this write,
    on the head at `head_version`. The strict statement makes it, with the variables' upsert,
    refusing (Conflict) a head that is not running at that version or a pending count that would
    not stay above 0 (the classic decision then finishes the execution). The variables as stored
    are read back after the commit, in the same round trip: a step's decision is one round trip.
    The stored variables, and the pending count, are returned only when no other decision came in
    between (the state version read back is the one this write set); otherwise none, and the
    caller reads again.

    `settles`: the key of an earlier decision row whose lease this decision's causing row (the
    outcome of that decision's only message) answers: the lease is deleted in the same write.

    A result or variable above NOETL_MAX_RESULT_BYTES is stored once outside its row, the row
    holding its reference (store/blobs.py)."""
    from noetl_celery.store import blobs

    rows, variables = blobs.by_reference(conn, rows, variables)
    execution_id = rows[0]["execution_id"]
    dialect = conn.dialect
    commit = db.commit_suffix(conn) if last else None
    if (
        commit is not None
        and (bump is not None or not any(variables.values()))
        and len(rows) <= INSERT_ROWS_PER_STATEMENT
    ):
        return _strict_insert(conn, rows, head_version, count, commit, bump, variables, settles)
    if count is not None or bump is not None:  # only the strict statement makes them
        raise Conflict(f"execution {execution_id}: a count or bump left to the write needs the one strict statement")
    if head_version is not None:
        head = execution_head(conn, execution_id, deciding=True)
        if not running_at(head, head_version):
            raise Conflict(f"execution {execution_id}: head {head} is not running at version {head_version}")
    if dialect.name != "postgresql" or len(rows) > INSERT_ROWS_PER_STATEMENT or not any(variables.values()):
        if not insert_events(conn, rows, first_must_be_new=True, new_keys=new_keys, settles=settles):
            return Recorded(False, {})
        return Recorded(
            True, {scope: put_variables(conn, execution_id, scope, values) for scope, values in variables.items()}
        )
    variable_count, params = _variable_rows(dialect, execution_id, variables)
    ((rows_count, event_params),) = _event_chunks(dialect, rows)
    sql = (
        f"WITH v AS ({_variables_upsert_sql(dialect, variable_count, 'scope, name, value')}), "
        f"e AS ({_events_insert_sql(dialect, rows_count)}) "
        "SELECT NULL, event_id, NULL::jsonb FROM e UNION ALL SELECT scope, name, value FROM v"
    )
    inserted: set[str] = set()
    stored: dict[str, dict[str, Any]] = {scope: {} for scope in variables}
    sql, all_params = _with_leases(conn, rows, sql, params + event_params, settles)
    for scope, name, value in _run(conn, sql, all_params).fetchall():
        if scope is None:
            inserted.add(name)
        else:
            stored[scope][name] = _read(dialect, VARIABLES, "value", value)
    if not _all_new(rows, inserted, True, new_keys):
        return Recorded(False, {})
    return Recorded(True, stored)


class Recorded(NamedTuple):
    """What `record_decision` wrote: whether the rows were new, the variables as stored and, when
    a strict write made the counters' update and read them back, the pending count it left."""

    new: bool
    stored: dict[str, dict[str, Any]]
    pending: int | None = None


class Bump(NamedTuple):
    """The execution counters' update a decision leaves to its strict statement: pending plus
    `pending` and the state version plus `version`. The pending count must be `expected` before
    (None: only stay above 0 after); with `finish`, it reaches 0 and the execution completes
    (as `finish_execution` completes it)."""

    pending: int
    version: int
    expected: int | None = None
    finish: bool = False

    @property
    def check(self) -> str:
        """Its `_BUMPS` entry: the pending check and what else the update sets."""
        return "finished" if self.finish else "bumped" if self.expected is None else "bumped.expected"


class IterationCount(NamedTuple):
    """A loop iteration to count in a decision's strict statement, with the loop's cap and total
    as the decision assumed them."""

    run_id: str
    ok: bool
    tolerated: bool
    cap: int
    total: int


_EVENT_KEY_AT = EVENT_COLUMNS.index("event_id")


def _strict_insert(
    conn: Connection,
    rows: list[dict[str, Any]],
    head_version: int | None,
    count: IterationCount | None,
    commit: str,
    bump: Bump | None = None,
    variables: dict[str, dict[str, Any]] | None = None,
    settles: str | None = None,
) -> Recorded:
    """`record_decision`'s one strict statement (PostgreSQL). A check that fails (the head, the
    iteration's count, the counters' update) makes the first row's key NULL, which the column's
    NOT NULL refuses. With `bump` and variables, returns them as stored and the pending count,
    read back after the commit when the state version is still the one the statement set."""
    dialect = conn.dialect
    ((row_count, params),) = _event_chunks(dialect, rows)
    execution_id = rows[0]["execution_id"]
    names = [(scope, name) for scope, values in (variables or {}).items() for name in values]
    read_back: list[Any] = []
    if bump is not None:
        assert head_version is not None and count is None, "a bump is made on an unread head, alone"
        now = _bound(dialect, EXECUTIONS, "updated_at", utcnow())
        variable_count, upsert = _variable_rows(dialect, execution_id, variables or {})
        assert variable_count == len(names)
        finish = [_bound(dialect, EXECUTIONS, "error", None), now] if bump.finish else []
        pending = bump.pending if bump.expected is None else bump.expected
        head = [bump.pending, bump.version, now, *finish, execution_id, head_version, pending]
        read_back = [part for pair in names for part in pair] + [execution_id] if names else []
        params = [*head, *upsert, *params, *read_back]
    elif count is not None:
        assert head_version is not None, "an iteration counted late is decided on an unread head"
        counted = _loop_done_params(dialect, count.run_id, count.ok, count.tolerated)
        params = [execution_id, *counted, count.cap, count.total, head_version, *params]
    elif head_version is not None:
        params = [execution_id, *params[:_EVENT_KEY_AT], head_version, *params[_EVENT_KEY_AT:]]
    if bump is not None:
        check: str | None = bump.check
    else:
        check = "counted" if count is not None else "head" if head_version is not None else None
    sql = _strict_insert_sql(dialect, row_count, check, len(names), commit)
    leases = _lease_statements(dialect, rows, settles, strict=True)
    if leases:  # between the insert and the commit: a refused insert never reaches them
        before, _, after = sql.partition(commit)
        sql = "; ".join([before, *(lease_sql for lease_sql, _ in leases)]) + commit + after
        kept = len(params) - len(read_back)
        params = [*params[:kept], *(p for _, lease_params in leases for p in lease_params), *params[kept:]]
    try:
        cursor = _run(conn, sql, params)
    except DBAPIError as exc:
        diag = getattr(exc.orig, "diag", None)
        if diag is None:
            raise
        key_exists = is_event_key(diag.constraint_name)
        check_failed = diag.sqlstate == "23502" and diag.column_name == "event_id"
        if key_exists or check_failed:
            raise Conflict(str(diag.message_primary)) from exc
        raise
    if not names:
        return Recorded(True, {})
    assert bump is not None and head_version is not None
    version, pending, triples = cursor.fetchone()
    if version != head_version + bump.version:  # another decision came after this one
        return Recorded(True, {})
    stored: dict[str, dict[str, Any]] = {scope: {} for scope in variables or {}}
    for scope, name, value in triples or ():
        stored[scope][name] = value
    return Recorded(True, stored, pending)


_strict_sql: dict[tuple[int, str | None, int, str], str] = {}
_HEAD_MATCHES = "(SELECT status = 'running' AND state_version = ? FROM head)"
_BUMP_SQL = (
    "UPDATE noetl_execution SET pending = pending + ?, state_version = state_version + ?, updated_at = ?{finish} "
    "WHERE execution_id = ? AND status = 'running' AND state_version = ? AND {pending} RETURNING 1"
)
_PG_VARIABLES = "json_agg(json_build_array(v.scope, v.name, v.value))"  # variables v as [scope, name, value]
_BUMPS = {  # `_strict_insert_sql` checks: the pending check, and what else the update sets
    "bumped": ("pending + ? > 0", ""),
    "bumped.expected": ("pending = ?", ""),
    "finished": ("pending = ?", ", status = 'completed', error = ?, failed_step = NULL, finished_at = ?"),
}


def _strict_insert_sql(dialect: Dialect, rows: int, check: str | None, variables: int, commit: str) -> str:
    """The strict insert of `rows` rows, then `commit`; `check`: None, "head" (the first row's key
    is NULL unless the head matches), "counted" (... unless the iteration was counted, the head
    matching) or one of `_BUMPS` (... unless the counters' update, at the head's version, was
    made; the upsert of `variables` variables rides on it, and they are read back after the
    commit)."""
    key = (rows, check, variables, commit)
    sql = _strict_sql.get(key)
    if sql is None:
        row = [_placeholders(dialect, 1)] * len(EVENT_COLUMNS)
        first = list(row)
        head = ""
        after = ""
        if check is not None:
            head = f"WITH head AS ({_HEAD_SQL} FOR KEY SHARE) "
            condition = _HEAD_MATCHES
            if check == "counted":  # `loop_iteration_done`, for an iteration that is not the last
                counted = (
                    f"{_LOOP_DONE_SQL} AND cap = ? AND total = ? AND done + 1 < total "
                    f"AND (context -> 'queue') IS NULL AND {_HEAD_MATCHES} RETURNING 1"
                )
                head = f"WITH head AS ({_HEAD_SQL} FOR KEY SHARE), counted AS ({counted}) "
                condition = "EXISTS (SELECT 1 FROM counted)"
            elif check in _BUMPS:  # `bump_execution`, on the head the decision assumed
                pending, finish = _BUMPS[check]
                head = f"WITH bumped AS ({_BUMP_SQL.format(pending=pending, finish=finish)}) "
                condition = "EXISTS (SELECT 1 FROM bumped)"
                if variables:
                    pairs = ", ".join(["(?, ?)"] * variables)
                    after = (
                        f"; SELECT e.state_version, e.pending, (SELECT {_PG_VARIABLES} FROM noetl_variable v "
                        f"WHERE v.execution_id = e.execution_id AND (v.scope, v.name) IN ({pairs})) "
                        "FROM noetl_execution e WHERE e.execution_id = ?"
                    )
            head = _dialect_sql(dialect, head)
            if check in _BUMPS and variables:  # the upsert is in the driver's paramstyle already
                head = f"{head[:-1]}, v AS ({_variables_upsert_sql(dialect, variables, '1')}) "
            after = _dialect_sql(dialect, after)
            first[_EVENT_KEY_AT] = _dialect_sql(dialect, f"CASE WHEN {condition} THEN ? END")
        values = ", ".join([f"({', '.join(first)})"] + [f"({', '.join(row)})"] * (rows - 1))
        sql = f"{head}INSERT INTO noetl_event ({', '.join(EVENT_COLUMNS)}) VALUES {values}{commit}{after}"
        if len(_strict_sql) < 64:
            _strict_sql[key] = sql
    return sql


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


# --- variables (ctx, vars, step results) --------------------------------------------------


def put_variables(conn: Connection, execution_id: int, scope: str, values: dict[str, Any]) -> dict[str, Any]:
    """Set variables of one scope (insert or overwrite), in one statement on the DBAPI cursor.
    Returns them as stored (masked, capped, through the column's JSON), as a read would give them."""
    if not values:
        return {}
    dialect = conn.dialect
    count, params = _variable_rows(dialect, execution_id, {scope: values})
    cursor = _run(conn, _variables_upsert_sql(dialect, count, "name, value"), params)
    return {name: _read(dialect, VARIABLES, "value", value) for name, value in cursor.fetchall()}


def _variables_upsert_sql(dialect: Dialect, rows: int, returning: str) -> str:
    row = f"({_placeholders(dialect, 5)})"
    return (
        f"INSERT INTO noetl_variable (execution_id, scope, name, value, updated_at) VALUES "
        f"{', '.join([row] * rows)} ON CONFLICT (execution_id, scope, name) "
        f"DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at RETURNING {returning}"
    )


def _variable_rows(dialect: Dialect, execution_id: int, variables: dict[str, dict[str, Any]]) -> tuple[int, list[Any]]:
    """The upsert's parameters for `variables` (by scope): each value masked, capped and bound."""
    now = _bound(dialect, VARIABLES, "updated_at", utcnow())
    params: list[Any] = []
    count = 0
    for scope, values in variables.items():
        for name, value in values.items():
            stored = _bound(dialect, VARIABLES, "value", limits.cap(secret_registry.mask(value)))
            params += [execution_id, scope, name, stored, now]
            count += 1
    return count, params


def read_state(conn: Connection, execution_id: int, *, full: bool) -> dict[str, Any] | None:
    """An execution's state version, pending count and variables by scope (`variables`), and with
    `full` its plan, workload and parent too: one statement, so one snapshot and one round trip
    (None: no such execution)."""
    dialect = conn.dialect
    if dialect.name == "postgresql":
        agg = _PG_VARIABLES
    else:  # SQLite stores JSON as text: json() reads it back as JSON inside the array
        agg = "json_group_array(json_array(v.scope, v.name, json(v.value)))"
    columns = "e.plan, e.workload, e.parent_execution_id" if full else "NULL, NULL, NULL"
    sql = _sql(
        dialect,
        "state.full" if full else "state",
        f"SELECT e.state_version, e.pending, {columns}, (SELECT {agg} FROM noetl_variable v "
        "WHERE v.execution_id = e.execution_id) FROM noetl_execution e WHERE e.execution_id = ?",
    )
    row = _run(conn, sql, (execution_id,)).fetchone()
    if row is None:
        return None
    version, pending, plan, workload, parent, triples = row
    if isinstance(triples, str):  # SQLite: the aggregate is JSON text
        triples = json.loads(triples)
    scopes: dict[str, dict[str, Any]] = {}
    for scope, name, value in triples or ():
        scopes.setdefault(scope, {})[name] = value
    state: dict[str, Any] = {"state_version": version, "pending": pending, "variables": scopes}
    if full:
        state["plan"] = _read(dialect, EXECUTIONS, "plan", plan)
        state["workload"] = _read(dialect, EXECUTIONS, "workload", workload)
        state["parent_execution_id"] = parent
    return state


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


def hold_claim(conn: Connection, execution_id: int, run_id: str, slot: int, claim: int, rows: list[Any]) -> None:
    """Keep the rows a cursor slot's claim took (noetl_cursor_hold), over its previous claim's."""
    values = {"execution_id": execution_id, "run_id": run_id, "slot": slot, "claim": claim, "rows": rows}
    stmt = _insert(conn, HOLDS).values(**values)
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


def get_loop(conn: Connection, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
    c = LOOPS.c
    cols = [col for col in LOOPS.c if with_collection or col.name != "collection"]
    row = conn.execute(select(*cols).where(c.run_id == run_id)).mappings().first()
    return dict(row) if row else None


def loop_iteration_done(conn: Connection, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]:
    """Count one finished iteration; returns the counters after the update (done, total, cap, ...)."""
    dialect = conn.dialect
    sql = _sql(dialect, "loop.done", _LOOP_DONE_SQL + " RETURNING " + ", ".join(_LOOP_COUNTERS))
    row = _run(conn, sql, _loop_done_params(dialect, run_id, ok, tolerated)).fetchone()
    if row is None:
        raise LookupError(f"loop {run_id} not found")
    return _loop_counters(dialect, row)


_LOOP_COUNTERS = ("done", "succeeded", "failed", "tolerated", "total", "cap", "status", "context")
# The counters only: an iteration's update leaves the row's later columns as they were, so its
# WAL record carries the changed counters, not the row from them to `updated_at` (130 bytes an
# iteration). `updated_at` is set when the loop completes (`complete_loop`).
_LOOP_DONE_SQL = (
    "UPDATE noetl_loop SET done = done + 1, succeeded = succeeded + ?, failed = failed + ?, "
    "tolerated = tolerated + ? WHERE run_id = ?"
)


def _loop_done_params(dialect: Dialect, run_id: str, ok: bool, tolerated: bool) -> tuple[Any, ...]:
    return (1 if ok else 0, 0 if ok else 1, 1 if tolerated else 0, run_id)


def _loop_counters(dialect: Dialect, row: Any) -> dict[str, Any]:
    counters = dict(zip(_LOOP_COUNTERS, row, strict=False))
    counters["context"] = _read(dialect, LOOPS, "context", counters["context"])
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
        head = execution_head(conn, execution_id, deciding=True)
        if head is None or head["status"] != "running":
            return None, head
        return loop_iteration_done(conn, run_id, ok=ok, tolerated=tolerated), head
    sql = _sql(
        dialect,
        "loop.done.checked",
        f"WITH head AS ({_HEAD_SQL} FOR KEY SHARE) {_LOOP_DONE_SQL} AND (SELECT status FROM head) = 'running' "
        f"RETURNING {', '.join(_LOOP_COUNTERS)}, (SELECT pending FROM head), (SELECT state_version FROM head)",
    )
    row = _run(conn, sql, (execution_id, *_loop_done_params(dialect, run_id, ok, tolerated))).fetchone()
    if row is None:
        return None, None
    n = len(_LOOP_COUNTERS)
    return _loop_counters(dialect, row[:n]), {"status": "running", "pending": row[n], "state_version": row[n + 1]}


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
            c.finished_at,
            c.failed_step,
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


def list_playbooks(conn: Connection) -> list[dict[str, Any]]:
    """The catalog entries by path, without their content."""
    c = CATALOG.c
    rows = conn.execute(select(c.path, c.name, c.source_file, c.registered_at).order_by(c.path)).mappings()
    return [dict(r) for r in rows]


def running_since(conn: Connection, before: datetime) -> list[int]:
    """Top-level executions still running that were created before `before`, oldest first."""
    c = EXECUTIONS.c
    query = select(c.execution_id).where(
        and_(c.status == "running", c.parent_execution_id.is_(None), c.created_at < before)
    )
    return [int(r[0]) for r in conn.execute(query.order_by(c.created_at))]
