"""How an execution ends from outside its own decisions: cancelled, or out of time.

Decides: the status and the row that record it, and that child executions (parent_execution_id)
end with their parent (their error names it: `ended_with`, the id this call ended; a resume of
that execution runs their tasks again: engine/recovery/resume.py). A decision arriving afterwards sees a
non-running execution: its outcome row is recorded, nothing new is dispatched.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from noetl_celery.store import recovery as store_recovery
from noetl_celery.store import repo

MAX_CHILD_DEPTH = 32  # levels of sub-playbooks followed when ending a tree of executions


def end_tree(conn: Connection, execution_id: int, status: str, event_type: str, error: dict[str, Any]) -> list[int]:
    """End `execution_id` and its running descendants; returns the ids that this call ended.

    When `execution_id` is itself a sub-playbook, its parent's task is told, as when a child ends
    by its own decision: the end row carries the child's end event in its dispatch list, due at
    once, so the next sweep delivers it (and sends it again until the parent records it)."""
    ended: list[int] = []
    level = [execution_id]
    for _ in range(MAX_CHILD_DEPTH):
        if not level:
            break
        for eid in level:
            repo.lock_execution(conn, eid)  # decisions in flight commit first
            own = error if eid == execution_id else {**error, "ended_with": execution_id}
            if repo.finish_execution(conn, eid, status, error=own):
                row: dict[str, Any] = {
                    "execution_id": eid,
                    "event_id": event_type,
                    "event_type": event_type,
                    "status": status,
                    "error": own,
                }
                if eid == execution_id:
                    row.update(_parent_notice(conn, eid, status, error))
                repo.insert_events(conn, [row])
                ended.append(eid)
        level = store_recovery.running_children(conn, level)
    return ended


def _parent_notice(conn: Connection, execution_id: int, status: str, error: dict[str, Any]) -> dict[str, Any]:
    """The dispatch list (and deadline: now) that tells a running parent its child has ended."""
    from noetl_celery.engine.decision.write import child_end  # the decider's side of sub-playbooks

    end = child_end(conn, execution_id, status, {}, error)
    if end is None:
        return {}
    return {"meta": {"dispatch": [end.to_dict()]}, "deadline_at": repo.utcnow()}
