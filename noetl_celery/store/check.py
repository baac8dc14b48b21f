"""Whether the event store and the broker can be used, and infrastructure errors as one line.

Decides which failures to reach the store or the broker are transient (worth waiting for: a
server starting, refusing connections, a timeout) and which are final (wrong password, unknown
database or role, bad URL, missing schema), and how either is told in one line that says what
failed and where (the URL with its password hidden).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from noetl_celery.config import secret_registry
from noetl_celery.store.urls import safe_url as safe_url

log = logging.getLogger(__name__)

STARTUP_WAIT = 30.0  # seconds a starting worker waits for a store that is not reachable yet
STARTUP_RETRY_DELAY = 2.0  # seconds between two such attempts

_FINAL_PATTERNS = (
    "password authentication failed",
    "no password supplied",
    "authentication failed",
    "does not exist",
    "could not translate host name",
    "invalid dsn",
    "invalid port",
    "invalid connection option",
    "unable to open database file",
    "permission denied",
    "no such table",
    'missing "="',
    "invalid integer value",
)
DRIVER_MODULES = frozenset({"psycopg", "psycopg2", "asyncpg", "pg8000", "pymysql", "MySQLdb", "cx_Oracle"})
_LIBPQ_PREFIX = re.compile(r"^connection to server (?:at|on) .*? failed:\s*(?:FATAL:\s*)?", re.IGNORECASE)


class StoreUnusable(Exception):
    """The event store cannot be used as configured (a one-line message, password hidden)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(secret_registry.mask_text(message))
        self.transient = transient


def first_line(exc: BaseException) -> str:
    """The informative first line of a driver's error (libpq's 'connection to server' preamble dropped)."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip() or type(orig).__name__
    for line in text.splitlines():
        line = _LIBPQ_PREFIX.sub("", line.strip())
        if line:
            return secret_registry.mask_text(line)
    return type(orig).__name__


def is_transient(exc: BaseException) -> bool:
    """True for a failure that may pass by itself (server down or busy), False for configuration."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    return not any(pattern in text for pattern in _FINAL_PATTERNS)


def _probe(url: str) -> None:
    from sqlalchemy import text

    from noetl_celery.store.db import get_engine

    with get_engine(url).connect() as conn:
        conn.execute(text("SELECT 1"))


def check_store(url: str, wait: float = STARTUP_WAIT) -> None:
    """Connect to the store once; final failures raise StoreUnusable at once, transient ones are
    retried for up to `wait` seconds."""
    from sqlalchemy.exc import ArgumentError, DBAPIError

    deadline = time.monotonic() + wait
    where = safe_url(url)
    while True:
        try:
            _probe(url)
            return
        except ArgumentError as exc:
            raise StoreUnusable(f"event store URL {where} is not valid: {exc}") from None
        except DBAPIError as exc:
            transient = is_transient(exc)
            message = f"event store at {where}: {first_line(exc)}"
            if not transient or time.monotonic() >= deadline:
                raise StoreUnusable(message, transient=transient) from None
            log.warning("%s; trying again in %.0f s", message, STARTUP_RETRY_DELAY)
            time.sleep(STARTUP_RETRY_DELAY)


def describe_infrastructure_error(exc: BaseException, database_url: str | None, broker_url: str | None) -> str | None:
    """One line for a failure to use the store or the broker, None if `exc` is no such failure."""
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    store = safe_url(database_url) if database_url else "(no NOETL_DATABASE_URL)"
    if isinstance(exc, StoreUnusable):
        return str(exc)
    if isinstance(exc, (ArgumentError, NoSuchModuleError)):
        return secret_registry.mask_text(f"event store URL {store} is not valid: {exc}")
    if isinstance(exc, ImportError) and exc.name in DRIVER_MODULES:
        return (
            f"event store URL {store} needs the database driver {exc.name!r}, which is not installed "
            "(for PostgreSQL write postgresql+psycopg2://...)"
        )
    if isinstance(exc, DBAPIError):
        line = first_line(exc)
        if "no such table" in line or ("relation" in line and "does not exist" in line):
            return f"event store at {store} has no schema ({line}): run `noetl-celery migrate`"
        return f"event store at {store} cannot be used: {line}"
    alembic_line = _alembic_error(exc, store)
    if alembic_line is not None:
        return alembic_line
    if _is_broker_error(exc):
        where = safe_url(broker_url) if broker_url else "(no NOETL_BROKER_URL)"
        return secret_registry.mask_text(f"broker at {where} cannot be used: {one_line(exc)}")
    return None


def _alembic_error(exc: BaseException, store: str) -> str | None:
    try:
        from alembic.util import CommandError
    except ImportError:  # pragma: no cover - alembic is a dependency
        return None
    if isinstance(exc, CommandError) and "Can't locate revision" in str(exc):
        return secret_registry.mask_text(
            f"event store at {store} is at a schema revision this release does not know "
            f"({one_line(exc)}): it was migrated by another release; run that release, or this "
            "release's `noetl-celery migrate` on a store of its own"
        )
    if isinstance(exc, CommandError):
        return secret_registry.mask_text(
            f"event store at {store}: schema migration failed: {one_line(exc)} "
            "(is this release's `noetl-celery migrate` applied?)"
        )
    return None


def _is_broker_error(exc: BaseException) -> bool:
    """A broker's error: by its class's package (kombu's OperationalError among them), or a
    ConnectionError; by name, so that the store needs no import of the broker's libraries."""
    names = {cls.__module__.split(".")[0] for cls in type(exc).__mro__}
    return isinstance(exc, ConnectionError) or bool(names & {"redis", "amqp", "kombu", "librabbitmq"})


def one_line(exc: Any) -> str:
    text = str(exc).strip().splitlines()
    return secret_registry.mask_text(text[0] if text else type(exc).__name__)
