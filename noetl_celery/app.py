"""The Celery app: its configuration, its signals and the task shims; the transport's work is in
engine/transport/.

- `noetl.run_task` (queue NOETL_TASK_QUEUE): one attempt of one tool call; ends by sending its
  outcome to `noetl.on_event` (engine/transport/attempts.py).
- `noetl.on_event` (queue NOETL_EVENT_QUEUE): records the event and decides what runs next
  (engine/transport/deciding.py); decided messages are published by engine/transport/publish.py.
- `noetl.notify` (the event queue): one delivery attempt of a failed execution's webhook.
Both are late-acknowledged and rejected on worker loss, so a killed worker loses nothing; a task
that keeps killing its pool process ends as a `worker_lost` attempt (engine/transport/worker_loss.py).
Each run_task message carries Celery soft/hard time limits derived from the attempt's timeout.
Neither uses Celery retries, chords or groups: retries and loops are on_event's decisions.
Every worker main process runs the sweeper (engine/transport/sweeping.py) on a timer.
The app, its tasks and its settings are bound to the transport (engine/transport/bound.py) here.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from noetl_celery.compiler.names import ON_EVENT, RUN_TASK
from noetl_celery.config import limits as noetl_limits
from noetl_celery.config import secret_registry
from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import AttemptFailed, ConfigurationError, WebhookNotDelivered
from noetl_celery.engine.transport import (
    attempts,
    bound,
    deciding,
    eager,
    process,
    reconnect,
    redis_transport,
    worker_loss,
)
from noetl_celery.engine.transport.publish import PUBLISH_RETRY_POLICY, PublishFailed
from noetl_celery.engine.transport.store_eta import install_store_eta
from noetl_celery.engine.transport.sweeping import enqueue_notifications, start_sweeper, stop_sweeper
from noetl_celery.observe import log_format, metrics
from noetl_celery.store import blobs, clock
from noetl_celery.store import check as store_check

log = logging.getLogger(__name__)

EMBEDDED_POLLING_INTERVAL = 0.001  # seconds; memory:// polls at 1 s by default (33 msgs/s)
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
        # `celery -A noetl_celery beat`: the schedules of the event store (noetl_celery/schedules/beat.py)
        beat_scheduler="noetl_celery.schedules.beat:StoreScheduler",
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
    """One attempt of one tool call (engine/transport/attempts.py). `execution_id` is duplicated
    here for Flower's kwargs column."""
    return attempts.run_task(self, execution_id, message)


@app.task(name=ON_EVENT, bind=True, acks_late=True, ignore_result=True)
def on_event(self, execution_id: int, event: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Record one event and publish what it decides (engine/transport/deciding.py)."""
    deciding.on_event(execution_id, event)


NOTIFY = "noetl.notify"  # a failed or cancelled execution's webhook (noetl_celery/observe/webhooks.py)


@app.task(name=NOTIFY, bind=True, acks_late=True, ignore_result=True, throws=(WebhookNotDelivered,))
def notify(self, execution_id: int) -> str:  # type: ignore[no-untyped-def]
    """One delivery attempt of an execution's webhook; a failed one is sent again with its backoff
    as a countdown (the sweep's scan also finds it once due: the lease takes one of them), and
    the task ends as a failure (WebhookNotDelivered, logged without a traceback): Flower shows it."""
    from noetl_celery.observe import webhooks

    outcome, delay = webhooks.deliver(current_settings(), int(execution_id))
    metrics.webhook_delivery(outcome)
    if outcome == "retry" and delay is not None:
        enqueue_notifications([int(execution_id)], countdown=delay)
    if outcome in ("retry", "gave_up"):
        state = f"tried again in {delay:.0f} s" if outcome == "retry" and delay is not None else "given up"
        raise WebhookNotDelivered(f"webhook of execution {execution_id} not delivered ({state})")
    return outcome


# looked up on each call, so a test that replaces `current_settings` here is heard
bound.bind(app, run_task=run_task, on_event=on_event, notify=notify, settings=lambda: current_settings())
worker_loss.install(settings=lambda: current_settings(), report=lambda payload: deciding.process_event(payload))


@signals.worker_process_init.connect
def _fresh_process(**_: Any) -> None:
    process.reset_after_fork()  # a forked child never reuses the parent's connections or caches
    process.mark_pool_child()  # its attempts let a supervisor's SIGTERM pass (engine/transport/process.py)


@signals.task_postrun.connect
def _release_memory(**_: Any) -> None:
    if blobs.take_written():  # a big value was built here: its freed memory goes back (process.py)
        process.release_freed_memory()


@signals.worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    start_sweeper()  # in the worker's main process: `celery -A noetl_celery worker` needs no more
    eager.clear_stale_notes()
    process.freeze_startup_heap()  # what the consumer and the sweeper set up


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
def _note_main_process(**_: Any) -> None:
    process.note_main_process()  # a SIGTERM here is the worker's warm shutdown (engine/transport/process.py)


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
    process.freeze_startup_heap()  # before the prefork pool forks its children


def _serve_metrics() -> None:
    """With NOETL_METRICS_PORT: this worker's series on that port (noetl_celery/observe/metrics.py), set up
    in the main process before the pool forks."""
    settings = current_settings()
    if settings.metrics_port is None or metrics.enabled():
        return
    try:
        metrics.start_worker_endpoint(settings.metrics_port, settings.metrics_host)
    except OSError as exc:  # the port is taken: the worker runs, without its metrics
        log.error("metrics: cannot listen on %s:%s: %s", settings.metrics_host, settings.metrics_port, exc)
