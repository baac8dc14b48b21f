"""The playbook catalog's table."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from noetl_celery.store import kernel
from noetl_celery.store.kernel import CATALOG, utcnow


def register_playbook(conn: Connection, *, path: str, name: str, content: str, source_file: str | None) -> None:
    """Add or replace the catalog entry of `path`."""
    values = {"path": path, "name": name, "content": content, "source_file": source_file, "registered_at": utcnow()}
    stmt = kernel.insert(conn, CATALOG).values(**values)
    conn.execute(
        stmt.on_conflict_do_update(index_elements=["path"], set_={k: v for k, v in values.items() if k != "path"})
    )


def find_playbook(conn: Connection, path: str) -> dict[str, Any] | None:
    row = conn.execute(select(CATALOG).where(CATALOG.c.path == path)).mappings().first()
    return dict(row) if row else None


def list_playbooks(conn: Connection) -> list[dict[str, Any]]:
    """The catalog entries by path, without their content."""
    c = CATALOG.c
    rows = conn.execute(select(c.path, c.name, c.source_file, c.registered_at).order_by(c.path)).mappings()
    return [dict(r) for r in rows]
