"""Retention: delete the history of finished executions (`noetl-celery prune`, NOETL_PRUNE_OLDER_THAN).

What goes: whole execution trees (a top-level execution and its sub-playbooks, at any depth) whose
top-level execution finished with one of the chosen statuses and was created and finished before
the cutoff, and none of whose members is running. So a running execution is never touched, nor
its parents (its tree has a running member), nor a finished child of a running parent (only trees
are pruned, from their top). An execution whose parent row is gone counts as a top-level one.

How: short transactions, never one long one.
1. Mark: a batch of eligible trees (up to BATCH top-level executions, in creation order) gets the
   status `pruning`, in one transaction that re-reads their members' status under a row lock
   (PostgreSQL: FOR UPDATE, skipping rows another transaction holds): a resume that took a
   failed execution first wins, and a resume that comes after finds it `pruning` and refuses.
2. Delete: the rows of the marked executions, table by table, at most CHUNK rows a transaction,
   then the execution rows themselves. A prune stopped in between leaves executions `pruning`;
   the next prune finishes them first.
A dry run selects the same trees and counts their rows, changing nothing.

A partitioned event table (store/partitions.py) loses whole partitions first: a partition whose
range of execution ids ended before the cutoff is dropped (DETACH, then DROP) when every execution
in that range belongs to a tree the steps above would remove. In one transaction, which waits at
most MAINTENANCE_LOCK_TIMEOUT for the table's lock (else the partition is left for the row delete):
the trees' rows are locked (NOWAIT: a resume holding one keeps the partition), re-checked, marked
`pruning`, and the partition goes; the rest of those trees' rows (other tables, other partitions)
are then deleted as in step 2. Any other partition's trees go by the row delete.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, func, select, text, tuple_
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from noetl_celery.config.settings import parse_age
from noetl_celery.core.errors import ConfigurationError
from noetl_celery.store import partitions
from noetl_celery.store import schedules as schedule_store
from noetl_celery.store.db import transaction
from noetl_celery.store.kernel import BLOBS, EVENTS, EXECUTIONS, HOLDS, JOINS, LEASES, LOOPS, VARIABLES, utcnow

FINISHED = ("completed", "failed", "cancelled")
PRUNING = "pruning"  # the status of an execution whose rows are being deleted
BATCH = 200  # top-level executions examined (and trees marked) per transaction
CHUNK = 5000  # rows deleted per transaction
# the tables holding rows of an execution, deleted in this order; the execution rows go last
TABLES: tuple[Table, ...] = (
    EVENTS,
    VARIABLES,
    LOOPS,
    JOINS,
    LEASES,
    HOLDS,
    BLOBS,
    schedule_store.NOTIFICATIONS,
)
__all__ = ["FINISHED", "Dropped", "Pruned", "keep_partitions_ahead", "parse_age", "prune"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dropped:
    """A partition of the event table a prune dropped (or, dry, would drop)."""

    name: str
    start: datetime  # the time of the first execution id of its range
    end: datetime  # the time past its last
    rows: int  # event rows it held


@dataclass
class Pruned:
    """What a prune removed (or, dry, would remove): rows per table, executions included."""

    rows: dict[str, int] = field(default_factory=lambda: {t.name: 0 for t in (*TABLES, EXECUTIONS)})
    trees: int = 0
    done: bool = True  # False: stopped by its time budget with work left
    skipped_running: int = 0  # eligible top-level executions left because their tree runs
    partitions: list[Dropped] = field(default_factory=list)  # of a partitioned event table

    def add(self, table: str, count: int) -> None:
        self.rows[table] = self.rows.get(table, 0) + count

    @property
    def executions(self) -> int:
        return self.rows[EXECUTIONS.name]


def prune(
    url: str,
    older_than: timedelta,
    *,
    statuses: Sequence[str] = FINISHED,
    dry_run: bool = False,
    budget: float | None = None,
    now: datetime | None = None,
) -> Pruned:
    """Delete (or count, `dry_run`) the trees of finished executions older than `older_than`.
    `budget`: seconds after which it stops between two transactions (`done` False)."""
    _check_statuses(statuses)
    cutoff = (now or utcnow()) - older_than
    began = time.monotonic()
    result = Pruned()

    def over() -> bool:
        return budget is not None and time.monotonic() - began > budget

    if not dry_run and not _delete_marked(url, result, over):
        result.done = False
        return result
    claimed = _prune_partitions(url, cutoff, statuses, result, dry_run=dry_run, over=over)
    if claimed is None:
        result.done = False
        return result
    result.done = _prune_rows(url, cutoff, statuses, result, claimed, dry_run=dry_run, over=over)
    return result


def _check_statuses(statuses: Sequence[str]) -> None:
    """Only finished executions are pruned: any other status is refused, by name."""
    bad = [s for s in statuses if s not in FINISHED]
    if bad or not statuses:
        raise ConfigurationError(f"prune: a status is one of {', '.join(FINISHED)}: got {', '.join(bad) or 'none'}")


def _prune_partitions(
    url: str, cutoff: datetime, statuses: Sequence[str], result: Pruned, *, dry_run: bool, over: Any
) -> set[int] | None:
    """A partitioned event table's share: the partitions that may go dropped (dry: counted);
    returns the roots of the trees they took (none when the table is not partitioned), None
    when the budget ran out or the marked rows could not all be deleted."""
    if not _partitioned(url):
        return set()
    if not dry_run:
        keep_partitions_ahead(url)
    claimed = _drop_partitions(url, cutoff, statuses, result, dry_run=dry_run, over=over)
    if over() or (not dry_run and not _delete_marked(url, result, over)):
        return None
    return claimed


def _prune_rows(
    url: str,
    cutoff: datetime,
    statuses: Sequence[str],
    result: Pruned,
    claimed: set[int],
    *,
    dry_run: bool,
    over: Any,
) -> bool:
    """The row deletes (dry: counts), one batch of roots a transaction, oldest first; whether
    it got through them all (False: stopped by the budget or left marked rows)."""
    after: tuple[datetime, int] | None = None
    while True:
        if over():
            return False
        with transaction(url) as conn:
            roots = _roots(conn, cutoff, statuses, after, lock=not dry_run)
            if not roots:
                return True
            after = roots[-1]
            members = _batch(conn, [r[1] for r in roots if r[1] not in claimed], result, dry_run=dry_run)
            if dry_run:
                continue
            _mark(conn, members)
        if members and not _delete_marked(url, result, over):
            return False


def _batch(conn: Connection, todo: list[int], result: Pruned, *, dry_run: bool) -> list[int]:
    """The members of the trees of these roots that may go (a tree that still runs is skipped,
    counted); a dry run counts their rows."""
    trees = _trees(conn, todo, lock=not dry_run) if todo else {}
    members = [m for ids in trees.values() if ids is not None for m in ids]
    result.skipped_running += sum(1 for ids in trees.values() if ids is None)
    result.trees += sum(1 for ids in trees.values() if ids is not None)
    if dry_run:
        for table in (*TABLES, EXECUTIONS):
            result.add(table.name, _count(conn, table, members))
    return members


def _partitioned(url: str) -> bool:
    """Whether the event table is partitioned (never on SQLite, which is not asked)."""
    if make_url(url).get_backend_name() != "postgresql":
        return False
    with transaction(url) as conn:
        return partitions.is_partitioned(conn)


def keep_partitions_ahead(url: str) -> None:
    """partitions.keep_ahead, logged. A failure (the table's lock not had in time, a partition
    another process made first, the store unreachable) is logged and left for the next call."""
    try:
        created = partitions.keep_ahead(url)
    except DBAPIError as exc:
        log.warning("event table: partitions ahead not created this time: %s", str(exc.orig).strip())
        return
    if created:
        log.info("event table: created partition(s) %s", ", ".join(created))


class _Busy(Exception):
    """A partition's trees or the table were locked by another transaction: left for later."""


def _drop_partitions(
    url: str, cutoff: datetime, statuses: Sequence[str], result: Pruned, *, dry_run: bool, over: Any
) -> set[int]:
    """Drop (dry: count) every partition that ended before `cutoff` and whose executions' trees
    may all go; returns the roots of those trees."""
    with transaction(url) as conn:
        candidates = [p for p in partitions.partitions(conn) if p.end <= cutoff]
    roots: set[int] = set()
    members: set[int] = set()
    for partition in candidates:
        if over():
            break
        try:
            taken = _drop_partition(url, partition, cutoff, statuses, dry_run=dry_run)
        except _Busy as exc:
            log.info("retention: partition %s left to the row delete: %s", partition.name, exc)
            continue
        if taken is not None:
            result.partitions.append(taken[0])
            roots.update(taken[1])
            members.update(taken[2])
    result.trees += len(roots)
    if dry_run and members:
        with transaction(url) as conn:
            _count_rest(conn, sorted(members), result)
    return roots


_RANGE_TREES_SQL = (
    "WITH RECURSIVE up(id, parent) AS ("
    " SELECT execution_id, parent_execution_id FROM noetl_execution WHERE execution_id >= :low AND execution_id < :high"
    " UNION SELECT p.execution_id, p.parent_execution_id FROM noetl_execution p JOIN up u ON p.execution_id = u.parent"
    "), tree(id) AS ("
    " SELECT u.id FROM up u WHERE u.parent IS NULL"
    "  OR NOT EXISTS (SELECT 1 FROM noetl_execution o WHERE o.execution_id = u.parent)"
    " UNION SELECT c.execution_id FROM noetl_execution c JOIN tree t ON c.parent_execution_id = t.id"
    ") SELECT id FROM tree UNION SELECT id FROM up"
)


def _drop_partition(
    url: str, partition: partitions.Partition, cutoff: datetime, statuses: Sequence[str], *, dry_run: bool
) -> tuple[Dropped, list[int], list[int]] | None:
    """Drop `partition` when every execution in its range is in a tree that may go: (what was
    dropped, the trees' roots, their members); None when one may not."""
    timeout = int(partitions.MAINTENANCE_LOCK_TIMEOUT * 1000)
    try:
        with transaction(url) as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{timeout}ms'"))
            bounds = {"low": partition.low, "high": partition.high}
            ids = [int(r[0]) for r in conn.execute(text(_RANGE_TREES_SQL), bounds)]
            lock = "" if dry_run else " FOR UPDATE NOWAIT"
            rows = conn.execute(
                text(
                    "SELECT execution_id, parent_execution_id, status, created_at, finished_at"
                    f" FROM noetl_execution WHERE execution_id = ANY(:ids){lock}"
                ),
                {"ids": ids},
            ).all()
            roots = _roots_if_all_may_go(rows, cutoff, statuses)
            if roots is None:
                return None
            count = int(conn.execute(text(f"SELECT count(*) FROM {partition.name}")).scalar() or 0)
            dropped = Dropped(partition.name, partition.start, partition.end, count)
            if not dry_run:
                _mark(conn, ids)
                conn.execute(text(f"ALTER TABLE {partitions.TABLE} DETACH PARTITION {partition.name}"))
                conn.execute(text(f"DROP TABLE {partition.name}"))
            return dropped, roots, ids
    except OperationalError as exc:
        if getattr(exc.orig, "pgcode", None) == "55P03":  # lock_not_available: NOWAIT, lock_timeout
            raise _Busy(str(exc.orig).strip()) from exc
        raise


def _roots_if_all_may_go(rows: Sequence[Any], cutoff: datetime, statuses: Sequence[str]) -> list[int] | None:
    """The roots of the trees of `rows` (execution_id, parent, status, created_at, finished_at),
    or None when one of them runs or a root is not one a prune with these options removes."""
    ids = {int(r[0]) for r in rows}
    roots = []
    for execution_id, parent, status, created_at, finished_at in rows:
        if status == "running":
            return None
        if parent is not None and int(parent) in ids:
            continue
        ended_before = finished_at is None or finished_at < cutoff
        if status != PRUNING and not (status in statuses and created_at < cutoff and ended_before):
            return None
        roots.append(int(execution_id))
    return roots


def _count_rest(conn: Connection, members: list[int], result: Pruned) -> None:
    """Dry run: the rows of the trees of the partitions it would drop that the row delete would
    then remove (every table but the event rows in those partitions)."""
    dropped = {p.name for p in result.partitions}
    ranges = [p for p in partitions.partitions(conn) if p.name in dropped]
    for table in (*TABLES, EXECUTIONS):
        if table is not EVENTS:
            result.add(table.name, _count(conn, table, members))
            continue
        outside = " AND ".join(f"NOT (execution_id >= {p.low} AND execution_id < {p.high})" for p in ranges)
        for chunk in _chunks(members, 500):
            sql = f"SELECT count(*) FROM noetl_event WHERE execution_id = ANY(:ids) AND {outside or 'true'}"
            result.add(table.name, int(conn.execute(text(sql), {"ids": chunk}).scalar() or 0))


def _roots(
    conn: Connection, cutoff: datetime, statuses: Sequence[str], after: tuple[datetime, int] | None, *, lock: bool
) -> list[tuple[datetime, int]]:
    """The next BATCH top-level executions (by creation) finished with `statuses` before `cutoff`."""
    x = EXECUTIONS.c
    parent = EXECUTIONS.alias("parent")
    orphan_or_top = (
        x.parent_execution_id.is_(None)
        | ~select(parent.c.execution_id).where(parent.c.execution_id == x.parent_execution_id).exists()
    )
    query = (
        select(x.created_at, x.execution_id)
        .where(
            x.status.in_(list(statuses)),
            x.created_at < cutoff,
            x.finished_at.is_(None) | (x.finished_at < cutoff),
            orphan_or_top,
        )
        .order_by(x.created_at, x.execution_id)
        .limit(BATCH)
    )
    if after is not None:
        query = query.where(tuple_(x.created_at, x.execution_id) > tuple_(*after))
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update(of=EXECUTIONS, skip_locked=True)
    return [(r[0], int(r[1])) for r in conn.execute(query)]


_TREE_SQL = (
    "WITH RECURSIVE tree(root, id) AS ("
    " SELECT execution_id, execution_id FROM noetl_execution WHERE execution_id IN ({roots})"
    " UNION ALL SELECT t.root, c.execution_id FROM noetl_execution c JOIN tree t ON c.parent_execution_id = t.id"
    ") SELECT t.root, t.id, e.status FROM tree t JOIN noetl_execution e ON e.execution_id = t.id"
)


def _trees(conn: Connection, roots: list[int], *, lock: bool) -> dict[int, list[int] | None]:
    """Each root's tree (itself and its descendants), or None when a member is running (or
    being resumed: its row is locked). On PostgreSQL the members' rows are locked for the mark."""
    sql = _TREE_SQL.format(roots=", ".join(str(int(r)) for r in roots))
    members: dict[int, list[int] | None] = {r: [] for r in roots}
    rows: list[tuple[Any, Any, Any]] = [tuple(r) for r in conn.execute(text(sql))]
    if lock and conn.dialect.name == "postgresql" and rows:
        ids = sorted({int(r[1]) for r in rows})
        c = EXECUTIONS.c
        locked = {
            int(r[0]): r[1]
            for r in conn.execute(
                select(c.execution_id, c.status).where(c.execution_id.in_(ids)).with_for_update(skip_locked=True)
            )
        }
        rows = [(root, member, locked.get(int(member), "running")) for root, member, _ in rows]
    for root, member, status in rows:
        found = members[int(root)]
        if found is None:
            continue
        members[int(root)] = None if status == "running" else [*found, int(member)]
    return members


def _mark(conn: Connection, members: list[int]) -> None:
    c = EXECUTIONS.c
    for chunk in _chunks(members, 500):
        conn.execute(EXECUTIONS.update().where(c.execution_id.in_(chunk), c.status != "running").values(status=PRUNING))


def _count(conn: Connection, table: Table, members: list[int]) -> int:
    total = 0
    for chunk in _chunks(members, 500):
        query = select(func.count()).select_from(table).where(table.c.execution_id.in_(chunk))
        total += int(conn.execute(query).scalar() or 0)
    return total


def _delete_marked(url: str, result: Pruned, over: Any) -> bool:
    """Delete the rows of every `pruning` execution, CHUNK rows a transaction; False when the
    budget ran out first."""
    c = EXECUTIONS.c
    while True:
        with transaction(url) as conn:
            marked = [int(r[0]) for r in conn.execute(select(c.execution_id).where(c.status == PRUNING).limit(BATCH))]
        if not marked:
            return True
        for table in (*TABLES, EXECUTIONS):
            while True:
                if over():
                    return False
                with transaction(url) as conn:
                    removed = _delete_chunk(conn, table, marked)
                result.add(table.name, removed)
                if removed < CHUNK:
                    break


def _delete_chunk(conn: Connection, table: Table, executions: list[int]) -> int:
    """At most CHUNK rows of `table` belonging to `executions`: one statement."""
    ids = ", ".join(str(int(x)) for x in executions)
    if table is EXECUTIONS:
        where = f"execution_id IN ({ids}) AND status = '{PRUNING}'"
    else:
        where = f"execution_id IN ({ids})"
    rows = f"SELECT {{row}} FROM {table.name} WHERE {where} LIMIT {CHUNK}"
    if conn.dialect.name == "postgresql":  # by physical row: no key of its own needed; a ctid is
        # only unique within one partition, so the rows' own condition is repeated (a row of another
        # partition at the same ctid is not one of these executions')
        sql = f"DELETE FROM {table.name} WHERE {where} AND ctid = ANY(ARRAY({rows.format(row='ctid')}))"
    else:
        sql = f"DELETE FROM {table.name} WHERE rowid IN ({rows.format(row='rowid')})"
    return int(conn.execute(text(sql)).rowcount or 0)


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
