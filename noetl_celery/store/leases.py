"""Leases and recovery: the statements the sweeper (engine/recovery/sweeper.py) makes, by name.

A decision row with messages to dispatch is written with a lease (`repo.LEASE_KEY`): a row of
noetl_lease on the decision row's key, with the time by which every message it dispatched should
have an outcome row. The event row itself is never updated for it. The sweeper reads the overdue
leases in deadline order (with their decision rows' dispatch lists and their executions' status,
one statement per batch), looks up which outcome and re-publish keys exist (one statement), then
deletes the leases that are settled and moves the others' deadline on (one statement each, and
one per distinct postponement): no statement per lease, whatever the batch holds.

A decision's only message carries the decision row's key (TaskMessage.lease): the decision that
records that message's outcome deletes the lease in its own write (repo.record_decision's
`settles`), and the sweeper never reads it. Each message of a decision that sent several carries
the key as the lease it shares (TaskMessage.shares): a worker that takes one late moves that
lease on (`taken`), and the sweeper settles it. So the table holds the leases of attempts in flight,
those of decisions that sent several messages for about a lease period, and whatever is overdue:
small, so the churn of its rows (an insert per dispatching decision, a delete by the outcome's
decision or by the sweeper) costs a fraction of rewriting event rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Connection, and_, delete, select, text, tuple_, update

from noetl_celery.store import kernel, repo
from noetl_celery.store.db import get_engine, outside_transaction

PAIRS_PER_STATEMENT = 400  # row values per statement where arrays are not at hand (SQLite)
VACUUM_DEAD_ROWS = 10_000  # dead lease rows past which the sweeper vacuums the table itself...
VACUUM_QUIET = 60.0  # ...when no vacuum has run on it for this many seconds (autovacuum off or behind)


class Overdue(NamedTuple):
    """An overdue lease: its decision row's key, dispatch list, its execution's status, and when
    the decision was recorded (its row's created_at: when its messages were sent)."""

    execution_id: int
    event_id: str
    dispatch: list[dict[str, Any]]
    status: str
    decided_at: datetime | None = None


class Batch(NamedTuple):
    """A batch of overdue leases: those left to decide, and how many were settled on the way."""

    pending: list[Overdue]
    settled: int


# The dispatches (`dsp`, elements of the decision rows' meta.dispatch) that need nothing more: an
# attempt of an execution that has ended, or a plain attempt or cursor claim (not a batch: its
# keys are the engine's business) whose outcome row exists, its key built as engine/ids.py's
# attempt_key or claim_key builds it (TaskMessage.outcome_key), with TaskMessage's defaults for
# the fields a compact message leaves out. Anything else (a sub-playbook's end, a batch, an
# attempt without outcome) leaves its lease to the sweeper, which decides every dispatch of it.
# The outcome row is looked up by a LATERAL join, one unique-index probe per dispatch (a
# correlated EXISTS may be planned as a hash of every row of the execution).
_PLAIN = (
    "dsp->>'kind' = 'run' AND d.status = 'running' AND jsonb_typeof(dsp->'message'->'batch') IS DISTINCT FROM 'array'"
)
_OUTCOME_KEY = (
    "(dsp->'message'->>'run_id')"
    " || CASE WHEN dsp->'message'->'slot'->>'phase' = 'claim'"
    " THEN '.c' || (dsp->'message'->'slot'->>'id') || '.' || (dsp->'message'->'slot'->>'claim')"
    " ELSE CASE WHEN jsonb_typeof(dsp->'message'->'iteration') = 'number'"
    " THEN '.i' || (dsp->'message'->>'iteration') ELSE '' END"
    " || '.s' || COALESCE(dsp->'message'->>'seq', '0') END"
    " || '.a' || COALESCE(dsp->'message'->>'attempt', '1') || '.done'"
)
_OVERDUE_PG = (
    "WITH due AS (SELECT l.execution_id, l.event_id, e.meta, x.status, e.created_at FROM noetl_lease l"
    " LEFT JOIN noetl_event e ON e.execution_id = l.execution_id AND e.event_id = l.event_id"
    " LEFT JOIN noetl_execution x ON x.execution_id = l.execution_id"
    " WHERE l.deadline_at < :now ORDER BY l.deadline_at LIMIT :n),"
    " elems AS (SELECT d.execution_id, d.event_id,"
    " (dsp->>'kind' = 'run' AND d.status IS DISTINCT FROM 'running') AS ended,"
    f" CASE WHEN {_PLAIN} THEN {_OUTCOME_KEY} END AS okey"
    " FROM due d, jsonb_array_elements(CASE WHEN jsonb_typeof(d.meta->'dispatch') = 'array'"
    " THEN d.meta->'dispatch' ELSE '[]'::jsonb END) AS t(dsp)),"
    " open AS MATERIALIZED (SELECT DISTINCT m.execution_id, m.event_id FROM elems m"
    " LEFT JOIN LATERAL (SELECT 1 AS hit FROM noetl_event o"
    " WHERE o.execution_id = m.execution_id AND o.event_id = m.okey LIMIT 1) f ON m.okey IS NOT NULL"
    " WHERE NOT m.ended AND f.hit IS NULL),"
    " settled AS (DELETE FROM noetl_lease l USING due d"
    " WHERE l.execution_id = d.execution_id AND l.event_id = d.event_id AND NOT EXISTS ("
    " SELECT 1 FROM open u WHERE u.execution_id = d.execution_id AND u.event_id = d.event_id)"
    " RETURNING l.execution_id, l.event_id)"
    " SELECT d.execution_id, d.event_id, d.meta -> 'dispatch', d.status, d.created_at, NULL FROM due d"
    " WHERE (d.execution_id, d.event_id) IN (SELECT execution_id, event_id FROM open)"
    " UNION ALL SELECT NULL, NULL, NULL, NULL, NULL, count(*) FROM settled"
)


def overdue(conn: Connection, now: datetime, limit: int) -> Batch:
    """Up to `limit` leases past their deadline at `now`, earliest first, with what recovery
    needs of their decision rows and executions: one statement (the lease index, then the event
    rows' and executions' primary keys). On PostgreSQL the same statement deletes the leases that
    need nothing more (`_OVERDUE_PG`: every attempt has its outcome row, or the execution
    has ended), which is nearly all of them, and returns only the others' dispatch lists: what
    is settled is never decoded by the sweeper."""
    if conn.dialect.name == "postgresql":
        rows = conn.execute(text(_OVERDUE_PG), {"now": now, "n": limit}).all()
        pending = [
            Overdue(int(x), event_id, list(dispatch or []), status or "gone", decided_at)
            for x, event_id, dispatch, status, decided_at, _ in rows
            if x is not None
        ]
        return Batch(pending, sum(int(settled) for x, *_, settled in rows if x is None))
    lease, e, x = repo.LEASES.c, repo.EVENTS.c, repo.EXECUTIONS.c
    found = conn.execute(
        select(lease.execution_id, lease.event_id, e.meta, x.status, e.created_at)
        .select_from(repo.LEASES)
        .outerjoin(repo.EVENTS, and_(e.execution_id == lease.execution_id, e.event_id == lease.event_id))
        .outerjoin(repo.EXECUTIONS, x.execution_id == lease.execution_id)
        .where(lease.deadline_at < now)
        .order_by(lease.deadline_at)
        .limit(limit)
    ).all()
    return Batch(
        [
            Overdue(int(execution_id), event_id, list((meta or {}).get("dispatch") or []), status or "gone", decided_at)
            for execution_id, event_id, meta, status, decided_at in found
        ],
        0,
    )


TAKEN_STEP = 1.0  # seconds: a late pickup moves a lease on only when it moves it by more than this
_TAKEN_PG = (  # the kernel's positional parameters: seconds, key, lease, seconds - step, key, outcome
    "WITH held AS (UPDATE noetl_lease SET deadline_at = now() + make_interval(secs => ?)"
    " WHERE execution_id = ? AND event_id = ? AND deadline_at < now() + make_interval(secs => ?)"
    " RETURNING 1)"
    " SELECT EXISTS (SELECT 1 FROM noetl_event WHERE execution_id = ? AND event_id = ?),"
    " (SELECT count(*) FROM held)"
)


def taken(conn: Connection, execution_id: int, lease_key: str | None, outcome_key: str, seconds: float) -> bool:
    """A worker took, late, a message that waited in its broker's queue: the lease of its decision
    row (`lease_key`, when the message carries it) now runs from this moment (its deadline at least
    `seconds` from the store's clock), and whether the attempt's outcome row exists already (a
    re-published copy ran it). The lease may be one its decision's other messages share (a loop's
    first iterations, a fan-out): it is rewritten only when that moves it by more than TAKEN_STEP,
    so a backlog of such messages taken late rewrites it about once a second, not once each.
    One statement on PostgreSQL (run outside a transaction: it is its own; prepared, on the kernel's
    path: a backlog makes it once per message); an update and a read elsewhere."""
    if conn.dialect.name == "postgresql":
        params = (float(seconds), execution_id, lease_key or "", float(seconds - TAKEN_STEP), execution_id, outcome_key)
        row = kernel.run(conn, kernel.sql(conn.dialect, "lease.taken", _TAKEN_PG), params).fetchone()
        return bool(row[0])
    if lease_key is not None:
        until = repo.utcnow() + timedelta(seconds=seconds)
        lease = repo.LEASES.c
        conn.execute(
            update(repo.LEASES)
            .where(
                and_(
                    lease.execution_id == execution_id,
                    lease.event_id == lease_key,
                    lease.deadline_at < until - timedelta(seconds=TAKEN_STEP),
                )
            )
            .values(deadline_at=until)
        )
    return repo.event_exists(conn, execution_id, outcome_key)


def settle(conn: Connection, keys: Sequence[tuple[int, str]]) -> int:
    """Delete the leases of these decision rows (every attempt they dispatched has an outcome, or
    their execution has ended): one statement."""
    if not keys:
        return 0
    if conn.dialect.name == "postgresql":
        result = conn.execute(
            text(
                "DELETE FROM noetl_lease l USING unnest(CAST(:x AS bigint[]), CAST(:k AS text[])) AS t(x, k)"
                " WHERE l.execution_id = t.x AND l.event_id = t.k"
            ),
            {"x": [k[0] for k in keys], "k": [k[1] for k in keys]},
        )
        return int(result.rowcount or 0)
    lease = repo.LEASES.c
    removed = 0
    for chunk in _chunks(list(keys)):
        result = conn.execute(delete(repo.LEASES).where(tuple_(lease.execution_id, lease.event_id).in_(chunk)))
        removed += int(result.rowcount or 0)
    return removed


def postpone(conn: Connection, keys: Sequence[tuple[int, str]], until: datetime) -> None:
    """Move the deadline of these leases to `until`: one statement."""
    if not keys:
        return
    if conn.dialect.name == "postgresql":
        conn.execute(
            text(
                "UPDATE noetl_lease l SET deadline_at = :d FROM unnest(CAST(:x AS bigint[]), CAST(:k AS text[]))"
                " AS t(x, k) WHERE l.execution_id = t.x AND l.event_id = t.k"
            ),
            {"d": until, "x": [k[0] for k in keys], "k": [k[1] for k in keys]},
        )
        return
    lease = repo.LEASES.c
    for chunk in _chunks(list(keys)):
        conn.execute(
            update(repo.LEASES).where(tuple_(lease.execution_id, lease.event_id).in_(chunk)).values(deadline_at=until)
        )


def existing_keys(conn: Connection, pairs: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
    """Which (execution_id, event_id) event keys exist: one statement on PostgreSQL (two arrays
    joined to the unique key's index), chunks of row values elsewhere."""
    ordered = sorted(set(pairs))
    if not ordered:
        return set()
    if conn.dialect.name == "postgresql":
        found = conn.execute(
            text(
                "SELECT e.execution_id, e.event_id FROM unnest(CAST(:x AS bigint[]), CAST(:k AS text[])) AS t(x, k)"
                " JOIN noetl_event e ON e.execution_id = t.x AND e.event_id = t.k"
            ),
            {"x": [p[0] for p in ordered], "k": [p[1] for p in ordered]},
        )
        return {(int(r[0]), r[1]) for r in found}
    e = repo.EVENTS.c
    result: set[tuple[int, str]] = set()
    for chunk in _chunks(ordered):
        query = select(e.execution_id, e.event_id).where(tuple_(e.execution_id, e.event_id).in_(chunk))
        result |= {(int(r[0]), r[1]) for r in conn.execute(query)}
    return result


def running(conn: Connection, execution_ids: Iterable[int]) -> set[int]:
    """Which of these executions are running: one statement."""
    ids = sorted(set(execution_ids))
    if not ids:
        return set()
    c = repo.EXECUTIONS.c
    query = select(c.execution_id).where(and_(c.execution_id.in_(ids), c.status == "running"))
    return {int(r[0]) for r in conn.execute(query)}


def timed_out(conn: Connection, now: datetime) -> list[int]:
    """Running executions past their playbook `timeout`: a range of the partial index
    `ix_noetl_execution_due` (revision 0011_sweep_due), only those that are due."""
    c = repo.EXECUTIONS.c
    rows = conn.execute(
        select(c.execution_id).where(and_(c.status == "running", c.deadline_at.is_not(None), c.deadline_at < now))
    ).all()
    return [int(r[0]) for r in rows]


def missing_starts(conn: Connection, now: datetime, grace: float, since: datetime | None = None) -> list[int]:
    """Running executions created more than `grace` seconds ago (and at or after `since`, when
    given: a range of the `(status, created_at)` index) without an `execution.started` row."""
    c, e = repo.EXECUTIONS.c, repo.EVENTS.c
    started = select(e.id).where(and_(e.execution_id == c.execution_id, e.event_id == "execution.started"))
    window = [c.created_at >= since] if since is not None else []
    rows = conn.execute(
        select(c.execution_id).where(
            and_(c.status == "running", c.created_at < now - timedelta(seconds=grace), *window, ~started.exists())
        )
    ).all()
    return [int(r[0]) for r in rows]


def deadline(conn: Connection, execution_id: int, event_id: str) -> datetime | None:
    """The deadline of one decision row's lease (None: it has none, or it was settled)."""
    lease = repo.LEASES.c
    return conn.execute(
        select(lease.deadline_at).where(and_(lease.execution_id == execution_id, lease.event_id == event_id))
    ).scalar()


def expire(conn: Connection, now: datetime, execution_id: int | None = None) -> int:
    """Make every lease (of one execution) overdue at `now`: what waiting out the lease period
    would do (tests, `bench.recovery`)."""
    query = update(repo.LEASES).values(deadline_at=now - timedelta(seconds=1))
    if execution_id is not None:
        query = query.where(repo.LEASES.c.execution_id == execution_id)
    return int(conn.execute(query).rowcount or 0)


def count(conn: Connection, *, overdue_at: datetime | None = None) -> int:
    """How many leases there are (overdue at `overdue_at`, when given)."""
    query = select(repo.LEASES.c.execution_id)
    if overdue_at is not None:
        query = query.where(repo.LEASES.c.deadline_at < overdue_at)
    return int(conn.execute(select(text("count(*)")).select_from(query.subquery())).scalar() or 0)


def _chunks(items: list[Any]) -> Iterable[list[Any]]:
    for start in range(0, len(items), PAIRS_PER_STATEMENT):
        yield items[start : start + PAIRS_PER_STATEMENT]


VACUUM_LOOK = (  # dead rows, seconds since the last vacuum, whether this role may vacuum the table
    "SELECT s.n_dead_tup, extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum)), "
    "pg_has_role(c.relowner, 'MEMBER') OR pg_has_role(d.datdba, 'MEMBER') "
    "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) "
    "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid "
    "JOIN pg_database d ON d.datname = current_database() "
    "WHERE s.relid = to_regclass('noetl_lease')"
)


def vacuum_if_needed(url: str, dead_rows: int = VACUUM_DEAD_ROWS, quiet: float = VACUUM_QUIET) -> bool:
    """On PostgreSQL, `VACUUM noetl_lease` when the table holds more than `dead_rows` dead rows
    (pg_stat_user_tables) and no vacuum, autovacuum's or another, ran on it in the last `quiet`
    seconds; whether it did. A lease lives for the milliseconds between a decision and its
    outcome, and the entries it leaves in the table's two indexes are reclaimed only by a vacuum:
    where autovacuum runs (PostgreSQL's default) it gets there first and this does nothing; where
    it is off, the table would grow by every decision's lease. VACUUM takes no lock that stops
    inserts or deletes. A role that may not vacuum the table (neither its owner, the database's
    nor a superuser) does nothing here."""
    if get_engine(url).dialect.name != "postgresql":
        return False
    with outside_transaction(url) as conn:
        row = conn.execute(text(VACUUM_LOOK)).first()
        if row is None or not row[2]:  # no such table, or a role that may not vacuum it
            return False
        if int(row[0] or 0) <= dead_rows or (row[1] is not None and float(row[1]) < quiet):
            return False
        conn.execute(text("VACUUM noetl_lease"))
    return True
