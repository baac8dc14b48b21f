"""Event store: executions, events, variables, joins, loops.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Json = sa.JSON().with_variant(JSONB(), "postgresql")
Stamp = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "noetl_execution",
        sa.Column("execution_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("parent_execution_id", sa.BigInteger()),
        sa.Column("playbook_name", sa.String(200), nullable=False),
        sa.Column("playbook_path", sa.String(500)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("plan", Json, nullable=False),
        sa.Column("workload", Json, nullable=False),
        sa.Column("error", Json),
        sa.Column("failed_step", sa.String(200)),
        sa.Column("pending", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("state_version", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", Stamp, nullable=False),
        sa.Column("updated_at", Stamp, nullable=False),
        sa.Column("finished_at", Stamp),
    )
    op.create_index("ix_noetl_execution_status", "noetl_execution", ["status"])
    op.create_table(
        "noetl_event",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("execution_id", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.String(200), nullable=False),
        sa.Column("parent_event_id", sa.String(200)),
        sa.Column("parent_execution_id", sa.BigInteger()),
        sa.Column("queue_id", sa.String(64)),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("status", sa.String(32)),
        sa.Column("step", sa.String(200)),
        sa.Column("task", sa.String(200)),
        sa.Column("run_id", sa.String(64)),
        sa.Column("attempt", sa.Integer()),
        sa.Column("iteration", sa.Integer()),
        sa.Column("page", sa.Integer()),
        sa.Column("created_at", Stamp, nullable=False),
        sa.Column("started_at", Stamp),
        sa.Column("duration_ms", sa.Float()),
        sa.Column("worker", sa.String(200)),
        sa.Column("context", Json),
        sa.Column("result", Json),
        sa.Column("error", Json),
        sa.Column("meta", Json),
        sa.UniqueConstraint("execution_id", "event_id", name="uq_noetl_event_key"),
    )
    op.create_index("ix_noetl_event_execution_id", "noetl_event", ["execution_id"])
    op.create_index("ix_noetl_event_run", "noetl_event", ["execution_id", "run_id", "event_type"])
    op.create_table(
        "noetl_variable",
        sa.Column("execution_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("scope", sa.String(16), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("value", Json),
        sa.Column("updated_at", Stamp, nullable=False),
    )
    op.create_table(
        "noetl_join",
        sa.Column("execution_id", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("fork_id", sa.String(200), primary_key=True),
        sa.Column("join_step", sa.String(200), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("settled", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("arrived", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_table(
        "noetl_loop",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("execution_id", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.String(200), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("cap", sa.Integer(), nullable=False),
        sa.Column("dispatched", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("done", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("succeeded", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("tolerated", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("collection", Json),
        sa.Column("context", Json),
        sa.Column("created_at", Stamp, nullable=False),
        sa.Column("updated_at", Stamp, nullable=False),
    )
    op.create_index("ix_noetl_loop_execution_id", "noetl_loop", ["execution_id"])


def downgrade() -> None:
    op.drop_index("ix_noetl_loop_execution_id", table_name="noetl_loop")
    op.drop_table("noetl_loop")
    op.drop_table("noetl_join")
    op.drop_table("noetl_variable")
    op.drop_index("ix_noetl_event_run", table_name="noetl_event")
    op.drop_index("ix_noetl_event_execution_id", table_name="noetl_event")
    op.drop_table("noetl_event")
    op.drop_index("ix_noetl_execution_status", table_name="noetl_execution")
    op.drop_table("noetl_execution")
