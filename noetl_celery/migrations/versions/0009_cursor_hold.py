"""A cursor claim that runs its first row in its own job keeps the rows it took until that row's
outcome is recorded: `noetl_cursor_hold`, one row per cursor slot (execution, loop run, slot)
with the claim's number and rows, overwritten by the slot's next claim. The same claim run again
(its job died, or was delivered twice) takes these rows back instead of running the claim SQL,
whatever the SQL does with rows that ran (engine/attempt/cursor_claim.py).

Revision ID: 0009_cursor_hold
Revises: 0008_indexes
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009_cursor_hold"
down_revision = "0008_indexes"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "noetl_cursor_hold",
        sa.Column("execution_id", sa.BigInteger(), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("claim", sa.Integer(), nullable=False),
        sa.Column("rows", Json, nullable=False),
        sa.PrimaryKeyConstraint("execution_id", "run_id", "slot"),
    )


def downgrade() -> None:
    op.drop_table("noetl_cursor_hold")
