"""A tiny Celery app for testing the worker support code without the real noetl_celery app.

Broker and result backend both come from env ``NOETL_BROKER_URL`` (default ``memory://``), the
default queue from ``NOETL_TASK_QUEUE`` (default ``noetl.tasks``), the same variables the real
app reads, so `WorkerProcess("tests.support.echo_app", ...)` is configured like a real worker.
A client in the test process builds its own instance with `make_app(url)`.
"""

from __future__ import annotations

import os
import time

from celery import Celery


def make_app(broker_url: str | None = None, queue: str | None = None) -> Celery:
    broker_url = broker_url or os.environ.get("NOETL_BROKER_URL", "memory://")
    app = Celery(
        "echo_app",
        broker=broker_url,
        backend=broker_url if broker_url.startswith(("redis://", "rediss://", "unix://")) else "cache+memory://",
    )
    app.conf.update(
        task_default_queue=queue or os.environ.get("NOETL_TASK_QUEUE", "noetl.tasks"),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=600,
    )
    visibility = os.environ.get("ECHO_VISIBILITY_TIMEOUT")
    if visibility:  # for showing what Redis does with a countdown longer than this
        options = {"visibility_timeout": int(visibility), "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        app.conf.broker_transport_options = options
        app.conf.result_backend_transport_options = options

    @app.task(name="echo.echo")
    def echo(value):
        return value

    @app.task(name="echo.add")
    def add(a, b):
        return a + b

    @app.task(name="echo.pid")
    def pid():
        """The pid of the process that ran the task (a pool child under prefork)."""
        return os.getpid()

    @app.task(name="echo.count")
    def count(key):
        """Count the runs of this message in the broker's Redis (INCR key)."""
        import redis

        return redis.Redis.from_url(broker_url).incr(key)

    @app.task(name="echo.sleep")
    def sleep(seconds):
        time.sleep(seconds)
        return seconds

    return app


app = make_app()
