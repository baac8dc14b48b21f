"""Revision 0002 (durability) adds and removes exactly its columns and index, on SQLite and on
PostgreSQL, and rows written before it survive the round trip."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect, text

from noetl_celery.store.db import downgrade, migrate


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def database_url(request) -> str:
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("fresh_postgres").url


def shape(url: str) -> tuple[set[str], set[str], set[str]]:
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return (
            {c["name"] for c in found.get_columns("noetl_event")},
            {c["name"] for c in found.get_columns("noetl_execution")},
            {i["name"] for i in found.get_indexes("noetl_event")},
        )
    finally:
        engine.dispose()


def test_0002_upgrade_and_downgrade(database_url):
    migrate(database_url, "0001")
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO noetl_execution (execution_id, playbook_name, status, plan, workload, "
                "pending, state_version, created_at, updated_at) VALUES (7, 'p', 'failed', '{}', '{}', "
                "0, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
            )
        )
    events, executions, indexes = shape(database_url)
    assert "deadline_at" not in events and "epoch" not in executions
    migrate(database_url, "0002")
    events, executions, indexes = shape(database_url)
    assert "deadline_at" in events and {"deadline_at", "epoch"} <= executions
    assert "ix_noetl_event_deadline" in indexes
    with engine.begin() as conn:
        assert conn.execute(text("SELECT epoch FROM noetl_execution WHERE execution_id = 7")).scalar() == 0
        conn.execute(text("UPDATE noetl_execution SET status = 'cancelled' WHERE execution_id = 7"))
    downgrade(database_url, "0001")
    events, executions, indexes = shape(database_url)
    assert "deadline_at" not in events and not {"deadline_at", "epoch"} & executions
    assert "ix_noetl_event_deadline" not in indexes
    with engine.begin() as conn:
        assert conn.execute(text("SELECT status FROM noetl_execution WHERE execution_id = 7")).scalar() == "cancelled"
    engine.dispose()
    migrate(database_url)
