"""SQLAlchemy models of the event store. Alembic owns the schema (noetl_celery/migrations/versions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only autoincrements an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")
DUE = "status = 'running' AND deadline_at IS NOT NULL"  # an execution with a playbook timeout, running
ENDED = "status IN ('failed', 'cancelled') AND parent_execution_id IS NULL"  # a top-level failure or cancel


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: Json, Any: Json}


class Execution(Base):
    """One run of a playbook. `pending` counts step runs dispatched and not yet finished."""

    __tablename__ = "noetl_execution"
    __table_args__ = (
        Index("ix_noetl_execution_created", "created_at"),
        Index("ix_noetl_execution_playbook", "playbook_name", "created_at"),
        Index("ix_noetl_execution_status_created", "status", "created_at"),
        # the webhook scan's (store/schedules.py unnotified_ends): recent failed top-level ends
        Index("ix_noetl_execution_ended", "finished_at", postgresql_where=text(ENDED), sqlite_where=text(ENDED)),
        # the sweep's playbook-timeout check (store/leases.py timed_out): running executions by deadline
        Index("ix_noetl_execution_due", "deadline_at", postgresql_where=text(DUE), sqlite_where=text(DUE)),
    )

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    parent_execution_id: Mapped[int | None] = mapped_column(BigInteger, index=True)
    parent_event_id: Mapped[str | None] = mapped_column(String(200))  # the parent's row that started it
    parent_task: Mapped[Any | None] = mapped_column(Json)  # {message, return_step, path}: what to resume
    depth: Mapped[int] = mapped_column(Integer, default=0)  # sub-playbook nesting (0: top level)
    playbook_name: Mapped[str] = mapped_column(String(200))
    playbook_path: Mapped[str | None] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(String(16))  # running | completed | failed | cancelled
    plan: Mapped[dict[str, Any]] = mapped_column(Json)
    workload: Mapped[dict[str, Any]] = mapped_column(Json)
    error: Mapped[Any | None] = mapped_column(Json)
    failed_step: Mapped[str | None] = mapped_column(String(200))
    pending: Mapped[int] = mapped_column(Integer, default=0)
    state_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # playbook `timeout`
    epoch: Mapped[int] = mapped_column(Integer, default=0)  # times resumed


class Event(Base):
    """One row per attempt, iteration and decision. `event_id` is deterministic: redelivery of
    the same event hits the unique key and is a no-op. On PostgreSQL that key,
    `uq_noetl_event_key (execution_id, event_id)`, is the table's primary key and `id` is unique
    by its sequence alone (revision 0010_event_key: no index on `id` by itself); on SQLite `id` is
    the rowid, the primary key, and the key a unique index."""

    __tablename__ = "noetl_event"
    __table_args__ = (
        UniqueConstraint("execution_id", "event_id", name="uq_noetl_event_key"),
        Index("ix_noetl_event_run", "execution_id", "run_id", "event_type"),
        Index("ix_noetl_event_page", "execution_id", "id"),
        Index("ix_noetl_event_type", "execution_id", "event_type", "step"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    execution_id: Mapped[int] = mapped_column(BigInteger)  # first column of each index above
    event_id: Mapped[str] = mapped_column(String(200))
    parent_event_id: Mapped[str | None] = mapped_column(String(200))
    parent_execution_id: Mapped[int | None] = mapped_column(BigInteger)
    queue_id: Mapped[str | None] = mapped_column(String(64))  # Celery task id
    event_type: Mapped[str] = mapped_column(String(64))
    status: Mapped[str | None] = mapped_column(String(32))
    step: Mapped[str | None] = mapped_column(String(200))
    task: Mapped[str | None] = mapped_column(String(200))
    run_id: Mapped[str | None] = mapped_column(String(64))
    attempt: Mapped[int | None] = mapped_column(Integer)
    iteration: Mapped[int | None] = mapped_column(Integer)
    page: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    duration_ms: Mapped[float | None] = mapped_column(Float)
    worker: Mapped[str | None] = mapped_column(String(200))
    context: Mapped[Any | None] = mapped_column(Json)
    result: Mapped[Any | None] = mapped_column(Json)
    error: Mapped[Any | None] = mapped_column(Json)
    meta: Mapped[Any | None] = mapped_column(Json)


class Lease(Base):
    """One row per decision row whose dispatched messages may still be owed an outcome row: by
    `deadline_at` all of them should have one (engine/deadlines.py). The sweeper reads the overdue
    ones, deletes those whose attempts all have outcomes and moves the others' deadline on: the
    event row itself is written once. A small table (the decisions of the last lease period), so
    its churn costs little; the event log is never updated for a lease."""

    __tablename__ = "noetl_lease"
    __table_args__ = (Index("ix_noetl_lease_deadline", "deadline_at"),)

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    event_id: Mapped[str] = mapped_column(String(200), primary_key=True)  # the decision row's key
    deadline_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Variable(Base):
    """Execution-scoped state, one row per name: ctx.*, vars.* and each step's latest result."""

    __tablename__ = "noetl_variable"

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    scope: Mapped[str] = mapped_column(String(16), primary_key=True)  # ctx | vars | result
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    value: Mapped[Any | None] = mapped_column(Json)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Join(Base):
    """Fan-in state of one fork: how many of its branches have settled, and where they meet."""

    __tablename__ = "noetl_join"

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    fork_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    join_step: Mapped[str] = mapped_column(String(200))
    width: Mapped[int] = mapped_column(Integer)
    settled: Mapped[int] = mapped_column(Integer, default=0)
    arrived: Mapped[int] = mapped_column(Integer, default=0)


class LoopState(Base):
    """Counters of one loop instance (one entry of a loop step). A cache of the event rows."""

    __tablename__ = "noetl_loop"

    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    execution_id: Mapped[int] = mapped_column(BigInteger, index=True)
    step: Mapped[str] = mapped_column(String(200))
    mode: Mapped[str] = mapped_column(String(16))
    total: Mapped[int] = mapped_column(Integer)
    # iterations (a cursor loop: slots) in flight at most; the column keeps its first name, `cap`
    # (migrations only add: an older worker of a rolling deploy still writes and reads `cap`)
    max_in_flight: Mapped[int] = mapped_column("cap", Integer, key="max_in_flight")
    dispatched: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    succeeded: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    tolerated: Mapped[int] = mapped_column(Integer, default=0)  # failures a policy said to continue past
    slots_ended: Mapped[int] = mapped_column(Integer, default=0)  # cursor loops: slots that saw no row
    status: Mapped[str] = mapped_column(String(16))  # running | completed
    collection: Mapped[Any | None] = mapped_column(Json)
    context: Mapped[Any | None] = mapped_column(Json)  # run context of the loop (fork frames, args)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class CursorHold(Base):
    """The rows a cursor slot's last claim took, for a claim of a SQL driver that runs its first
    row in its own job (engine/decision/cursor_loop.py `run`): written by the worker before the
    row runs, read when the same claim runs again (its job died, or was delivered again), so that
    the claim takes back its rows whatever the claim SQL does with rows that ran. One row per
    slot, overwritten by its next claim."""

    __tablename__ = "noetl_cursor_hold"

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    claim: Mapped[int] = mapped_column(Integer, nullable=False)
    rows: Mapped[Any] = mapped_column(Json, nullable=False)


class CatalogEntry(Base):
    """A registered playbook (`noetl-celery register`), found by its catalog path (metadata.path)."""

    __tablename__ = "noetl_catalog"

    path: Mapped[str] = mapped_column(String(500), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    source_file: Mapped[str | None] = mapped_column(String(1000))
    content: Mapped[str] = mapped_column(Text)
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Schedule(Base):
    """A playbook fired by Celery beat (noetl_celery/schedules/__init__.py): a cron expression in its time
    zone, or every `interval_s` seconds. Only fire times after `anchor_at` count."""

    __tablename__ = "noetl_schedule"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    playbook: Mapped[str] = mapped_column(String(1000))  # a catalog path, or a playbook file
    cron: Mapped[str | None] = mapped_column(String(200))
    interval_s: Mapped[int | None] = mapped_column(Integer)
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    workload: Mapped[Any | None] = mapped_column(Json)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    missed: Mapped[str] = mapped_column(String(16), default="latest")  # latest | skip
    anchor_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ScheduleRun(Base):
    """One fire time of one schedule, claimed by a beat: the primary key is the claim."""

    __tablename__ = "noetl_schedule_run"
    __table_args__ = (Index("ix_noetl_schedule_run_execution", "execution_id"),)

    schedule: Mapped[str] = mapped_column(String(200), primary_key=True)
    fire_time: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16))  # started | skipped | refused
    execution_id: Mapped[int | None] = mapped_column(BigInteger)
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(String(200))
    detail: Mapped[Any | None] = mapped_column(Json)


class Notification(Base):
    """The failure webhook of one ended execution (noetl_celery/observe/webhooks.py)."""

    __tablename__ = "noetl_notification"

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    url: Mapped[str | None] = mapped_column(String(2000))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_token: Mapped[str | None] = mapped_column(String(64))
    next_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    gave_up_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Blob(Base):
    """A value above NOETL_MAX_RESULT_BYTES, stored once per execution outside the rows that hold
    its reference (limits.reference), by the SHA-256 of its JSON text (store/blobs.py)."""

    __tablename__ = "noetl_blob"

    execution_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)  # bytes of JSON text
    encoding: Mapped[str] = mapped_column(String(16))  # json | json+zlib
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
