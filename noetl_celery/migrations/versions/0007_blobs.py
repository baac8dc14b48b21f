"""Values stored by reference: a result above NOETL_MAX_RESULT_BYTES is stored once per execution
in noetl_blob (by the SHA-256 of its JSON text, zlib-compressed when that saves), and the event
rows, variables and loop collections that hold it keep a small reference (store/blobs.py).

Revision ID: 0007_blobs
Revises: 0006_scale
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_blobs"
down_revision = "0006_scale"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "noetl_blob",
        sa.Column("execution_id", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("encoding", sa.String(16), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("execution_id", "sha256"),
    )


def downgrade() -> None:
    op.drop_table("noetl_blob")
