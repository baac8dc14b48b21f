"""The event table partitioned by time (PostgreSQL, opt in): `noetl-celery store partition-events`.

`convert` turns `noetl_event` into a table partitioned by RANGE of `execution_id`, one partition per
month, week or day of the ids' time (noetl_celery.core.id_time), plus a default partition that takes any
id no partition covers, so no insert ever fails. `undo` turns it back into a plain table. Both run
in one transaction that holds an ACCESS EXCLUSIVE lock on `noetl_event` while every row is copied:
decisions wait for it (they insert event rows), readers too. `keep_ahead` creates the partitions of
the coming periods (the sweeper and `prune` call it); retention drops a partition whose executions
have all ended (store/retention.py).

What the engine relies on holds in both forms: the same columns, defaults and id sequence; the
primary key `uq_noetl_event_key (execution_id, event_id)` (ON CONFLICT, redelivery), which holds
the partition key already; every other index, by the same name. A partition's copy of the key is
named `uq_noetl_event_key_<partition>`: a duplicate key is reported under the partition's name
(is_event_key). A table partitioned before revision 0010_event_key has the key as a unique
constraint (and no primary key): `undo` makes it the plain table's primary key.

Nothing here runs unless an operator converts the table: a store that was never converted is
left as it is, and SQLite is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from noetl_celery.core.errors import ConfigurationError
from noetl_celery.core.id_time import EPOCH_MS, RANDOM_BITS, first_id_at, time_of
from noetl_celery.store.db import transaction
from noetl_celery.store.events import EVENT_KEY as KEY
from noetl_celery.store.urls import safe_url

TABLE = "noetl_event"
DEFAULT = "noetl_event_default"  # the partition of any id no other partition covers
UNITS = ("month", "week", "day")  # a partition's period (weeks start on Monday, UTC)
AHEAD = 3  # periods after the current one that always have a partition
CONVERT_LOCK_TIMEOUT = 10.0  # seconds `convert`/`undo` wait for the table's lock before giving up
MAINTENANCE_LOCK_TIMEOUT = 3.0  # seconds creating or dropping a partition waits for the table's lock
_STAGING = "noetl_event_converting"  # the new table while rows are copied into it
_BOUND = re.compile(r"FOR VALUES FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")
_NAME = re.compile(r"^noetl_event_(month|week|day)_(\d{8})$")


class PartitionError(ConfigurationError):
    """The event table cannot be converted as asked (SQLite, already converted, a key without the
    partition key...): the message says why and what to do."""


@dataclass(frozen=True)
class Partition:
    """One partition of the event table: the ids from `low` up to (not including) `high`."""

    name: str
    low: int
    high: int

    @property
    def start(self) -> datetime:
        return time_of(self.low)

    @property
    def end(self) -> datetime:
        return time_of(self.high)


@dataclass
class Conversion:
    """What `convert` or `undo` did (or, dry, would do)."""

    rows: int = 0  # event rows copied
    partitions: list[str] = field(default_factory=list)  # created (convert) or removed (undo)
    seconds: float = 0.0  # how long the table was locked (0 for a dry run)
    dry_run: bool = False


# --- periods -------------------------------------------------------------------------------


def period_start(when: datetime, unit: str) -> datetime:
    """The start (UTC) of the `unit` period holding `when`."""
    day = when.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if unit == "month":
        return day.replace(day=1)
    if unit == "week":
        return day - timedelta(days=day.weekday())
    if unit == "day":
        return day
    raise PartitionError(f"--interval is one of {', '.join(UNITS)}: got {unit!r}")


def next_period(start: datetime, unit: str) -> datetime:
    if unit == "month":
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return start + timedelta(days=7 if unit == "week" else 1)


def partition_for(start: datetime, unit: str) -> Partition:
    """The partition of the `unit` period starting at `start`."""
    name = f"{TABLE}_{unit}_{start:%Y%m%d}"
    return Partition(name, first_id_at(start), first_id_at(next_period(start, unit)))


def periods_ahead(now: datetime, unit: str) -> Iterator[datetime]:
    """The current period and the AHEAD after it."""
    start = period_start(now, unit)
    for _ in range(AHEAD + 1):
        yield start
        start = next_period(start, unit)


# --- what the store has --------------------------------------------------------------------


def require_postgresql(url: str) -> None:
    backend = make_url(url).get_backend_name()
    if backend != "postgresql":
        raise PartitionError(
            f"a partitioned event table needs PostgreSQL; the store at {safe_url(url)} is {backend}: "
            "nothing was changed"
        )


def is_partitioned(conn: Connection) -> bool:
    """Whether `noetl_event` is a partitioned table (False on SQLite, or a plain table)."""
    if conn.dialect.name != "postgresql":
        return False
    kind = conn.execute(text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:t)"), {"t": TABLE}).scalar()
    return kind == "p"


def partitions(conn: Connection) -> list[Partition]:
    """The range partitions of `noetl_event`, oldest first (the default partition not included)."""
    rows = conn.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
            " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"
        ),
        {"t": TABLE},
    )
    found = []
    for name, bound in rows:
        match = _BOUND.search(bound or "")
        if match:
            found.append(Partition(name, int(match.group(1)), int(match.group(2))))
    return sorted(found, key=lambda p: p.low)


def unit_of(found: list[Partition]) -> str:
    """The period of the newest partition made here (`month` when none is)."""
    for partition in reversed(found):
        match = _NAME.match(partition.name)
        if match:
            return match.group(1)
    return "month"


# --- convert and undo ----------------------------------------------------------------------


def convert(
    url: str,
    unit: str = "month",
    *,
    dry_run: bool = False,
    lock_timeout: float = CONVERT_LOCK_TIMEOUT,
    now: datetime | None = None,
) -> Conversion:
    """Turn the plain `noetl_event` into one partitioned by RANGE of execution_id, in one
    transaction: a partition per `unit` period that holds rows, the current period and AHEAD
    more, and the default partition. Refused on SQLite and when already partitioned."""
    require_postgresql(url)
    period_start(datetime.now(UTC), unit)  # an unknown unit is refused before anything
    now = now or datetime.now(UTC)
    result = Conversion(dry_run=dry_run)
    with transaction(url) as conn:
        _lock(conn, lock_timeout, exclusive=not dry_run)
        if is_partitioned(conn):
            raise PartitionError(f"{TABLE} is partitioned already: nothing was changed (`--undo` turns it back)")
        indexes = _indexes(conn)
        began = _clock(conn)
        starts = sorted({*_periods_with_rows(conn, unit, now), *periods_ahead(now, unit)})
        planned = [partition_for(start, unit) for start in starts]
        result.partitions = [p.name for p in planned] + [DEFAULT]
        if dry_run:
            result.rows = int(conn.execute(text(f"SELECT count(*) FROM {TABLE}")).scalar() or 0)
            return result
        conn.execute(
            text(
                f"CREATE TABLE {_STAGING} (LIKE {TABLE} INCLUDING ALL EXCLUDING INDEXES)"
                " PARTITION BY RANGE (execution_id)"
            )
        )
        for partition in planned:
            _create_partition(conn, partition, parent=_STAGING)
        conn.execute(text(f"CREATE TABLE {DEFAULT} PARTITION OF {_STAGING} DEFAULT"))
        result.rows = _move_rows(conn)
        _finish_swap(conn, indexes)
        for partition in [*planned, Partition(DEFAULT, 0, 0)]:
            _name_key(conn, partition.name)
        result.seconds = _clock(conn) - began
    _analyze(url)
    return result


def undo(url: str, *, dry_run: bool = False, lock_timeout: float = CONVERT_LOCK_TIMEOUT) -> Conversion:
    """Turn the partitioned `noetl_event` back into a plain table, rows, indexes and sequence
    kept, the event key its primary key, in one transaction. Refused when it is not partitioned."""
    require_postgresql(url)
    result = Conversion(dry_run=dry_run)
    with transaction(url) as conn:
        _lock(conn, lock_timeout, exclusive=not dry_run)
        if not is_partitioned(conn):
            raise PartitionError(f"{TABLE} is not partitioned: nothing to undo")
        indexes = _indexes(conn)
        began = _clock(conn)
        result.partitions = [p.name for p in partitions(conn)] + [DEFAULT]
        if dry_run:
            result.rows = int(conn.execute(text(f"SELECT count(*) FROM {TABLE}")).scalar() or 0)
            return result
        conn.execute(text(f"CREATE TABLE {_STAGING} (LIKE {TABLE} INCLUDING ALL EXCLUDING INDEXES)"))
        result.rows = _move_rows(conn)
        _finish_swap(conn, indexes)
        result.seconds = _clock(conn) - began
    _analyze(url)
    return result


@dataclass(frozen=True)
class _Index:
    name: str
    definition: str  # CREATE [UNIQUE] INDEX ... ON noetl_event ... (or the constraint's definition)
    constraint: bool  # a UNIQUE constraint (ADD CONSTRAINT), else an index


def _lock(conn: Connection, timeout: float, *, exclusive: bool) -> None:
    """`lock_timeout` for this transaction, and (not for a dry run, which only reads) the table's
    ACCESS EXCLUSIVE lock until it ends."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{int(timeout * 1000)}ms'"))
    if exclusive:
        conn.execute(text(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE"))


def _clock(conn: Connection) -> float:
    return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar() or 0.0)


def _indexes(conn: Connection) -> list[_Index]:
    """The table's indexes and unique constraints but its primary key and the event key (which the
    new table gets as its primary key), as they can be made again. Refuses a unique one without
    execution_id: a partitioned table cannot keep it."""
    found: list[_Index] = []
    rows = conn.execute(
        text(
            "SELECT i.relname, pg_get_indexdef(x.indexrelid), x.indisunique, c.conname,"
            " pg_get_constraintdef(c.oid), array_to_string(ARRAY(SELECT a.attname FROM pg_attribute a"
            "  WHERE a.attrelid = x.indrelid AND a.attnum = ANY(x.indkey)), ',')"
            " FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid"
            " LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid"
            " WHERE x.indrelid = to_regclass(:t) AND NOT x.indisprimary ORDER BY i.relname"
        ),
        {"t": TABLE},
    )
    for name, index_sql, unique, constraint, constraint_sql, columns in rows:
        if unique and "execution_id" not in columns.split(","):
            raise PartitionError(
                f"unique index {name} ({columns}) does not hold execution_id, the partition key: "
                "a partitioned table cannot keep it; nothing was changed"
            )
        if constraint == KEY:
            continue
        if constraint:
            found.append(_Index(constraint, constraint_sql, True))
        else:
            found.append(_Index(name, index_sql.replace(" ON ONLY ", " ON "), False))
    return found


def _periods_with_rows(conn: Connection, unit: str, now: datetime) -> list[datetime]:
    """The starts of the `unit` periods (from the ids' epoch up to the last one made ahead) that
    hold rows; rows outside them go to the default partition."""
    last = list(periods_ahead(now, unit))[-1]
    high = partition_for(last, unit).high
    sql = (
        f"SELECT DISTINCT date_trunc('{unit}', to_timestamp(((execution_id >> {RANDOM_BITS}) + {EPOCH_MS}) / 1000.0)"
        f" AT TIME ZONE 'UTC') FROM {TABLE} WHERE execution_id >= 0 AND execution_id < {high}"
    )
    return [start.replace(tzinfo=UTC) for (start,) in conn.execute(text(sql))]


def _create_partition(conn: Connection, partition: Partition, *, parent: str = TABLE) -> None:
    conn.execute(
        text(
            f"CREATE TABLE {partition.name} PARTITION OF {parent}"
            f" FOR VALUES FROM ({partition.low}) TO ({partition.high})"
        )
    )


def _move_rows(conn: Connection) -> int:
    """Copy every row into the new table (same columns, same order: it was made LIKE the old)."""
    return int(conn.execute(text(f"INSERT INTO {_STAGING} SELECT * FROM {TABLE}")).rowcount or 0)


def _finish_swap(conn: Connection, indexes: list[_Index]) -> None:
    """Drop the old table, keeping its id sequence; the new one takes its name, the event key as
    its primary key, and the indexes."""
    sequence = conn.execute(text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": TABLE}).scalar()
    if sequence:
        conn.execute(text(f"ALTER SEQUENCE {sequence} OWNED BY NONE"))
    conn.execute(text(f"DROP TABLE {TABLE}"))
    conn.execute(text(f"ALTER TABLE {_STAGING} RENAME TO {TABLE}"))
    conn.execute(text(f"ALTER TABLE {TABLE} ADD CONSTRAINT {KEY} PRIMARY KEY (execution_id, event_id)"))
    for index in indexes:
        if index.constraint:
            conn.execute(text(f"ALTER TABLE {TABLE} ADD CONSTRAINT {index.name} {index.definition}"))
        else:
            conn.execute(text(index.definition))
    if sequence:
        conn.execute(text(f"ALTER SEQUENCE {sequence} OWNED BY {TABLE}.id"))


def _name_key(conn: Connection, partition: str) -> None:
    """Name the partition's copy of the unique key `uq_noetl_event_key_<partition suffix>`."""
    name = conn.execute(
        text(
            "SELECT c.conname FROM pg_constraint c JOIN pg_constraint p ON p.oid = c.conparentid"
            " WHERE c.conrelid = to_regclass(:part) AND p.conname = :key"
        ),
        {"part": partition, "key": KEY},
    ).scalar()
    wanted = f"{KEY}_{partition.removeprefix(TABLE + '_')}"
    if name and name != wanted:
        conn.execute(text(f'ALTER TABLE {partition} RENAME CONSTRAINT "{name}" TO {wanted}'))


def _analyze(url: str) -> None:
    """Statistics for the new table (autovacuum analyses partitions, never a partitioned parent)."""
    with transaction(url) as conn:
        conn.execute(text(f"ANALYZE {TABLE}"))


# --- partitions ahead ----------------------------------------------------------------------


def keep_ahead(url: str, *, now: datetime | None = None, lock_timeout: float = MAINTENANCE_LOCK_TIMEOUT) -> list[str]:
    """Create the partitions of the current period and the AHEAD after it that are missing, each
    in its own short transaction; returns their names. Nothing (and no lock) when every one
    exists, the table is not partitioned, or the store is not PostgreSQL. Rows already in the
    default partition for a new partition's range are moved into it."""
    if make_url(url).get_backend_name() != "postgresql":
        return []
    now = now or datetime.now(UTC)
    with transaction(url) as conn:
        if not is_partitioned(conn):
            return []
        found = partitions(conn)
    unit = unit_of(found)
    created = []
    for start in periods_ahead(now, unit):
        wanted = partition_for(start, unit)
        if any(p.low < wanted.high and wanted.low < p.high for p in found):
            continue  # covered (or overlapped: a partition made by hand is left alone)
        with transaction(url) as conn:
            conn.execute(text(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'"))
            add_partition(conn, wanted)
        created.append(wanted.name)
    return created


def add_partition(conn: Connection, partition: Partition) -> None:
    """Create `partition` of the partitioned `noetl_event`, first taking out of the default
    partition the rows of its range (PostgreSQL refuses a partition whose rows sit in the default)."""
    bounds = f"execution_id >= {partition.low} AND execution_id < {partition.high}"
    stray = conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE {bounds})")).scalar()
    if stray:
        conn.execute(text(f"CREATE TEMP TABLE noetl_event_stray (LIKE {TABLE}) ON COMMIT DROP"))
        conn.execute(
            text(
                f"WITH gone AS (DELETE FROM {DEFAULT} WHERE {bounds} RETURNING *)"
                " INSERT INTO noetl_event_stray SELECT * FROM gone"
            )
        )
    _create_partition(conn, partition)
    _name_key(conn, partition.name)
    if stray:
        conn.execute(text(f"INSERT INTO {TABLE} SELECT * FROM noetl_event_stray"))
