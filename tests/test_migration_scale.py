"""Revision 0006_scale on SQLite and PostgreSQL: a decision row written before it with a
deadline on the event row (revision 0002's column) gets a lease, and its lost attempt is then
re-published by the sweeper; the executions' (status, created_at) index exists; the downgrade
moves the leases back onto the event rows."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, inspect, text

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.recovery import sweeper
from noetl_celery.runner import create_execution
from noetl_celery.store import leases, repo
from noetl_celery.store.db import dispose_engine, downgrade, migrate, transaction
from tests.test_sweeper import PLAYBOOK


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def database_url(request) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("fresh_postgres").url


def indexes(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {i["name"] for i in inspect(engine).get_indexes(table)}
    finally:
        engine.dispose()


def test_a_deadline_written_before_0006_becomes_a_lease_and_is_recovered(database_url, tmp_path):
    # a dispatching decision as the head of today writes it, to borrow its dispatch list
    migrate(database_url)
    path = tmp_path / "sweep.yaml"
    path.write_text(PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), database_url)
    [dispatch] = orchestrator.handle_event(database_url, orchestrator.start_payload(execution_id))
    with transaction(database_url) as conn:
        [started] = [r for r in repo.list_events(conn, execution_id) if r["event_id"] == "execution.started"]
        assert leases.deadline(conn, execution_id, "execution.started") is not None
    dispose_engine(database_url)
    # back to 0004: the lease goes back onto its row as deadline_at
    downgrade(database_url, "0004")
    assert "ix_noetl_event_deadline" in indexes(database_url, "noetl_event")
    engine = create_engine(database_url)
    past = repo.utcnow() - timedelta(seconds=5)
    with engine.begin() as conn:
        back = conn.execute(
            text("SELECT deadline_at FROM noetl_event WHERE execution_id = :x AND event_id = 'execution.started'"),
            {"x": execution_id},
        ).scalar()
        assert back is not None
        # and a row such as 0004 wrote: an overdue decision row of its own, dispatching the attempt again
        conn.execute(
            text(
                "INSERT INTO noetl_event (execution_id, event_id, event_type, status, step, created_at, meta,"
                " deadline_at) VALUES (:x, 'old.decision', 'step.started', 'started', 'start', :c, :m, :d)"
            ),
            {"x": execution_id, "c": past, "m": json.dumps(started["meta"]), "d": past},
        )
    engine.dispose()
    migrate(database_url)
    assert "ix_noetl_execution_status_created" in indexes(database_url, "noetl_execution")
    assert "ix_noetl_event_deadline" not in indexes(database_url, "noetl_event")
    with transaction(database_url) as conn:
        assert leases.deadline(conn, execution_id, "old.decision") is not None
        assert leases.deadline(conn, execution_id, "execution.started") is not None
        assert leases.count(conn, overdue_at=repo.utcnow()) == 1  # the old row's: overdue already
    result = sweeper.sweep(database_url)
    assert [d.message["step"] for d in result.republished] == ["start"]
    assert result.republished[0].message["run_id"] == dispatch.message["run_id"]
    with transaction(database_url) as conn:
        moved = leases.deadline(conn, execution_id, "old.decision")
    assert moved is not None and moved.replace(tzinfo=None) > repo.utcnow().replace(tzinfo=None)  # not cleared
    dispose_engine(database_url)
