"""What the pages and the REST API read of the store, on one connection: an execution's facts
(the execution page, its live panel, the API's JSON of it), the same with a page of its events,
and one playbook's run history (the grid of /history).
"""

from __future__ import annotations

from typing import Any

import tornado.web

from noetl_celery.dashboard import layout
from noetl_celery.store import repo, views
from noetl_celery.store.status import rerun_origin


def execution(conn: Any, execution_id: int, timeline: bool = True) -> dict[str, Any]:
    row = repo.get_execution(conn, execution_id)
    if row is None:
        raise tornado.web.HTTPError(404, reason=f"no execution {execution_id}")
    states = views.step_states(conn, execution_id)
    loops = views.loops(conn, execution_id)
    joins = views.joins(conn, execution_id)
    done, total = views.progress_of(conn, [execution_id])[execution_id]
    return {
        "execution": row,
        "workload": views.mask(row["workload"]),
        "states": states,
        "loops": loops,
        "joins": joins,
        "done": done,
        "total": total,
        "progress_pct": progress_percent(row["status"], done, total, states, loops),
        "graph": layout.graph(row["plan"], states, loops, joins),
        "timeline": layout.timeline(views.attempts(conn, execution_id)) if timeline else None,
        "children": views.list_executions(conn, parent=execution_id),
        "failure": views.failure(conn, row),
        "rerun": rerun_origin(conn, execution_id),
        "duration_s": views.duration_s(row["created_at"], row["finished_at"], views._now(row["created_at"])),
    }


def progress_percent(status: str, done: int, total: int, states: dict[str, Any], loops: list[dict[str, Any]]) -> float:
    """The width of an execution's progress bar: the units that succeeded, over the units known.
    A failed unit is finished but no progress, so a failed execution's bar is never full."""
    if status == "completed":
        return 100.0
    failed = sum(int(s.get("failed") or 0) for s in states.values()) + sum(int(lp.get("failed") or 0) for lp in loops)
    succeeded = max(0, done - failed)
    if not total:
        return 0.0
    return min(100.0 * succeeded / total, 99.0)  # only a completed execution's bar is full


def with_events(conn: Any, execution_id: int, filters: dict[str, Any]) -> dict[str, Any]:
    data = execution(conn, execution_id)
    path = data["execution"]["playbook_path"]
    data["registered"] = (repo.find_playbook(conn, path) or {}).get("registered_at") if path else None
    data["events"] = views.events_page(conn, execution_id, **filters)
    data["event_total"] = views.event_counts(conn, execution_id)
    return data


HISTORY_RUNS = 25  # executions in the run-history grid


def run_history(conn: Any, playbook: str, before: int | None) -> dict[str, Any]:
    """The last HISTORY_RUNS executions of `playbook` (its exact name), newest first, and the state
    of each step in each: the rows of the grid; its columns are the steps of the newest plan, then
    the steps only older runs had."""
    rows = [
        r
        for r in views.list_executions(conn, playbook=playbook, before=before, limit=4 * HISTORY_RUNS)
        if r["playbook_name"] == playbook
    ][:HISTORY_RUNS]
    steps: list[str] = []
    runs = []
    for r in rows:
        plan = (repo.get_execution(conn, r["execution_id"]) or {}).get("plan") or {}
        for step in plan.get("steps") or {}:
            if step not in steps:
                steps.append(step)
        runs.append({**r, "states": views.step_states(conn, r["execution_id"])})
    for run in runs:
        for step in run["states"]:
            if step not in steps:
                steps.append(step)
    return {"runs": runs, "steps": steps}
