"""A decision's one-statement write: its event rows, the execution's counters and variables,
guarded by the head it was decided on (`record_decision`), or refused whole (Conflict) when the
head moved or a row's key is taken (the unique key's error fails the whole statement)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

from noetl_celery.store import db, executions, kernel
from noetl_celery.store.events import (
    EVENT_COLUMNS,
    INSERT_ROWS_PER_STATEMENT,
    all_new,
    event_chunks,
    events_insert_sql,
    insert_events,
    is_event_key,
    lease_statements,
    with_leases,
)
from noetl_celery.store.executions import HEAD_SQL, RUNNING_BY_KEY, running_at
from noetl_celery.store.kernel import EXECUTIONS, VARIABLES, utcnow
from noetl_celery.store.loops import LOOP_DONE_SQL, loop_done_params
from noetl_celery.store.variables import PG_VARIABLES, put_variables, variable_rows, variables_upsert_sql


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
    last (entries.CountIteration, write.count_iteration). The strict statement counts it, and refuses
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
        head = executions.execution_head(conn, execution_id, deciding=True)
        if not running_at(head, head_version):
            raise Conflict(f"execution {execution_id}: head {head} is not running at version {head_version}")
    if dialect.name != "postgresql" or len(rows) > INSERT_ROWS_PER_STATEMENT or not any(variables.values()):
        if not insert_events(conn, rows, first_must_be_new=True, new_keys=new_keys, settles=settles):
            return Recorded(False, {})
        return Recorded(
            True, {scope: put_variables(conn, execution_id, scope, values) for scope, values in variables.items()}
        )
    variable_count, params = variable_rows(dialect, execution_id, variables)
    ((rows_count, event_params),) = event_chunks(dialect, rows)
    sql = (
        f"WITH v AS ({variables_upsert_sql(dialect, variable_count, 'scope, name, value')}), "
        f"e AS ({events_insert_sql(dialect, rows_count)}) "
        "SELECT NULL, event_id, NULL::jsonb FROM e UNION ALL SELECT scope, name, value FROM v"
    )
    inserted: set[str] = set()
    stored: dict[str, dict[str, Any]] = {scope: {} for scope in variables}
    sql, all_params = with_leases(conn, rows, sql, params + event_params, settles)
    for scope, name, value in kernel.run(conn, sql, all_params).fetchall():
        if scope is None:
            inserted.add(name)
        else:
            stored[scope][name] = kernel.read(dialect, VARIABLES, "value", value)
    if not all_new(rows, inserted, True, new_keys):
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
        """Its `BUMPS` entry: the pending check and what else the update sets."""
        return "finished" if self.finish else "bumped" if self.expected is None else "bumped.expected"


class IterationCount(NamedTuple):
    """A loop iteration to count in a decision's strict statement, with the loop's max_in_flight
    and total as the decision assumed them."""

    run_id: str
    ok: bool
    tolerated: bool
    max_in_flight: int
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
    ((row_count, params),) = event_chunks(dialect, rows)
    names = [(scope, name) for scope, values in (variables or {}).items() for name in values]
    if bump is not None:
        assert head_version is not None and count is None, "a bump is made on an unread head, alone"
        params, read_back = _bumped_params(dialect, rows, params, head_version, bump, variables or {}, names)
    else:
        params, read_back = _checked_params(dialect, rows, params, head_version, count), []
    sql = _strict_insert_sql(dialect, row_count, _strict_check(head_version, count, bump), len(names), commit)
    sql, params = _with_strict_leases(dialect, rows, settles, sql, params, len(read_back), commit)
    cursor = _run_strict(conn, sql, params)
    if not names:
        return Recorded(True, {})
    assert bump is not None and head_version is not None
    return _read_back(cursor, head_version + bump.version, variables or {})


def _bumped_params(
    dialect: Dialect,
    rows: list[dict[str, Any]],
    params: list[Any],
    head_version: int,
    bump: Bump,
    variables: dict[str, dict[str, Any]],
    names: list[tuple[str, str]],
) -> tuple[list[Any], list[Any]]:
    """The parameters of a strict insert that updates the head's counters (and upserts the
    variables, read back after the commit): all of them, and the read-back ones at their end."""
    execution_id = rows[0]["execution_id"]
    now = kernel.bound(dialect, EXECUTIONS, "updated_at", utcnow())
    variable_count, upsert = variable_rows(dialect, execution_id, variables)
    assert variable_count == len(names)
    finish = [kernel.bound(dialect, EXECUTIONS, "error", None), now] if bump.finish else []
    pending = bump.pending if bump.expected is None else bump.expected
    head = [bump.pending, bump.version, now, *finish, execution_id, head_version, pending]
    read_back = [part for pair in names for part in pair] + [execution_id] if names else []
    return [*head, *upsert, *params, *read_back], read_back


def _checked_params(
    dialect: Dialect,
    rows: list[dict[str, Any]],
    params: list[Any],
    head_version: int | None,
    count: IterationCount | None,
) -> list[Any]:
    """The parameters of a strict insert checked against the head, or the iteration's count."""
    execution_id = rows[0]["execution_id"]
    if count is not None:
        assert head_version is not None, "an iteration counted late is decided on an unread head"
        counted = loop_done_params(dialect, count.run_id, count.ok, count.tolerated)
        return [execution_id, *counted, count.max_in_flight, count.total, head_version, *params]
    if head_version is not None:
        return [execution_id, *params[:_EVENT_KEY_AT], head_version, *params[_EVENT_KEY_AT:]]
    return params


def _strict_check(head_version: int | None, count: IterationCount | None, bump: Bump | None) -> str | None:
    """What the statement checks before its rows count: the bump's, the count, the head, or nothing."""
    if bump is not None:
        return bump.check
    return "counted" if count is not None else "head" if head_version is not None else None


def _with_strict_leases(
    dialect: Dialect,
    rows: list[dict[str, Any]],
    settles: str | None,
    sql: str,
    params: list[Any],
    read_back: int,
    commit: str,
) -> tuple[str, list[Any]]:
    """The lease statements of the rows, between the insert and the commit (a refused insert
    never reaches them), their parameters before the `read_back` last ones."""
    leases = lease_statements(dialect, rows, settles, strict=True)
    if not leases:
        return sql, params
    before, _, after = sql.partition(commit)
    sql = "; ".join([before, *(lease_sql for lease_sql, _ in leases)]) + commit + after
    kept = len(params) - read_back
    return sql, [*params[:kept], *(p for _, lease_params in leases for p in lease_params), *params[kept:]]


def _run_strict(conn: Connection, sql: str, params: list[Any]) -> Any:
    """Send the strict statement; a taken key or a failed check is a Conflict."""
    try:
        return kernel.run(conn, sql, params)
    except DBAPIError as exc:
        diag = getattr(exc.orig, "diag", None)
        if diag is None:
            raise
        key_exists = is_event_key(diag.constraint_name)
        check_failed = diag.sqlstate == "23502" and diag.column_name == "event_id"
        if key_exists or check_failed:
            raise Conflict(str(diag.message_primary)) from exc
        raise


def _read_back(cursor: Any, version: int, variables: dict[str, dict[str, Any]]) -> Recorded:
    """The variables as stored and the pending count, when the state version is still `version`
    (else another decision came after this one: nothing is read back)."""
    stored_version, pending, triples = cursor.fetchone()
    if stored_version != version:  # another decision came after this one
        return Recorded(True, {})
    stored: dict[str, dict[str, Any]] = {scope: {} for scope in variables}
    for scope, name, value in triples or ():
        stored[scope][name] = value
    return Recorded(True, stored, pending)


_strict_sql: dict[tuple[int, str | None, int, str], str] = {}
_HEAD_MATCHES = "(SELECT status = 'running' AND state_version = ? FROM head)"
BUMP_SQL = (  # executions.RUNNING_BY_KEY: the key, never the status index, finds the row
    "UPDATE noetl_execution SET pending = pending + ?, state_version = state_version + ?, updated_at = ?{finish} "
    f"WHERE {RUNNING_BY_KEY} AND state_version = ? AND {{pending}} RETURNING 1"
)
BUMPS = {  # `_strict_insert_sql` checks: the pending check, and what else the update sets
    "bumped": ("pending + ? > 0", ""),
    "bumped.expected": ("pending = ?", ""),
    "finished": ("pending = ?", ", status = 'completed', error = ?, failed_step = NULL, finished_at = ?"),
}


def _strict_insert_sql(dialect: Dialect, rows: int, check: str | None, variables: int, commit: str) -> str:
    """The strict insert of `rows` rows, then `commit`; `check`: None, "head" (the first row's key
    is NULL unless the head matches), "counted" (... unless the iteration was counted, the head
    matching) or one of `BUMPS` (... unless the counters' update, at the head's version, was
    made; the upsert of `variables` variables rides on it, and they are read back after the
    commit)."""
    key = (rows, check, variables, commit)
    sql = _strict_sql.get(key)
    if sql is None:
        row = [kernel.placeholders(dialect, 1)] * len(EVENT_COLUMNS)
        first = list(row)
        head = ""
        after = ""
        if check is not None:
            head = f"WITH head AS ({HEAD_SQL} FOR KEY SHARE) "
            condition = _HEAD_MATCHES
            if check == "counted":  # `loop_iteration_done`, for an iteration that is not the last
                # (`cap`: the column of the loop's max_in_flight)
                counted = (
                    f"{LOOP_DONE_SQL} AND cap = ? AND total = ? AND done + 1 < total "
                    f"AND (context -> 'queue') IS NULL AND {_HEAD_MATCHES} RETURNING 1"
                )
                head = f"WITH head AS ({HEAD_SQL} FOR KEY SHARE), counted AS ({counted}) "
                condition = "EXISTS (SELECT 1 FROM counted)"
            elif check in BUMPS:  # `bump_execution`, on the head the decision assumed
                pending, finish = BUMPS[check]
                head = f"WITH bumped AS ({BUMP_SQL.format(pending=pending, finish=finish)}) "
                condition = "EXISTS (SELECT 1 FROM bumped)"
                if variables:
                    pairs = ", ".join(["(?, ?)"] * variables)
                    after = (
                        f"; SELECT e.state_version, e.pending, (SELECT {PG_VARIABLES} FROM noetl_variable v "
                        f"WHERE v.execution_id = e.execution_id AND (v.scope, v.name) IN ({pairs})) "
                        "FROM noetl_execution e WHERE e.execution_id = ?"
                    )
            head = kernel.dialect_sql(dialect, head)
            if check in BUMPS and variables:  # the upsert is in the driver's paramstyle already
                head = f"{head[:-1]}, v AS ({variables_upsert_sql(dialect, variables, '1')}) "
            after = kernel.dialect_sql(dialect, after)
            first[_EVENT_KEY_AT] = kernel.dialect_sql(dialect, f"CASE WHEN {condition} THEN ? END")
        values = ", ".join([f"({', '.join(first)})"] + [f"({', '.join(row)})"] * (rows - 1))
        sql = f"{head}INSERT INTO noetl_event ({', '.join(EVENT_COLUMNS)}) VALUES {values}{commit}{after}"
        if len(_strict_sql) < 64:
            _strict_sql[key] = sql
    return sql
