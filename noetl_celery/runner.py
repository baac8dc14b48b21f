"""Submitting executions, following them, and the embedded run (a worker inside this process).

The CLI is a thin layer over these functions; a Python user calls the same ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from noetl_celery import settings as noetl_settings
from noetl_celery.dsl.plan import Plan
from noetl_celery.engine.ids import new_execution_id
from noetl_celery.engine.orchestrator import start_payload
from noetl_celery.errors import ExecutionNotFound
from noetl_celery.store import repo
from noetl_celery.store.db import ensure_schema, transaction

EMBEDDED_CONCURRENCY = 4  # worker threads of `noetl-celery run`
POLL_INTERVAL = 0.05  # seconds between status reads while waiting


def create_execution(plan: Plan, database_url: str, *, parent_execution_id: int | None = None) -> int:
    ensure_schema(database_url)
    execution_id = new_execution_id()
    with transaction(database_url) as conn:
        repo.create_execution(conn, execution_id=execution_id, plan=plan.model_dump(mode="json"),
                              workload=plan.workload, parent_execution_id=parent_execution_id)
    return execution_id


def submit(plan: Plan, settings: noetl_settings.Settings | None = None) -> int:
    """Create the execution and enqueue its start on the configured broker."""
    from noetl_celery.app import app, send_event

    settings = settings or app.conf.noetl_settings
    execution_id = create_execution(plan, settings.database_url)
    send_event(start_payload(execution_id))
    return execution_id


def execution_status(database_url: str, execution_id: int) -> dict[str, Any]:
    """{execution_id, status, error, failed_step, results: {step: result}, ...} from the store."""
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        row = repo.get_execution(conn, execution_id)
        if row is None:
            raise ExecutionNotFound(f"no execution {execution_id} in {_safe_url(database_url)}")
        variables = repo.load_variables(conn, execution_id)
    return {
        "execution_id": execution_id,
        "playbook": row["playbook_name"],
        "status": row["status"],
        "error": row["error"],
        "failed_step": row["failed_step"],
        "results": variables.get("result", {}),
        "ctx": variables.get("ctx", {}),
        "vars": variables.get("vars", {}),
        "created_at": row["created_at"].isoformat() if row["created_at"] else None,
        "finished_at": row["finished_at"].isoformat() if row["finished_at"] else None,
    }


def execution_events(database_url: str, execution_id: int) -> list[dict[str, Any]]:
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        if repo.execution_head(conn, execution_id) is None:
            raise ExecutionNotFound(f"no execution {execution_id} in {_safe_url(database_url)}")
        return repo.list_events(conn, execution_id)


def wait(database_url: str, execution_id: int, timeout: float | None = None) -> dict[str, Any]:
    """Poll until the execution is no longer running (or `timeout` seconds pass)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with transaction(database_url) as conn:
            head = repo.execution_head(conn, execution_id)
        if head is None:
            raise ExecutionNotFound(f"no execution {execution_id}")
        if head["status"] != "running":
            break  # attempts still in flight after a failure are recorded, not waited for
        if deadline is not None and time.monotonic() > deadline:
            break
        time.sleep(POLL_INTERVAL)
    return execution_status(database_url, execution_id)


@contextmanager
def embedded_worker(concurrency: int = EMBEDDED_CONCURRENCY) -> Iterator[Any]:
    """A worker thread pool inside this process, on the in-memory broker."""
    from celery.contrib.testing.worker import start_worker

    from noetl_celery.app import app, configure

    settings = noetl_settings.load()
    configure(app, settings, embedded=True)
    with start_worker(app, pool="threads", concurrency=concurrency, perform_ping_check=False,
                      loglevel="WARNING", shutdown_timeout=10.0,
                      queues=[settings.task_queue, settings.event_queue]) as worker:
        try:
            yield worker
        finally:
            _wake_for_shutdown(app, settings)


def _wake_for_shutdown(app: Any, settings: noetl_settings.Settings) -> None:
    """Ask the embedded worker to stop, and send it one message so that its consumer loop (which
    waits up to 2 s for a message between shutdown checks) notices at once."""
    from celery.worker import state

    from noetl_celery.app import bench_noop

    state.should_terminate = 0
    bench_noop.apply_async(queue=settings.event_queue)


def run_embedded(plan: Plan, timeout: float | None = None) -> dict[str, Any]:
    """Run a playbook to completion with an embedded worker; returns the final status."""
    settings = noetl_settings.load()
    ensure_schema(settings.database_url)
    with embedded_worker():
        execution_id = submit(plan, settings)
        return wait(settings.database_url, execution_id, timeout)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
