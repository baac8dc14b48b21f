"""Celery beat's scheduler for the schedules in the event store (noetl_celery/schedules/__init__.py).

`celery -A noetl_celery beat` uses StoreScheduler (the app's `beat_scheduler`): Celery's beat
service runs its loop, its heap of entries and its sleeps; this class gives it one entry per
schedule that is not paused, read from the store again every `reload_every` seconds, each with
a `FireTimes` schedule (when the next fire time comes). When an entry is due, the fire time is
not sent as a Celery task but claimed and started here, in the beat process, in one transaction
(`schedules.fire`): the claim of (schedule, fire time) in the store decides, so that a second
beat, or one restarted, never starts a fire time twice. Nothing is kept in a local file: the
store is the schedule's state.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import datetime
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import BaseSchedule, schedstate

from noetl_celery import schedules
from noetl_celery.store import clock
from noetl_celery.store import schedules as store
from noetl_celery.store.db import ensure_schema, transaction

log = logging.getLogger(__name__)

ENTRY_PREFIX = "noetl-schedule:"
FIRE_TASK = "noetl.schedule"  # the entries' task name: shown by beat's logs, never sent
RELOAD_EVERY = 5.0  # seconds between reads of the schedules (added, removed, paused, resumed)
# the row fields that make an entry: another value of one of them makes a new entry
ROW_FIELDS = ("playbook", "cron", "interval_s", "timezone", "workload", "missed", "anchor_at", "created_at")


def _now() -> datetime:
    return clock.now()  # the store's clock (store/clock.py), not this host's


class FireTimes(BaseSchedule):
    """When schedule `row` is due next: its first fire time after `seen` (the latest fire time
    this beat has handled, or the store's latest claim when the entry was made)."""

    def __init__(self, row: dict[str, Any], seen: datetime, app: Any = None):
        super().__init__(app=app)
        self.row = row
        self.seen = seen

    def is_due(self, last_run_at: datetime) -> schedstate:
        now = _now()
        upcoming = schedules.next_fire(self.row, self.seen)
        if upcoming <= now:
            following = schedules.next_fire(self.row, now)
            return schedstate(True, max((following - now).total_seconds(), 0.01))
        return schedstate(False, (upcoming - now).total_seconds())

    def remaining_estimate(self, last_run_at: datetime) -> Any:
        return schedules.next_fire(self.row, self.seen) - _now()

    def same(self, row: dict[str, Any]) -> bool:
        return all(self.row.get(k) == row.get(k) for k in ROW_FIELDS)

    def __repr__(self) -> str:
        every = (
            f"cron {self.row['cron']!r} {self.row['timezone']}"
            if self.row["cron"]
            else f"every {self.row['interval_s']} s"
        )
        return f"<FireTimes {self.row['name']}: {every}>"


class StoreScheduler(Scheduler):
    """Celery beat's Scheduler over the store's schedules (see the module's docstring)."""

    max_interval = RELOAD_EVERY
    reload_every = RELOAD_EVERY

    def __init__(self, *args: Any, **kwargs: Any):
        self._loaded_at = 0.0
        self.claimer = f"{socket.gethostname()}:{os.getpid()}"
        super().__init__(*args, **kwargs)

    @property
    def settings(self) -> Any:
        from noetl_celery.app import current_settings

        return current_settings()

    def setup_schedule(self) -> None:
        settings = self.settings
        if not settings.broker_url:
            raise SystemExit(
                "noetl_celery beat: NOETL_BROKER_URL is not set: a beat starts executions for the workers of a broker"
            )
        ensure_schema(settings.database_url)
        self.data: dict[str, ScheduleEntry] = {}
        self.reload()

    def reload(self) -> None:
        """Read the schedules: an entry for each one not paused, kept when its row is unchanged."""
        url = self.settings.database_url
        with transaction(url) as conn:
            rows = [row for row in store.list_schedules(conn) if not row["paused"]]
            lasts = {row["name"]: store.last_fire(conn, row["name"]) for row in rows}
        entries: dict[str, ScheduleEntry] = {}
        for row in rows:
            key = ENTRY_PREFIX + row["name"]
            old = self.data.get(key)
            if old is not None and isinstance(old.schedule, FireTimes) and old.schedule.same(row):
                entries[key] = old
                continue
            last = lasts[row["name"]]
            seen = max(row["anchor_at"], last) if last is not None else row["anchor_at"]
            entries[key] = self.Entry(
                name=key,
                task=FIRE_TASK,
                schedule=FireTimes(row, seen, app=self.app),
                args=(row["name"],),
                app=self.app,
            )
        self.data = entries
        self._loaded_at = time.monotonic()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if time.monotonic() - self._loaded_at >= self.reload_every:
            try:
                self.reload()
            except Exception as exc:  # the store is unreachable: keep the entries, try again later
                log.warning("beat: could not read the schedules: %s", exc)
                self._loaded_at = time.monotonic()
        return float(super().tick(*args, **kwargs))

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **_: Any) -> None:
        """Start what is due of the entry's schedule (claimed in the store), instead of sending a
        Celery message."""
        entry = self.reserve(entry) if advance else entry
        fire_times = entry.schedule
        now = _now()
        started = schedules.fire(self.settings, fire_times.row["name"], now, by=self.claimer)
        fire_times.seen = max(fire_times.seen, now)
        for item in started:
            log.info("beat: schedule %s, fire time %s: %s", fire_times.row["name"], item["fire_time"], item["outcome"])

    def sync(self) -> None:
        """Nothing to write: the store holds every claim."""

    @property
    def info(self) -> str:
        from noetl_celery.store.check import safe_url

        return f"schedules of {safe_url(self.settings.database_url)}"
