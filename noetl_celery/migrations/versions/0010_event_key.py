"""The event row's key is its table's primary key (PostgreSQL): one index fewer per event row.

`noetl_event` had a primary key on `(id)` beside its unique key `(execution_id, event_id)`. No
read looks a row up by `id` alone: an execution's rows are read in order through
`(execution_id, id)` (`ix_noetl_event_page`), and a row by its key through the unique key. Each
row cost the `(id)` index an entry: about 24 bytes of store and 80 of WAL, two of them per loop
iteration. The unique key becomes the primary key, under the name it had
(`uq_noetl_event_key`), so that a duplicate row is reported as before (a worker of the release
before this one, in a rolling upgrade, recognises it too), and `ON CONFLICT (execution_id,
event_id)` finds it as before. `id` keeps its sequence and stays unique by it.

- A plain table: the key's index is built again with `CREATE UNIQUE INDEX CONCURRENTLY` (writes
  go on meanwhile; an index left invalid by an interrupted build is dropped first), then one
  `ALTER TABLE` drops the `(id)` key and the unique constraint and makes the new index the
  primary key: a lock for milliseconds.
- A table partitioned by `noetl-celery store partition-events`: its primary key `(id,
  execution_id)` is dropped; its unique constraint `(execution_id, event_id)` stays its key
  (PostgreSQL cannot make a partitioned table's primary key from an index it has). `--undo` and a
  conversion make that key the primary key of the table they build.
- SQLite: nothing changes (`id` is the table's rowid there: its key costs no index).

Revision ID: 0010_event_key
Revises: 0009_cursor_hold
Create Date: 2026-11-26
"""

from alembic import op
from sqlalchemy import text

revision = "0010_event_key"
down_revision = "0009_cursor_hold"
branch_labels = None
depends_on = None

KEY = "uq_noetl_event_key"
OLD_PRIMARY = "noetl_event_pkey"
BUILDING = "noetl_event_key_building"  # the index being built, until it becomes a key


def _relkind() -> str | None:
    return op.get_bind().execute(text("SELECT relkind FROM pg_class WHERE oid = to_regclass('noetl_event')")).scalar()


def _build_concurrently(columns: str) -> None:
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {BUILDING}")
        op.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {BUILDING} ON noetl_event ({columns})")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    if _relkind() == "p":
        op.execute(f"ALTER TABLE noetl_event DROP CONSTRAINT IF EXISTS {OLD_PRIMARY}")
        return
    _build_concurrently("execution_id, event_id")
    op.execute(
        f"ALTER TABLE noetl_event DROP CONSTRAINT {OLD_PRIMARY}, DROP CONSTRAINT {KEY},"
        f" ADD CONSTRAINT {KEY} PRIMARY KEY USING INDEX {BUILDING}"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    if _relkind() == "p":
        op.execute(f"ALTER TABLE noetl_event DROP CONSTRAINT IF EXISTS {KEY}")
        op.execute(f"ALTER TABLE noetl_event ADD CONSTRAINT {OLD_PRIMARY} PRIMARY KEY (id, execution_id)")
        op.execute(f"ALTER TABLE noetl_event ADD CONSTRAINT {KEY} UNIQUE (execution_id, event_id)")
        return
    _build_concurrently("id")
    op.execute(
        f"ALTER TABLE noetl_event DROP CONSTRAINT {KEY},"
        f" ADD CONSTRAINT {OLD_PRIMARY} PRIMARY KEY USING INDEX {BUILDING},"
        f" ADD CONSTRAINT {KEY} UNIQUE (execution_id, event_id)"
    )
