"""The sweeper: notices what time alone reveals, so every execution moves again or ends.

Decides, on each sweep (one sweeper at a time per deployment: a PostgreSQL advisory lock held for
each of the sweep's transactions; on SQLite the write lock of that transaction serialises sweeps):
- an execution past its playbook `timeout` fails (kind `timeout`), with its children;
- an execution that never recorded its start (the start message was lost) gets its start again
  (each sweep reads those that came past the grace since the previous one; every running
  execution once per START_FULL_CHECK);
- a decision row whose lease (store/leases.py: a noetl_lease row written with it) is past its
  deadline (engine/deadlines.py) and whose dispatched attempts have no outcome row: each such
  attempt is published again from the stored dispatch list (flagged `replay`: a receiver that
  finds the outcome recorded does nothing) and an `attempt.republished` row records it; after
  MAX_REPUBLISHES the attempt gets the outcome `lost` (an ordinary failed attempt, retryable by
  policy). A lease whose attempts all have outcomes is deleted; the event row is never updated.
- a finished sub-playbook's end event (its outcome for the parent's task) whose outcome row the
  parent never recorded is sent again (an `attempt.republished` row in the parent each time, up to
  MAX_REPUBLISHES; the parent's on_event dedupes a late duplicate). A lost child start is covered
  by the missing-start check.
Re-published attempts travel on the event queue, so a backlog in the task queue does not delay
them. A lease counts only the time its attempt is in a worker's hands: a worker that takes a
message after it waited in the queue moves the lease on to run from then (app._late,
leases.taken). So an overdue lease whose decision was recorded after the oldest message the
queues still hold was sent (`waiting_since`, read from the broker: Redis' queues are first in,
first out) may be waiting in line: it is postponed, never re-published. One recorded before it
was taken off the queue by a worker, which would have moved it on: its attempt is overdue in a
worker's hands (a worker killed, a publish lost) and is re-published. Where the broker cannot
tell how long its oldest message waited (RabbitMQ) and the queues hold messages, an overdue
attempt is re-published once (a worker that takes the original late finds its outcome recorded
and skips it), and its later re-publishes and the `lost` verdict wait until the queues drain.

A sweep is short transactions, never one long one: the executions' checks, then the overdue
leases in batches of BATCH (while they come full, for at most the sweep interval), each batch its
own transaction (a fixed number of set-based statements whatever the batch holds) and its
messages published after its commit. On PostgreSQL
each transaction is bounded by the server (`SET LOCAL` statement_timeout, lock_timeout and
idle_in_transaction_session_timeout, NOETL_SWEEP_TIMEOUT): a sweeper frozen inside a sweep (a
paused VM or container, a stopped process, a network partition) has its session ended by
PostgreSQL, which releases the lock, instead of stopping every other sweep until TCP keepalive
notices. The lock is a transaction-level advisory lock, so it never outlives a transaction (and
works behind a transaction-pooling PgBouncer).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, text

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.vocabulary import DispatchKind, ErrorKind, PayloadKind
from noetl_celery.engine import deadlines
from noetl_celery.engine.messages import Dispatch, OutcomeEvent, TaskMessage
from noetl_celery.engine.recovery.lifecycle import end_tree
from noetl_celery.store import leases, repo
from noetl_celery.store.db import transaction

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 5.0  # seconds between sweeps (NOETL_SWEEP_INTERVAL)
MAX_REPUBLISHES = 3  # times an overdue attempt is published again before it is `lost`
START_GRACE = 30.0  # seconds an execution may wait for its start to be recorded
START_FULL_CHECK = 300.0  # seconds between two checks of every running execution for a lost start
START_WINDOW_MARGIN = 5.0  # seconds the lost-start check's window reaches back past the previous check
# seconds between a decision's row (its created_at) and the publish of its messages, at most, for
# the sweeper's reading of how long the broker's oldest waiting message has waited
IN_LINE_SLACK = 1.0
BATCH = 500  # overdue decision rows examined per transaction
# a sweep goes on with batches while they come full, for at most its interval (at least
# SWEEP_BUDGET_MIN seconds): a backlog is worked off at the store's pace, not a fixed share per sweep
SWEEP_BUDGET_MIN = 1.0
SWEEP_TIMEOUT = 10.0  # seconds: bounds each sweep transaction on PostgreSQL (NOETL_SWEEP_TIMEOUT)
LOCK_WARN_AFTER = 30.0  # seconds without taking the sweep lock before a sweeper warns
ADVISORY_LOCK_KEY = zlib.crc32(b"noetl_celery.sweeper")  # one sweeper per PostgreSQL database
REPUBLISHED = ev.ATTEMPT_REPUBLISHED
RUN = DispatchKind.RUN  # Dispatch.kind of a task attempt
EVENT = DispatchKind.EVENT  # Dispatch.kind of an event for on_event (a sub-playbook's start or end)


@dataclass
class SweepResult:
    republished: list[Dispatch] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)  # outcome events to decide
    starts: list[int] = field(default_factory=list)  # executions whose start is sent again
    timed_out: list[int] = field(default_factory=list)
    cleared: int = 0
    skipped: bool = False  # another sweeper holds the lock
    rows: int = 0  # overdue decision rows examined
    transactions: int = 0  # transactions that held the lock

    def add(self, other: SweepResult) -> None:
        self.republished += other.republished
        self.lost += other.lost
        self.starts += other.starts
        self.timed_out += other.timed_out
        self.cleared += other.cleared
        self.rows += other.rows
        self.transactions += other.transactions


def lost_outcome(message: dict[str, Any], kind: str, reason: str, worker: str) -> dict[str, Any]:
    """The on_event payload of an attempt that ended without reporting (lost, worker_lost, timeout)."""
    error = {"kind": kind, "message": reason, "retryable": True}
    return OutcomeEvent(
        message["execution_id"],
        message,
        {"status": "error", "data": None, "error": error, "http": None, "pg": None, "meta": {}},
        {"queue_id": None, "worker": worker, "started_at": None, "duration_ms": None},
    ).to_dict()


@contextmanager
def sweep_transaction(url: str, timeout: float = SWEEP_TIMEOUT) -> Iterator[Connection | None]:
    """One transaction of a sweep, holding the sweep lock; None when another sweeper holds it.

    On PostgreSQL the lock is `pg_try_advisory_xact_lock` (released with the transaction) and the
    transaction is bounded by the server, in the same statement: no statement runs longer than
    `timeout` (statement_timeout), waits longer for a row lock (lock_timeout), and the session
    idle inside the transaction longer is ended by PostgreSQL (idle_in_transaction_session_timeout),
    which rolls back and releases the lock. A frozen sweeper then blocks the others for `timeout`
    at most. The sweep's statements read a few index entries each (what is due); where the
    planner's statistics lag behind a burst of new rows (a fresh store, autoanalyze not yet past)
    it took tables for small and read them whole (a hash join over every event row), and their
    estimated cost passed `jit_above_cost`, so that PostgreSQL compiled each of them, every
    sweep: about 500 ms of CPU a sweep at 10,000 running executions. So the transaction runs
    with JIT off and sequential scans discouraged (`enable_seqscan` off: a table without a
    usable index is still read, at its price). On SQLite the transaction's write lock serialises sweeps."""
    with transaction(url) as conn:
        if conn.dialect.name != "postgresql":
            yield conn
            return
        limit = f"{max(int(timeout * 1000), 1)}ms"
        locked = conn.execute(
            text(
                "SELECT set_config('statement_timeout', :t, true), set_config('lock_timeout', :t, true),"
                " set_config('idle_in_transaction_session_timeout', :t, true), set_config('jit', 'off', true),"
                " set_config('enable_seqscan', 'off', true), pg_try_advisory_xact_lock(:k)"
            ),
            {"t": limit, "k": ADVISORY_LOCK_KEY},
        ).one()[5]
        yield conn if locked else None


class _LockWatch:
    """How long this process's sweeper has not been able to take the sweep lock: a skipped sweep
    is normal (another sweeper is at work) and logged at debug; skipping for longer than
    LOCK_WARN_AFTER is not (a sweeper holds the lock too long, or is frozen holding it) and is
    logged at warning, naming the holder's session, once per LOCK_WARN_AFTER."""

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic time of the first skip in a row
        self.warned: float | None = None
        self.lock = threading.Lock()

    def skipped(self, url: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.since = self.since if self.since is not None else now
            waited = now - self.since
            due = waited > LOCK_WARN_AFTER and (self.warned is None or now - self.warned > LOCK_WARN_AFTER)
            if due:
                self.warned = now
        if not due:
            log.debug("sweep skipped: another sweeper holds the lock (for %.0f s in a row)", waited)
            return
        log.warning(
            "sweeper: could not take the sweep lock for %.0f s; held by %s. PostgreSQL ends a sweep"
            " transaction idle longer than NOETL_SWEEP_TIMEOUT",
            waited,
            _holder(url),
        )

    def taken(self) -> None:
        with self.lock:
            since, self.since, self.warned = self.since, None, None
        if since is not None and time.monotonic() - since > LOCK_WARN_AFTER:
            log.warning("sweeper: took the sweep lock again after %.0f s", time.monotonic() - since)


_watch = _LockWatch()


def _holder(url: str) -> str:
    """The session holding the sweep lock of this database (the lock is per database: other
    databases of the server have their own), as pg_stat_activity tells it (for a warning)."""
    try:
        with transaction(url) as conn:
            row = conn.execute(
                text(
                    "SELECT a.pid, a.state, a.client_addr, a.application_name,"
                    " extract(epoch FROM now() - a.xact_start), extract(epoch FROM now() - a.state_change)"
                    " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                    " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0"
                    " AND l.objid::bigint = :k AND l.objsubid = 1"
                    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
                {"k": ADVISORY_LOCK_KEY},
            ).first()
    except Exception as exc:  # a warning must not fail the sweep
        return f"(unknown: {type(exc).__name__})"
    if row is None:
        return "(nobody now)"
    pid, state, addr, app, xact, idle = row
    return (
        f"backend pid {pid} ({state}, client {addr or 'local'}{f', {app}' if app else ''},"
        f" transaction open {float(xact or 0):.0f} s, in this state {float(idle or 0):.0f} s)"
    )


def sweep(
    url: str,
    *,
    queue_busy: bool = False,
    waiting_since: float | None = None,
    max_republishes: int = MAX_REPUBLISHES,
    interval: float = SWEEP_INTERVAL,
    timeout: float = SWEEP_TIMEOUT,
    committed: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """One sweep: short transactions, each recording its rows; `committed` is called with what
    each one decided (to publish and decide) right after its commit. Returns the whole.
    `queue_busy`: the broker's queues hold messages; `waiting_since`: the publish time (epoch
    seconds) of the oldest of them, when the broker can tell it."""
    result = SweepResult()
    now = repo.utcnow()
    part = SweepResult(transactions=1)
    with sweep_transaction(url, timeout) as conn:
        if conn is None:
            result.skipped = True
            _watch.skipped(url)
            return result
        _timeouts(conn, now, part)
        _missing_starts(conn, now, part, url)
    _watch.taken()
    result.add(part)
    if committed is not None:
        committed(part)
    began = time.monotonic()
    while True:
        part = SweepResult(transactions=1)
        with sweep_transaction(url, timeout) as conn:
            if conn is None:  # another sweeper took over between two batches
                break
            _overdue(
                conn,
                now,
                part,
                queue_busy=queue_busy,
                waiting_since=waiting_since if queue_busy else None,
                max_republishes=max_republishes,
                interval=interval,
            )
        result.add(part)
        if committed is not None:
            committed(part)
        if part.rows < BATCH or time.monotonic() - began > max(interval, SWEEP_BUDGET_MIN):
            break
    return result


def _timeouts(conn: Connection, now: Any, result: SweepResult) -> None:
    for execution_id in leases.timed_out(conn, now):
        error = {"kind": ErrorKind.TIMEOUT, "message": "the execution ran past its playbook timeout"}
        result.timed_out += end_tree(conn, execution_id, "failed", ev.EXECUTION_FAILED, error)


class _StartWindow:
    """Which executions a sweep checks for a lost start: those that came past START_GRACE since
    this process's previous check (created at or after that check's time less the grace and a
    margin: a range of the `(status, created_at)` index, what is new, not every running
    execution), and every running one at the first check and once per START_FULL_CHECK (a start
    sent again and lost again, a gap in this process's sweeps while another process swept)."""

    def __init__(self) -> None:
        self.checked_at: datetime | None = None  # the store's time of this process's previous check
        self.full_at: float | None = None  # monotonic time of the previous full check
        self.lock = threading.Lock()

    def since(self, now: datetime) -> datetime | None:
        with self.lock:
            previous, full = self.checked_at, self.full_at
            if previous is None or full is None or time.monotonic() - full > START_FULL_CHECK:
                self.full_at = time.monotonic()
                previous = None
            self.checked_at = now
        if previous is None:
            return None
        return previous - timedelta(seconds=START_GRACE + START_WINDOW_MARGIN)


_starts: dict[str, _StartWindow] = {}  # per store URL


def _missing_starts(conn: Connection, now: Any, result: SweepResult, url: str) -> None:
    window = _starts.setdefault(url, _StartWindow())
    result.starts += leases.missing_starts(conn, now, START_GRACE, window.since(now))


def _overdue(
    conn: Connection,
    now: datetime,
    result: SweepResult,
    *,
    queue_busy: bool,
    waiting_since: float | None = None,
    max_republishes: int,
    interval: float,
) -> None:
    """One batch of overdue leases (store/leases.py), in a fixed number of statements: the leases
    (with their decision rows' dispatch lists and executions' status), the existing rows among
    every key they could need (outcomes and earlier re-publishes), the parents' status for
    sub-playbook ends, one insert of the re-publish rows (per 500), one delete of the settled
    leases and one update per distinct postponement. No event row is updated."""
    batch = leases.overdue(conn, now, BATCH)  # the settled ones are deleted by the same statement
    rows = batch.pending
    result.rows = len(rows) + batch.settled
    result.cleared = batch.settled
    if not rows:
        return
    counts = range(1, max_republishes + 1)
    decisions: list[tuple[tuple[int, str], int, list[Dispatch], list[tuple[int, str, str, Dispatch]]]] = []
    postpone_in_line: dict[float, list[tuple[int, str]]] = {}
    wanted: set[tuple[int, str]] = set()
    parents: set[int] = set()
    behind = _behind(waiting_since)
    for execution_id, event_id, dispatch_list, status, decided_at in rows:
        ahead = behind(decided_at)
        if ahead is not None:  # its messages may still wait in the queue: not overdue yet
            wait = _wait_in_line(ahead, dispatch_list, interval)
            postpone_in_line.setdefault(wait, []).append((execution_id, event_id))
            continue
        stored = [Dispatch.from_dict(d) for d in dispatch_list]
        ends = []
        for d in stored:
            if d.kind == EVENT and d.message.get("kind") == PayloadKind.OUTCOME:
                parent_id = int(d.message["execution_id"])
                key = TaskMessage.from_dict(d.message["task"]).outcome_key()
                base = key.removesuffix(".done")
                ends.append((parent_id, key, base, d))
                parents.add(parent_id)
                wanted.add((parent_id, key))
                wanted.update((parent_id, f"{base}.end.republished.{n}") for n in counts)
        runs = [d for d in stored if d.kind == RUN] if status == "running" else []
        for d in runs:
            key = d.attempt_key()
            wanted.add((execution_id, key + ".done"))
            wanted.update((execution_id, f"{key}.republished.{n}") for n in counts)
        decisions.append(((execution_id, event_id), execution_id, runs, ends))
    seen = leases.existing_keys(conn, wanted)
    running = leases.running(conn, parents)
    clear: list[tuple[int, str]] = []
    postpone: dict[float, list[tuple[int, str]]] = postpone_in_line
    records: list[dict[str, Any]] = []
    for lease, execution_id, runs, ends in decisions:
        if ends and _resend_ends(ends, seen, running, result, records, max_republishes=max_republishes):
            postpone.setdefault(interval, []).append(lease)  # its own attempts are looked at next time
            continue
        missing = {d.attempt_key(): d for d in runs if (execution_id, d.attempt_key() + ".done") not in seen}
        if not missing:
            clear.append(lease)
            continue
        wait = 0.0
        for key, dispatch in missing.items():
            count = sum(1 for n in counts if (execution_id, f"{key}.republished.{n}") in seen)
            if count and queue_busy:  # re-published once already: the rest waits for the queues to drain
                wait = max(wait, interval)
                continue
            if count >= max_republishes:
                reason = (
                    f"no outcome after {count} re-publishes (each waited {deadlines.lease(0, dispatch.timeout):g} s)"
                )
                result.lost.append(lost_outcome(dispatch.message, ErrorKind.LOST, reason, "sweeper"))
                wait = max(wait, interval)
                continue
            meta = {"count": count + 1, "limit": max_republishes}
            records.append(_republish_row(execution_id, f"{key}.republished.{count + 1}", dispatch.message, meta))
            result.republished.append(dispatch.as_replay())
            wait = max(wait, deadlines.lease(0, dispatch.timeout))
        postpone.setdefault(wait, []).append(lease)
    if records:
        repo.insert_events(conn, records)
    result.cleared += leases.settle(conn, clear)
    for seconds, keys in postpone.items():
        leases.postpone(conn, keys, now + timedelta(seconds=seconds))


def _wait_in_line(ahead: float, dispatch_list: list[dict[str, Any]], interval: float) -> float:
    """How long a lease whose messages may still wait in the queue is left alone: about as long as
    the queue needs to reach them (`ahead`: the seconds of publishing between the oldest waiting
    message and its decision; the queue moves on by about that much in as many seconds, at least
    one sweep interval and at most a lease of its messages). Each sweep then reads mostly what
    newly came due, not every message still waiting; a worker that takes one of them late moves
    the lease on to a lease from then anyway (store/leases.py `taken`, never backwards)."""
    timeouts = [float(d.get("timeout", deadlines.DEFAULT_TIMEOUT)) for d in dispatch_list if isinstance(d, dict)]
    longest = deadlines.lease(0, max(timeouts)) if timeouts else interval
    return float(round(max(interval, min(longest, ahead))))


def _behind(waiting_since: float | None) -> Callable[[datetime | None], float | None]:
    """For a decision recorded at a given time: None when its messages have all left the queues
    (a worker took them), else how many seconds of publishing lie between the oldest message still
    waiting (published at `waiting_since`) and it. Queues are first in, first out: what was sent
    before the oldest message still there has been taken by a worker. IN_LINE_SLACK absorbs the
    gap between a decision's row and its publish (milliseconds, after the commit). No
    `waiting_since` (the queues are empty, or the broker cannot tell): nothing is in line."""
    if waiting_since is None:
        return lambda _decided_at: None
    since = waiting_since - IN_LINE_SLACK

    def behind(decided_at: datetime | None) -> float | None:
        if decided_at is None or _epoch(decided_at) < since:
            return None
        return max(_epoch(decided_at) - waiting_since, 0.0)

    return behind


def _epoch(moment: datetime) -> float:
    if moment.tzinfo is None:  # SQLite gives back naive UTC datetimes
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _resend_ends(
    ends: list[tuple[int, str, str, Dispatch]],
    seen: set[tuple[int, str]],
    running: set[int],
    result: SweepResult,
    records: list[dict[str, Any]],
    *,
    max_republishes: int,
) -> bool:
    """Send again each child end event whose outcome row the (running) parent lacks; True if any
    is still undelivered and may be sent again later."""
    waiting = False
    for parent_id, key, base, dispatch in ends:
        if parent_id not in running or (parent_id, key) in seen:
            continue
        count = sum(1 for n in range(1, max_republishes + 1) if (parent_id, f"{base}.end.republished.{n}") in seen)
        if count >= max_republishes:
            log.error(
                "the end of a sub-playbook for execution %s was sent %d times and never recorded", parent_id, count
            )
            continue
        meta = {"count": count + 1, "limit": max_republishes, "child_end": True}
        records.append(_republish_row(parent_id, f"{base}.end.republished.{count + 1}", dispatch.message["task"], meta))
        result.republished.append(dispatch)
        waiting = True
    return waiting


def _republish_row(execution_id: int, event_id: str, message: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The `attempt.republished` row of one re-sent message (`message`: the attempt's task message)."""
    return {
        "execution_id": execution_id,
        "event_id": event_id,
        "event_type": REPUBLISHED,
        "status": "republished",
        "meta": meta,
        **{k: message.get(k) for k in ("step", "run_id", "attempt", "iteration", "page", "parent_event_id")},
    }


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
