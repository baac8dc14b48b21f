"""Durability: attempt deadlines, execution deadlines, resume epochs.

- noetl_event.deadline_at: on the row that records a decision with messages to dispatch, the time
  by which every one of those attempts should have an outcome row (the sweeper scans it).
- noetl_execution.deadline_at: the playbook-level `timeout` (NULL: no limit).
- noetl_execution.epoch: how many times the execution was resumed.
- status `cancelled` needs no schema change (a value of noetl_execution.status).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

Stamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("noetl_event") as batch:
        batch.add_column(sa.Column("deadline_at", Stamp))
    # partial: only decision rows with attempts still owed an outcome are in it
    op.create_index(
        "ix_noetl_event_deadline",
        "noetl_event",
        ["deadline_at"],
        postgresql_where=sa.text("deadline_at IS NOT NULL"),
        sqlite_where=sa.text("deadline_at IS NOT NULL"),
    )
    with op.batch_alter_table("noetl_execution") as batch:
        batch.add_column(sa.Column("deadline_at", Stamp))
        batch.add_column(sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("noetl_execution") as batch:
        batch.drop_column("epoch")
        batch.drop_column("deadline_at")
    op.drop_index("ix_noetl_event_deadline", table_name="noetl_event")
    with op.batch_alter_table("noetl_event") as batch:
        batch.drop_column("deadline_at")
