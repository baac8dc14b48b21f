"""Read-only queries for watching executions (the dashboard, `status`, `executions`, progress).

What they decide: how far an execution is (units done / known total: a unit is one step run or
one loop iteration), the state of each step, which attempts to show, how the event log is paged.
Every query is bounded and uses an index of revision 0004 (never a scan of all of an execution's
events), so an execution with 100,000 events reads as fast as one with ten.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select

from noetl_celery.config import credentials, secret_registry
from noetl_celery.core import vocabulary as ev
from noetl_celery.store.models import Event, Execution, Join, LoopState

EVENTS = Event.__table__
EXECUTIONS = Execution.__table__
LOOPS = LoopState.__table__
JOINS = Join.__table__

EVENT_PAGE_SIZE = 100  # event rows per page of the log
EXECUTION_PAGE_SIZE = 50  # executions per page of the list
GANTT_ATTEMPTS = 300  # most recent attempts drawn in the timeline
FAILED_ATTEMPTS_SHOWN = 10  # attempts listed under a failed step
STEP_EVENTS = (ev.STEP_STARTED, ev.STEP_COMPLETED, ev.STEP_FAILED, ev.STEP_SKIPPED)
START_EVENTS = (ev.ACTION_STARTED, ev.ITERATION_STARTED)  # rows whose context holds the input
MASK = "***"
ATTEMPT_OUTPUT = ("stdout", "stderr", "log")  # what a python attempt wrote, in its row's meta


# --- executions -----------------------------------------------------------------------------


def duration_s(started: datetime | None, finished: datetime | None, now: datetime | None = None) -> float | None:
    if started is None:
        return None
    end = finished or now
    if end is None:
        return None
    if (end.tzinfo is None) != (started.tzinfo is None):
        end, started = end.replace(tzinfo=None), started.replace(tzinfo=None)
    return max((end - started).total_seconds(), 0.0)


def list_executions(
    conn: Connection,
    *,
    status: str | None = None,
    playbook: str | None = None,
    parent: int | None = None,
    execution_id: int | None = None,
    before: int | None = None,
    limit: int = EXECUTION_PAGE_SIZE,
    path: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[dict[str, Any]]:
    """Newest first, with progress, duration and the parent/children links. `playbook` matches a
    part of the name (case-insensitive), `path` is the catalog path; `execution_id` finds one
    execution; `before` (an execution id, the last one of a page) gives the next, older page;
    `since` and `until` bound the start time (since <= created_at < until)."""
    c = EXECUTIONS.c
    query = select(
        c.execution_id,
        c.parent_execution_id,
        c.playbook_name,
        c.playbook_path,
        c.status,
        c.created_at,
        c.finished_at,
        c.failed_step,
        c.error,
    )
    if status:
        query = query.where(c.status == status)
    if playbook:
        query = query.where(func.lower(c.playbook_name).contains(playbook.lower(), autoescape=True))
    if parent is not None:
        query = query.where(c.parent_execution_id == parent)
    if path is not None:
        query = query.where(c.playbook_path == path)
    if since is not None:
        query = query.where(c.created_at >= _stored_time(conn, since))
    if until is not None:
        query = query.where(c.created_at < _stored_time(conn, until))
    if execution_id is not None:
        query = query.where(c.execution_id == execution_id)
    if before is not None:
        mark = conn.execute(select(c.created_at).where(c.execution_id == before)).scalar()
        if mark is not None:  # keyset paging on (created_at, execution_id), the list's order
            query = query.where(or_(c.created_at < mark, and_(c.created_at == mark, c.execution_id < before)))
    order = (c.created_at.desc(), c.execution_id.desc())
    rows = [dict(r) for r in conn.execute(query.order_by(*order).limit(limit)).mappings()]
    ids = [r["execution_id"] for r in rows]
    progress = progress_of(conn, ids)
    children: dict[Any, Any] = (
        dict(
            conn.execute(
                select(c.parent_execution_id, func.count())
                .where(c.parent_execution_id.in_(ids))
                .group_by(c.parent_execution_id)
            ).all()
        )
        if ids
        else {}
    )
    for row in rows:
        row["done"], row["total"] = progress.get(row["execution_id"], (0, 0))
        row["children"] = int(children.get(row["execution_id"], 0))
        row["duration_s"] = duration_s(row["created_at"], row["finished_at"], _now(row["created_at"]))
    return rows


def _stored_time(conn: Connection, moment: datetime) -> datetime:
    """`moment` as the store compares it: SQLite keeps naive UTC, a naive moment is UTC."""
    if conn.dialect.name == "sqlite":
        return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo is not None else moment
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _now(like: datetime | None) -> datetime:
    from noetl_celery.store.kernel import utcnow

    now = utcnow()
    return now if like is None or like.tzinfo is not None else now.replace(tzinfo=None)


def progress_of(conn: Connection, execution_ids: list[int]) -> dict[int, tuple[int, int]]:
    """execution id -> (units done, units known): step runs finished + loop iterations done,
    over step runs started + loop iterations known. Grows while the run discovers its work."""
    if not execution_ids:
        return {}
    e = EVENTS.c
    done: dict[int, int] = {i: 0 for i in execution_ids}
    total: dict[int, int] = {i: 0 for i in execution_ids}
    for execution_id, event_type, count in conn.execute(
        select(e.execution_id, e.event_type, func.count())
        .where(and_(e.execution_id.in_(execution_ids), e.event_type.in_(STEP_EVENTS)))
        .group_by(e.execution_id, e.event_type)
    ):
        if event_type == ev.STEP_STARTED:
            total[execution_id] += int(count)
        else:
            done[execution_id] += int(count)
    lp = LOOPS.c
    for execution_id, loop_done, loop_total in conn.execute(
        select(lp.execution_id, func.sum(lp.done), func.sum(lp.total))
        .where(lp.execution_id.in_(execution_ids))
        .group_by(lp.execution_id)
    ):
        done[execution_id] += int(loop_done or 0)
        total[execution_id] += int(loop_total or 0)
    return {i: (done[i], max(total[i], done[i])) for i in execution_ids}


# --- one execution --------------------------------------------------------------------------


def step_states(conn: Connection, execution_id: int) -> dict[str, dict[str, Any]]:
    """step -> {state, runs, completed, failed, skipped}; state: running/completed/failed/skipped."""
    e = EVENTS.c
    counts: dict[str, dict[str, int]] = {}
    for step, event_type, count in conn.execute(
        select(e.step, e.event_type, func.count())
        .where(and_(e.execution_id == execution_id, e.event_type.in_(STEP_EVENTS)))
        .group_by(e.step, e.event_type)
    ):
        counts.setdefault(step, {})[event_type.split(".")[1]] = int(count)
    states = {}
    for step, c in counts.items():
        started, completed = c.get("started", 0), c.get("completed", 0)
        failed, skipped = c.get("failed", 0), c.get("skipped", 0)
        if failed:
            state = "failed"
        elif started > completed + skipped:
            state = "running"
        elif completed:
            state = "completed"
        else:
            state = "skipped"
        states[step] = {"state": state, "runs": started, "completed": completed, "failed": failed, "skipped": skipped}
    return states


def loops(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    """Each loop instance: step, mode, done/total, succeeded, failed, in flight, status, rate.

    A cursor loop has no total while it runs (None: it pulls rows until the claim finds none),
    and its in-flight count is its slots. A loop of an execution that has ended (cancelled, or
    failed elsewhere) shows the execution's status and nothing in flight: nothing more is sent."""
    head = conn.execute(
        select(EXECUTIONS.c.status, EXECUTIONS.c.finished_at).where(EXECUTIONS.c.execution_id == execution_id)
    ).first()
    ended, finished_at = (head.status, head.finished_at) if head is not None else (None, None)
    lp = LOOPS.c
    rows = conn.execute(
        select(
            lp.run_id,
            lp.step,
            lp.mode,
            lp.total,
            lp.max_in_flight.label("cap"),  # the loops' output names it `cap`
            lp.done,
            lp.succeeded,
            lp.failed,
            lp.tolerated,
            lp.status,
            lp.created_at,
            lp.updated_at,
        )
        .where(lp.execution_id == execution_id)
        .order_by(lp.created_at)
    ).mappings()
    out = []
    for row in rows:
        item = dict(row)
        if item["status"] == "running" and ended not in (None, "running"):
            item["status"] = ended
        running = item["status"] == "running"
        if item["mode"] == "cursor":
            item["total"] = None if running else item["done"]
            item["in_flight"] = item["cap"] if running else 0
        else:
            item["in_flight"] = min(item["cap"], item["total"] - item["done"]) if running else 0
        # a loop's row is stamped when it completes, not at each iteration: a loop still counting
        # is measured to now, or to its execution's end
        last = item["updated_at"] if item["status"] == "completed" else finished_at
        elapsed = duration_s(item["created_at"], last, _now(item["created_at"]))
        item["rate"] = round(item["done"] / elapsed, 2) if elapsed else None  # iterations per second
        out.append(item)
    return out


def loop_count(loop: dict[str, Any]) -> str:
    """`done/total` of a loop; `N rows so far` for a running cursor loop, whose total is not known."""
    if loop["total"] is None:
        return f"{loop['done']} rows so far"
    return f"{loop['done']}/{loop['total']}"


def joins(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    j = JOINS.c
    rows = conn.execute(
        select(j.fork_id, j.join_step, j.width, j.settled, j.arrived).where(j.execution_id == execution_id)
    ).mappings()
    return [dict(r) for r in rows]


def event_counts(conn: Connection, execution_id: int) -> int:
    e = EVENTS.c
    return int(conn.execute(select(func.count()).where(e.execution_id == execution_id)).scalar() or 0)


def attempt_rows(conn: Connection, execution_id: int, first: int, count: int) -> list[dict[str, Any]]:
    """Attempts `first`.. (from 1, `count` of them) of an execution in the order they ended (the
    rows a worker timed, by id), each with `n` its number and what it wrote (ATTEMPT_OUTPUT)."""
    e = EVENTS.c
    rows = conn.execute(
        select(EVENTS)
        .where(and_(e.execution_id == execution_id, e.started_at.is_not(None)))
        .order_by(e.id)
        .offset(first - 1)
        .limit(count)
    ).mappings()
    return [{"n": first + i, **mask(dict(r))} for i, r in enumerate(rows)]


def attempts(conn: Connection, execution_id: int, limit: int = GANTT_ATTEMPTS) -> list[dict[str, Any]]:
    """The most recent attempts (oldest first), for the timeline: step, worker, start, duration.
    Attempt rows are the ones a worker timed (`started_at`); filtering on it rather than on the
    event types lets the database walk the (execution_id, id) index backwards and stop at `limit`."""
    e = EVENTS.c
    rows = conn.execute(
        select(
            e.id,
            e.event_type,
            e.status,
            e.step,
            e.task,
            e.attempt,
            e.iteration,
            e.page,
            e.worker,
            e.queue_id,
            e.started_at,
            e.duration_ms,
            e.created_at,
        )
        .where(and_(e.execution_id == execution_id, e.started_at.is_not(None)))
        .order_by(e.id.desc())
        .limit(limit)
    ).mappings()
    return [dict(r) for r in reversed(list(rows))]


def events_page(
    conn: Connection,
    execution_id: int,
    *,
    after: int | None = None,
    before: int | None = None,
    event_type: str | None = None,
    step: str | None = None,
    status: str | None = None,
    iteration: int | None = None,
    limit: int = EVENT_PAGE_SIZE,
) -> list[dict[str, Any]]:
    """One page of the event log in id order: after `after` (forward) or before `before` (back)."""
    e = EVENTS.c
    query = select(EVENTS).where(e.execution_id == execution_id)
    if event_type:
        query = query.where(e.event_type == event_type)
    if step:
        query = query.where(e.step == step)
    if status:
        query = query.where(e.status == status)
    if iteration is not None:
        query = query.where(e.iteration == iteration)
    if before is not None:
        rows = conn.execute(query.where(e.id < before).order_by(e.id.desc()).limit(limit)).mappings()
        return [mask(dict(r)) for r in reversed(list(rows))]
    if after is not None:
        query = query.where(e.id > after)
    return [mask(dict(r)) for r in conn.execute(query.order_by(e.id).limit(limit)).mappings()]


def events_numbered_page(
    conn: Connection,
    execution_id: int,
    page: int,
    page_size: int,
    *,
    after: int | None = None,
    event_type: str | None = None,
) -> list[dict[str, Any]]:
    """Page `page` (from 1) of the event log, newest first, `page_size` rows a page (NoETL's
    paging of an execution's events); only rows after event id `after`, of `event_type`."""
    e = EVENTS.c
    query = select(EVENTS).where(_numbered_filter(execution_id, after, event_type)).order_by(e.id.desc())
    rows = conn.execute(query.offset((page - 1) * page_size).limit(page_size)).mappings()
    return [mask(dict(r)) for r in rows]


def events_numbered_total(
    conn: Connection, execution_id: int, *, after: int | None = None, event_type: str | None = None
) -> int:
    """The rows events_numbered_page pages through."""
    if after is None and event_type is None:
        return event_counts(conn, execution_id)
    query = select(func.count()).select_from(EVENTS).where(_numbered_filter(execution_id, after, event_type))
    return int(conn.execute(query).scalar() or 0)


def _numbered_filter(execution_id: int, after: int | None, event_type: str | None) -> Any:
    e = EVENTS.c
    clauses = [e.execution_id == execution_id]
    if after is not None:
        clauses.append(e.id > after)
    if event_type is not None:
        clauses.append(e.event_type == event_type)
    return and_(*clauses)


def failure(conn: Connection, execution: dict[str, Any]) -> dict[str, Any] | None:
    """For a failed execution: the failed step, its error, the failing iteration, its input (the
    rendered arguments of that attempt, secrets masked), the loop element, what the attempt wrote
    (stdout, stderr, log records) and the step's last failed attempts."""
    if execution.get("status") != "failed":
        return None
    e = EVENTS.c
    step = execution.get("failed_step")
    failed = [
        mask(dict(r))
        for r in conn.execute(
            select(EVENTS)
            .where(
                and_(
                    e.execution_id == execution["execution_id"],
                    e.event_type.in_((ev.ACTION_FAILED, ev.ITERATION_FAILED)),
                    e.step == step,
                )
            )
            .order_by(e.id.desc())
            .limit(FAILED_ATTEMPTS_SHOWN)
        ).mappings()
    ]
    first = failed[0] if failed else None
    started = None
    if first is not None:
        started = conn.execute(
            select(e.context)
            .where(
                and_(
                    e.execution_id == execution["execution_id"],
                    e.run_id == first["run_id"],
                    e.event_type.in_(START_EVENTS),
                    e.iteration == first["iteration"] if first["iteration"] is not None else e.iteration.is_(None),
                )
            )
            .order_by(e.id)
            .limit(1)
        ).scalar()
    meta = (first or {}).get("meta") or {}
    started = mask(started) or {}
    return {
        "step": step,
        "error": mask(execution.get("error")),
        "iteration": first["iteration"] if first else None,
        "attempt": first["attempt"] if first else None,
        # the rendered arguments the worker recorded with the failed attempt; for an attempt that
        # never rendered them (a template error, a sub-playbook) what its start row holds
        "input": meta.get("input") if meta.get("input") is not None else (started or None),
        "element": started.get("element"),
        **{stream: meta.get(stream) for stream in ATTEMPT_OUTPUT},
        "attempts": failed,
    }


# --- masking --------------------------------------------------------------------------------


def _mask_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: (
                MASK
                if isinstance(k, str) and k.lower() in credentials.SECRET_KEYS - {"value"} and v not in (None, "")
                else _mask_keys(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_mask_keys(v) for v in value]
    return value


def mask(value: Any) -> Any:
    """A value fit to show: secret-named keys and every configured credential value (in any of its
    forms, see secret_registry) replaced by ***."""
    if value is None:
        return None
    return secret_registry.mask(_mask_keys(value))


def to_json(value: Any) -> str:
    return json.dumps(value, default=str, indent=2, sort_keys=True)
