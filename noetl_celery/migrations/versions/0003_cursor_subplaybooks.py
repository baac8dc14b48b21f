"""Cursor loops and sub-playbooks: slots, catalog.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    # cursor loops: how many of the loop's slots have seen an empty claim (loop.done at == cap)
    with op.batch_alter_table("noetl_loop") as batch:
        batch.add_column(sa.Column("slots_ended", sa.Integer(), nullable=False, server_default="0"))
    # sub-playbooks: a child execution knows the parent row that started it, the parent's task
    # message to resume, and how deep it is nested
    with op.batch_alter_table("noetl_execution") as batch:
        batch.add_column(sa.Column("parent_event_id", sa.String(200)))
        batch.add_column(sa.Column("parent_task", Json))
        batch.add_column(sa.Column("depth", sa.Integer(), nullable=False, server_default="0"))
    op.create_index("ix_noetl_execution_parent_execution_id", "noetl_execution", ["parent_execution_id"])
    # the playbook catalog (`noetl-celery register`): one row per catalog path
    op.create_table(
        "noetl_catalog",
        sa.Column("path", sa.String(500), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("source_file", sa.String(1000)),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("noetl_catalog")
    op.drop_index("ix_noetl_execution_parent_execution_id", table_name="noetl_execution")
    with op.batch_alter_table("noetl_execution") as batch:
        batch.drop_column("depth")
        batch.drop_column("parent_task")
        batch.drop_column("parent_event_id")
    with op.batch_alter_table("noetl_loop") as batch:
        batch.drop_column("slots_ended")
