"""Scale: leases out of the event log, the executions' status index.

- noetl_lease: one row per decision row whose dispatched messages may still be owed an outcome
  row, with the time by which they should all have one. It replaces noetl_event.deadline_at,
  which made every dispatching decision row written twice (the deadline, then the sweeper's
  clearing update; an indexed column, so never a HOT update). The deadlines of rows written
  before this revision are moved into it, so their attempts are still recovered; the downgrade
  moves them back.
- ix_noetl_execution_status_created: executions by status, newest first (`/?status=failed`),
  and the candidates of `noetl-celery prune`.

Revision ID: 0006_scale
Revises: 0005_schedules
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_scale"
down_revision = "0005_schedules"
branch_labels = None
depends_on = None

Stamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "noetl_lease",
        sa.Column("execution_id", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.String(200), nullable=False),
        sa.Column("deadline_at", Stamp, nullable=False),
        sa.PrimaryKeyConstraint("execution_id", "event_id"),
    )
    op.create_index("ix_noetl_lease_deadline", "noetl_lease", ["deadline_at"])
    op.execute(
        "INSERT INTO noetl_lease (execution_id, event_id, deadline_at)"
        " SELECT execution_id, event_id, deadline_at FROM noetl_event WHERE deadline_at IS NOT NULL"
    )
    op.drop_index("ix_noetl_event_deadline", table_name="noetl_event")
    with op.batch_alter_table("noetl_event") as batch:
        batch.drop_column("deadline_at")
    op.create_index("ix_noetl_execution_status_created", "noetl_execution", ["status", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_noetl_execution_status_created", table_name="noetl_execution")
    with op.batch_alter_table("noetl_event") as batch:
        batch.add_column(sa.Column("deadline_at", Stamp))
    op.execute(
        "UPDATE noetl_event SET deadline_at = (SELECT l.deadline_at FROM noetl_lease l"
        " WHERE l.execution_id = noetl_event.execution_id AND l.event_id = noetl_event.event_id)"
        " WHERE EXISTS (SELECT 1 FROM noetl_lease l"
        " WHERE l.execution_id = noetl_event.execution_id AND l.event_id = noetl_event.event_id)"
    )
    op.create_index(
        "ix_noetl_event_deadline",
        "noetl_event",
        ["deadline_at"],
        postgresql_where=sa.text("deadline_at IS NOT NULL"),
        sqlite_where=sa.text("deadline_at IS NOT NULL"),
    )
    op.drop_index("ix_noetl_lease_deadline", table_name="noetl_lease")
    op.drop_table("noetl_lease")
