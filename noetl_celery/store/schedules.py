"""The store's side of schedules (noetl_schedule, noetl_schedule_run) and of failure
notifications (noetl_notification). SQLAlchemy Core; no Celery, no decisions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, delete, func, not_, or_, select, true, update

from noetl_celery.store.kernel import insert as _insert
from noetl_celery.store.kernel import utcnow
from noetl_celery.store.models import Execution, Notification, Schedule, ScheduleRun

SCHEDULES = cast(Table, Schedule.__table__)
RUNS = cast(Table, ScheduleRun.__table__)
NOTIFICATIONS = cast(Table, Notification.__table__)
EXECUTIONS = cast(Table, Execution.__table__)


def aware(value: datetime | None) -> datetime | None:
    """A stored time as an aware UTC datetime (SQLite gives it back naive)."""
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _row(row: Any) -> dict[str, Any]:
    data = dict(row)
    for key, value in data.items():
        if isinstance(value, datetime):
            data[key] = aware(value)
    return data


# --- schedules ---------------------------------------------------------------------------


def get_schedule(conn: Connection, name: str) -> dict[str, Any] | None:
    row = conn.execute(select(SCHEDULES).where(SCHEDULES.c.name == name)).mappings().first()
    return _row(row) if row is not None else None


def list_schedules(conn: Connection) -> list[dict[str, Any]]:
    return [_row(r) for r in conn.execute(select(SCHEDULES).order_by(SCHEDULES.c.name)).mappings()]


def put_schedule(conn: Connection, values: dict[str, Any], *, replace: bool) -> bool:
    """Insert a schedule; with `replace`, an existing one of that name is overwritten (its runs are
    kept). Returns False when it exists and `replace` is not set."""
    now = utcnow()
    row = {**values, "anchor_at": now, "created_at": now, "updated_at": now}
    statement = _insert(conn, SCHEDULES).values(**row)
    if replace:
        changed = {k: v for k, v in row.items() if k not in ("name", "created_at")}
        statement = statement.on_conflict_do_update(index_elements=["name"], set_=changed)
    else:
        statement = statement.on_conflict_do_nothing(index_elements=["name"])
    return conn.execute(statement).rowcount > 0


def delete_schedule(conn: Connection, name: str) -> bool:
    """Remove a schedule (the record of its runs stays)."""
    return conn.execute(delete(SCHEDULES).where(SCHEDULES.c.name == name)).rowcount > 0


def set_paused(conn: Connection, name: str, paused: bool) -> bool:
    """Pause or resume; a resume moves the anchor to now: fire times while paused are not missed."""
    now = utcnow()
    values: dict[str, Any] = {"paused": paused, "updated_at": now}
    if not paused:
        values["anchor_at"] = now
    c = SCHEDULES.c
    return conn.execute(update(SCHEDULES).where(c.name == name).values(**values)).rowcount > 0


def last_fire(conn: Connection, name: str) -> datetime | None:
    """The latest fire time claimed for schedule `name` (started, skipped or refused)."""
    return aware(conn.execute(select(func.max(RUNS.c.fire_time)).where(RUNS.c.schedule == name)).scalar())


def claim_fire(
    conn: Connection,
    name: str,
    fire_time: datetime,
    outcome: str,
    *,
    execution_id: int | None = None,
    by: str | None = None,
    detail: Any = None,
) -> bool:
    """Claim (schedule, fire time): True for the one caller that inserts the row, False for every
    other (a second beat, a restarted one). On PostgreSQL a concurrent claimer waits for the first
    one's transaction and then gets False."""
    statement = (
        _insert(conn, RUNS)
        .values(
            schedule=name,
            fire_time=fire_time,
            outcome=outcome,
            execution_id=execution_id,
            claimed_at=utcnow(),
            claimed_by=by,
            detail=detail,
        )
        .on_conflict_do_nothing(index_elements=["schedule", "fire_time"])
    )
    return conn.execute(statement).rowcount > 0


def schedule_runs(conn: Connection, name: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    query = select(RUNS)
    if name is not None:
        query = query.where(RUNS.c.schedule == name)
    rows = conn.execute(query.order_by(RUNS.c.fire_time.desc()).limit(limit)).mappings()
    return [_row(r) for r in rows]


def started_by(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    """{schedule, fire_time} of the schedule run that started `execution_id`, None when it was
    not started by a schedule."""
    row = (
        conn.execute(select(RUNS.c.schedule, RUNS.c.fire_time).where(RUNS.c.execution_id == execution_id))
        .mappings()
        .first()
    )
    if row is None:
        return None
    fire_time = aware(row["fire_time"])
    return {"schedule": row["schedule"], "fire_time": fire_time.isoformat() if fire_time else None}


# --- failure notifications ----------------------------------------------------------------


def unnotified_ends(
    conn: Connection, since: datetime, now: datetime, limit: int = 100, *, own_url_only: bool = False
) -> list[int]:
    """Top-level executions that ended after `since` with a webhook event, whose webhook is
    neither delivered nor given up, and not leased or waiting for its next try at `now`: those
    that failed or were cancelled (`own_url_only`, no NOETL_WEBHOOK_URL: only those whose plan
    names its own webhook), and those that completed and whose playbook asked for `completed`
    (their row was made when they started: `expect_completion`)."""
    e, n = EXECUTIONS.c, NOTIFICATIONS.c
    waiting = select(n.execution_id).where(
        or_(
            n.delivered_at.is_not(None),
            n.gave_up_at.is_not(None),
            n.lease_until > now,
            n.next_at > now,
        )
    )
    failed = (
        select(e.execution_id, e.finished_at)
        .where(
            and_(
                e.status.in_(("failed", "cancelled")),
                e.parent_execution_id.is_(None),
                e.finished_at >= since,
                not_(e.execution_id.in_(waiting)),
                e.plan["webhook"].as_string().is_not(None) if own_url_only else true(),
            )
        )
        .order_by(e.finished_at)
        .limit(limit)
    )
    expected = select(n.execution_id).where(
        and_(
            n.delivered_at.is_(None),
            n.gave_up_at.is_(None),
            or_(n.lease_until.is_(None), n.lease_until <= now),
            or_(n.next_at.is_(None), n.next_at <= now),
        )
    )
    completed = (
        select(e.execution_id, e.finished_at)
        .where(and_(e.execution_id.in_(expected), e.status == "completed", e.finished_at >= since))
        .order_by(e.finished_at)
        .limit(limit)
    )
    found = sorted([*conn.execute(failed), *conn.execute(completed)], key=lambda r: r[1])
    return [int(r[0]) for r in found[:limit]]


def expect_completion(conn: Connection, execution_id: int, now: datetime) -> None:
    """The notification row of an execution whose playbook wants a webhook when it completes, made
    as it starts: the sweep's scan finds completed executions through these rows only."""
    conn.execute(
        _insert(conn, NOTIFICATIONS)
        .values(execution_id=execution_id, attempts=0, created_at=now)
        .on_conflict_do_nothing(index_elements=["execution_id"])
    )


def lease_notification(conn: Connection, execution_id: int, token: str, until: datetime, now: datetime) -> bool:
    """Take the delivery of `execution_id`'s webhook until `until`: True for one caller at a time,
    never once it was delivered or given up."""
    conn.execute(
        _insert(conn, NOTIFICATIONS)
        .values(execution_id=execution_id, attempts=0, created_at=now)
        .on_conflict_do_nothing(index_elements=["execution_id"])
    )
    n = NOTIFICATIONS.c
    taken = conn.execute(
        update(NOTIFICATIONS)
        .where(
            and_(
                n.execution_id == execution_id,
                n.delivered_at.is_(None),
                n.gave_up_at.is_(None),
                or_(n.lease_until.is_(None), n.lease_until <= now),
                or_(n.next_at.is_(None), n.next_at <= now),
            )
        )
        .values(lease_until=until, lease_token=token)
    )
    return taken.rowcount > 0


def notification_done(
    conn: Connection,
    execution_id: int,
    token: str,
    *,
    url: str | None,
    delivered: bool,
    error: str | None,
    next_at: datetime | None,
    give_up: bool,
) -> None:
    """Record one delivery attempt of the lease holder `token` and release the lease."""
    n = NOTIFICATIONS.c
    now = utcnow()
    conn.execute(
        update(NOTIFICATIONS)
        .where(and_(n.execution_id == execution_id, n.lease_token == token))
        .values(
            url=url,
            attempts=n.attempts + 1,
            lease_until=None,
            lease_token=None,
            delivered_at=now if delivered else None,
            gave_up_at=now if give_up and not delivered else None,
            next_at=None if delivered else next_at,
            last_error=error,
        )
    )


def notification(conn: Connection, execution_id: int) -> dict[str, Any] | None:
    row = conn.execute(select(NOTIFICATIONS).where(NOTIFICATIONS.c.execution_id == execution_id)).mappings().first()
    return _row(row) if row is not None else None
