"""The sweeper's transport: what a sweep of the event store publishes and decides, how busy the
broker's queues are, and the sweeper's share of upkeep (retention, partitions, the lease table's
vacuum) and of failure webhooks.

Every worker main process runs the sweeper (engine/recovery/sweeper.py) on a timer
(`start_sweeper`, at `worker_ready`); the sweep itself decides in the store, and this module acts
on each of its transactions once committed (`_act_on_sweep`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from typing import Any

from noetl_celery.config.settings import Settings
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.recovery import sweeper
from noetl_celery.engine.transport import publisher
from noetl_celery.engine.transport.bound import binding, current_settings
from noetl_celery.engine.transport.deciding import process_event
from noetl_celery.engine.transport.publish import SUBMIT_RETRY_POLICY, publish, send_event
from noetl_celery.observe import metrics
from noetl_celery.store import leases, retention

log = logging.getLogger(__name__)


def sweep_once() -> sweeper.SweepResult:
    """One sweep of the event store, and the publishing and deciding it calls for (after each of
    the sweep's transactions commits); then, with NOETL_PRUNE_OLDER_THAN, a share of retention,
    the coming partitions of a partitioned event table, and a vacuum of the lease table where
    autovacuum has not kept up with it."""
    settings = current_settings()
    busy, waiting_since = _queue_view(settings)
    result = sweeper.sweep(
        settings.database_url,
        queue_busy=busy,
        waiting_since=waiting_since,
        max_republishes=settings.max_republishes,
        interval=settings.sweep_interval,
        timeout=settings.sweep_timeout,
        committed=functools.partial(_act_on_sweep, queues_busy=busy, waits_known=waiting_since is not None),
    )
    if settings.prune_older_than is not None and not result.skipped:  # the sweeper holding the lock prunes
        _prune_share(settings.database_url, settings.prune_older_than, settings.sweep_interval)
    if not result.skipped:
        _partitions_ahead(settings.database_url)
        _vacuum_leases(settings.database_url)
    _notify_ended()
    return result


PRUNE_EVERY = 60.0  # seconds between two retention passes of the sweeper once one found nothing left
_next_prune = 0.0


def _prune_share(url: str, older_than: Any, interval: float) -> None:
    """At most a fifth of the sweep interval of `noetl-celery prune --older-than` work; the next
    tick goes on while it leaves work, else the next pass is PRUNE_EVERY seconds later."""
    global _next_prune
    if time.monotonic() < _next_prune:
        return
    pruned = retention.prune(url, older_than, budget=max(interval / 5, 0.2))
    if pruned.executions:
        log.info("retention: removed %d execution(s) older than %s: %s", pruned.executions, older_than, pruned.rows)
    for dropped in pruned.partitions:
        log.info("retention: dropped partition %s (%d event rows)", dropped.name, dropped.rows)
    _next_prune = 0.0 if not pruned.done else time.monotonic() + PRUNE_EVERY


PARTITIONS_EVERY = 600.0  # seconds between two looks at a partitioned event table's coming partitions
_next_partitions = 0.0


def _partitions_ahead(url: str) -> None:
    """A partitioned event table (`noetl-celery store partition-events`) gets the partitions of
    the coming periods before ids reach them (store/partitions.py keep_ahead): one catalog read
    every PARTITIONS_EVERY seconds on PostgreSQL, nothing on SQLite."""
    global _next_partitions
    if time.monotonic() < _next_partitions:
        return
    _next_partitions = time.monotonic() + PARTITIONS_EVERY
    retention.keep_partitions_ahead(url)


LEASE_VACUUM_EVERY = 60.0  # seconds between two looks at the lease table's dead rows
_next_lease_vacuum = 0.0


_lease_vacuum: threading.Thread | None = None


def _vacuum_leases(url: str) -> threading.Thread | None:
    """The lease table vacuumed where autovacuum has not kept up with it (store/leases.py
    vacuum_if_needed): one statistics read every LEASE_VACUUM_EVERY seconds on PostgreSQL, nothing
    on SQLite. It runs on a thread of its own, so that a long first vacuum of a bloated table does
    not hold back the sweeps (and the recovery of lost attempts); a look while the last one still
    runs is skipped. A failure is logged; the next look tries again. The thread, when one started."""
    global _next_lease_vacuum, _lease_vacuum
    if time.monotonic() < _next_lease_vacuum or (_lease_vacuum is not None and _lease_vacuum.is_alive()):
        return None
    _next_lease_vacuum = time.monotonic() + LEASE_VACUUM_EVERY

    def look() -> None:
        try:
            if leases.vacuum_if_needed(url):
                log.info("sweeper: vacuumed noetl_lease (autovacuum had not, for %.0f s)", leases.VACUUM_QUIET)
        except Exception as exc:
            log.warning("sweeper: VACUUM noetl_lease failed: %s", exc)

    _lease_vacuum = threading.Thread(target=look, name="noetl-lease-vacuum", daemon=True)
    _lease_vacuum.start()
    return _lease_vacuum


def enqueue_notifications(execution_ids: list[int], countdown: float = 0.0) -> None:
    """Send `noetl.notify` for each execution to the event queue (after the decision that ended
    it committed). A broker that cannot be reached is logged: the next sweep sends them."""
    for execution_id in execution_ids:
        try:
            binding().notify.apply_async(
                kwargs={"execution_id": execution_id},
                queue=current_settings().event_queue,
                countdown=countdown or None,
                argsrepr=f"webhook of execution {execution_id}",
                retry_policy=SUBMIT_RETRY_POLICY,
            )
        except Exception as exc:
            log.warning("webhook of execution %s not enqueued (the sweep retries): %s", execution_id, exc)


def _notify_ended() -> None:
    """The sweep's part of failure webhooks: enqueue the notifications that are due."""
    from noetl_celery.observe import webhooks

    try:
        due = webhooks.pending(current_settings())
    except Exception as exc:  # a store behind this version, or unreachable: the next sweep
        log.debug("webhook scan skipped: %s", exc)
        return
    enqueue_notifications(due)


def _act_on_sweep(result: sweeper.SweepResult, queues_busy: bool = False, waits_known: bool = False) -> None:
    """Publish and decide what one transaction of a sweep recorded. Re-published attempts go to
    the event queue: a backlog in the task queue must not hold back the attempts that were lost.
    Where the broker cannot tell how long its messages waited (`waits_known` false: RabbitMQ) and
    the queues hold messages, an overdue attempt may only be waiting in line: its re-publish is
    logged at INFO, and whichever copy runs first is recorded, the other skipped. Otherwise (the
    sweeper left alone what may still be in the queue) it is a WARNING."""
    settings = current_settings()
    if result.republished:
        if queues_busy and not waits_known:
            log.info(
                "sweeper: re-publishing %d overdue attempt(s) while the queues hold messages (they may be "
                "waiting in line; the copy that runs first is recorded, the other skipped)",
                len(result.republished),
            )
        else:
            log.warning("sweeper: re-publishing %d overdue attempt(s)", len(result.republished))
        publish(result.republished, queue=settings.event_queue)
        metrics.republished(len(result.republished))
    for execution_id in result.starts:
        send_event(orchestrator.start_payload(execution_id))
    for payload in result.lost:
        log.warning("sweeper: attempt of execution %s lost", payload["execution_id"])
        process_event(payload)


def _queues_busy(settings: Settings, celery_app: Any = None) -> bool:
    """True when a queue still holds messages (an overdue attempt, or its outcome, may be waiting
    in line)."""
    return _queue_view(settings, celery_app)[0]


def _queue_view(settings: Settings, celery_app: Any = None) -> tuple[bool, float | None]:
    """(whether a queue still holds messages, the publish time of the oldest of them when the
    broker can tell it). Messages a worker has taken (held countdowns included) are not counted,
    on Redis (LLEN) as on RabbitMQ (a passive declare's message_count: the ready messages). On
    Redis the oldest message of a queue is its tail (kombu pushes on the left and pops on the
    right), read with the count in one pipeline; RabbitMQ cannot show a message without taking
    it, so there the time is unknown (None).

    The connection comes from the app's pool and keeps its default channel between sweeps (on
    Redis one client over that channel's connection pool: no new connection per sweep). On
    RabbitMQ each queue gets a channel of its own: a queue that does not exist yet closes the
    channel that asked."""
    queues = (settings.task_queue, settings.event_queue)
    try:
        with (celery_app or binding().app).pool.acquire(block=True, timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
            if conn.transport.driver_type == "redis":
                return _redis_queue_view(conn.default_channel.client, queues)
            for queue in queues:
                channel = conn.channel()
                try:
                    if channel.queue_declare(queue=queue, passive=True).message_count > 0:
                        return True, None
                except Exception:  # the queue does not exist yet: nothing waits in it
                    continue
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
            return False, None
    except Exception:  # the broker cannot be reached or cannot tell: not busy
        return False, None


def _redis_queue_view(client: Any, queues: tuple[str, ...]) -> tuple[bool, float | None]:
    """Busy, and the oldest waiting message's `noetl_sent`, of these Redis lists: one round trip.
    A waiting message without the header (sent by an earlier release) makes the time unknown."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(queue)
        pipe.lindex(queue, -1)
    answers = pipe.execute()
    busy, oldest, known = False, None, True
    for length, tail in zip(answers[0::2], answers[1::2], strict=True):
        if not length:
            continue
        busy = True
        sent = _sent_of(tail)
        if sent is None:
            known = False
        elif oldest is None or sent < oldest:
            oldest = sent
    return busy, (oldest if busy and known else None)


def _sent_of(raw: bytes | str | None) -> float | None:
    """The `noetl_sent` header of a message as kombu's Redis transport keeps it (JSON)."""
    if raw is None:
        return None
    try:
        sent = json.loads(raw).get("headers", {}).get(publisher.SENT_HEADER)
    except (ValueError, AttributeError):
        return None
    return float(sent) if isinstance(sent, int | float) else None


_sweeper: sweeper.SweeperThread | None = None


def start_sweeper() -> sweeper.SweeperThread | None:
    """Start the sweeper thread of this process (once); NOETL_SWEEP_INTERVAL=0 disables it."""
    global _sweeper
    interval = current_settings().sweep_interval
    if interval <= 0:
        return None
    if _sweeper is None or not _sweeper.is_alive():
        _sweeper = sweeper.SweeperThread(sweep_once, interval)
        _sweeper.start()
    return _sweeper


def stop_sweeper() -> None:
    global _sweeper
    if _sweeper is not None:
        _sweeper.stop()
        _sweeper = None
