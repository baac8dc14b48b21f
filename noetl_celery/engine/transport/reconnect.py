"""How soon a worker's consumer has its broker again after the link comes back.

Celery's consumer reconnects through kombu's `ensure_connection` with its default intervals: 2 s,
growing by 2 s up to 30 s between tries, so a link that was down for half a minute is noticed
again only at the next try, up to 30 s after it healed (55-75 s in all were measured). Here the
tries are RECONNECT_START apart, growing by RECONNECT_STEP up to RECONNECT_MAX seconds: a healed
link is back within RECONNECT_MAX seconds and a try to an unreachable broker costs one refused
TCP connection. Nothing else of the consumer changes; its warnings stay one line each.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer

RECONNECT_START = 0.5  # seconds before the first reconnect try
RECONNECT_STEP = 0.5  # seconds added to the wait after each failed try...
RECONNECT_MAX = 2.0  # ...up to this many seconds between tries
CONSUMER = "noetl_celery.engine.transport.reconnect:QuickReconnect"  # Celery's worker_consumer setting


class QuickReconnect(Consumer):  # type: ignore[misc]
    """Celery's consumer, whose broker connection is retried every RECONNECT_MAX seconds at most."""

    def ensure_connected(self, conn: Any) -> Any:
        ensure = conn.ensure_connection

        def quickly(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("interval_start", RECONNECT_START)
            kwargs.setdefault("interval_step", RECONNECT_STEP)
            kwargs.setdefault("interval_max", RECONNECT_MAX)
            return ensure(*args, **kwargs)

        conn.ensure_connection = quickly
        return super().ensure_connected(conn)
