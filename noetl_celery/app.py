"""The Celery app: configuration, the two task types, and how decisions are published.

- `noetl.run_task` (queue NOETL_TASK_QUEUE): one attempt of one tool call; ends by sending its
  outcome to `noetl.on_event`.
- `noetl.on_event` (queue NOETL_EVENT_QUEUE): records the event and decides what runs next.
Both are late-acknowledged and rejected on worker loss, so a killed worker loses nothing.
Neither uses Celery retries, chords or groups: retries and loops are on_event's decisions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, signals
from sqlalchemy.exc import DBAPIError

from noetl_celery import settings as noetl_settings
from noetl_celery.engine import orchestrator, worker
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.errors import ConfigurationError
from noetl_celery.store.db import dispose_engines

log = logging.getLogger(__name__)

RUN_TASK = "noetl.run_task"
ON_EVENT = "noetl.on_event"
EMBEDDED_POLLING_INTERVAL = 0.001  # seconds; memory:// polls at 1 s by default (33 msgs/s)
EVENT_DB_RETRIES = 20  # times an event is delayed while the event store is unreachable
EVENT_DB_MAX_WAIT = 60.0  # seconds; the longest such delay


def configure(app: Celery, settings: noetl_settings.Settings, *, embedded: bool = False) -> None:
    transport_options: dict[str, Any] = {
        "visibility_timeout": settings.visibility_timeout,
        # Redis: sweep for messages whose consumer died (unacked past the visibility timeout)
        # every `restore_interval` seconds, instead of kombu's default of about 100 s.
        "unacked_restore_interval": settings.restore_interval,
        "unacked_restore_throttle": 1,
    }
    if embedded:
        transport_options["polling_interval"] = EMBEDDED_POLLING_INTERVAL
    app.conf.update(
        broker_url=noetl_settings.EMBEDDED_BROKER if embedded else (settings.broker_url or
                                                                    noetl_settings.EMBEDDED_BROKER),
        result_backend=settings.result_backend,
        task_ignore_result=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=settings.prefetch_multiplier,
        broker_transport_options=transport_options,
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout},
        visibility_timeout=settings.visibility_timeout,
        broker_connection_retry_on_startup=True,
        task_default_queue=settings.task_queue,
        task_routes={RUN_TASK: {"queue": settings.task_queue}, ON_EVENT: {"queue": settings.event_queue}},
        worker_send_task_events=settings.task_events,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        noetl_settings=settings,
        noetl_embedded=embedded,
    )


def _settings_at_import() -> tuple[noetl_settings.Settings, ConfigurationError | None]:
    """The environment's settings; a bad environment must not break `import noetl_celery` (the
    CLI reports it, a worker refuses to start with the message)."""
    try:
        return noetl_settings.load(), None
    except ConfigurationError as exc:
        return noetl_settings.defaults(), exc


app = Celery("noetl_celery")
_settings, _settings_error = _settings_at_import()
configure(app, _settings)


def current_settings() -> noetl_settings.Settings:
    if _settings_error is not None and not app.conf.noetl_embedded:
        raise _settings_error
    return app.conf.noetl_settings


@app.task(name=RUN_TASK, bind=True, acks_late=True, ignore_result=True)
def run_task(self, execution_id: int, message: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Run one attempt and report it. `execution_id` is duplicated here for Flower's kwargs column.

    The outcome goes to on_event: called in this same job when NOETL_EVENT_DISPATCH=inline (the
    default: one message per attempt), or sent to the on_event queue when it is `queue`.
    """
    payload = worker.execute(current_settings().database_url, TaskMessage.from_dict(message),
                             queue_id=self.request.id)
    if payload is None:
        return
    if current_settings().event_dispatch == "inline":
        process_event(payload)
    else:
        send_event(payload)


@app.task(name=ON_EVENT, bind=True, acks_late=True, ignore_result=True)
def on_event(self, execution_id: int, event: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Record one event and publish what it decides."""
    if event.get("kind") == "wake":
        publish([Dispatch.from_dict(event["dispatch"])], due=event.get("due"))
        return
    process_event(event)


def process_event(event: dict[str, Any]) -> None:
    """on_event's body. A database that is down or busy delays the event (it is sent again to the
    on_event queue with a growing countdown); any other failure fails the execution, recorded."""
    url = current_settings().database_url
    try:
        dispatches = orchestrator.handle_event(url, event)
    except DBAPIError as exc:
        tries = int(event.get("tries", 0)) + 1
        if tries > EVENT_DB_RETRIES:
            orchestrator.fail_internally(url, event, f"event store unavailable: {exc.orig!r}")
            return
        delay = min(2 ** tries * 0.1, EVENT_DB_MAX_WAIT)
        log.warning("event store error, event delayed %.1fs (try %d): %s", delay, tries, exc.orig)
        send_event({**event, "tries": tries}, countdown=delay)
        return
    except Exception as exc:
        log.exception("on_event failed")
        orchestrator.fail_internally(url, event, f"{type(exc).__name__}: {exc}")
        return
    publish(dispatches)


def send_event(payload: dict[str, Any], countdown: float = 0.0) -> None:
    on_event.apply_async(kwargs={"execution_id": payload["execution_id"], "event": payload},
                         queue=current_settings().event_queue, countdown=countdown or None,
                         shadow=f"on_event:{payload.get('kind')}")


def publish(dispatches: list[Dispatch], due: float | None = None) -> None:
    """Send the decided task messages. A wait longer than the broker can safely hold (Redis
    counts it toward the visibility timeout) is split: a `wake` event re-checks the due time."""
    settings = current_settings()
    now = time.time()
    for dispatch in dispatches:
        wait = (due - now) if due is not None else dispatch.countdown
        if wait > settings.max_countdown:
            target = due if due is not None else now + wait
            send_event({"kind": "wake", "execution_id": dispatch.message["execution_id"],
                        "dispatch": dispatch.to_dict(), "due": target}, countdown=settings.max_countdown)
            continue
        message = TaskMessage.from_dict(dispatch.message)
        shadow = f"{dispatch.label or message.step}#attempt{message.attempt}"
        run_task.apply_async(
            kwargs={"execution_id": message.execution_id, "message": dispatch.message},
            queue=settings.task_queue,
            countdown=wait if wait > 0 else None,
            shadow=shadow,
            argsrepr=message.describe(),
            kwargsrepr=f"{{'execution_id': {message.execution_id}}}",
        )


@signals.worker_process_init.connect
def _fresh_connections(**_: Any) -> None:
    dispose_engines()  # a forked child never reuses the parent's pooled connections


@signals.worker_init.connect
def _require_broker(sender: Any = None, **_: Any) -> None:
    if app.conf.noetl_embedded:
        return
    try:
        noetl_settings.require_broker(current_settings())
    except ConfigurationError as exc:
        log.error("%s", exc)
        raise SystemExit(f"noetl_celery: {exc}") from None


@app.task(name="noetl.bench_noop", acks_late=True, ignore_result=True)
def bench_noop(counter_key: str | None = None) -> None:
    """A task that does nothing but count itself: the raw-Celery baseline of bench/loops.py."""
    if counter_key:
        _bench_redis().incr(counter_key)


_redis_client: Any = None


def _bench_redis() -> Any:
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(current_settings().broker_url)
    return _redis_client
