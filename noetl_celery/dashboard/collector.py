"""The server's `/metrics`: the deployment's state, read from the store and the broker at each scrape.

Decides which series the server shows and how a failed read shows: a collector (not values kept
in this process) because what an operator alerts on is the deployment's state, the same
whichever process is asked: executions by playbook and status, overdue leases and the sweeper's
lag (store/gauges.py says what each means), webhook notifications, schedule fire times, and the
depth of the task and event queues. A store or broker that cannot be read gives
`noetl_store_up 0` / `noetl_broker_up 0` and leaves its series out: a scrape never fails for it.
What only a worker sees as it happens (attempts, tool and decision durations, re-publishes) is
on each worker's own port (metrics.py). Each scrape costs a few grouped statements, bounded by
SCRAPE_TIMEOUT on PostgreSQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import Connection, text

from noetl_celery import schedules
from noetl_celery.config import settings as noetl_settings
from noetl_celery.store import gauges
from noetl_celery.store.db import transaction
from noetl_celery.store.kernel import utcnow

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_MS = 5000  # PostgreSQL statement_timeout of each scrape's reads
MISSED_CAP = 1000  # fire times counted as missed per schedule, at most


def registry(settings: noetl_settings.Settings, celery_app: Callable[[], Any] | None = None) -> CollectorRegistry:
    """A registry holding the store's collector (`celery_app`: returns the app whose broker's queues
    are measured; None: no queue depths, as with the embedded broker)."""
    found = CollectorRegistry(auto_describe=False)
    found.register(StoreCollector(settings, celery_app))  # type: ignore[arg-type]
    return found


def exposition(found: CollectorRegistry) -> bytes:
    return generate_latest(found)


class StoreCollector:
    """Yields the series of one scrape (see the module docstring)."""

    def __init__(self, settings: noetl_settings.Settings, celery_app: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.celery_app = celery_app

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        yield from self._store_series()
        if self.celery_app is not None:
            yield from self._queue_series()
        took = GaugeMetricFamily("noetl_scrape_seconds", "Seconds this scrape's reads of the store and broker took")
        took.add_metric([], time.perf_counter() - started)
        yield took

    def _store_series(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("noetl_store_up", "Whether the event store answered this scrape (1) or not (0)")
        try:
            with transaction(self.settings.database_url) as conn:
                _bound(conn)
                series = list(_store_facts(conn, utcnow(), self.settings.schedule_grace))
        except Exception as exc:  # unreachable, or behind this version: shown as down
            log.warning("metrics: the store could not be read: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from series

    def _queue_series(self) -> Iterator[Metric]:
        from noetl_celery.dashboard import broker_queues

        up = GaugeMetricFamily("noetl_broker_up", "Whether the broker answered this scrape (1) or not (0)")
        queues = (self.settings.task_queue, self.settings.event_queue)
        try:
            assert self.celery_app is not None
            depths = broker_queues.queue_depths(self.celery_app(), queues)
        except Exception as exc:
            log.warning("metrics: the broker's queues could not be read: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily(
            "noetl_queue_depth", "Messages waiting in the queue (not yet taken)", labels=["queue"]
        )
        for queue, count in depths.items():
            depth.add_metric([queue], count)
        yield depth


def _bound(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"SET LOCAL statement_timeout = {SCRAPE_TIMEOUT_MS}"))


def _store_facts(conn: Connection, now: datetime, grace: float) -> Iterator[Metric]:
    yield from _executions(conn)
    yield from _leases(conn, now)
    yield from _notifications(conn)
    yield from _schedules(conn, now, grace)


def _executions(conn: Connection) -> Iterator[Metric]:
    started = CounterMetricFamily("noetl_executions_started", "Executions started, by playbook", labels=["playbook"])
    ended = CounterMetricFamily(
        "noetl_executions_ended", "Executions ended, by playbook and status", labels=["playbook", "status"]
    )
    running = GaugeMetricFamily("noetl_executions_running", "Executions running now, by playbook", labels=["playbook"])
    totals: dict[str, int] = {}
    counts: dict[tuple[str, str], int] = {}
    for playbook, status, count in gauges.executions_by_status(conn):
        totals[playbook] = totals.get(playbook, 0) + count
        counts[(playbook, status)] = count
    for playbook, count in sorted(totals.items()):
        started.add_metric([playbook], count)
        running.add_metric([playbook], counts.get((playbook, "running"), 0))
        for status in gauges.ENDED_STATUSES:  # 0 from the first start: a first failure is a rise, not a new series
            ended.add_metric([playbook, status], counts.get((playbook, status), 0))
    yield from (started, ended, running)


def _leases(conn: Connection, now: datetime) -> Iterator[Metric]:
    count, lag = gauges.overdue_leases(conn, now)
    overdue = GaugeMetricFamily("noetl_leases_overdue", "Decision leases past their deadline (attempts not reported)")
    overdue.add_metric([], count)
    behind = GaugeMetricFamily(
        "noetl_sweeper_lag_seconds", "Seconds the oldest overdue lease is past its deadline (0: the sweeper keeps up)"
    )
    behind.add_metric([], lag)
    yield from (overdue, behind)


def _notifications(conn: Connection) -> Iterator[Metric]:
    states = GaugeMetricFamily("noetl_webhook_notifications", "Webhook notifications, by state", labels=["state"])
    failed = CounterMetricFamily("noetl_webhook_deliveries_failed", "Webhook delivery attempts that failed")
    fails = 0
    for state, (count, failures) in sorted(gauges.notifications_by_state(conn).items()):
        states.add_metric([state], count)
        fails += failures
    failed.add_metric([], fails)
    yield from (states, failed)


def _schedules(conn: Connection, now: datetime, grace: float) -> Iterator[Metric]:
    claims = CounterMetricFamily(
        "noetl_schedule_fires", "Schedule fire times claimed, by outcome", labels=["schedule", "outcome"]
    )
    for name, outcome, count in gauges.schedule_claims(conn):
        claims.add_metric([name, outcome], count)
    missed = GaugeMetricFamily(
        "noetl_schedule_fires_missed",
        "Fire times of a schedule that are past their grace and not claimed by any beat (no beat is firing it)",
        labels=["schedule"],
    )
    for row in gauges.schedules_with_last_fire(conn):
        missed.add_metric([row["name"]], missed_fires(row, now, grace))
    yield from (claims, missed)


def missed_fires(row: dict[str, Any], now: datetime, grace: float) -> int:
    """How many fire times of schedule `row` after its last claim are more than `grace` seconds
    old (at most MISSED_CAP)."""
    after = max(row["anchor_at"], row["last"]) if row.get("last") else row["anchor_at"]
    border = now - timedelta(seconds=grace)
    count = 0
    fire = schedules.next_fire(row, after)
    while fire <= border and count < MISSED_CAP:
        count += 1
        fire = schedules.next_fire(row, fire)
    return count
