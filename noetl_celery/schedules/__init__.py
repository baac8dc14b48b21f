"""Schedules: a playbook started by Celery beat on a cron expression or an interval.

A schedule (`noetl-celery schedule add`, POST /api/schedules) names a playbook (a catalog path,
or a playbook file), a cron expression (5 fields, or 6 with seconds first) in a time zone, or an
interval in whole seconds, and workload overrides merged as `--set` does. `celery -A noetl_celery
beat` fires them through noetl_celery.schedules.beat.StoreScheduler, which reads them from the store.

Exactly once per fire time: a fire time is started by claiming the row (schedule, fire time) of
noetl_schedule_run in the very transaction that creates the execution and decides its start. A
second beat, or a restarted one, that comes to the same fire time finds the row and starts
nothing; the execution and the claim are committed together or not at all.

Missed fire times (the beat was down, or too busy): a fire time up to NOETL_SCHEDULE_GRACE
seconds late (default 10) still runs, each one. Older ones are missed, and the schedule's
`missed` policy decides:
- `latest` (the default): the latest missed fire time runs once, the earlier ones are passed over
  (when a fire time within the grace is due too, that one runs instead);
- `skip`: none runs; the latest is recorded as `skipped` and the schedule waits for the next one.
Fire times while a schedule is paused are not missed: `resume` starts counting from then.

Each started execution records its schedule and fire time (noetl_schedule_run.execution_id):
`status` shows them as `scheduled: {schedule, fire_time}`.

The room schedules holds this module and beat.py (Celery beat's scheduler, the one module of it
that imports Celery). It stands above the runner, through which it starts executions: nothing
below the runner imports it (`.importlinter`, contract schedules).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import ConfigurationError, NoetlError, PlaybookError
from noetl_celery.store import clock
from noetl_celery.store import schedules as store
from noetl_celery.store.db import ensure_schema, transaction

log = logging.getLogger(__name__)

MISSED_POLICIES = ("latest", "skip")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$")
MAX_INTERVAL_S = 366 * 86400


class ScheduleError(NoetlError):
    """A schedule that cannot be stored as given (says which field)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ScheduleNotFound(NoetlError):
    pass


class AlreadyClaimed(Exception):
    """Another beat claimed this fire time first: the start is rolled back."""


@dataclass(frozen=True)
class Fire:
    fire_time: datetime
    action: str  # start | skip


# --- fire times --------------------------------------------------------------------------


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError("timezone", f"unknown time zone {name!r} (an IANA name such as Europe/Berlin)") from None


def _check_cron(expression: str) -> None:
    from croniter import croniter

    fields = expression.split()
    if len(fields) not in (5, 6) or not croniter.is_valid(expression):
        raise ScheduleError(
            "cron", f"not a cron expression: {expression!r} (5 fields, or 6 with seconds first: '*/10 * * * * *')"
        )


def _cron_iter(expression: str, start: datetime, zone: str) -> Any:
    from croniter import croniter

    fields = expression.split()
    return croniter(expression, start.astimezone(_zone(zone)), second_at_beginning=len(fields) == 6)


def _origin(row: dict[str, Any]) -> datetime:
    """The phase of an interval schedule: its creation, to the whole second."""
    created: datetime = row["created_at"]
    return created.replace(microsecond=0)


def next_fire(row: dict[str, Any], after: datetime) -> datetime:
    """The first fire time of schedule `row` strictly after `after` (aware UTC)."""
    if row.get("cron"):
        value = _cron_iter(row["cron"], after, row.get("timezone") or "UTC").get_next(datetime)
        return value.astimezone(UTC)
    step = int(row["interval_s"])
    origin = _origin(row)
    k = math.floor((after - origin).total_seconds() / step) + 1
    candidate = origin + timedelta(seconds=k * step)
    while candidate <= after:  # float rounding at the boundary
        candidate += timedelta(seconds=step)
    return candidate


def latest_fire(row: dict[str, Any], at_or_before: datetime) -> datetime | None:
    """The last fire time of `row` at or before `at_or_before` (None: none since its origin)."""
    if row.get("cron"):
        probe = at_or_before + timedelta(seconds=1)
        value = _cron_iter(row["cron"], probe, row.get("timezone") or "UTC").get_prev(datetime)
        value = value.astimezone(UTC)
        return value if value <= at_or_before else None
    step = int(row["interval_s"])
    origin = _origin(row)
    k = math.floor((at_or_before - origin).total_seconds() / step)
    return origin + timedelta(seconds=k * step) if k >= 1 else None


def due_fires(row: dict[str, Any], last: datetime | None, now: datetime, grace: float) -> list[Fire]:
    """What is due of schedule `row` at `now`, after `last` (the latest fire time claimed): every
    fire time at most `grace` seconds old starts; of the older (missed) ones, the latest starts
    under policy `latest` when nothing within the grace is due, or is recorded as skipped under
    `skip` (see the module's docstring)."""
    after = max(row["anchor_at"], last) if last is not None else row["anchor_at"]
    if after >= now:
        return []
    border = now - timedelta(seconds=grace)
    fires: list[Fire] = []
    cursor = max(after, border)
    while True:
        nxt = next_fire(row, cursor)
        if nxt > now:
            break
        fires.append(Fire(nxt, "start"))
        cursor = nxt
    if border > after:
        missed = latest_fire(row, border)
        if missed is not None and missed > after and not fires:
            fires.append(Fire(missed, "start" if row.get("missed", "latest") == "latest" else "skip"))
    return fires


# --- schedules in the store --------------------------------------------------------------


def validate(
    name: str,
    playbook: str,
    *,
    cron: str | None = None,
    every: int | None = None,
    timezone: str = "UTC",
    workload: dict[str, Any] | None = None,
    missed: str = "latest",
    paused: bool = False,
) -> dict[str, Any]:
    """The row of a schedule as given, or ScheduleError naming the field."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ScheduleError("name", f"letters, digits and _ . : - (up to 200), got {name!r}")
    if not isinstance(playbook, str) or not playbook.strip():
        raise ScheduleError("playbook", "expected a catalog path or a playbook file")
    if (cron is None) == (every is None):
        raise ScheduleError("cron", "give either a cron expression or an interval (every), not both or neither")
    if cron is not None:
        if not isinstance(cron, str):
            raise ScheduleError("cron", f"expected a string, got {cron!r}")
        _check_cron(cron.strip())
    if every is not None and (
        not isinstance(every, int) or isinstance(every, bool) or not 1 <= every <= MAX_INTERVAL_S
    ):
        raise ScheduleError("every", f"expected whole seconds from 1 to {MAX_INTERVAL_S}, got {every!r}")
    _zone(timezone)
    if missed not in MISSED_POLICIES:
        raise ScheduleError("missed", f"one of {', '.join(MISSED_POLICIES)}, got {missed!r}")
    if workload is not None and not isinstance(workload, dict):
        raise ScheduleError("workload", "expected a mapping of overrides")
    return {
        "name": name,
        "playbook": playbook.strip(),
        "cron": cron.strip() if cron is not None else None,
        "interval_s": every,
        "timezone": timezone,
        "workload": workload or {},
        "paused": bool(paused),
        "missed": missed,
    }


def _resolve_playbook(reference: str, database_url: str) -> str:
    """A catalog path as it is; a file as its absolute path. ScheduleError when it is neither."""
    from noetl_celery import runner

    if runner.catalog(database_url)(reference) is not None:
        return reference
    path = Path(reference).expanduser()
    if path.is_file():
        return str(path.resolve())
    raise ScheduleError("playbook", f"no playbook registered at catalog path {reference!r} and no such file")


def add(database_url: str, values: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
    """Store a schedule (validated with `validate`); returns it as `describe` shows it."""
    ensure_schema(database_url)
    row = {**values, "playbook": _resolve_playbook(values["playbook"], database_url)}
    with transaction(database_url) as conn:
        if not store.put_schedule(conn, row, replace=replace):
            raise ScheduleError("name", f"a schedule named {row['name']!r} exists (remove it, or replace it)")
        stored = store.get_schedule(conn, row["name"])
    assert stored is not None
    return describe(stored, None)


def remove(database_url: str, name: str) -> None:
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        if not store.delete_schedule(conn, name):
            raise ScheduleNotFound(f"no schedule named {name!r}")


def set_paused(database_url: str, name: str, paused: bool) -> dict[str, Any]:
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        if not store.set_paused(conn, name, paused):
            raise ScheduleNotFound(f"no schedule named {name!r}")
        row = store.get_schedule(conn, name)
        last = store.last_fire(conn, name)
    assert row is not None
    return describe(row, last)


def list_all(database_url: str) -> list[dict[str, Any]]:
    ensure_schema(database_url)
    out = []
    with transaction(database_url) as conn:
        for row in store.list_schedules(conn):
            latest = store.schedule_runs(conn, row["name"], 1)
            last = latest[0]["fire_time"] if latest else None
            out.append({**describe(row, last), "last_run": _run_view(latest[0]) if latest else None})
    return out


def get(database_url: str, name: str, runs: int = 20) -> dict[str, Any]:
    ensure_schema(database_url)
    with transaction(database_url) as conn:
        row = store.get_schedule(conn, name)
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        found = store.schedule_runs(conn, name, runs)
        last = store.last_fire(conn, name)
    return {**describe(row, last), "runs": [_run_view(r) for r in found]}


def _run_view(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "fire_time": _iso(run["fire_time"]),
        "outcome": run["outcome"],
        "execution_id": run["execution_id"],
        "claimed_at": _iso(run["claimed_at"]),
        "claimed_by": run["claimed_by"],
        "detail": run["detail"],
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def describe(row: dict[str, Any], last: datetime | None, now: datetime | None = None) -> dict[str, Any]:
    """A schedule as the CLI, the API and the dashboard show it."""
    now = now or clock.now()  # the store's clock
    after = max(now, row["anchor_at"], last or row["anchor_at"])
    return {
        "name": row["name"],
        "playbook": row["playbook"],
        "cron": row["cron"],
        "every": row["interval_s"],
        "timezone": row["timezone"],
        "workload": row["workload"] or {},
        "paused": bool(row["paused"]),
        "missed": row["missed"],
        "last_fire": _iso(last),
        "next_fire": None if row["paused"] else _iso(next_fire(row, after)),
        "created_at": _iso(row["created_at"]),
        "updated_at": _iso(row["updated_at"]),
    }


# --- firing ------------------------------------------------------------------------------


def fire(
    settings: noetl_settings.Settings, name: str, now: datetime | None = None, by: str | None = None
) -> list[dict[str, Any]]:
    """Start what is due of schedule `name` at `now` (see `due_fires`); returns one entry per fire
    time this call claimed: {fire_time, outcome, execution_id}. Fire times another beat claimed
    first are left out. A paused or removed schedule starts nothing."""
    url = settings.database_url
    now = now or clock.now()  # the store's clock
    with transaction(url) as conn:
        row = store.get_schedule(conn, name)
        last = store.last_fire(conn, name) if row is not None else None
    if row is None or row["paused"]:
        return []
    done: list[dict[str, Any]] = []
    for due in due_fires(row, last, now, settings.schedule_grace):
        outcome = _fire_one(settings, row, due, by)
        if outcome is not None:
            done.append(outcome)
    return done


def run_now(settings: noetl_settings.Settings, name: str) -> int:
    """Start schedule `name`'s playbook now, with its workload, outside its fire times (the
    dashboard's and the API's "run now"): no fire time is claimed, so the next one still runs.
    A paused schedule runs too (pausing stops only its fire times)."""
    from noetl_celery import runner

    url = settings.database_url
    with transaction(url) as conn:
        row = store.get_schedule(conn, name)
    if row is None:
        raise ScheduleNotFound(f"no schedule named {name!r}")
    execution_id = runner.submit(_plan(row, url), settings)
    log.info("schedule %s: run now started execution %s", name, execution_id)
    return execution_id


def _fire_one(
    settings: noetl_settings.Settings, row: dict[str, Any], due: Fire, by: str | None
) -> dict[str, Any] | None:
    from noetl_celery import runner

    url, name = settings.database_url, row["name"]
    if due.action == "skip":
        with transaction(url) as conn:
            claimed = store.claim_fire(conn, name, due.fire_time, "skipped", by=by, detail={"reason": "missed"})
        if claimed:
            log.info("schedule %s: fire time %s missed, skipped (policy skip)", name, due.fire_time.isoformat())
            return {"fire_time": due.fire_time.isoformat(), "outcome": "skipped", "execution_id": None}
        return None
    try:
        plan = _plan(row, url)
    except (PlaybookError, ConfigurationError, OSError) as exc:
        reason = str(exc).splitlines()[0][:2000]
        with transaction(url) as conn:
            claimed = store.claim_fire(conn, name, due.fire_time, "refused", by=by, detail={"error": reason})
        if claimed:
            log.error("schedule %s: fire time %s not started: %s", name, due.fire_time.isoformat(), reason)
            return {"fire_time": due.fire_time.isoformat(), "outcome": "refused", "execution_id": None}
        return None

    def claim(conn: Any, execution_id: int) -> None:
        if not store.claim_fire(conn, name, due.fire_time, "started", execution_id=execution_id, by=by):
            raise AlreadyClaimed(name)

    try:
        execution_id = runner.submit(plan, settings, claim=claim)
    except AlreadyClaimed:
        return None
    log.info("schedule %s: fire time %s started execution %s", name, due.fire_time.isoformat(), execution_id)
    return {"fire_time": due.fire_time.isoformat(), "outcome": "started", "execution_id": execution_id}


def _plan(row: dict[str, Any], database_url: str) -> Any:
    """The schedule's playbook as it is now (the latest registration, or the file), compiled with
    the schedule's workload overrides."""
    from noetl_celery import runner
    from noetl_celery.compiler import compile_playbook

    overrides = row["workload"] or {}
    reference = row["playbook"]
    if runner.catalog(database_url)(reference) is not None:
        return runner.compile_registered(reference, overrides, database_url)
    return compile_playbook(reference, overrides=overrides, catalog=runner.catalog(database_url))
