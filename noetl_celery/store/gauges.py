"""The store's facts a metrics scrape reads (collector.py): one grouped statement per fact.

Decides what each fact means, as read from the rows:
- executions by playbook and status (every execution row: top-level and sub-playbooks); a
  count that only grows while nothing is pruned, so it serves as a counter (retention's prune
  makes it fall, which Prometheus reads as a counter reset);
- overdue leases (past their deadline) and the sweeper's lag: how many seconds the oldest overdue
  lease is past its deadline. A sweep settles an overdue lease or moves its deadline on, so with
  sweeps running the lag stays below a sweep interval or two; a lag that grows means no sweeper
  is sweeping (no worker, a sweep that keeps failing, a lock held by a frozen one);
- webhook notifications by state (`pending`: not tried yet, or awaiting a completion;
  `retrying`: failed at least once, tried again; `gave_up`; `delivered`; `not_chosen`: an event
  the playbook did not choose) and their failed delivery attempts;
- schedule fire times by claim outcome (`started`, `skipped`: missed and skipped, `refused`).
Nothing here writes; each read is bounded by the caller's statement timeout.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, case, func, select

from noetl_celery.store.kernel import EXECUTIONS, LEASES
from noetl_celery.store.schedules import NOTIFICATIONS, RUNS, SCHEDULES, aware

NOT_CHOSEN = "not chosen"  # webhooks.NOT_CHOSEN: an event the playbook did not choose (never sent)
ENDED_STATUSES = ("completed", "failed", "cancelled")


def executions_by_status(conn: Connection) -> list[tuple[str, str, int]]:
    """(playbook, status, executions) for every pair that has one."""
    e = EXECUTIONS.c
    query = select(e.playbook_name, e.status, func.count()).group_by(e.playbook_name, e.status)
    return [(str(name), str(status), int(count)) for name, status, count in conn.execute(query)]


def overdue_leases(conn: Connection, now: datetime) -> tuple[int, float]:
    """(leases past their deadline at `now`, seconds the oldest of them is past it; 0 when none)."""
    c = LEASES.c
    count, oldest = conn.execute(select(func.count(), func.min(c.deadline_at)).where(c.deadline_at < now)).one()
    oldest_at = aware(oldest)
    return int(count or 0), max((now - oldest_at).total_seconds(), 0.0) if oldest_at else 0.0


def notifications_by_state(conn: Connection) -> dict[str, tuple[int, int]]:
    """State -> (notifications, failed delivery attempts among them)."""
    n = NOTIFICATIONS.c
    state = case(
        (n.delivered_at.is_not(None), "delivered"),
        (and_(n.gave_up_at.is_not(None), n.last_error.like(f"{NOT_CHOSEN}%")), "not_chosen"),
        (n.gave_up_at.is_not(None), "gave_up"),
        (n.attempts > 0, "retrying"),
        else_="pending",
    )
    failed = func.sum(case((n.delivered_at.is_not(None), n.attempts - 1), else_=n.attempts))
    query = select(state, func.count(), failed).group_by(state)
    return {str(name): (int(count), int(fails or 0)) for name, count, fails in conn.execute(query)}


def schedule_claims(conn: Connection) -> list[tuple[str, str, int]]:
    """(schedule, claim outcome, fire times) for every pair that has one."""
    r = RUNS.c
    query = select(r.schedule, r.outcome, func.count()).group_by(r.schedule, r.outcome)
    return [(str(name), str(outcome), int(count)) for name, outcome, count in conn.execute(query)]


def schedules_with_last_fire(conn: Connection) -> list[dict[str, Any]]:
    """Every schedule that is not paused, with `last` (its latest claimed fire time, or None)."""
    s, r = SCHEDULES.c, RUNS.c
    last = select(r.schedule, func.max(r.fire_time).label("last")).group_by(r.schedule).subquery()
    query = select(SCHEDULES, last.c.last).outerjoin(last, last.c.schedule == s.name).where(s.paused.is_(False))
    rows = []
    for row in conn.execute(query).mappings():
        found = dict(row)
        for key in ("anchor_at", "created_at", "updated_at", "last"):
            found[key] = aware(found.get(key))
        rows.append(found)
    return rows
