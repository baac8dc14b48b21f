"""`noetl-celery prune` on SQLite and PostgreSQL, over a store holding running, finished and
parent/child executions: whole finished trees older than the cutoff go, with every row of theirs in
every table; a running execution, its parents and a finished child of a running parent stay; a
dry run counts exactly what a prune then removes; a prune stopped half way is finished by the next."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select, text

import noetl_celery.app  # noqa: F401  (binds the Celery app to the transport)
from noetl_celery.store import repo, retention
from noetl_celery.store.db import migrate, transaction
from noetl_celery.store.schedules import NOTIFICATIONS
from tests.test_hostile_input import cli

OLD = timedelta(days=40)
TABLES = (
    repo.EVENTS,
    repo.VARIABLES,
    repo.LOOPS,
    repo.JOINS,
    repo.LEASES,
    repo.HOLDS,
    repo.BLOBS,
    NOTIFICATIONS,
    repo.EXECUTIONS,
)
PLAN = {"name": "retention", "steps": {}}


def add(url: str, execution_id: int, status: str, *, age: timedelta, parent: int | None = None) -> None:
    """An execution with a row in every table of its own (a decision row with a lease, a stored
    value, a cursor slot's kept claim and a webhook record included)."""
    with transaction(url) as conn:
        repo.create_execution(
            conn, execution_id=execution_id, plan=PLAN, workload={}, parent_execution_id=parent, depth=int(bool(parent))
        )
        stamp = repo.utcnow() - age
        rows = [
            {"execution_id": execution_id, "event_id": f"e{i}", "event_type": "step.done", "created_at": stamp}
            for i in range(3)
        ]
        rows[0]["deadline_at"] = stamp  # a decision with a lease
        repo.insert_events(conn, rows)
        repo.put_variables(conn, execution_id, "vars", {"x": execution_id})
        repo.open_join(conn, execution_id, "fork", "join", 2)
        repo.create_loop(
            conn,
            {
                "run_id": f"run{execution_id}",
                "execution_id": execution_id,
                "step": "s",
                "mode": "sequential",
                "total": 1,
                "max_in_flight": 1,
                "collection": [1],
                "context": {},
            },
        )
        repo.hold_claim(conn, execution_id, f"run{execution_id}", 0, 3, [{"id": 1}])
        conn.execute(  # a big result stored by reference, and a failure webhook's record
            repo.BLOBS.insert().values(
                execution_id=execution_id, sha256="0" * 64, size=2, encoding="json", data=b"[]", created_at=stamp
            )
        )
        conn.execute(NOTIFICATIONS.insert().values(execution_id=execution_id, attempts=0, created_at=stamp))
        c = repo.EXECUTIONS.c
        conn.execute(
            repo.EXECUTIONS.update()
            .where(c.execution_id == execution_id)
            .values(status=status, created_at=stamp, finished_at=None if status == "running" else stamp)
        )


def counts(url: str, execution_id: int) -> dict[str, int]:
    with transaction(url) as conn:
        return {
            t.name: int(
                conn.execute(select(func.count()).select_from(t).where(t.c.execution_id == execution_id)).scalar()
            )
            for t in TABLES
        }


def store(url: str) -> dict[str, int]:
    migrate(url)
    add(url, 1, "completed", age=OLD)  # a finished tree: 1 -> 11 -> 111
    add(url, 11, "completed", age=OLD, parent=1)
    add(url, 111, "failed", age=OLD, parent=11)
    add(url, 2, "running", age=OLD)  # running, with a finished child: both stay
    add(url, 21, "completed", age=OLD, parent=2)
    add(url, 3, "failed", age=OLD)  # finished, with a running child: both stay
    add(url, 31, "running", age=OLD, parent=3)
    add(url, 4, "completed", age=timedelta(days=2))  # recent
    add(url, 5, "cancelled", age=OLD)
    add(url, 6, "failed", age=OLD)
    return {x: sum(counts(url, x).values()) for x in (1, 11, 111, 2, 21, 3, 31, 4, 5, 6)}


def test_prune_removes_old_finished_trees_and_nothing_running(either_store):
    url = either_store
    before = store(url)
    assert all(n == 11 for n in before.values()), before  # 3 events, a lease, a variable, a join, a loop,
    # a kept claim, a blob, a notification, itself
    dry = retention.prune(url, timedelta(days=30), statuses=("completed", "failed"), dry_run=True)
    assert dry.trees == 2 and dry.skipped_running == 1  # 1 (with 11, 111) and 6; 3 has a running child
    assert sum(counts(url, x)["noetl_execution"] for x in before) == len(before)  # nothing removed
    pruned = retention.prune(url, timedelta(days=30), statuses=("completed", "failed"))
    assert pruned.rows == dry.rows
    assert pruned.rows == {
        "noetl_event": 12,
        "noetl_variable": 4,
        "noetl_loop": 4,
        "noetl_join": 4,
        "noetl_lease": 4,
        "noetl_cursor_hold": 4,
        "noetl_blob": 4,
        "noetl_notification": 4,
        "noetl_execution": 4,
    }
    for gone in (1, 11, 111, 6):
        assert sum(counts(url, gone).values()) == 0, gone
    for kept in (2, 21, 3, 31, 4, 5):  # running, their parents and children, recent, other status
        assert counts(url, kept) == {t.name: (3 if t is repo.EVENTS else 1) for t in TABLES}, kept
    rest = retention.prune(url, timedelta(days=30))  # all finished statuses: the cancelled one
    assert rest.executions == 1 and sum(counts(url, 5).values()) == 0
    with transaction(url) as conn:  # the running execution ends: its tree goes with the next prune
        conn.execute(text("UPDATE noetl_execution SET status = 'completed', finished_at = created_at"))
    assert retention.prune(url, timedelta(days=30)).executions == 4  # 2, 21, 3, 31; 4 is recent
    assert sum(counts(url, 4).values()) == 11


def test_a_prune_stopped_half_way_is_finished_by_the_next(either_store, monkeypatch):
    url = either_store
    store(url)
    monkeypatch.setattr(retention, "CHUNK", 2)  # several transactions per table
    with transaction(url) as conn:  # what an interrupted prune leaves: marked, some rows gone
        conn.execute(text("UPDATE noetl_execution SET status = 'pruning' WHERE execution_id IN (4, 5)"))
        conn.execute(text("DELETE FROM noetl_event WHERE execution_id = 4 AND event_id = 'e0'"))
    # a cutoff neither would meet: the marked ones are finished all the same, the others stay
    pruned = retention.prune(url, timedelta(days=365))
    assert pruned.executions == 2 and pruned.rows["noetl_event"] == 5 and pruned.trees == 0
    assert sum(counts(url, 4).values()) == 0 and sum(counts(url, 5).values()) == 0
    assert counts(url, 1)["noetl_execution"] == 1


def test_prune_command(sqlite_url, tmp_path):
    store(sqlite_url)
    env = {"NOETL_DATABASE_URL": sqlite_url, "NOETL_HOME": str(tmp_path / "home")}
    dry = cli(["prune", "--older-than", "30d", "--status", "cancelled", "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert "would remove 1 execution(s) in 1 tree(s)" in dry.stdout and "noetl_event: 3 row(s)" in dry.stdout
    assert counts(sqlite_url, 5)["noetl_execution"] == 1
    done = cli(["prune", "--older-than", "30d"], env)
    assert done.returncode == 0, done.stderr
    assert "removed 5 execution(s) in 3 tree(s)" in done.stdout and "kept 1 tree(s) with a running" in done.stdout
    bad = cli(["prune", "--older-than", "soon"], env)
    assert bad.returncode != 0 and "--older-than" in bad.stderr


def test_the_sweeper_prunes_with_noetl_prune_older_than(sqlite_url, monkeypatch):
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.engine.transport import sweeping as app

    assert noetl_settings.load({"NOETL_PRUNE_OLDER_THAN": "30d"}).prune_older_than == timedelta(days=30)
    assert noetl_settings.load({}).prune_older_than is None
    store(sqlite_url)
    monkeypatch.setattr(app, "_next_prune", 0.0)
    app._prune_share(sqlite_url, timedelta(days=30), 5.0)
    assert counts(sqlite_url, 1)["noetl_execution"] == 0 and counts(sqlite_url, 2)["noetl_execution"] == 1
    assert app._next_prune > 0  # done: the next pass waits PRUNE_EVERY
