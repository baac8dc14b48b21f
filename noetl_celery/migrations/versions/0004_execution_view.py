"""The execution view: the indexes the dashboard and `events --follow` read by.

- events of one execution in id order, paged by id (`ix_noetl_event_page`);
- events of one execution by type and step: step states, attempts, failures (`ix_noetl_event_type`);
- executions newest first, and by playbook (children by parent: ix_noetl_execution_parent_execution_id
  of revision 0003).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_noetl_event_page", "noetl_event", ["execution_id", "id"])
    op.create_index("ix_noetl_event_type", "noetl_event", ["execution_id", "event_type", "step"])
    op.create_index("ix_noetl_execution_created", "noetl_execution", ["created_at"])
    op.create_index("ix_noetl_execution_playbook", "noetl_execution", ["playbook_name", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_noetl_execution_playbook", table_name="noetl_execution")
    op.drop_index("ix_noetl_execution_created", table_name="noetl_execution")
    op.drop_index("ix_noetl_event_type", table_name="noetl_event")
    op.drop_index("ix_noetl_event_page", table_name="noetl_event")
