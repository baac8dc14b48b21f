"""Two indexes that another index already covers go, each a write per row for nothing:

- `ix_noetl_event_execution_id` on `noetl_event (execution_id)`: every query on execution_id
  finds it as the first column of another index (the page index `(execution_id, id)`, the
  unique key, the run and type indexes). Each event row cost it an entry: about 15 bytes of
  store and 65 of WAL.
- `ix_noetl_execution_status` on `noetl_execution (status)`: `(status, created_at)` (0006_scale)
  serves every query on status. Each execution's insert and its end cost it an entry.

Revision ID: 0008_redundant_indexes
Revises: 0007_blobs
Create Date: 2026-11-25
"""

from alembic import op

revision = "0008_redundant_indexes"
down_revision = "0007_blobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_noetl_event_execution_id", table_name="noetl_event", if_exists=True)
    op.drop_index("ix_noetl_execution_status", table_name="noetl_execution", if_exists=True)


def downgrade() -> None:
    op.create_index("ix_noetl_execution_status", "noetl_execution", ["status"])
    op.create_index("ix_noetl_event_execution_id", "noetl_event", ["execution_id"])
