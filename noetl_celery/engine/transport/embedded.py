"""The embedded worker: a Celery worker thread pool inside this process, on the in-memory broker
(`noetl-celery run`, runner.embedded_worker). The process is the deployment's only sweeper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from noetl_celery.config.settings import Settings
from noetl_celery.engine.transport.sweeping import start_sweeper, stop_sweeper

SHUTDOWN_WAKE_MESSAGES = 2  # control messages that wake the embedded worker's two waits


@contextmanager
def worker_thread_pool(app: Any, settings: Settings, concurrency: int) -> Iterator[Any]:
    """Run `app`'s worker on threads while the context lasts; it stops at once on leaving."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(
        app,
        pool="threads",
        concurrency=concurrency,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=10.0,
        queues=[settings.task_queue, settings.event_queue],
    ) as worker:
        start_sweeper()  # the embedded process is the deployment's only sweeper
        try:
            yield worker
        finally:
            stop_sweeper()
            _wake_for_shutdown(app, worker)


def _wake_for_shutdown(app: Any, worker: Any) -> None:
    """Ask the embedded worker to stop, and wake its consumer loop at once. Between shutdown
    checks the loop waits up to 2 s for a message, and after the check that stops it, it waits
    once more (Celery's synloop drains in a `finally`). Two control pings to this worker alone (no
    reply wanted, nothing run) end both waits at once."""
    from celery.worker import state

    state.should_terminate = 0
    for _ in range(SHUTDOWN_WAKE_MESSAGES):
        app.control.broadcast("ping", destination=[worker.hostname], reply=False)
