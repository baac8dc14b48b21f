"""The event table partitioned by time on a real PostgreSQL (`noetl-celery store partition-events`,
store/partitions.py): a conversion keeps every row, key and index the engine relies on, and an
execution runs on the partitioned table; `--undo` gives the plain table back, rows included; the
coming partitions are made ahead (rows that reached the default partition move into them); `prune`
drops a partition whose executions all ended and are old, and keeps one with a running
execution, its parent or child, or an execution the --status filter excludes; SQLite is refused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

import noetl_celery.app  # noqa: F401  (binds the Celery app to the transport)
from noetl_celery.core.id_time import first_id_at, time_of
from noetl_celery.engine.transport import sweeping as app
from noetl_celery.store import partitions, repo, retention
from noetl_celery.store.db import migrate, transaction
from tests.support.harness import run_playbook
from tests.test_hostile_input import cli
from tests.test_prune import OLD, add, counts

PLAYBOOK = Path(__file__).parent / "playbooks" / "loop_modes.yaml"
ENGINE_INDEXES = {"ix_noetl_event_page", "ix_noetl_event_run", "ix_noetl_event_type"}


def month_id(year: int, month: int, n: int = 0) -> int:
    """An execution id made in that month (the 10th, plus n milliseconds)."""
    return first_id_at(datetime(year, month, 10, tzinfo=UTC)) + (n << 22) + 7


def event_rows(url: str) -> list[tuple[int, int, str, str]]:
    with transaction(url) as conn:
        rows = conn.execute(text("SELECT id, execution_id, event_id, event_type FROM noetl_event ORDER BY id"))
        return [tuple(r) for r in rows]


def holder(url: str, execution_id: int) -> set[str]:
    """The tables (partitions) holding the execution's event rows."""
    with transaction(url) as conn:
        sql = "SELECT DISTINCT tableoid::regclass::text FROM noetl_event WHERE execution_id = :x"
        return {r[0] for r in conn.execute(text(sql), {"x": execution_id})}


EVENT_KEY = ("uq_noetl_event_key", ["execution_id", "event_id"])  # the primary key, both forms


def primary_key(conn) -> tuple[str, list[str]] | None:
    """The name and columns of noetl_event's primary key (None: it has none)."""
    rows = conn.execute(
        text(
            "SELECT c.conname, a.attname FROM pg_constraint c"
            " JOIN LATERAL unnest(c.conkey) WITH ORDINALITY k(attnum, n) ON true"
            " JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum"
            " WHERE c.conrelid = 'noetl_event'::regclass AND c.contype = 'p' ORDER BY k.n"
        )
    ).all()
    return (rows[0][0], [r[1] for r in rows]) if rows else None


def table_shape(url: str) -> tuple[str, tuple[str, list[str]] | None, set[str], set[str]]:
    """relkind, the primary key, the unique constraints and the other indexes of noetl_event."""
    with transaction(url) as conn:
        kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = 'noetl_event'::regclass")).scalar()
        sql = "SELECT conname FROM pg_constraint WHERE conrelid = 'noetl_event'::regclass AND contype = 'u'"
        uniques = {r[0] for r in conn.execute(text(sql))}
        indexes = {i.name for i in partitions._indexes(conn) if not i.constraint}
        return kind, primary_key(conn), uniques, indexes


def run(url: str) -> dict:
    code, status = run_playbook(url, PLAYBOOK)
    assert (code, status["status"]) == (0, "completed"), status.get("error")
    return status


def test_conversion_keeps_rows_and_keys_and_the_engine_runs_on_it_and_undo_gives_the_plain_table(migrated_postgres):
    url = migrated_postgres.url
    first = run(url)["execution_id"]
    add(url, month_id(2025, 6), "completed", age=OLD)  # an old execution, in a month of its own
    before = event_rows(url)
    plain = table_shape(url)
    assert plain == ("r", EVENT_KEY, set(), ENGINE_INDEXES)

    dry = partitions.convert(url, "month", dry_run=True)
    assert dry.rows == len(before) and "noetl_event_month_20250601" in dry.partitions
    assert table_shape(url)[0] == "r"  # nothing changed

    done = partitions.convert(url, "month")
    assert done.rows == len(before) and done.partitions == dry.partitions
    now = datetime.now(UTC)
    ahead = [partitions.partition_for(s, "month").name for s in partitions.periods_ahead(now, "month")]
    assert set(ahead) <= set(done.partitions) and done.partitions[-1] == partitions.DEFAULT
    assert event_rows(url) == before  # every row, its id kept
    assert table_shape(url) == ("p", EVENT_KEY, set(), ENGINE_INDEXES)
    assert holder(url, month_id(2025, 6)) == {"noetl_event_month_20250601"}
    assert holder(url, first) == {
        partitions.partition_for(partitions.period_start(time_of(first), "month"), "month").name
    }

    # the key: ON CONFLICT skips a row that exists; a strict insert's violation is known as the key's
    with transaction(url) as conn:
        row = {"execution_id": first, "event_id": before[0][2], "event_type": "again", "created_at": repo.utcnow()}
        repo.insert_events(conn, [row])
    assert event_rows(url) == before
    with pytest.raises(IntegrityError) as violation, transaction(url) as conn:
        conn.execute(
            text(
                "INSERT INTO noetl_event (execution_id, event_id, event_type, created_at) VALUES (:x, :k, 't', now())"
            ),
            {"x": first, "k": before[0][2]},
        )
    name = violation.value.orig.diag.constraint_name
    assert name.startswith("uq_noetl_event_key_month_") and repo.is_event_key(name)

    second = run(url)["execution_id"]  # the engine on the partitioned table
    assert holder(url, second) == holder(url, first)
    during = event_rows(url)
    assert len(during) > len(before) and min(r[0] for r in during[len(before) :]) > before[-1][0]

    with pytest.raises(partitions.PartitionError, match="partitioned already"):
        partitions.convert(url, "week")

    undone = partitions.undo(url)
    assert undone.rows == len(during) and partitions.DEFAULT in undone.partitions
    assert event_rows(url) == during
    assert table_shape(url) == plain
    third = run(url)["execution_id"]  # and on the plain table again, ids still from the one sequence
    assert min(r[0] for r in event_rows(url) if r[1] == third) > during[-1][0]
    with pytest.raises(partitions.PartitionError, match="not partitioned"):
        partitions.undo(url)


def test_a_table_partitioned_before_the_event_key_was_the_primary_key_is_upgraded_and_undone(migrated_postgres):
    """A table partitioned by an earlier release (primary key (id, execution_id) and the unique key
    as a constraint): 0010_event_key drops the (id, execution_id) key and keeps the unique one, the
    engine runs on it, and --undo gives the plain table of this release (the key its primary key)."""
    url = migrated_postgres.url
    first = run(url)["execution_id"]
    partitions.convert(url, "month")
    with transaction(url) as conn:  # the shape the earlier release's conversion made
        conn.execute(text("ALTER TABLE noetl_event DROP CONSTRAINT uq_noetl_event_key"))
        conn.execute(text("ALTER TABLE noetl_event ADD CONSTRAINT noetl_event_pkey PRIMARY KEY (id, execution_id)"))
        conn.execute(text("ALTER TABLE noetl_event ADD CONSTRAINT uq_noetl_event_key UNIQUE (execution_id, event_id)"))
        for partition in [*partitions.partitions(conn), partitions.Partition(partitions.DEFAULT, 0, 0)]:
            partitions._name_key(conn, partition.name)
        conn.execute(text("UPDATE alembic_version SET version_num = '0009_cursor_hold'"))
    assert table_shape(url)[1:3] == (("noetl_event_pkey", ["id", "execution_id"]), {"uq_noetl_event_key"})

    migrate(url)
    assert table_shape(url) == ("p", None, {"uq_noetl_event_key"}, ENGINE_INDEXES)
    before = event_rows(url)
    with pytest.raises(IntegrityError) as violation, transaction(url) as conn:
        conn.execute(
            text(
                "INSERT INTO noetl_event (execution_id, event_id, event_type, created_at) VALUES (:x, :k, 't', now())"
            ),
            {"x": first, "k": before[0][2]},
        )
    assert repo.is_event_key(violation.value.orig.diag.constraint_name)
    second = run(url)["execution_id"]  # the engine on it
    assert holder(url, second) == holder(url, first)

    partitions.undo(url)
    assert table_shape(url) == ("r", EVENT_KEY, set(), ENGINE_INDEXES)
    assert len(event_rows(url)) > len(before)


def test_partitions_are_made_ahead_and_take_their_rows_from_the_default_partition(migrated_postgres, monkeypatch):
    url = migrated_postgres.url
    partitions.convert(url, "week", now=datetime(2025, 1, 1, tzinfo=UTC))  # ahead of January 2025 only
    stray = first_id_at(datetime.now(UTC))  # an id of now: no partition covers it yet
    with transaction(url) as conn:
        repo.insert_events(
            conn, [{"execution_id": stray, "event_id": "k", "event_type": "t", "created_at": repo.utcnow()}]
        )
    assert holder(url, stray) == {partitions.DEFAULT}
    monkeypatch.setattr(app, "_next_partitions", 0.0)
    app._partitions_ahead(url)  # what the sweeper does
    this_week = partitions.partition_for(partitions.period_start(datetime.now(UTC), "week"), "week")
    assert holder(url, stray) == {this_week.name}
    with transaction(url) as conn:
        names = {p.name for p in partitions.partitions(conn)}
    assert {
        partitions.partition_for(s, "week").name for s in partitions.periods_ahead(datetime.now(UTC), "week")
    } <= names
    assert partitions.keep_ahead(url) == []  # all there: nothing made, no lock taken


def test_prune_drops_partitions_whose_executions_all_ended_and_deletes_rows_elsewhere(migrated_postgres):
    url = migrated_postgres.url
    a, a_child = month_id(2025, 1), month_id(2025, 2, 1)  # a finished tree across two months
    b_running = month_id(2025, 2, 2)
    c_failed = month_id(2025, 3)
    d_failed, d_child = month_id(2025, 4), month_id(2025, 4, 1)  # a finished parent of a running child
    add(url, a, "completed", age=OLD)
    add(url, a_child, "completed", age=OLD, parent=a)
    add(url, b_running, "running", age=OLD)
    add(url, c_failed, "failed", age=OLD)
    add(url, d_failed, "failed", age=OLD)
    add(url, d_child, "running", age=OLD, parent=d_failed)
    partitions.convert(url, "month")
    month = {m: f"noetl_event_month_2025{m:02d}01" for m in (1, 2, 3, 4)}

    dry = retention.prune(url, timedelta(days=30), statuses=("completed",), dry_run=True)
    assert [p.name for p in dry.partitions] == [month[1]] and dry.partitions[0].rows == 3
    pruned = retention.prune(url, timedelta(days=30), statuses=("completed",))
    assert [(p.name, p.rows) for p in pruned.partitions] == [(month[1], 3)]
    assert pruned.rows == dry.rows and pruned.trees == dry.trees == 1
    assert pruned.rows["noetl_event"] == 3  # the child's rows, in February's partition: by row
    assert pruned.executions == 2 and sum(counts(url, a).values()) == sum(counts(url, a_child).values()) == 0
    with transaction(url) as conn:
        names = {p.name for p in partitions.partitions(conn)}
        assert conn.execute(text(f"SELECT to_regclass('{month[1]}')")).scalar() is None
    assert month[1] not in names and {month[2], month[3], month[4]} <= names
    assert counts(url, c_failed)["noetl_event"] == 3  # --status completed: the failed one stays

    done = cli(["prune", "--older-than", "30d"], {"NOETL_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    assert f"dropped partition {month[3]} (ids of 2025-03-01 to 2025-04-01): 3 event row(s)" in done.stdout
    assert "removed 1 execution(s) in 1 tree(s)" in done.stdout and "kept 1 tree(s) with a running" in done.stdout
    assert sum(counts(url, c_failed).values()) == 0
    for kept in (b_running, d_failed, d_child):  # running, and the finished parent of a running child
        assert counts(url, kept)["noetl_execution"] == 1 and counts(url, kept)["noetl_event"] == 3, kept
    with transaction(url) as conn:
        names = {p.name for p in partitions.partitions(conn)}
    assert month[3] not in names and {month[2], month[4]} <= names


def test_a_partition_whose_execution_is_being_resumed_is_left_to_the_row_delete(migrated_postgres):
    url = migrated_postgres.url
    old = month_id(2025, 5)
    add(url, old, "failed", age=OLD)
    partitions.convert(url, "month")
    with transaction(url) as holder_conn:  # a resume holds the row while it decides
        holder_conn.execute(text("SELECT 1 FROM noetl_execution WHERE execution_id = :x FOR UPDATE"), {"x": old})
        pruned = retention.prune(url, timedelta(days=30))
        assert pruned.partitions == [] and pruned.executions == 0
    with transaction(url) as conn:
        assert "noetl_event_month_20250501" in {p.name for p in partitions.partitions(conn)}
    assert [p.name for p in retention.prune(url, timedelta(days=30)).partitions] == ["noetl_event_month_20250501"]


def test_sqlite_is_refused_and_left_as_it_is(sqlite_url, tmp_path):
    migrate(sqlite_url)
    add(sqlite_url, 1, "completed", age=OLD)
    with pytest.raises(partitions.PartitionError, match="needs PostgreSQL"):
        partitions.convert(sqlite_url)
    assert partitions.keep_ahead(sqlite_url) == []
    env = {"NOETL_DATABASE_URL": sqlite_url, "NOETL_HOME": str(tmp_path / "home")}
    refused = cli(["store", "partition-events", "--interval", "week"], env)
    assert refused.returncode == 2 and "a partitioned event table needs PostgreSQL" in refused.stderr
    assert counts(sqlite_url, 1)["noetl_event"] == 3
    assert retention.prune(sqlite_url, timedelta(days=30)).executions == 1  # prune as before


def test_partition_events_command_on_postgresql(migrated_postgres):
    env = {"NOETL_DATABASE_URL": migrated_postgres.url}
    add(migrated_postgres.url, month_id(2025, 7), "completed", age=OLD)
    dry = cli(["store", "partition-events", "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert "would move 3 event row(s) into noetl_event partitioned by month" in dry.stdout
    assert "noetl_event_month_20250701" in dry.stdout
    done = cli(["store", "partition-events"], env)
    assert done.returncode == 0, done.stderr
    assert "moved 3 event row(s)" in done.stdout and "noetl_event was locked for" in done.stdout
    back = cli(["store", "partition-events", "--undo"], env)
    assert back.returncode == 0 and "moved 3 event row(s) into a plain noetl_event" in back.stdout


def test_a_conversion_that_cannot_lock_the_table_in_time_changes_nothing(migrated_postgres):
    url = migrated_postgres.url
    add(url, month_id(2025, 8), "completed", age=OLD)
    with transaction(url) as reader:  # a long reader of the event table
        reader.execute(text("SELECT count(*) FROM noetl_event"))
        with pytest.raises(OperationalError) as refused:
            partitions.convert(url, "month", lock_timeout=0.3)
    assert refused.value.orig.pgcode == "55P03"  # lock_not_available
    assert table_shape(url)[0] == "r" and len(event_rows(url)) == 3
    with transaction(url) as conn:
        assert conn.execute(text(f"SELECT to_regclass('{partitions._STAGING}')")).scalar() is None
