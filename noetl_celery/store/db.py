"""Engines, transactions and migrations of the event store.

One engine per (process, URL): engines are disposed after fork (prefork workers must never
share pooled connections). SQLite gets WAL, a busy timeout and `BEGIN IMMEDIATE` transactions,
so read-then-write sections never fail with "database is locked".
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import ConfigurationError
from noetl_celery.store import clock, prepared
from noetl_celery.store.urls import safe_url

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT = 60  # seconds a SQLite writer waits for the lock
POOL_RECYCLE = 1800  # seconds before a pooled server connection is replaced
PING_AFTER_IDLE = 2.0  # seconds a pooled server connection may sit idle before checkout pings it
_LAST_USED = "noetl_last_used"  # connection record info: monotonic time of its last check-in
# connection record info, present while the connection runs a `decision_transaction`: True until
# its BEGIN has been sent (with the first statement), then False
_BEGIN_PENDING = "noetl_begin_pending"
_DEFERRED = "noetl_deferred_statements"  # bound statements that go in front of the next one

_engines: dict[tuple[int, str], Engine] = {}
_migrated: set[tuple[int, str]] = set()
# the Alembic scripts shipped in the package (noetl_celery/migrations), found by path: the
# migrations import the store (its models and engines), the store never imports them
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"
_lock = threading.Lock()


class SchemaOutOfDate(ConfigurationError):
    """The event store's schema is missing or older than this version: `noetl-celery migrate`."""


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # let SQLAlchemy's begin emit BEGIN IMMEDIATE
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT * 1000}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def get_engine(url: str) -> Engine:
    """The engine for `url` in this process (created on first use)."""
    key = (os.getpid(), url)
    engine = _engines.get(key)
    if engine is not None:
        return engine
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _create_engine(url)
            _engines[key] = engine
    return engine


def _create_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT},
            pool_size=8,
            max_overflow=16,
        )
        _configure_sqlite(engine)
        return engine
    engine = create_engine(url, pool_size=5, max_overflow=10, pool_recycle=POOL_RECYCLE)
    _ping_when_idle(engine)
    if engine.dialect.name == "postgresql":
        event.listen(engine, "connect", _measure_clock)
    if _folds_begin(engine):
        event.listen(engine, "before_cursor_execute", _begin_with_first_statement, retval=True)
        _prepare_statements(engine, parsed.host, parsed.port)
    return engine


def _measure_clock(dbapi_connection, _record):  # type: ignore[no-untyped-def]
    """Each new PostgreSQL connection measures this process's clock against the server's
    (store/clock.py); a connection that cannot is used all the same (the last measure stays)."""
    try:
        clock.measure(dbapi_connection)
        dbapi_connection.rollback()
    except Exception as exc:  # the measure must never stop a connection
        log.debug("could not measure the store's clock: %s", exc)


def _prepare_statements(engine: Engine, host: str | None, port: int | None) -> None:
    """Each new connection of a psycopg2 engine gets its prepared-statement Session, by
    NOETL_PG_PREPARE (store/prepared.py)."""
    chosen = noetl_settings.pg_prepare()
    if chosen == "off":
        return

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, record):  # type: ignore[no-untyped-def]
        prepared.on_connect(dbapi_connection, record, chosen, host, port)


def _folds_begin(engine: Engine) -> bool:
    """Whether the driver sends a statement with its parameters bound as one simple query, which
    may hold several statements: psycopg2 (not psycopg 3, whose bound statements are one each)."""
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg2"


def _begin_with_first_statement(conn, cursor, statement, parameters, _context, executemany):  # type: ignore[no-untyped-def]
    """A statement built with SQLAlchemy Core in a `decision_transaction` opens it when it is the
    first, and carries the statements deferred before it (the hot path's own statements do the
    same in `kernel.run`, with `begin_prefix`)."""
    if executemany:
        prefix = begin_prefix(conn, bound=False)
        if prefix:
            cursor.execute(prefix)
        return statement, parameters
    return begin_prefix(conn, bound=parameters is not None) + statement, parameters


def _ping_when_idle(engine: Engine) -> None:
    """Pre-ping a pooled connection at checkout when it sat idle for PING_AFTER_IDLE seconds.

    A connection dropped while pooled (a PgBouncer restart, a failover, an idle timeout) is then
    replaced at checkout instead of failing the first statement. A connection checked in moments
    ago is not pinged: under load that ping was a round trip on every decision (7 % of a worker's
    busy time in a cursor loop profile). If such a connection was dropped all the same, its first
    statement raises a disconnect error, the pool discards its connections, and the caller's
    delay-and-retry path runs the unit of work again, as for a connection lost mid-transaction."""

    @event.listens_for(engine, "connect")
    def _connect(_dbapi_connection, record):  # type: ignore[no-untyped-def]
        record.info[_LAST_USED] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection, record):  # type: ignore[no-untyped-def]
        if record is not None:
            record.info[_LAST_USED] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection, record, _proxy):  # type: ignore[no-untyped-def]
        if time.monotonic() - record.info.get(_LAST_USED, 0.0) < PING_AFTER_IDLE:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            # the pool closes this connection and checks out another (or opens a new one)
            raise DisconnectionError(f"pooled connection failed its ping: {exc}") from exc


def dispose_engines() -> None:
    """Forget every engine (called in a forked child: never reuse the parent's connections)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=False)
        _engines.clear()


def dispose_engine(url: str) -> None:
    """Close and forget this process's engine for `url` (a scratch store that is done with)."""
    with _lock:
        engine = _engines.pop((os.getpid(), url), None)
    if engine is not None:
        engine.dispose()


@contextmanager
def transaction(url: str) -> Iterator[Connection]:
    """One unit of work: commits on success, rolls back on error."""
    with get_engine(url).begin() as conn:
        yield conn


@contextmanager
def single_read(url: str) -> Iterator[Connection]:
    """A connection for one read statement. On PostgreSQL it runs outside a transaction
    (autocommit): a statement reads one snapshot, and BEGIN and COMMIT would be two more round
    trips. Elsewhere it is a transaction, as `transaction` gives."""
    if get_engine(url).dialect.name != "postgresql":
        with transaction(url) as conn:
            yield conn
        return
    with outside_transaction(url) as conn:
        yield conn


@contextmanager
def outside_transaction(url: str) -> Iterator[Connection]:
    """A PostgreSQL connection in autocommit mode, for a statement that cannot run inside a
    transaction (VACUUM)."""
    with _autocommit(get_engine(url)) as (conn, _):
        yield conn


@contextmanager
def _autocommit(engine: Engine) -> Iterator[tuple[Connection, Any]]:
    """A pooled connection whose DBAPI connection is in autocommit mode until it goes back."""
    with engine.connect() as conn:
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection is not None
        dbapi_connection.autocommit = True
        try:
            yield conn, dbapi_connection
        finally:
            if not dbapi_connection.closed:  # a lost connection was invalidated: nothing to reset
                dbapi_connection.autocommit = False


@contextmanager
def decision_transaction(url: str) -> Iterator[Connection]:
    """A transaction as `transaction` gives, whose BEGIN and COMMIT need no round trip of their own
    on PostgreSQL with psycopg2.

    psycopg2 sends BEGIN alone before a transaction's first statement, and COMMIT alone at the
    end: two of the four round trips of a loop iteration's decision. Here the connection runs in
    autocommit mode and the transaction is opened by `BEGIN; ` sent in front of its first
    statement (`begin_prefix`). A writer that knows its statement is the last one sends
    `; COMMIT` behind it (`commit_suffix`); otherwise the exit commits. On any error the
    transaction is rolled back before the connection goes back to the pool. Elsewhere (SQLite) it
    is `transaction`, as it is with another PostgreSQL driver than psycopg2."""
    engine = get_engine(url)
    if not _folds_begin(engine):
        with transaction(url) as conn:
            yield conn
        return
    with _autocommit(engine) as (conn, dbapi_connection):
        info = conn.info
        info[_BEGIN_PENDING] = True
        try:
            yield conn
            if info.get(_DEFERRED) or dbapi_connection.info.transaction_status != IDLE:
                conn.exec_driver_sql("COMMIT")  # carries what is still deferred
        except BaseException:
            info.pop(_DEFERRED, None)
            if not dbapi_connection.closed and dbapi_connection.info.transaction_status != IDLE:
                conn.exec_driver_sql("ROLLBACK")
            raise
        finally:
            info.pop(_BEGIN_PENDING, None)
            info.pop(_DEFERRED, None)


IDLE = 0  # psycopg2.extensions.TRANSACTION_STATUS_IDLE: no transaction open on the server


def begin_prefix(conn: Connection, *, bound: bool = True) -> str:
    """What goes in front of the next statement of a `decision_transaction`: "BEGIN; " for its
    first, and the statements `defer` left for it; "" for any other. `bound`: the statement is
    sent with parameters (psycopg2 formats it then, so a `%` of the deferred text is doubled)."""
    info = conn.info
    parts = []
    if info.get(_BEGIN_PENDING):
        info[_BEGIN_PENDING] = False
        parts.append("BEGIN; ")
    deferred = info.pop(_DEFERRED, None)
    if deferred:
        text = "".join(f"{sql}; " for sql in deferred)
        parts.append(text.replace("%", "%%") if bound else text)
    return "".join(parts)


def defer(conn: Connection, sql: str, params: Any) -> bool:
    """Send `sql` (the driver's paramstyle, bound to `params` here) in front of the next statement
    of this `decision_transaction`, or with its commit: one round trip less. False, with nothing
    done, on any other connection (the caller runs it itself). A deferred statement's error is
    raised by the statement it travels with, and rolls back the transaction as its own would."""
    info = conn.info
    if _BEGIN_PENDING not in info:
        return False
    dbapi_connection = conn.connection.dbapi_connection
    assert dbapi_connection is not None
    from psycopg2.extensions import encodings  # only psycopg2 folds statements (_folds_begin)

    cursor = dbapi_connection.cursor()
    try:
        text = cursor.mogrify(sql, params).decode(encodings[dbapi_connection.encoding])
    finally:
        cursor.close()
    info.setdefault(_DEFERRED, []).append(text)
    return True


def commit_suffix(conn: Connection) -> str | None:
    """ "; COMMIT" for the last statement of a `decision_transaction` (None elsewhere: the caller
    leaves the commit to its transaction)."""
    return "; COMMIT" if _BEGIN_PENDING in conn.info else None


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    """Alembic's configuration for `url`, reading the migrations shipped in the package."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["noetl_url"] = url
    config.attributes["noetl_engine_factory"] = get_engine  # SQLite: migrated on the store's engine
    return config


def migrate(url: str, revision: str = "head") -> None:
    """`alembic upgrade <revision>` on `url`."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The schema revision the store at `url` is at (None: no schema), read with one query of
    Alembic's `alembic_version` table, without loading Alembic. A store that cannot be reached
    raises."""
    with get_engine(url).connect() as conn:
        try:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except DBAPIError:  # no such table: no schema yet
            return None


def upgrade(url: str, revision: str = "head") -> tuple[str | None, str]:
    """`noetl-celery migrate --revision R`: upgrade the store at `url` to R; returns the revisions
    (before, after) as read from the store. R is `head`, a revision (`0002`) or its file name
    (`0002_durability.py`). Only upgrades: a store already past R is refused (SchemaOutOfDate
    names both revisions; a downgrade is `alembic downgrade`, by hand, with a backup), and so is a
    revision this release does not ship."""
    order = shipped_revisions()
    name = Path(revision).name.removesuffix(".py")
    target = order[-1] if name == "head" else name if name in order else name.split("_", 1)[0]
    where = safe_url(url)
    if target not in order:
        raise ConfigurationError(
            f"--revision {revision!r} is not a schema revision of this release (it has {', '.join(order)} and head)"
        )
    before = current_revision(url)
    if before in order and order.index(before) > order.index(target):
        raise SchemaOutOfDate(
            f"the event store at {where} is at revision {before}, past {target}: `noetl-celery migrate` only "
            f"upgrades; to go back, back the store up and run `alembic downgrade {target}` on it by hand"
        )
    migrate(url, target)
    after = current_revision(url)
    assert after is not None
    return before, after


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def ensure_schema(url: str) -> None:
    """Make sure the event store at `url` can be used by this version (once per process).

    The embedded SQLite store is created or upgraded here, on first use. Any other store is only
    checked: `noetl-celery migrate` alone changes its schema, so that in a rolling deploy the
    first new process does not change the schema under the old workers. A store that is behind
    raises SchemaOutOfDate saying what to run; one that is ahead (migrated by a newer version)
    is used as it is, since migrations only add.
    """
    key = (os.getpid(), url)
    if key in _migrated:
        return
    if current_revision(url) != head_revision():  # at head: nothing to do, and no Alembic to load
        if make_url(url).get_backend_name() == "sqlite":
            migrate(url)
        else:
            check_revision(url)
    _migrated.add(key)


_REVISION_LINE = re.compile(r"""^(revision|down_revision)\s*=\s*(?:"([^"]*)"|'([^']*)'|None)\s*$""", re.M)


@functools.cache
def shipped_revisions() -> tuple[str, ...]:
    """The schema revisions this release ships, oldest first, read from the migration files'
    `revision` and `down_revision` lines without loading Alembic (tests/test_migrations.py holds
    this to Alembic's own reading of the same files)."""
    parents: dict[str, str | None] = {}
    for path in (MIGRATIONS / "versions").glob("*.py"):
        found = {name: double or single or None for name, double, single in _REVISION_LINE.findall(path.read_text())}
        if found.get("revision"):
            parents[str(found["revision"])] = found.get("down_revision")
    children = {parent: revision for revision, parent in parents.items()}
    order: list[str] = []
    revision = children.get(None)
    while revision is not None:
        order.append(revision)
        revision = children.get(revision)
    if not order or len(order) != len(parents):
        raise ConfigurationError(
            f"the schema migrations in {MIGRATIONS / 'versions'} are missing or not one line of revisions "
            f"({parents or 'no revision found'}): reinstall noetl_celery"
        )
    return tuple(order)


def head_revision() -> str:
    """The newest revision of the schema this version knows (the one `migrate` brings a store to)."""
    return shipped_revisions()[-1]


def check_revision(url: str) -> None:
    """SchemaOutOfDate when the store at `url` has no schema or an older one than this version."""
    head = head_revision()
    current = current_revision(url)
    where = safe_url(url)
    if current is None:
        raise SchemaOutOfDate(f"the event store at {where} has no schema: run `noetl-celery migrate`")
    if current != head and current in shipped_revisions():
        raise SchemaOutOfDate(
            f"the event store at {where} is at revision {current}, this version needs {head}: "
            "run `noetl-celery migrate`"
        )
