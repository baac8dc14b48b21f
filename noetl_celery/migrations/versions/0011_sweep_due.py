"""The sweeper's playbook-timeout check reads only the executions that are due.

- `ix_noetl_execution_due` on `noetl_execution (deadline_at)`, for running executions with a
  playbook `timeout:` only: the sweep's check (store/leases.py `timed_out`: running, deadline
  past) read every running execution through `(status, created_at)`, each sweep (10,000 running
  executions: every one of them, every 5 s); through this partial index it reads those whose
  deadline has passed. An execution's row enters it when it starts with a deadline and leaves it
  when it ends; the counters' updates (`pending`, `state_version`) do not touch it.

Revision ID: 0011_sweep_due
Revises: 0010_event_key
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_sweep_due"
down_revision = "0010_event_key"
branch_labels = None
depends_on = None

DUE = "status = 'running' AND deadline_at IS NOT NULL"


def upgrade() -> None:
    op.create_index(
        "ix_noetl_execution_due",
        "noetl_execution",
        ["deadline_at"],
        postgresql_where=sa.text(DUE),
        sqlite_where=sa.text(DUE),
    )


def downgrade() -> None:
    op.drop_index("ix_noetl_execution_due", table_name="noetl_execution")
