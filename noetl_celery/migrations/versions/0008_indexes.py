"""Indexes that cost a write for nothing go, and the webhook scan gets one of its own.

- `ix_noetl_event_execution_id` on `noetl_event (execution_id)` goes: every query on
  execution_id finds it as the first column of another index (the page index
  `(execution_id, id)`, the unique key, the run and type indexes). Each event row cost it an
  entry: about 15 bytes of store and 65 of WAL.
- `ix_noetl_execution_status` on `noetl_execution (status)` goes: `(status, created_at)`
  (0006_scale) serves every query on status. Each execution's insert and its end cost it an
  entry.
- `ix_noetl_execution_ended` on `noetl_execution (finished_at)`, for top-level executions that
  failed or were cancelled only: the sweep's webhook scan (store/schedules.py
  `unnotified_ends`) looks for those that ended in the last 24 hours. Through
  `(status, created_at)` it read every failed execution ever kept (60 ms a sweep with 200,000
  of them); through this partial index it reads the last day's (0.4 ms).

Revision ID: 0008_indexes
Revises: 0007_blobs
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_indexes"
down_revision = "0007_blobs"
branch_labels = None
depends_on = None

ENDED = "status IN ('failed', 'cancelled') AND parent_execution_id IS NULL"


def upgrade() -> None:
    op.drop_index("ix_noetl_event_execution_id", table_name="noetl_event", if_exists=True)
    op.drop_index("ix_noetl_execution_status", table_name="noetl_execution", if_exists=True)
    op.create_index(
        "ix_noetl_execution_ended",
        "noetl_execution",
        ["finished_at"],
        postgresql_where=sa.text(ENDED),
        sqlite_where=sa.text(ENDED),
    )


def downgrade() -> None:
    op.drop_index("ix_noetl_execution_ended", table_name="noetl_execution")
    op.create_index("ix_noetl_execution_status", "noetl_execution", ["status"])
    op.create_index("ix_noetl_event_execution_id", "noetl_event", ["execution_id"])
