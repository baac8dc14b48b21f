"""The sweeper's playbook-timeout check reads only the executions that are due.

- `ix_noetl_execution_due` on `noetl_execution (deadline_at)`, for running executions with a
  playbook `timeout:` only: the sweep's check (store/leases.py `timed_out`: running, deadline
  past) read every running execution through `(status, created_at)`, each sweep (10,000 running
  executions: every one of them, every 5 s); through this partial index it reads those whose
  deadline has passed. An execution's row enters it when it starts with a deadline and leaves it
  when it ends; the counters' updates (`pending`, `state_version`) do not touch it. On
  PostgreSQL it is built with `CREATE INDEX CONCURRENTLY` (submits and ends go on meanwhile; an
  index left invalid by an interrupted build is dropped and built again by the next `migrate`).

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


INDEX = "ix_noetl_execution_due"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.create_index(INDEX, "noetl_execution", ["deadline_at"], sqlite_where=sa.text(DUE))
        return
    with op.get_context().autocommit_block():  # submits and ends go on while it is built
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")  # left invalid by an interrupted build
        op.execute(f"CREATE INDEX CONCURRENTLY {INDEX} ON noetl_execution (deadline_at) WHERE {DUE}")


def downgrade() -> None:
    op.drop_index(INDEX, table_name="noetl_execution")
