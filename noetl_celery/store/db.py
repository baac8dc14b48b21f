"""Engines, transactions and migrations of the event store.

One engine per (process, URL): engines are disposed after fork (prefork workers must never
share pooled connections). SQLite gets WAL, a busy timeout and `BEGIN IMMEDIATE` transactions,
so read-then-write sections never fail with "database is locked".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

from noetl_celery.errors import ConfigurationError

SQLITE_BUSY_TIMEOUT = 60  # seconds a SQLite writer waits for the lock
POOL_RECYCLE = 1800  # seconds before a pooled server connection is replaced
REPO_ROOT = Path(__file__).resolve().parents[2]

_engines: dict[tuple[int, str], Engine] = {}
_migrated: set[tuple[int, str]] = set()
_lock = threading.Lock()


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
    # No pre-ping (it costs a round trip per checkout on the hot path): a dropped connection
    # surfaces as a DBAPIError, the pool discards it, and the event is delayed and retried.
    return create_engine(url, pool_size=5, max_overflow=10, pool_recycle=POOL_RECYCLE)


def dispose_engines() -> None:
    """Forget every engine (called in a forked child: never reuse the parent's connections)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose(close=False)
        _engines.clear()


@contextmanager
def transaction(url: str) -> Iterator[Connection]:
    """One unit of work: commits on success, rolls back on error."""
    with get_engine(url).begin() as conn:
        yield conn


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    ini = REPO_ROOT / "alembic.ini"
    if not ini.exists():
        raise ConfigurationError(f"alembic.ini not found at {ini}: install noetl_celery from its source tree")
    config = Config(str(ini))
    config.set_main_option("script_location", str(REPO_ROOT / "alembic"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["noetl_url"] = url
    return config


def migrate(url: str, revision: str = "head") -> None:
    """`alembic upgrade <revision>` on `url`."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def ensure_schema(url: str) -> None:
    """Upgrade to head unless this process already did it for `url`."""
    key = (os.getpid(), url)
    if key in _migrated:
        return
    migrate(url)
    _migrated.add(key)
