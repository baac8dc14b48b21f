"""The benchmark's Celery app: noetl_celery's app plus the raw-Celery baseline task.

Benchmark workers run `celery -A bench.app worker`, so `noetl.bench_noop` and its Redis client
exist only in the benchmark, never in a production worker. The counter is in the Redis named by
env BENCH_COUNTER_URL (set by bench/loops.py; the broker's when unset), so the task is the same
whichever broker carries it.
"""

from __future__ import annotations

import os
from typing import Any

from noetl_celery.app import app, current_settings

BENCH_NOOP = "noetl.bench_noop"

_redis_client: Any = None


@app.task(name=BENCH_NOOP, acks_late=True, ignore_result=True)
def bench_noop(counter_key: str | None = None) -> None:
    """A task that does nothing but count itself: the raw-Celery baseline of bench/loops.py."""
    if counter_key:
        _bench_redis().incr(counter_key)


def _bench_redis() -> Any:
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL") or current_settings().broker_url or "")
    return _redis_client


__all__ = ["app", "bench_noop"]
