"""The statements that update a running execution by its key find it by the key on PostgreSQL,
whatever plan a prepared statement keeps: the generic plan is made once per connection (after a
few executions) and kept, and made while noetl_execution holds a handful of rows it costs the key
and ix_noetl_execution_status_created the same. Kept with that index, every decision read the
index entries of all running executions (a backlog of 10,000 executions: about 800 a statement).
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import create_engine, text

from noetl_celery.store import decisions, executions

pytestmark = pytest.mark.services


def _statements() -> dict[str, str]:
    bumps = {name: decisions.BUMP_SQL.format(pending=p, finish=f) for name, (p, f) in decisions.BUMPS.items()}
    return {**bumps, "finish": executions.FINISH_SQL}


def _numbered(sql: str) -> tuple[str, int]:
    """`?` placeholders as $1, $2, ... (none of these texts has a `?` in a literal)."""
    count = 0

    def number(_: re.Match[str]) -> str:
        nonlocal count
        count += 1
        return f"${count}"

    return re.sub(r"\?", number, sql), count


def _explain_generic(conn, name: str, sql: str) -> str:
    numbered, count = _numbered(sql)
    conn.exec_driver_sql(f"PREPARE {name} AS {numbered}")
    conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
    nulls = ", ".join(["NULL"] * count)
    return "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN EXECUTE {name}({nulls})"))


def _plan_on_a_small_table(url: str, sql: str, statuses: tuple[str, ...]) -> str:
    """The generic plan of `sql` on noetl_execution holding one row per status, as a new
    deployment's first executions leave it."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for n, status in enumerate(statuses):
                conn.execute(
                    text(
                        "INSERT INTO noetl_execution (execution_id, playbook_name, status, plan, workload, "
                        "pending, state_version, created_at, updated_at, epoch, depth) "
                        "VALUES (:id, 'p', :status, '{}', '{}', 1, 1, now(), now(), 0, 0)"
                    ),
                    {"id": n + 1, "status": status},
                )
            plan = _explain_generic(conn, "under_test", sql)
            conn.rollback()
            return plan
    finally:
        engine.dispose()


@pytest.mark.parametrize("statement", sorted(_statements()))
def test_a_generic_plan_made_on_a_small_table_finds_the_execution_by_its_key(migrated_postgres, statement):
    plan = _plan_on_a_small_table(migrated_postgres.url, _statements()[statement], ("completed", "running", "running"))
    assert "noetl_execution_pkey" in plan, plan
    assert "ix_noetl_execution_status_created" not in plan, plan


def test_the_plain_status_test_is_what_a_small_table_plans_through_the_status_index(migrated_postgres):
    """What the statements avoid, on this server: the same update with `status = 'running'`
    (what they said before) is planned through the status index."""
    plain = decisions.BUMP_SQL.format(pending="pending + ? > 0", finish="").replace(
        "(status = 'running') IS TRUE", "status = 'running'"
    )
    plan = _plan_on_a_small_table(migrated_postgres.url, plain, ("running", "running", "running"))
    assert "ix_noetl_execution_status_created" in plan, plan
