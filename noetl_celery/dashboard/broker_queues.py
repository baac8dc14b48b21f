"""How many messages wait in the broker's queues: the sweeper's busy check and the metrics.

Decides how a queue's depth is read: the ready messages, on Redis (LLEN) as on RabbitMQ (a
passive declare's message_count); messages a worker has taken (held countdowns included) are
not counted. The connection comes from the app's pool (RabbitMQ would otherwise see a new
connection every call) and each queue gets a channel of its own: on RabbitMQ a queue that does
not exist yet closes the channel that asked (it is reported as 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

POOL_TIMEOUT = 5.0  # seconds to wait for a connection of the app's pool


def queue_depths(celery_app: Any, queues: Iterable[str], *, stop_at_first: bool = False) -> dict[str, int]:
    """Queue -> ready messages. Raises when the broker cannot be reached. `stop_at_first`: return
    as soon as one queue holds a message (the sweeper only asks whether any does)."""
    depths: dict[str, int] = {}
    with celery_app.pool.acquire(block=True, timeout=POOL_TIMEOUT) as conn:
        conn.ensure_connection(max_retries=1)
        for queue in queues:
            depths[queue] = _depth(conn, queue)
            if stop_at_first and depths[queue] > 0:
                break
    return depths


def _depth(conn: Any, queue: str) -> int:
    channel = conn.channel()
    try:
        return int(channel.queue_declare(queue=queue, passive=True).message_count)
    except Exception:  # the queue does not exist yet: nothing waits in it
        return 0
    finally:
        with contextlib.suppress(Exception):
            channel.close()
