"""The store's SQL kernel: the tables, the store's time, and the hot path of statements sent as
SQL text on the transaction's own DBAPI cursor (`run`).

The statements every decision makes (the execution head, the execution and loop counters, the
insert of the event rows) are written once per dialect as SQL text and run on the transaction's
own DBAPI cursor: building them as Core constructs cost about 4x their client CPU. They bind
their values through the same SQLAlchemy type processors as Core would (`bound`, `read`: JSON,
timestamps on SQLite), so rows read the same either way, and driver errors still surface as
SQLAlchemy's DBAPIError (what the callers retry on). Every table module of the store builds on
these; none of them on another's private helpers.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any, NoReturn, cast

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError

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


def insert(conn: Connection, table):  # type: ignore[no-untyped-def]
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return postgresql.insert(table)
    if dialect == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"event store on {dialect} is not supported (use PostgreSQL or SQLite)")


# --- the hot path: SQL text on the DBAPI cursor --------------------------------------------


def run(conn: Connection, sql: str, params: Any) -> Any:
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


def run_text(conn: Connection, sql: str, params: Any) -> Any:
    """`run` without preparing `sql` (a statement PostgreSQL cannot prepare: DECLARE, FETCH,
    CLOSE of a cursor); in a `db.decision_transaction` it carries the BEGIN when it is the first."""
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = dbapi_connection.cursor()
    return _send(conn, cursor, db.begin_prefix(conn, bound=params is not None) + sql, params)


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


def copies(conn: Connection) -> bool:
    """Whether `copy_in` can stream to this connection's server: PostgreSQL through psycopg2."""
    return conn.dialect.name == "postgresql" and conn.dialect.driver == "psycopg2"


class _Pieces:
    """A file for psycopg2's `copy_expert` reading the pieces of an iterable, one per read."""

    def __init__(self, pieces: Iterable[bytes]):
        self._pieces = iter(pieces)

    def read(self, _size: int = -1) -> bytes:
        return next(self._pieces, b"")

    readline = read


def copy_in(conn: Connection, sql: str, pieces: Iterable[bytes]) -> None:
    """COPY ... FROM STDIN on the transaction's DBAPI connection (`copies`), its data the
    concatenation of `pieces`, each sent as it is made. In a `db.decision_transaction` the BEGIN
    and deferred statements go first, as with `run`."""
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    cursor = dbapi_connection.cursor()
    prefix = db.begin_prefix(conn, bound=False)
    if prefix:
        _send(conn, cursor, prefix, None)
    try:
        cursor.copy_expert(sql, _Pieces(pieces))
    except Exception as exc:
        _raise(conn, cursor, sql, None, exc)


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


def placeholders(dialect: Dialect, count: int) -> str:
    mark = "?" if dialect.paramstyle == "qmark" else "%s"
    return ", ".join([mark] * count)


def dialect_sql(dialect: Dialect, sql: str) -> str:
    """`sql` written with `?` placeholders, in the driver's paramstyle."""
    if dialect.paramstyle == "qmark":
        return sql
    return sql.replace("%", "%%").replace("?", "%s")


class Processors:
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


PROCESSORS = Processors()
_sql_cache: dict[tuple[str, str], str] = {}


def sql(dialect: Dialect, name: str, text: str) -> str:
    key = (dialect.name, name)
    found = _sql_cache.get(key)
    if found is None:
        found = _sql_cache[key] = dialect_sql(dialect, text)
    return found


def bound(dialect: Dialect, table: Table, column: str, value: Any) -> Any:
    process = PROCESSORS.bind(dialect, table, column)
    return process(value) if process is not None else value


def read(dialect: Dialect, table: Table, column: str, value: Any) -> Any:
    process = PROCESSORS.result(dialect, table, column)
    return process(value) if process is not None else value
