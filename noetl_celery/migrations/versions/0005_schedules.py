"""Schedules fired by Celery beat, the runs they claimed, and failure-notification deliveries.

- `noetl_schedule`: one row per schedule (`noetl-celery schedule add`): the playbook (catalog path
  or file), a cron expression or an interval in seconds, its time zone, workload overrides, the
  paused flag, the missed-fire policy, and `anchor_at` (only fire times after it count: set at
  creation and at resume, so that a paused period is not "missed").
- `noetl_schedule_run`: one row per (schedule, fire time) a beat claimed; its primary key is the
  claim, so two beats (or a restarted one) never start the same fire time twice. `execution_id`
  is the execution it started (none for a skipped or refused fire time).
- `noetl_notification`: one row per ended execution whose failure webhook was tried: attempts,
  the lease of the delivery in progress, when it was delivered.

Revision ID: 0005_schedules
Revises: 0004
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005_schedules"
down_revision = "0004"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "noetl_schedule",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("playbook", sa.String(1000), nullable=False),
        sa.Column("cron", sa.String(200)),
        sa.Column("interval_s", sa.Integer()),
        sa.Column("timezone", sa.String(64), nullable=False, server_default="UTC"),
        sa.Column("workload", Json),
        sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("missed", sa.String(16), nullable=False, server_default="latest"),
        sa.Column("anchor_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "noetl_schedule_run",
        sa.Column("schedule", sa.String(200), primary_key=True),
        sa.Column("fire_time", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("outcome", sa.String(16), nullable=False),  # started | skipped | refused
        sa.Column("execution_id", sa.BigInteger()),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_by", sa.String(200)),
        sa.Column("detail", Json),
    )
    op.create_index("ix_noetl_schedule_run_execution", "noetl_schedule_run", ["execution_id"])
    op.create_table(
        "noetl_notification",
        sa.Column("execution_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("url", sa.String(2000)),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("lease_token", sa.String(64)),
        sa.Column("next_at", sa.DateTime(timezone=True)),
        sa.Column("delivered_at", sa.DateTime(timezone=True)),
        sa.Column("gave_up_at", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("noetl_notification")
    op.drop_index("ix_noetl_schedule_run_execution", table_name="noetl_schedule_run")
    op.drop_table("noetl_schedule_run")
    op.drop_table("noetl_schedule")
