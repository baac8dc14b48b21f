"""The SQL of docs/operations.md runs against the store's schema as it is (PostgreSQL, at head),
and its query for executions that look stuck lists a running execution whose last event is old,
not one that is progressing, whatever its row's `updated_at` says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery import runner
from noetl_celery.compiler import compile_source
from noetl_celery.store.db import get_engine
from tests.support.harness import Harness, cli_sets

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
LOOP = Path(__file__).resolve().parents[1] / "bench" / "playbooks" / "loop_noop.yaml"

pytestmark = pytest.mark.services


def _statements() -> list[str]:
    blocks = re.findall(r"```sql\n(.*?)```", OPERATIONS.read_text(), re.S)
    return [s.strip() for block in blocks for s in block.split(";") if s.strip()]


def test_every_query_of_the_operations_guide_runs(migrated_postgres):
    statements = _statements()
    assert len(statements) >= 8
    with get_engine(migrated_postgres.url).connect() as conn:
        for statement in statements:
            conn.execute(text(statement)).fetchall()


def test_the_stuck_query_goes_by_the_last_event_not_the_execution_row(migrated_postgres):
    [stuck] = [s for s in _statements() if "last_event_at" in s]
    url = migrated_postgres.url
    plan = compile_source(str(LOOP), cli_sets({"n": 4}), runner.catalog(url))
    quiet, busy = Harness(url), Harness(url)
    quiet_id, busy_id = quiet.start(plan), busy.start(plan)
    busy.step()
    with get_engine(url).begin() as conn:  # both rows look old; only the quiet one's events are
        conn.execute(
            text("UPDATE noetl_execution SET updated_at = now() - interval '1 hour' WHERE execution_id IN (:a, :b)"),
            {"a": quiet_id, "b": busy_id},
        )
        conn.execute(
            text("UPDATE noetl_event SET created_at = now() - interval '20 minutes' WHERE execution_id = :a"),
            {"a": quiet_id},
        )
    with get_engine(url).connect() as conn:
        listed = [row[0] for row in conn.execute(text(stuck))]
    assert listed == [quiet_id]
