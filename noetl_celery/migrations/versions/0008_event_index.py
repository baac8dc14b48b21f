"""The event table's index on execution_id alone goes: every query on execution_id finds it in
the first column of another index (the page index `(execution_id, id)`, the unique key, the run
and type indexes). Each event row written so cost an index entry, about 15 bytes of store and
70 bytes of WAL, for nothing.

Revision ID: 0008_event_index
Revises: 0007_blobs
Create Date: 2026-11-25
"""

from alembic import op

revision = "0008_event_index"
down_revision = "0007_blobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_noetl_event_execution_id", table_name="noetl_event", if_exists=True)


def downgrade() -> None:
    op.create_index("ix_noetl_event_execution_id", "noetl_event", ["execution_id"])
