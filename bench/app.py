"""The benchmark's Celery app: noetl_celery's app plus the raw-Celery baseline tasks.

Benchmark workers run `celery -A bench.app worker`, so these tasks and their Redis client exist
only in the benchmark, never in a production worker. The counter and the timestamps are in the
Redis named by env BENCH_COUNTER_URL (set by bench/loops.py and bench/latency.py; the broker's
when unset), so the tasks are the same whichever broker carries them.

- `noetl.bench_noop` (bench/loops.py): counts itself.
- `noetl.bench_chain_step` (bench/latency.py, bench/executions.py): returns its argument; given
  `key`, it first writes its end time there, given `counter_key` it counts itself there (the last
  task of a raw 3-task chain).
- `noetl.bench_retry_once` (bench/latency.py): the first attempt calls `self.retry(countdown=0)`
  and carries its start and end times in the retry's kwargs; the second attempt writes the four
  times to `key`.
- `noetl.bench_echo` / `noetl.bench_collect` (bench/fanout.py): a raw `group` + chord, each task
  returning its element, the chord's callback writing how many results it got and their sum.
"""

from __future__ import annotations

import os
import time
from typing import Any

from noetl_celery.app import app, current_settings

BENCH_NOOP = "noetl.bench_noop"
BENCH_CHAIN_STEP = "noetl.bench_chain_step"
BENCH_RETRY_ONCE = "noetl.bench_retry_once"
BENCH_ECHO = "noetl.bench_echo"
BENCH_COLLECT = "noetl.bench_collect"

_redis_client: Any = None


@app.task(name=BENCH_NOOP, acks_late=True, ignore_result=True)
def bench_noop(counter_key: str | None = None) -> None:
    """A task that does nothing but count itself: the raw-Celery baseline of bench/loops.py."""
    if counter_key:
        _bench_redis().incr(counter_key)


@app.task(name=BENCH_CHAIN_STEP, acks_late=True, ignore_result=True)
def bench_chain_step(x: Any = None, key: str | None = None, counter_key: str | None = None) -> Any:
    """A no-op link of a raw chain; the last link records when it ended (given `key`) or counts
    itself (given `counter_key`: bench/executions.py's many chains)."""
    if key:
        _bench_redis().set(key, repr(time.time()))
    if counter_key:
        _bench_redis().incr(counter_key)
    return x


@app.task(name=BENCH_RETRY_ONCE, bind=True, acks_late=True, ignore_result=True, max_retries=1)
def bench_retry_once(self: Any, key: str, start1: float | None = None, end1: float | None = None) -> None:
    """Fails its first attempt with `self.retry(countdown=0)`; the second attempt writes
    start1/end1 (carried in the retry's kwargs, so the first attempt makes no Redis call) and its
    own start2/end2 to `key`."""
    started = time.time()
    if self.request.retries == 0:
        raise self.retry(countdown=0, kwargs={"key": key, "start1": started, "end1": time.time()})
    ended = time.time()
    _bench_redis().hset(
        key, mapping={"start1": repr(start1), "end1": repr(end1), "start2": repr(started), "end2": repr(ended)}
    )


@app.task(name=BENCH_ECHO, acks_late=True)
def bench_echo(x: Any) -> Any:
    """Returns its element: a member of bench/fanout.py's raw chord."""
    return x


@app.task(name=BENCH_COLLECT, acks_late=True, ignore_result=True)
def bench_collect(results: list[Any], key: str) -> None:
    """The raw chord's callback: writes how many results it received and their sum to `key`."""
    _bench_redis().set(key, f"{len(results)} {sum(int(r) for r in results)}")


def _bench_redis() -> Any:
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(os.environ.get("BENCH_COUNTER_URL") or current_settings().broker_url or "")
    return _redis_client


__all__ = ["app", "bench_chain_step", "bench_collect", "bench_echo", "bench_noop", "bench_retry_once"]
