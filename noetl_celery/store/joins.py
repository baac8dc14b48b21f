"""The joins' table: a fork's join, opened with its width and settled by each arrival."""

from __future__ import annotations

from sqlalchemy import Connection, and_, update

from noetl_celery.store import kernel
from noetl_celery.store.kernel import JOINS

# --- joins --------------------------------------------------------------------------------


def open_join(conn: Connection, execution_id: int, fork_id: str, join_step: str, width: int) -> None:
    conn.execute(
        kernel.insert(conn, JOINS)
        .values(execution_id=execution_id, fork_id=fork_id, join_step=join_step, width=width, settled=0, arrived=0)
        .on_conflict_do_nothing(index_elements=["execution_id", "fork_id"])
    )


def settle_join(conn: Connection, execution_id: int, fork_id: str, *, arrived: bool) -> tuple[int, int, int]:
    """One branch of the fork settled (arrived at the join, or ended); returns (settled, arrived, width)."""
    c = JOINS.c
    row = conn.execute(
        update(JOINS)
        .where(and_(c.execution_id == execution_id, c.fork_id == fork_id))
        .values(settled=c.settled + 1, arrived=c.arrived + (1 if arrived else 0))
        .returning(c.settled, c.arrived, c.width)
    ).first()
    if row is None:
        raise LookupError(f"fork {fork_id} of execution {execution_id} not found")
    return int(row[0]), int(row[1]), int(row[2])
