"""The event store schema is Alembic's: upgrade to head creates it, downgrade to base removes it,
and upgrading again works. Checked with the real `alembic` command (from the repository root, the
URL given with `-x url=...`), through `noetl_celery.store.db.migrate`/`downgrade`, and with
`noetl-celery migrate`, on SQLite and on PostgreSQL."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import create_engine, inspect

from noetl_celery.store.db import (
    SchemaOutOfDate,
    alembic_config,
    current_revision,
    downgrade,
    ensure_schema,
    head_revision,
    migrate,
    shipped_revisions,
)
from tests.support.engines import REPO_ROOT, _clean_env, cli

HEAD = head_revision()  # the revision `migrate` brings a store to

TABLES = {"noetl_execution", "noetl_event", "noetl_variable", "noetl_join", "noetl_loop"}
EVENT_COLUMNS = {
    "id",
    "execution_id",
    "event_id",
    "parent_event_id",
    "parent_execution_id",
    "queue_id",
    "event_type",
    "status",
    "step",
    "task",
    "run_id",
    "attempt",
    "iteration",
    "page",
    "created_at",
    "started_at",
    "duration_ms",
    "worker",
    "context",
    "result",
    "error",
    "meta",
}
ALEMBIC_TIMEOUT = 120  # seconds


def noetl_tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {name for name in inspect(engine).get_table_names() if name.startswith("noetl_")}
    finally:
        engine.dispose()


def assert_schema(url: str) -> None:
    engine = create_engine(url)
    try:
        found = inspect(engine)
        assert set(found.get_table_names()) >= TABLES
        assert {c["name"] for c in found.get_columns("noetl_event")} >= EVENT_COLUMNS
        unique = {tuple(u["column_names"]) for u in found.get_unique_constraints("noetl_event")}
        unique.add(tuple(found.get_pk_constraint("noetl_event")["constrained_columns"]))  # PostgreSQL: the key
        assert ("execution_id", "event_id") in unique  # the idempotency key of every event row
    finally:
        engine.dispose()


def alembic(url: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={url}", *args],
        cwd=REPO_ROOT,
        env=_clean_env({}),
        capture_output=True,
        text=True,
        timeout=ALEMBIC_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"alembic {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def database_url(request) -> str:
    """An empty database: a SQLite file, or a fresh PostgreSQL database of this test."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("fresh_postgres").url


def test_alembic_command_upgrades_downgrades_and_upgrades_again(database_url):
    assert noetl_tables(database_url) == set()
    alembic(database_url, "upgrade", "head")
    assert_schema(database_url)
    head = alembic(database_url, "heads").stdout.split()[0]
    assert f"{head} (head)" in alembic(database_url, "current").stdout
    alembic(database_url, "downgrade", "base")
    assert noetl_tables(database_url) == set()
    alembic(database_url, "upgrade", "head")
    assert_schema(database_url)


def test_store_migrate_and_downgrade_functions(database_url):
    migrate(database_url)
    assert_schema(database_url)
    migrate(database_url)  # at head already: nothing to do, no error
    downgrade(database_url)
    assert noetl_tables(database_url) == set()
    migrate(database_url, "head")
    assert_schema(database_url)
    downgrade(database_url, "base")
    assert noetl_tables(database_url) == set()


def test_noetl_celery_migrate_uses_noetl_database_url(database_url, tmp_path):
    proc = cli(["migrate"], {"NOETL_DATABASE_URL": database_url, "NOETL_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    assert f"is at revision {HEAD} (was empty)" in proc.stdout
    assert_schema(database_url)
    assert not (tmp_path / "home" / "noetl.sqlite").exists()  # the configured store, not the embedded one


def test_noetl_celery_migrate_defaults_to_the_embedded_store(tmp_path):
    proc = cli(["migrate"], {"NOETL_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    assert_schema(f"sqlite:///{tmp_path / 'home' / 'noetl.sqlite'}")


def test_only_migrate_changes_a_server_schema_other_commands_say_what_to_run(fresh_postgres, tmp_path):
    env = {
        "NOETL_DATABASE_URL": fresh_postgres.url,
        "NOETL_HOME": str(tmp_path),
        "NOETL_BROKER_URL": "redis://127.0.0.1:1/0",
    }  # never reached: the store is checked first
    for args in (
        ["status", "1"],
        ["events", "1"],
        ["executions"],
        ["submit", str(REPO_ROOT / "playbooks" / "hello_world.yaml")],
    ):
        proc = cli(args, env)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines() == [
            f"error: the event store at {fresh_postgres.url} has no schema: run `noetl-celery migrate`"
        ]
        assert noetl_tables(fresh_postgres.url) == set()  # nothing was created

    migrate(fresh_postgres.url, "0001")  # an older version's schema
    proc = cli(["executions"], env)
    assert proc.returncode == 2 and "is at revision 0001, this version needs" in proc.stderr
    assert "run `noetl-celery migrate`" in proc.stderr

    assert cli(["migrate"], env).returncode == 0
    proc = cli(["executions"], env)
    assert proc.returncode == 0, proc.stderr


def test_the_embedded_store_is_created_on_first_use(tmp_path):
    proc = cli(["executions"], {"NOETL_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert_schema(f"sqlite:///{tmp_path / 'noetl.sqlite'}")


def test_the_migrated_schema_has_the_models_indexes(database_url):
    """Alembic owns the schema and the models describe it: after `migrate`, each table of the
    models has exactly the indexes they declare (a migration that drops or adds one without the
    model, or the other way round, fails here)."""
    from noetl_celery.store.models import Base

    migrate(database_url)
    engine = create_engine(database_url)
    try:
        found = inspect(engine)
        present = {
            table.name: {
                index["name"]  # PostgreSQL lists a unique constraint's own index too
                for index in found.get_indexes(table.name)
                if not index.get("duplicates_constraint")
            }
            for table in Base.metadata.sorted_tables
        }
    finally:
        engine.dispose()
    for table in Base.metadata.sorted_tables:
        assert present[table.name] == {index.name for index in table.indexes}, table.name
    assert "ix_noetl_event_execution_id" not in present["noetl_event"]  # 0008: every index leads with it
    assert "ix_noetl_execution_status" not in present["noetl_execution"]  # 0008: (status, created_at) serves


def test_the_revisions_read_without_alembic_are_alembics():
    """ensure_schema reads the shipped revisions from the migration files itself (no Alembic to
    load when a store is at head): the same line of revisions, oldest first, as Alembic reads."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert shipped_revisions() == tuple(rev.revision for rev in reversed(list(script.walk_revisions())))
    assert head_revision() == script.get_current_head()


def test_a_store_at_head_is_checked_without_alembic_and_one_behind_is_not_taken_for_it(database_url):
    migrate(database_url)
    code = (
        "import sys; from noetl_celery.store.db import ensure_schema; "
        f"ensure_schema({database_url!r}); print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_clean_env({}), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # one query of alembic_version, and Alembic never imported

    downgrade(database_url, shipped_revisions()[-2])
    if database_url.startswith("sqlite"):
        ensure_schema(database_url)  # the embedded store is upgraded on first use
        assert current_revision(database_url) == HEAD
    else:
        with pytest.raises(SchemaOutOfDate, match=f"is at revision {shipped_revisions()[-2]}, this version needs"):
            ensure_schema(database_url)


def test_migration_files_missing_or_forked_are_refused_by_name(tmp_path, monkeypatch):
    from noetl_celery.core.errors import ConfigurationError
    from noetl_celery.store import db

    versions = tmp_path / "versions"
    versions.mkdir()
    monkeypatch.setattr(db, "MIGRATIONS", tmp_path)
    db.shipped_revisions.cache_clear()
    try:
        with pytest.raises(ConfigurationError, match="no revision found"):
            db.shipped_revisions()
        for name, parent in (("a", None), ("b", '"a"'), ("c", '"a"')):  # b and c both follow a: a fork
            (versions / f"{name}.py").write_text(f'revision = "{name}"\ndown_revision = {parent}\n')
        with pytest.raises(ConfigurationError, match="not one line of revisions"):
            db.shipped_revisions()
        (versions / "c.py").write_text('revision = "c"\ndown_revision = "b"\n')
        assert db.shipped_revisions() == ("a", "b", "c")
    finally:
        db.shipped_revisions.cache_clear()


@pytest.mark.services
def test_the_event_key_becomes_the_primary_key_with_the_rows_kept_and_goes_back_on_downgrade(fresh_postgres):
    """0010_event_key on PostgreSQL: the unique key (execution_id, event_id) becomes the primary key
    under its own name (no index on id alone any more), the rows and the id sequence are kept, and a
    duplicate is still reported as the event key's; downgrade gives the (id) key and the unique
    constraint back."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from noetl_celery.store import repo
    from tests.test_partitioned_events import primary_key

    url = fresh_postgres.url
    migrate(url, "0009_cursor_hold")
    insert = text(
        "INSERT INTO noetl_event (execution_id, event_id, event_type, created_at) VALUES (:x, :k, 't', now()) RETURNING id"
    )
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            ids = [conn.execute(insert, {"x": 7, "k": f"e{n}"}).scalar() for n in range(3)]
            assert primary_key(conn) == ("noetl_event_pkey", ["id"])
        migrate(url)
        with engine.begin() as conn:
            assert primary_key(conn) == ("uq_noetl_event_key", ["execution_id", "event_id"])
            assert {i["name"] for i in inspect(conn).get_indexes("noetl_event")} == {
                "ix_noetl_event_page",
                "ix_noetl_event_run",
                "ix_noetl_event_type",
            }
            assert conn.execute(text("SELECT id FROM noetl_event ORDER BY id")).scalars().all() == ids
            assert conn.execute(insert, {"x": 7, "k": "e3"}).scalar() > ids[-1]  # the same sequence
        with pytest.raises(IntegrityError) as duplicate, engine.begin() as conn:
            conn.execute(insert, {"x": 7, "k": "e0"})
        assert repo.is_event_key(duplicate.value.orig.diag.constraint_name)
        downgrade(url, "0009_cursor_hold")
        with engine.begin() as conn:
            assert primary_key(conn) == ("noetl_event_pkey", ["id"])
            uniques = conn.execute(
                text("SELECT conname FROM pg_constraint WHERE conrelid = 'noetl_event'::regclass AND contype = 'u'")
            ).scalars()
            assert set(uniques) == {"uq_noetl_event_key"}
            assert conn.execute(text("SELECT count(*) FROM noetl_event")).scalar() == 4
    finally:
        engine.dispose()
