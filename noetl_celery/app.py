"""The Celery app: configuration, the two task types, and how decisions are published.

- `noetl.run_task` (queue NOETL_TASK_QUEUE): one attempt of one tool call; ends by sending its
  outcome to `noetl.on_event`.
- `noetl.on_event` (queue NOETL_EVENT_QUEUE): records the event and decides what runs next.
Both are late-acknowledged and rejected on worker loss, so a killed worker loses nothing; a task
that keeps killing its pool process ends as a `worker_lost` attempt (engine/transport/worker_loss.py).
Each run_task message carries Celery soft/hard time limits derived from the attempt's timeout.
Neither uses Celery retries, chords or groups: retries and loops are on_event's decisions.
Every worker main process runs the sweeper (engine/recovery/sweeper.py) on a timer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject
from kombu.asynchronous.timer import to_timestamp as _kombu_to_timestamp
from sqlalchemy.exc import DataError, DBAPIError

from noetl_celery import limits as noetl_limits
from noetl_celery import log_format, metrics, publisher, redis_transport, secret_registry
from noetl_celery import settings as noetl_settings
from noetl_celery.compiler.names import ON_EVENT, RUN_TASK, attempt_shadow, event_shadow, execution_kwargsrepr
from noetl_celery.engine import deadlines
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, MessageError, TaskMessage, check_version, stamp, wire
from noetl_celery.engine.recovery import sweeper
from noetl_celery.engine.transport import eager, process, reconnect, task_events, verdict, worker_loss
from noetl_celery.errors import AttemptFailed, ConfigurationError, WebhookNotDelivered
from noetl_celery.jsonable import storable
from noetl_celery.store import check as store_check
from noetl_celery.store import clock, leases, retention
from noetl_celery.vocabulary import DispatchKind, ErrorKind, PayloadKind

log = logging.getLogger(__name__)

EMBEDDED_POLLING_INTERVAL = 0.001  # seconds; memory:// polls at 1 s by default (33 msgs/s)
# an event (or an attempt) is delayed while the event store is unreachable: 0.2 s doubling up to
# EVENT_DB_MAX_WAIT, EVENT_DB_RETRIES times (about 13 minutes in all), so that work goes on within
# EVENT_DB_MAX_WAIT seconds of the store coming back, however long it was away
EVENT_DB_RETRIES = 156
EVENT_DB_MAX_WAIT = 5.0
# publishing decided messages: about 16 s of retries ride out a broker restart; after that the
# sweeper re-publishes them from the stored dispatch list
PUBLISH_RETRY_POLICY = {"max_retries": 10, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2.0}
SUBMIT_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.3, "interval_max": 0.5}


class PublishFailed(Exception):
    """Decided messages could not be published (broker unreachable); they are in the store."""


REDIS_CONNECT_TIMEOUT = 5.0  # seconds a connect to Redis may take before it is tried again
REDIS_HEALTH_CHECK = 10.0  # seconds a Redis connection may sit idle before it is checked on its next use


def broker_options(settings: noetl_settings.Settings, *, embedded: bool = False) -> dict[str, Any]:
    """The Celery settings that depend on the kind of broker.

    Redis: the visibility timeout (broker, result backend and Celery's own setting) and a fast
    sweep for the unacknowledged messages of dead consumers. RabbitMQ has neither: it requeues a
    consumer's unacknowledged messages as soon as its connection closes. There, publisher confirms
    are on, so a publish returns once the broker has the message (as a Redis LPUSH does) and a
    refused one raises instead of vanishing."""
    if embedded:
        return {"broker_transport_options": {"polling_interval": EMBEDDED_POLLING_INTERVAL}}
    if settings.amqp_broker:
        return {"broker_transport_options": {"confirm_publish": True}}
    return {
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout,
            # Redis: sweep for messages whose consumer died (unacked past the visibility timeout)
            # every `restore_interval` seconds, instead of kombu's default of about 100 s.
            "unacked_restore_interval": settings.restore_interval,
            "unacked_restore_throttle": 1,
            # a dead link is noticed (keepalive, a health check before a command on a connection
            # idle that long) and a connect to an unreachable Redis gives up, in seconds
            "socket_keepalive": True,
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT,
            "health_check_interval": REDIS_HEALTH_CHECK,
            "retry_on_timeout": True,
        },
        "result_backend_transport_options": {"visibility_timeout": settings.visibility_timeout},
        "visibility_timeout": settings.visibility_timeout,
    }


def configure(app: Celery, settings: noetl_settings.Settings, *, embedded: bool = False) -> None:
    clock.warn_after = settings.clock_skew_warn
    options: dict[str, Any] = dict(
        broker_url=noetl_settings.EMBEDDED_BROKER
        if embedded
        else (settings.broker_url or noetl_settings.EMBEDDED_BROKER),
        result_backend=settings.result_backend,
        task_ignore_result=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=settings.prefetch_multiplier,
        broker_transport_options={},
        result_backend_transport_options={},
        broker_connection_retry_on_startup=True,
        # a lost broker link is tried again every 2 s at most: back within 2 s of healing
        worker_consumer=reconnect.CONSUMER,
        task_default_queue=settings.task_queue,
        task_routes={RUN_TASK: {"queue": settings.task_queue}, ON_EVENT: {"queue": settings.event_queue}},
        task_publish_retry_policy=PUBLISH_RETRY_POLICY,
        worker_send_task_events=settings.task_events,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        noetl_settings=settings,
        noetl_embedded=embedded,
        # `celery -A noetl_celery beat`: the schedules of the event store (noetl_celery/beat.py)
        beat_scheduler="noetl_celery.beat:StoreScheduler",
    )
    options.update(broker_options(settings, embedded=embedded))
    app.conf.update(options)


def _settings_at_import() -> tuple[noetl_settings.Settings, ConfigurationError | None]:
    """The environment's settings; a bad environment must not break `import noetl_celery` (the
    CLI reports it, a worker refuses to start with the message)."""
    try:
        return noetl_settings.load(), None
    except ConfigurationError as exc:
        return noetl_settings.defaults(), exc


redis_transport.install()  # before the app makes its first connection
app = Celery("noetl_celery")
_settings, _settings_error = _settings_at_import()
configure(app, _settings)
if _settings_error is None:
    noetl_limits.max_result_depth()  # the recursion limit that results of that depth need, from the start


def current_settings() -> noetl_settings.Settings:
    if _settings_error is not None and not app.conf.noetl_embedded:
        raise _settings_error
    return app.conf.noetl_settings


@app.task(
    name=RUN_TASK,
    bind=True,
    acks_late=True,
    ignore_result=True,
    Request="noetl_celery.engine.transport.worker_loss:AttemptRequest",
    # a failed attempt (the playbook's own doing, recorded) is logged as one INFO line, without the
    # engine's traceback, and so is a publish that failed in a broker outage (the decision is
    # recorded, its messages are in the store for the sweeper; `decide` logged it at ERROR, in one
    # line); any other exception is an engine fault and keeps ERROR and its traceback
    throws=(AttemptFailed, PublishFailed),
)
def run_task(self, execution_id: int, message: dict[str, Any]) -> str:  # type: ignore[no-untyped-def]
    """Run one attempt and report it. `execution_id` is duplicated here for Flower's kwargs column.

    The outcome goes to on_event: called in this same job when NOETL_EVENT_DISPATCH=inline (the
    default: one message per attempt), or sent to the on_event queue when it is `queue`. An event
    store that is down or busy delays the attempt like on_event's events (see `_store_delay`).
    Only then is Celery told how the attempt went (engine/transport/verdict.py): a failed attempt raises
    AttemptFailed (or a Retry), after its decision is recorded and published. With
    NOETL_EAGER_WINDOW, an attempt due now that the decision dispatches may run here first
    (engine/transport/eager.py); Celery is still told about this message's own attempt.
    """
    started = time.monotonic()
    process.defer_termination()  # a group-wide SIGTERM lets this attempt finish (engine/transport/process.py)
    try:
        task_message = TaskMessage.from_dict(message)
    except MessageError as exc:
        refuse_message(execution_id, {"task": message}, exc)
        return f"refused: {exc}"
    run = worker.execute_batch if task_message.batch else worker.execute
    settings = current_settings()
    url = settings.database_url
    try:
        if _redelivered(self.request) and not task_message.replay and worker.already_done(url, task_message):
            key = task_message.outcome_key()
            publish(orchestrator.replay(url, task_message.execution_id, key, ran_by=self.request.id))
            return "redelivered: this attempt was already recorded; its decision was sent again"
        lease = deadlines.lease(0, _timeout_of(self.request))
        if _late(self.request) and not task_message.replay and worker.taken_late(url, task_message, lease):
            # its lease runs from here on (one statement, only for a message that waited in line)
            return "late: this attempt waited in line past its lease; its re-published copy recorded it"
        if _redelivered(self.request) and task_message.is_claim:  # it may have claimed: take its rows back
            task_message = task_message.evolve(replay=True)
        payload = run(url, task_message, queue_id=self.request.id, node=self.request.hostname)
    except DBAPIError as exc:
        _store_delay(task_message, exc, _timeout_of(self.request))
        return "delayed: the event store is unavailable"
    if payload is None:
        return "replay: this attempt was already recorded"
    decided: list[Dispatch] | None = None
    if settings.event_dispatch == "inline":
        window = eager.window_of(self.request, settings.eager_window, started)
        decided, taken = decide(payload, window.take if window else None)
        if window is not None and taken is not None:
            _run_eagerly(taken, window, self.request)
    else:
        send_event(payload)
    return verdict.conclude(payload, decided, raise_failures=not app.conf.noetl_embedded)


def _run_eagerly(taken: Dispatch, window: eager.Window, request: Any) -> None:
    """Run, here, the attempt a decision of this message took (engine/transport/eager.py), then the one its
    decision takes, and so on. Each is decided and published like any other attempt."""
    settings = current_settings()
    mark = eager.Mark(request.id)  # which attempt this process is in, should it die (worker_loss)
    try:
        _run_taken(taken, window, request, mark, settings)
    finally:
        mark.close()


def _run_taken(
    taken: Dispatch, window: eager.Window, request: Any, mark: eager.Mark, settings: noetl_settings.Settings
) -> None:
    dispatch: Dispatch | None = taken
    while dispatch is not None:
        ran = dispatch
        message = TaskMessage.from_dict(ran.message)
        started, clock = time.time(), time.monotonic()
        mark.note(ran.message)
        try:
            payload = worker.run_attempt(settings.database_url, message, queue_id=request.id, node=request.hostname)
        except DBAPIError as exc:
            _store_delay(message, exc, ran.timeout)
            return
        decided, dispatch = decide(payload, window.take)
        log.info("ran eagerly: %s", verdict.conclude(payload, decided, raise_failures=False))
        if settings.eager_task_events:  # Flower shows it as a task of its own
            shown = attempt_shown(ran, message, settings.dashboard_url)
            task_events.announce(
                app,
                request,
                name=shown["shadow"],
                args=shown["argsrepr"],
                kwargs=shown["kwargsrepr"],
                started=started,
                runtime=time.monotonic() - clock,
                end=task_events.ending(payload, decided),
            )


def _redelivered(request: Any) -> bool:
    """Whether the broker delivered this message before (RabbitMQ's flag; kombu's Redis transport
    sets it on the messages it restores). A worker that died between an attempt's recorded
    decision and the acknowledgement leaves such a message: its tool must not run again."""
    return bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))


def _late(request: Any) -> bool:
    """Whether this message waited in its broker's queue longer than deadlines.PICKUP_SLACK: its
    decision's lease, which ran from the decision, would no longer cover the attempt from here.
    Such a message moves the lease on to run from now (its decision row's key travels with it,
    TaskMessage.lease) and checks the attempt's outcome row before running (a re-published copy
    may have run it): one statement, only for those. Messages carry their publish time in the
    `noetl_sent` header (publisher.send_task)."""
    sent = getattr(request, publisher.SENT_HEADER, None)
    if not isinstance(sent, int | float):
        return False
    return clock.epoch() - sent > deadlines.PICKUP_SLACK


def _timeout_of(request: Any) -> float:
    """The attempt's timeout, read back from the soft time limit its message carries."""
    limits = getattr(request, "timelimit", None) or (None, None)
    soft = limits[1] if len(limits) > 1 else None
    if not soft:
        return deadlines.DEFAULT_TIMEOUT
    return float(soft) - deadlines.SOFT_LIMIT_GRACE - current_settings().eager_window


def _store_delay(message: TaskMessage, exc: DBAPIError, timeout: float) -> None:
    """The worker could not read the event store: the same message is sent again with a growing
    countdown; after EVENT_DB_RETRIES the execution fails with the store's error."""
    url = current_settings().database_url
    tries = message.store_tries + 1
    if tries > EVENT_DB_RETRIES:
        orchestrator.fail_internally(
            url,
            {"execution_id": message.execution_id, "task": message.to_dict()},
            f"event store unavailable: {exc.orig!r}",
        )
        return
    delay = min(2**tries * 0.1, EVENT_DB_MAX_WAIT)
    log.warning("event store error, attempt delayed %.1fs (try %d): %s", delay, tries, exc.orig)
    publish(
        [
            Dispatch(
                kind=DispatchKind.RUN,
                message=message.evolve(store_tries=tries).to_dict(),
                countdown=delay,
                timeout=timeout,
            )
        ]
    )


@app.task(name=ON_EVENT, bind=True, acks_late=True, ignore_result=True)
def on_event(self, execution_id: int, event: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Record one event and publish what it decides. If the publish fails after the decision was
    recorded, the event is not acknowledged: it goes back to the queue, and its redelivery
    re-publishes the stored messages."""
    process.defer_termination()  # a group-wide SIGTERM lets this decision finish (engine/transport/process.py)
    try:
        check_version(event, "on_event payload")
        if event.get("kind") == PayloadKind.WAKE:
            if worker.still_running(current_settings().database_url, int(event["execution_id"])):
                publish([Dispatch.from_dict(event["dispatch"])], due=event.get("due"))
            return
        process_event(event)
    except MessageError as exc:
        refuse_message(execution_id, event, exc)
    except PublishFailed as exc:
        raise Reject(str(exc), requeue=True) from exc


def refuse_message(execution_id: int, payload: dict[str, Any], exc: MessageError) -> None:
    """A message this worker cannot read (e.g. from a newer version) fails its execution,
    recorded, instead of vanishing with a task error."""
    log.error("execution %s: %s", execution_id, exc)
    orchestrator.fail_internally(
        current_settings().database_url, {**payload, "execution_id": execution_id}, f"{type(exc).__name__}: {exc}"
    )


def process_event(event: dict[str, Any]) -> list[Dispatch] | None:
    """on_event's body: `decide`, with every decided message published."""
    return decide(event)[0]


# looked up on each call, so a test that replaces one of them is heard
worker_loss.install(settings=lambda: current_settings(), report=lambda payload: process_event(payload))


def decide(
    event: dict[str, Any], take: Callable[[list[Dispatch]], Dispatch | None] | None = None
) -> tuple[list[Dispatch] | None, Dispatch | None]:
    """Record one event and publish what it decides. A database that is down or busy delays the
    event (it is sent again to the on_event queue with a growing countdown); any other failure
    fails the execution, recorded. Raises PublishFailed when the decision is recorded but its
    messages could not be sent: the sweeper sends them from the stored dispatch list when their
    deadline passes. Returns what was decided (None when the event was delayed or failed) and the
    dispatch `take` chose to run in this process (engine/transport/eager.py), which is not published."""
    url = current_settings().database_url
    clock = time.perf_counter()
    try:
        dispatches = orchestrator.handle_event(url, event)
        metrics.decision_took(time.perf_counter() - clock)
    except DataError as exc:  # the store refused a value: sending the event again cannot help
        reason = refused_value(exc)
        log.error("execution %s: %s", event.get("execution_id"), reason)
        orchestrator.fail_internally(url, event, reason, kind=ErrorKind.STORE_REFUSED)
        return None, None
    except DBAPIError as exc:
        tries = int(event.get("tries", 0)) + 1
        if tries > EVENT_DB_RETRIES:
            orchestrator.fail_internally(url, event, f"event store unavailable: {exc.orig!r}")
            return None, None
        delay = min(2**tries * 0.1, EVENT_DB_MAX_WAIT)
        log.warning("event store error, event delayed %.1fs (try %d): %s", delay, tries, exc.orig)
        send_event({**event, "tries": tries}, countdown=delay)
        return None, None
    except Exception as exc:
        log.exception("on_event failed")
        orchestrator.fail_internally(url, event, f"{type(exc).__name__}: {exc}")
        return None, None
    taken = take(dispatches) if take is not None else None
    try:
        publish([d for d in dispatches if d is not taken])
    except Exception as exc:
        if isinstance(exc, PublishFailed):
            raise
        log.error("publish failed after the decision was recorded (execution %s): %s", event.get("execution_id"), exc)
        raise PublishFailed(f"{type(exc).__name__}: {exc}") from exc
    return dispatches, taken


def refused_value(exc: DataError) -> str:
    """What the event store said when it refused a value of an event (PostgreSQL: invalid JSON
    such as NaN, a \\u0000 escape, a lone surrogate), first lines only."""
    said = storable(" ".join(str(exc.orig).strip().splitlines()[:2]), 1)
    return f"the event store refused a value of this event (not an outage, not retried): {said}"


def due_at(countdown: float) -> datetime:
    """When a message sent with this countdown is due, by the store's clock (store/clock.py):
    workers hold it until then by the store's clock too (`_store_eta`), whatever their own says."""
    return clock.now() + timedelta(seconds=countdown)


def _store_eta(moment: Any, *args: Any, **kwargs: Any) -> Any:
    """Celery's worker turns a message's ETA into a time of its own timer through this process's
    wall clock (kombu's to_timestamp); an ETA is a time on the store's clock, so the timer fires
    when the store's clock reaches it (later by this process's skew when its clock runs ahead)."""
    stamp = _kombu_to_timestamp(moment, *args, **kwargs)
    return stamp + clock.skew() if isinstance(moment, datetime) else stamp


def install_store_eta() -> None:
    """Make this worker's Celery hold ETA messages by the store's clock (idempotent)."""
    from celery.worker import strategy

    strategy.to_timestamp = _store_eta  # type: ignore[attr-defined]


def send_event(payload: dict[str, Any], countdown: float = 0.0, retry_policy: dict[str, Any] | None = None) -> None:
    options: dict[str, Any] = {"retry_policy": retry_policy} if retry_policy else {}
    on_event.apply_async(
        kwargs={"execution_id": payload["execution_id"], "event": stamp(payload)},
        queue=current_settings().event_queue,
        eta=due_at(countdown) if countdown else None,
        shadow=event_shadow(payload.get("kind")),
        argsrepr=f"{payload.get('kind')} of execution {payload['execution_id']}",
        kwargsrepr=execution_kwargsrepr(payload["execution_id"]),
        producer=publisher.producer(app),
        headers={publisher.SENT_HEADER: round(clock.epoch(), 3)},
        **options,
    )


def publish(
    dispatches: list[Dispatch],
    due: float | None = None,
    retry_policy: dict[str, Any] | None = None,
    queue: str | None = None,
) -> None:
    """Send the decided task messages. A wait longer than the broker can safely hold (Redis
    counts it toward the visibility timeout) is split: a `wake` event re-checks the due time.
    Messages go out in their wire form (defaults left out) through this process's producer.
    `retry_policy`: how long to keep trying an unreachable broker (default PUBLISH_RETRY_POLICY).
    `queue`: where task messages go (default NOETL_TASK_QUEUE; the sweeper's re-publishes go to
    the event queue)."""
    settings = current_settings()
    task_queue = queue or settings.task_queue
    now = clock.epoch()
    options: dict[str, Any] = {"retry_policy": retry_policy} if retry_policy else {}
    for dispatch in dispatches:
        if dispatch.kind == DispatchKind.EVENT:  # an event for on_event (a sub-playbook's start or end)
            send_event(dispatch.message, countdown=max(dispatch.countdown, 0.0), retry_policy=retry_policy)
            continue
        wait = (due - now) if due is not None else dispatch.countdown
        if wait > settings.max_countdown:
            target = due if due is not None else now + wait
            send_event(
                {
                    "kind": PayloadKind.WAKE,
                    "execution_id": dispatch.message["execution_id"],
                    "dispatch": dispatch.to_dict(),
                    "due": target,
                },
                countdown=settings.max_countdown,
                retry_policy=retry_policy,
            )
            continue
        message = TaskMessage.from_dict(dispatch.message)
        shown = attempt_shown(dispatch, message, settings.dashboard_url)
        soft, hard = deadlines.time_limits(dispatch.timeout, settings.eager_window)
        kwargs = {"execution_id": message.execution_id, "message": wire(dispatch.message)}
        if wait <= 0:  # due now: Celery's message, without send_task's per-call work
            publisher.send_task(
                app,
                RUN_TASK,
                kwargs,
                queue=task_queue,
                **shown,
                soft_time_limit=soft,
                time_limit=hard,
                retry_policy=retry_policy,
            )
            continue
        run_task.apply_async(
            kwargs=kwargs,
            queue=task_queue,
            eta=due_at(wait),
            **shown,
            soft_time_limit=soft,
            time_limit=hard,
            producer=publisher.producer(app),
            **options,
        )


def attempt_shown(dispatch: Dispatch, message: TaskMessage, dashboard_url: str | None) -> dict[str, str]:
    """How Flower names an attempt, published or run eagerly: `shadow` (playbook:step: few names,
    per-name stats), `argsrepr` and `kwargsrepr`."""
    return {
        "shadow": attempt_shadow(dispatch.label or message.step),
        "argsrepr": attempt_argsrepr(message, dashboard_url),
        "kwargsrepr": execution_kwargsrepr(message.execution_id),
    }


def attempt_argsrepr(message: TaskMessage, dashboard_url: str | None) -> str:
    """Flower's args line of an attempt: which attempt of which unit, and, with NOETL_DASHBOARD_URL,
    the execution's dashboard page (one click or copy from the task to its execution)."""
    text = message.describe()
    return f"{text} {dashboard_url}/executions/{message.execution_id}" if dashboard_url else text


@signals.worker_process_init.connect
def _fresh_process(**_: Any) -> None:
    process.reset_after_fork()  # a forked child never reuses the parent's connections or caches
    process.mark_pool_child()  # its attempts let a supervisor's SIGTERM pass (engine/transport/process.py)


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


NOTIFY = "noetl.notify"  # a failed or cancelled execution's webhook (noetl_celery/webhooks.py)


@app.task(name=NOTIFY, bind=True, acks_late=True, ignore_result=True, throws=(WebhookNotDelivered,))
def notify(self, execution_id: int) -> str:  # type: ignore[no-untyped-def]
    """One delivery attempt of an execution's webhook; a failed one is sent again with its backoff
    as a countdown (the sweep's scan also finds it once due: the lease takes one of them), and
    the task ends as a failure (WebhookNotDelivered, logged without a traceback): Flower shows it."""
    from noetl_celery import webhooks

    outcome, delay = webhooks.deliver(current_settings(), int(execution_id))
    metrics.webhook_delivery(outcome)
    if outcome == "retry" and delay is not None:
        enqueue_notifications([int(execution_id)], countdown=delay)
    if outcome in ("retry", "gave_up"):
        state = f"tried again in {delay:.0f} s" if outcome == "retry" and delay is not None else "given up"
        raise WebhookNotDelivered(f"webhook of execution {execution_id} not delivered ({state})")
    return outcome


def enqueue_notifications(execution_ids: list[int], countdown: float = 0.0) -> None:
    """Send `noetl.notify` for each execution to the event queue (after the decision that ended
    it committed). A broker that cannot be reached is logged: the next sweep sends them."""
    for execution_id in execution_ids:
        try:
            notify.apply_async(
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
    from noetl_celery import webhooks

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


def _queues_busy(settings: noetl_settings.Settings, celery_app: Celery | None = None) -> bool:
    """True when a queue still holds messages (an overdue attempt, or its outcome, may be waiting
    in line)."""
    return _queue_view(settings, celery_app)[0]


def _queue_view(settings: noetl_settings.Settings, celery_app: Celery | None = None) -> tuple[bool, float | None]:
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
        with (celery_app or app).pool.acquire(block=True, timeout=5) as conn:
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


@signals.worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    start_sweeper()  # in the worker's main process: `celery -A noetl_celery worker` needs no more
    eager.clear_stale_notes()


@signals.worker_shutdown.connect
def _stop_sweeper(**_: Any) -> None:
    stop_sweeper()


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _mask_logs(logger: Any = None, **_: Any) -> None:
    secret_registry.install_log_filter(*(logger,) if logger is not None else ())
    try:
        style = current_settings().log_format
    except ConfigurationError:  # the worker refuses to start on it (worker_init): text meanwhile
        style = "text"
    log_format.install(logger, style)  # NOETL_LOG_FORMAT, and the attempt's fields on every line


@signals.worker_init.connect
def _require_broker(sender: Any = None, **_: Any) -> None:
    install_store_eta()
    secret_registry.install_log_filter(log, logging.getLogger("celery"))
    secret_registry.seal_environment()
    if app.conf.noetl_embedded:
        return
    _serve_metrics()
    from noetl_celery.store.db import ensure_schema

    try:
        settings = current_settings()
        noetl_settings.require_broker(settings)
        store_check.check_store(settings.database_url)
        ensure_schema(settings.database_url)  # a schema behind this version: refused, as the CLI does
    except (ConfigurationError, store_check.StoreUnusable) as exc:
        message = secret_registry.mask_text(str(exc))
        log.error("%s", message)
        raise SystemExit(f"noetl_celery: {message}") from None


def _serve_metrics() -> None:
    """With NOETL_METRICS_PORT: this worker's series on that port (noetl_celery/metrics.py), set up
    in the main process before the pool forks."""
    settings = current_settings()
    if settings.metrics_port is None or metrics.enabled():
        return
    try:
        metrics.start_worker_endpoint(settings.metrics_port, settings.metrics_host)
    except OSError as exc:  # the port is taken: the worker runs, without its metrics
        log.error("metrics: cannot listen on %s:%s: %s", settings.metrics_host, settings.metrics_port, exc)
