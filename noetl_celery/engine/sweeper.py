"""The sweeper: notices what time alone reveals, so every execution moves again or ends.

Decides, on each sweep (one sweeper at a time per deployment: a PostgreSQL advisory lock held for
the sweep's transaction; on SQLite the write lock of that transaction serialises sweeps):
- an execution past its playbook `timeout` fails (kind `timeout`), with its children;
- an execution that never recorded its start (the start message was lost) gets its start again;
- a decision row past its deadline (engine/deadlines.py) whose dispatched attempts have no
  outcome row: each such attempt is published again from the stored dispatch list (flagged
  `replay`: a receiver that finds the outcome recorded does nothing) and an `attempt.republished`
  row records it; after MAX_REPUBLISHES the attempt gets the outcome `lost` (an ordinary failed
  attempt, retryable by policy). A decision whose attempts all have outcomes is cleared.
- a finished sub-playbook's end event (its outcome for the parent's task) whose outcome row the
  parent never recorded is sent again (an `attempt.republished` row in the parent each time, up to
  MAX_REPUBLISHES; the parent's on_event dedupes a late duplicate). A lost child start is covered
  by the missing-start check.
While the task queue still holds messages an overdue attempt may just be waiting in line, so
re-publishing waits until the queue has drained (the deadline moves on by one period).
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, and_, select, text, update

from noetl_celery.engine import deadlines
from noetl_celery.engine.lifecycle import end_tree
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.store import repo
from noetl_celery.store.db import transaction

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 5.0  # seconds between sweeps (NOETL_SWEEP_INTERVAL)
MAX_REPUBLISHES = 3  # times an overdue attempt is published again before it is `lost`
START_GRACE = 30.0  # seconds an execution may wait for its start to be recorded
BATCH = 2000  # decision rows examined per sweep
ADVISORY_LOCK_KEY = zlib.crc32(b"noetl_celery.sweeper")  # one sweeper per PostgreSQL database
REPUBLISHED = "attempt.republished"
RUN = "run"  # Dispatch.kind of a task attempt
EVENT = "event"  # Dispatch.kind of an event for on_event (a sub-playbook's start or end)


@dataclass
class SweepResult:
    republished: list[Dispatch] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)  # outcome events to decide
    starts: list[int] = field(default_factory=list)  # executions whose start is sent again
    timed_out: list[int] = field(default_factory=list)
    cleared: int = 0
    skipped: bool = False  # another sweeper holds the lock


def lost_outcome(message: dict[str, Any], kind: str, reason: str, worker: str) -> dict[str, Any]:
    """The on_event payload of an attempt that ended without reporting (lost, worker_lost, timeout)."""
    error = {"kind": kind, "message": reason, "retryable": True}
    return {
        "kind": "outcome",
        "execution_id": message["execution_id"],
        "task": message,
        "outcome": {"status": "error", "data": None, "error": error, "http": None, "pg": None, "meta": {}},
        "report": {"queue_id": None, "worker": worker, "started_at": None, "duration_ms": None},
    }


def _locked(conn: Connection) -> bool:
    if conn.dialect.name != "postgresql":
        return True
    return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": ADVISORY_LOCK_KEY}).scalar())


def sweep(
    url: str, *, queue_busy: bool = False, max_republishes: int = MAX_REPUBLISHES, interval: float = SWEEP_INTERVAL
) -> SweepResult:
    """One sweep; records its rows and returns what to publish and decide (after the commit)."""
    result = SweepResult()
    now = repo.utcnow()
    with transaction(url) as conn:
        if not _locked(conn):
            result.skipped = True
            return result
        _timeouts(conn, now, result)
        _missing_starts(conn, now, result)
        _overdue(conn, now, result, queue_busy=queue_busy, max_republishes=max_republishes, interval=interval)
    return result


def _timeouts(conn: Connection, now: Any, result: SweepResult) -> None:
    c = repo.EXECUTIONS.c
    rows = conn.execute(
        select(c.execution_id).where(and_(c.status == "running", c.deadline_at.is_not(None), c.deadline_at < now))
    ).all()
    for (execution_id,) in rows:
        error = {"kind": "timeout", "message": "the execution ran past its playbook timeout"}
        result.timed_out += end_tree(conn, int(execution_id), "failed", "execution.failed", error)


def _missing_starts(conn: Connection, now: Any, result: SweepResult) -> None:
    c, e = repo.EXECUTIONS.c, repo.EVENTS.c
    started = select(e.id).where(and_(e.execution_id == c.execution_id, e.event_id == "execution.started"))
    rows = conn.execute(
        select(c.execution_id).where(
            and_(c.status == "running", c.created_at < now - timedelta(seconds=START_GRACE), ~started.exists())
        )
    ).all()
    result.starts += [int(r[0]) for r in rows]


def _overdue(
    conn: Connection, now: Any, result: SweepResult, *, queue_busy: bool, max_republishes: int, interval: float
) -> None:
    e, x = repo.EVENTS.c, repo.EXECUTIONS.c
    rows = conn.execute(
        select(e.id, e.execution_id, e.meta, x.status)
        .join_from(repo.EVENTS, repo.EXECUTIONS, e.execution_id == x.execution_id)
        .where(and_(e.deadline_at.is_not(None), e.deadline_at < now))
        .order_by(e.deadline_at)
        .limit(BATCH)
    ).all()
    clear: list[int] = []
    postpone: dict[int, float] = {}
    for row_id, execution_id, meta, status in rows:
        stored = [Dispatch.from_dict(d) for d in ((meta or {}).get("dispatch") or [])]
        ends = [d for d in stored if d.kind == EVENT and d.message.get("kind") == "outcome"]
        if ends and _resend_ends(conn, ends, result, max_republishes=max_republishes):
            postpone[row_id] = interval  # the decision's own attempts are looked at next time
            continue
        # task attempts (an event dispatch has no attempt key of its own execution)
        dispatches = [d for d in stored if d.kind == RUN]
        if status != "running" or not dispatches:
            clear.append(row_id)
            continue
        keys = {d.attempt_key(): d for d in dispatches}
        done = _existing(conn, execution_id, [k + ".done" for k in keys])
        missing = {k: d for k, d in keys.items() if k + ".done" not in done}
        if not missing:
            clear.append(row_id)
            continue
        if queue_busy:
            postpone[row_id] = interval
            continue
        candidates = [f"{k}.republished.{n}" for k in missing for n in range(1, max_republishes + 1)]
        seen = _existing(conn, execution_id, candidates)
        wait = 0.0
        for key, dispatch in missing.items():
            count = sum(1 for n in range(1, max_republishes + 1) if f"{key}.republished.{n}" in seen)
            if count >= max_republishes:
                reason = (
                    f"no outcome after {count} re-publishes (each waited {deadlines.lease(0, dispatch.timeout):g} s)"
                )
                result.lost.append(lost_outcome(dispatch.message, "lost", reason, "sweeper"))
                wait = max(wait, interval)
                continue
            _record_republish(
                conn,
                execution_id,
                f"{key}.republished.{count + 1}",
                dispatch.message,
                {"count": count + 1, "limit": max_republishes},
            )
            result.republished.append(dispatch.as_replay())
            wait = max(wait, deadlines.lease(0, dispatch.timeout))
        postpone[row_id] = wait
    if clear:
        conn.execute(update(repo.EVENTS).where(e.id.in_(clear)).values(deadline_at=None))
        result.cleared = len(clear)
    for row_id, seconds in postpone.items():
        conn.execute(update(repo.EVENTS).where(e.id == row_id).values(deadline_at=now + timedelta(seconds=seconds)))


def _resend_ends(conn: Connection, ends: list[Dispatch], result: SweepResult, *, max_republishes: int) -> bool:
    """Send again each child end event whose outcome row the (running) parent lacks; True if any
    is still undelivered and may be sent again later."""
    waiting = False
    for dispatch in ends:
        parent_id = int(dispatch.message["execution_id"])
        head = repo.execution_head(conn, parent_id)
        if head is None or head["status"] != "running":
            continue
        key = TaskMessage.from_dict(dispatch.message["task"]).outcome_key()
        base = key.removesuffix(".done")
        candidates = [key] + [f"{base}.end.republished.{n}" for n in range(1, max_republishes + 1)]
        seen = _existing(conn, parent_id, candidates)
        if key in seen:
            continue
        count = len(seen)
        if count >= max_republishes:
            log.error(
                "the end of a sub-playbook for execution %s was sent %d times and never recorded", parent_id, count
            )
            continue
        meta = {"count": count + 1, "limit": max_republishes, "child_end": True}
        _record_republish(conn, parent_id, f"{base}.end.republished.{count + 1}", dispatch.message["task"], meta)
        result.republished.append(dispatch)
        waiting = True
    return waiting


def _record_republish(
    conn: Connection, execution_id: int, event_id: str, message: dict[str, Any], meta: dict[str, Any]
) -> None:
    """The `attempt.republished` row of one re-sent message (`message`: the attempt's task message)."""
    row = {
        "execution_id": execution_id,
        "event_id": event_id,
        "event_type": REPUBLISHED,
        "status": "republished",
        "meta": meta,
        **{k: message.get(k) for k in ("step", "run_id", "attempt", "iteration", "page", "parent_event_id")},
    }
    repo.insert_events(conn, [row])


def _existing(conn: Connection, execution_id: int, keys: list[str]) -> set[str]:
    if not keys:
        return set()
    e = repo.EVENTS.c
    found: set[str] = set()
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        found |= {
            r[0]
            for r in conn.execute(select(e.event_id).where(and_(e.execution_id == execution_id, e.event_id.in_(chunk))))
        }
    return found


class SweeperThread(threading.Thread):
    """Runs `tick` every `interval` seconds until stopped; a failing tick is logged and retried."""

    def __init__(self, tick: Callable[[], Any], interval: float = SWEEP_INTERVAL):
        super().__init__(name="noetl-sweeper", daemon=True)
        self.tick = tick
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # the broker or the store is down: the next tick tries again
                log.warning("sweep failed, retried in %.0f s: %s", self.interval, exc)

    def stop(self) -> None:
        self.stopped.set()
