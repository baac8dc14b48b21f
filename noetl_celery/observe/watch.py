"""Following an execution from the command line: live progress, `events --follow`, and the
extra facts `status` and `executions` show (loops, the failure, durations).

What it decides: on a terminal, progress is one redrawn block (steps done, a bar per running loop
with done/total and rate) with retries and step ends scrolling above it; otherwise plain lines,
one per step end, retry and loop tenth. It only reads the event store.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

from sqlalchemy import and_, func, select

from noetl_celery.config import secret_registry
from noetl_celery.core import vocabulary as ev
from noetl_celery.store import views
from noetl_celery.store.db import transaction
from noetl_celery.store.status import not_found

TTY_REFRESH = 0.25  # seconds between redraws on a terminal
PLAIN_REFRESH = 1.0  # seconds between reads when writing plain lines
FOLLOW_INTERVAL = 0.5  # seconds between reads of `events --follow`
BAR_WIDTH = 30  # characters of a loop's progress bar
LOOP_STEP_PERCENT = 10  # plain output: a line each time a loop passes another 10 %
NOTICED = (
    ev.STEP_COMPLETED,
    ev.STEP_FAILED,
    ev.STEP_SKIPPED,
    ev.RETRY_SCHEDULED,
    ev.RETRY_EXHAUSTED,
    ev.ITERATOR_STARTED,
    ev.ITERATOR_COMPLETED,
    ev.EXECUTION_COMPLETED,
    ev.EXECUTION_FAILED,
)
NEW_EVENTS_LIMIT = 500  # rows read per poll


def new_events(
    conn: Any, execution_id: int, after: int, types: tuple[str, ...] | None = None, limit: int = NEW_EVENTS_LIMIT
) -> list[dict[str, Any]]:
    e = views.EVENTS.c
    query = select(views.EVENTS).where(and_(e.execution_id == execution_id, e.id > after))
    if types:
        query = query.where(e.event_type.in_(types))
    return [views.mask(dict(r)) for r in conn.execute(query.order_by(e.id).limit(limit)).mappings()]


def describe_event(row: dict[str, Any]) -> str:
    """One human line for a noticed event."""
    kind, step = row["event_type"], row.get("step") or ""
    meta = row.get("meta") or {}
    if kind == ev.RETRY_SCHEDULED:
        where = f" iteration {row['iteration']}" if row.get("iteration") is not None else ""
        return (
            f"retry     {step}{where}: attempt {row.get('attempt')} in {meta.get('delay', 0)} s "
            f"after: {str(meta.get('reason') or '')[:200]}"
        )
    if kind == ev.RETRY_EXHAUSTED:
        return f"gave up   {step}: {meta.get('limit')} {meta.get('kind', 'attempts')} used"
    if kind == ev.ITERATOR_STARTED and meta.get("mode") == "cursor":
        return f"loop      {step}: cursor, {meta.get('slots')} slots pulling rows"
    if kind == ev.ITERATOR_STARTED:
        return f"loop      {step}: {meta.get('total')} iterations, {meta.get('cap')} at a time"
    if kind == ev.ITERATOR_COMPLETED and "processed" in meta:  # a cursor loop: rows, not a known total
        ok = (meta.get("processed") or 0) - (meta.get("failed") or 0)
        return f"loop      {step}: done, {meta.get('processed')} rows, {ok} ok, {meta.get('failed')} failed"
    if kind == ev.ITERATOR_COMPLETED:
        return f"loop      {step}: done, {meta.get('success')} ok, {meta.get('failed')} failed"
    if kind == ev.STEP_FAILED:
        return f"failed    {step}: {_message(row.get('error'))}"
    if kind.startswith("execution."):
        return f"{kind.split('.')[1]:9} execution" + (f": {_message(row.get('error'))}" if row.get("error") else "")
    return f"{kind.split('.')[1]:9} {step}"


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = int(width * done / total) if total else width
    return "#" * filled + "." * (width - filled)


class Progress:
    """Polled by the waiting loop (`poll()`), cheap between refreshes; `close()` at the end."""

    def __init__(self, database_url: str, out: TextIO | None = None, *, tty: bool | None = None):
        self.url = database_url
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.interval = TTY_REFRESH if self.tty else PLAIN_REFRESH
        self.last_read = 0.0
        self.last_id = 0
        self.drawn = 0  # lines of the block drawn last (terminal)
        self.loop_marks: dict[str, int] = {}

    def skip_history(self, execution_id: int) -> None:
        """Print only what happens from now on (a resumed execution's earlier rows are not news)."""
        e = views.EVENTS.c
        with transaction(self.url) as conn:
            last = conn.execute(select(func.max(e.id)).where(e.execution_id == execution_id)).scalar()
        self.last_id = int(last or 0)

    def _write(self, text: str) -> None:
        self.out.write(secret_registry.mask_text(text))  # nothing printed shows a configured secret

    def poll(self, execution_id: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_read < self.interval:
            return
        self.last_read = now
        noticed: list[dict[str, Any]] = []
        with transaction(self.url) as conn:
            while True:  # only the rows it prints, and all of them: a batched loop writes thousands a second
                rows = new_events(conn, execution_id, self.last_id, NOTICED)
                if rows:
                    self.last_id = rows[-1]["id"]
                noticed += rows
                if len(rows) < NEW_EVENTS_LIMIT:
                    break
            loops = views.loops(conn, execution_id)
            done, total = views.progress_of(conn, [execution_id])[execution_id]
            steps = views.step_states(conn, execution_id)
        lines = [describe_event(r) for r in noticed]
        if self.tty:
            self._redraw(lines, loops, steps, done, total)
        else:
            self._plain(lines, loops)

    def _redraw(
        self, lines: list[str], loops: list[dict[str, Any]], steps: dict[str, Any], done: int, total: int
    ) -> None:
        if self.drawn:
            self._write(f"\x1b[{self.drawn}F\x1b[J")  # up to the block's start, clear below
        for line in lines:
            self._write(line + "\n")
        finished = sum(1 for s in steps.values() if s["state"] in ("completed", "failed", "skipped"))
        block = [f"steps {finished}/{len(steps)} done, {done}/{total} units"]
        for loop in loops:
            if loop["status"] == "running":
                rate = f"{loop['rate']:.1f}/s" if loop["rate"] else ""
                shown = f"[{bar(loop['done'], loop['total'])}] " if loop["total"] is not None else ""
                block.append(
                    f"  {loop['step'][:20]:20} {shown}{views.loop_count(loop)} {rate} ({loop['in_flight']} in flight)"
                )
        self._write("\n".join(block) + "\n")
        self.out.flush()
        self.drawn = len(block)

    def _plain(self, lines: list[str], loops: list[dict[str, Any]]) -> None:
        for line in lines:
            self._write(line + "\n")
        for loop in loops:
            if loop["status"] != "running" or not loop["total"]:
                continue
            mark = loop["done"] * 100 // loop["total"] // LOOP_STEP_PERCENT
            if mark > self.loop_marks.get(loop["run_id"], 0):
                self.loop_marks[loop["run_id"]] = mark
                rate = f" {loop['rate']:.1f}/s" if loop["rate"] else ""
                self._write(f"loop      {loop['step']}: {loop['done']}/{loop['total']}{rate}\n")
        self.out.flush()

    def close(self, execution_id: int) -> None:
        self.poll(execution_id, force=True)


def follow_events(
    database_url: str, execution_id: int, *, interval: float = FOLLOW_INTERVAL, timeout: float | None = None
) -> Iterator[dict[str, Any]]:
    """Every event row of the execution in order, then new ones as they are written, until the
    execution has finished and its last rows are read (or `timeout` seconds pass)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = 0
    while True:
        with transaction(database_url) as conn:
            head = conn.execute(
                select(views.EXECUTIONS.c.status).where(views.EXECUTIONS.c.execution_id == execution_id)
            ).scalar()
            rows = new_events(conn, execution_id, last)
        for row in rows:
            last = row["id"]
            yield row
        if len(rows) == NEW_EVENTS_LIMIT:
            continue
        if head != "running" or (deadline is not None and time.monotonic() > deadline):
            return
        time.sleep(interval)


STREAM_BATCH = 500  # event rows fetched at a time by `events` (a server-side cursor on PostgreSQL)


def stream_events(
    database_url: str,
    execution_id: int,
    *,
    types: tuple[str, ...] = (),
    steps: tuple[str, ...] = (),
    after_id: int | None = None,
    since: datetime | None = None,
    limit: int | None = None,
    batch: int = STREAM_BATCH,
) -> Iterator[dict[str, Any]]:
    """The execution's event rows in id order, read `batch` rows at a time (PostgreSQL: a
    server-side cursor) and yielded as they come, so that a log of any size is written in bounded
    memory. Filters: event types, steps, rows after id `after_id`, rows created at or after
    `since`; at most `limit` rows. Raises ExecutionNotFound for an unknown execution."""
    from noetl_celery.store.db import ensure_schema
    from noetl_celery.store.executions import execution_head

    ensure_schema(database_url)
    e = views.EVENTS.c
    query = select(views.EVENTS).where(e.execution_id == execution_id)
    if types:
        query = query.where(e.event_type.in_(types))
    if steps:
        query = query.where(e.step.in_(steps))
    if after_id is not None:
        query = query.where(e.id > after_id)
    query = query.order_by(e.id)
    if limit is not None:
        query = query.limit(limit)
    with transaction(database_url) as conn:
        if execution_head(conn, execution_id) is None:
            raise not_found(database_url, execution_id)
        if since is not None:
            if conn.dialect.name == "sqlite" and since.tzinfo is not None:  # SQLite keeps naive UTC
                since = since.astimezone(UTC).replace(tzinfo=None)
            query = query.where(e.created_at >= since)
        result = conn.execution_options(stream_results=True, yield_per=batch).execute(query)
        for row in result.mappings():
            yield dict(row)


def status_extras(database_url: str, execution_id: int) -> dict[str, Any]:
    """What `status` adds: the execution's parameters (its workload after --set, masked), the
    loops (done/total, in flight) and, for a failure, the failing step, iteration, error, the
    attempt's rendered input and what it wrote (stdout, stderr, log records)."""
    with transaction(database_url) as conn:
        execution = views.EXECUTIONS.c
        row = conn.execute(select(views.EXECUTIONS).where(execution.execution_id == execution_id)).mappings().first()
        loops = views.loops(conn, execution_id)
        failure = views.failure(conn, dict(row)) if row else None
        done, total = views.progress_of(conn, [execution_id])[execution_id]
    keep = ("step", "mode", "status", "done", "total", "succeeded", "failed", "in_flight", "rate")
    if failure:
        failure = {k: v for k, v in failure.items() if k != "attempts"} | {
            "attempt_error": (failure["attempts"][0].get("error") if failure["attempts"] else None),
            "queue_id": (failure["attempts"][0].get("queue_id") if failure["attempts"] else None),
        }
    return {
        "workload": views.mask(row["workload"]) if row else None,
        "loops": [{k: loop[k] for k in keep} for loop in loops],
        "failure": failure,
        "progress": {"done": done, "total": total},
    }


def executions(database_url: str, *, status: str | None, playbook: str | None, limit: int) -> list[dict[str, Any]]:
    with transaction(database_url) as conn:
        rows = views.list_executions(conn, status=status, playbook=playbook, limit=limit)
    return [_listed(r) for r in rows]


def tree_progress(database_url: str, row: dict[str, Any]) -> dict[str, Any]:
    """A row of runner.execution_tree in the shape of `executions` (with duration and progress)."""
    with transaction(database_url) as conn:
        done, total = views.progress_of(conn, [row["execution_id"]])[row["execution_id"]]
    return _listed(
        {
            **row,
            "done": done,
            "total": total,
            "duration_s": views.duration_s(row["created_at"], row["finished_at"], views._now(row["created_at"])),
        }
    )


def _listed(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "execution_id": r["execution_id"],
        "playbook": r["playbook_name"],
        "status": r["status"],
        "created_at": r["created_at"].isoformat() if r["created_at"] else None,
        "finished_at": r["finished_at"].isoformat() if r["finished_at"] else None,
        "duration_s": None if r["duration_s"] is None else round(r["duration_s"], 3),
        "failed_step": r["failed_step"],
        "parent_execution_id": r.get("parent_execution_id"),
        "done": r["done"],
        "total": r["total"],
    }
