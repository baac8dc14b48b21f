"""One clock for the deployment: the event store's.

Decides what time it is for everything the engine writes or compares across processes (event
timestamps, lease and playbook deadlines, retry and wake due times, schedule fire times, a
message's publish time): the database server's clock, never a worker's. Each process measures
how far its own wall clock is from the server's on every new connection to a PostgreSQL store
(one `SELECT clock_timestamp()`, halfway through the round trip) and keeps the last measure;
`now()` and `epoch()` are the local clock corrected by it, so they cost no round trip. On SQLite
the store's clock is the host's own: the skew is 0.

A process whose clock is further from the store's than NOETL_CLOCK_SKEW_WARN seconds logs one
warning (again only once its skew has come back under the limit and gone past it again).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_WARN_AFTER = 2.0  # seconds of skew past which a process warns (NOETL_CLOCK_SKEW_WARN)

_lock = threading.Lock()
_skew = 0.0  # seconds this process's wall clock is ahead of the store's
_warned = False
warn_after = DEFAULT_WARN_AFTER


def skew() -> float:
    """Seconds this process's wall clock is ahead of the store's (negative: behind)."""
    return _skew


def epoch() -> float:
    """The store's time, in epoch seconds."""
    return time.time() - _skew


def now() -> datetime:
    """The store's time, as an aware UTC datetime (from time.time(), like everything here)."""
    return datetime.fromtimestamp(time.time() - _skew, UTC)


def measure(dbapi_connection: Any) -> float:
    """Measure, on a new PostgreSQL DBAPI connection, how far this process's clock is from the
    server's, and keep it: the server's clock read halfway through the round trip."""
    cursor = dbapi_connection.cursor()
    try:
        before = time.time()
        cursor.execute("SELECT extract(epoch FROM clock_timestamp())")
        server = float(cursor.fetchone()[0])
        after = time.time()
    finally:
        cursor.close()
    observe((before + after) / 2 - server)
    return _skew


def observe(measured: float) -> None:
    """Keep a measured skew (seconds this clock is ahead of the store's); warn once past the limit."""
    global _skew, _warned
    with _lock:
        _skew = measured
        past = abs(measured) > warn_after
        first = past and not _warned
        _warned = past
    if first:
        log.warning(
            "this process's clock is %.1f s %s the event store's (NOETL_CLOCK_SKEW_WARN %g s): deadlines,"
            " due times and timestamps follow the store's clock; check this host's time synchronisation",
            abs(measured),
            "ahead of" if measured > 0 else "behind",
            warn_after,
        )


def reset() -> None:
    """Forget the measure (tests)."""
    global _skew, _warned
    with _lock:
        _skew, _warned = 0.0, False
