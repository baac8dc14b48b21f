"""The statements of time and recovery, named: what cancel and a playbook timeout read of an
execution tree, what resume changes, and how worker-loss counts the deliveries that killed a
process. The engine's recovery code (engine/recovery/lifecycle.py, resume.py) and the transport
(engine/transport/worker_loss.py) call these and write no SQL of their own.

Columns changed after insert here: `noetl_event.event_id` (resume's archive of the rows that
ended an epoch: `<key>.e<epoch>`), `noetl_event.event_type` / `result` / `meta` of an outcome row
resume decides again (`rewrite_outcome`), and the execution row's status and counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, select, update

from noetl_celery.store.kernel import EVENTS, EXECUTIONS, utcnow


def running_children(conn: Connection, parents: Iterable[int]) -> list[int]:
    """The running executions whose parent is one of `parents`."""
    c = EXECUTIONS.c
    query = select(c.execution_id).where(and_(c.parent_execution_id.in_(list(parents)), c.status == "running"))
    return [int(r[0]) for r in conn.execute(query)]


def children(conn: Connection, execution_id: int) -> list[tuple[str, Any, Any]]:
    """(status, error, parent_task) of every child execution of `execution_id`."""
    c = EXECUTIONS.c
    query = select(c.status, c.error, c.parent_task).where(c.parent_execution_id == execution_id)
    return [(r[0], r[1], r[2]) for r in conn.execute(query)]


def reopen_execution(conn: Connection, execution_id: int, *, epoch: int, deadline_at: datetime | None) -> None:
    """A resumed execution runs again, in epoch `epoch`, without its error."""
    conn.execute(
        update(EXECUTIONS)
        .where(EXECUTIONS.c.execution_id == execution_id)
        .values(
            status="running",
            error=None,
            failed_step=None,
            finished_at=None,
            epoch=epoch,
            updated_at=utcnow(),
            deadline_at=deadline_at,
        )
    )


def archive_events(conn: Connection, execution_id: int, epoch: int, keys: Iterable[str]) -> None:
    """Resume's archive: each row of `keys` is renamed `<key>.e<epoch>`, so its key is free again."""
    e = EVENTS.c
    for key in keys:
        conn.execute(
            update(EVENTS)
            .where(and_(e.execution_id == execution_id, e.event_id == key))
            .values(event_id=f"{key}.e{epoch}")
        )


def rewrite_outcome(
    conn: Connection, execution_id: int, event_id: str, *, event_type: str, result: Any, meta: dict[str, Any] | None
) -> None:
    """An outcome row resume decides again: its type, result and meta as the new decision left them."""
    e = EVENTS.c
    conn.execute(
        update(EVENTS)
        .where(and_(e.execution_id == execution_id, e.event_id == event_id))
        .values(event_type=event_type, result=result, meta=meta)
    )


def existing_keys(conn: Connection, execution_id: int, keys: Iterable[str]) -> set[str]:
    """Which of `keys` are event rows of the execution."""
    e = EVENTS.c
    query = select(e.event_id).where(and_(e.execution_id == execution_id, e.event_id.in_(list(keys))))
    return {r[0] for r in conn.execute(query)}
