"""run_task's body: one attempt of one tool call, reported, decided, published.

The outcome goes to on_event: decided in this same job when NOETL_EVENT_DISPATCH=inline (the
default: one message per attempt), or sent to the on_event queue when it is `queue`. An event
store that is down or busy delays the attempt like on_event's events (`_store_delay`). Only
then is Celery told how the attempt went (engine/transport/verdict.py): a failed attempt raises
AttemptFailed (or a Retry), after its decision is recorded and published. With
NOETL_EAGER_WINDOW, an attempt due now that the decision dispatches may run here first, then the
one its decision dispatches, and so on (the eager loop: engine/transport/eager.py); Celery is
still told about this message's own attempt.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.exc import DBAPIError

from noetl_celery.config.settings import Settings
from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine import deadlines
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, MessageError, TaskMessage
from noetl_celery.engine.transport import eager, process, publisher, task_events, verdict
from noetl_celery.engine.transport.bound import celery_app, current_settings
from noetl_celery.engine.transport.deciding import EVENT_DB_RETRIES, decide, refuse_message, store_delay
from noetl_celery.engine.transport.publish import attempt_shown, publish, send_event
from noetl_celery.store import clock

log = logging.getLogger(__name__)


def run_task(task: Any, execution_id: int, message: dict[str, Any]) -> str:
    """Run one attempt and report it (see the module docstring); `task` is the bound Celery task."""
    started = time.monotonic()
    process.defer_termination()  # a group-wide SIGTERM lets this attempt finish (engine/transport/process.py)
    try:
        task_message = TaskMessage.from_dict(message)
    except MessageError as exc:
        refuse_message(execution_id, {"task": message}, exc)
        return f"refused: {exc}"
    settings = current_settings()
    run = worker.execute_batch if task_message.batch else worker.execute
    request, url = task.request, settings.database_url
    try:
        skipped = _skipped(task_message, request, url)
        if skipped is not None:
            return skipped
        if _redelivered(request) and task_message.is_claim:  # it may have claimed: take its rows back
            task_message = task_message.evolve(replay=True)
        ran = run(url, task_message, queue_id=request.id, node=request.hostname)
    except DBAPIError as exc:
        _store_delay(task_message, exc, _timeout_of(request))
        return "delayed: the event store is unavailable"
    if ran is None:
        return "replay: this attempt was already recorded"
    decided: list[Dispatch] | None = None
    if settings.event_dispatch == "inline":
        window = eager.window_of(request, settings.eager_window, started)
        decided, taken = decide(ran, window.take if window else None)
        if window is not None and taken is not None:
            _run_eagerly(taken, window, request)
    else:
        send_event(ran)
    return verdict.conclude(ran, decided, raise_failures=not celery_app().conf.noetl_embedded)


def _skipped(task_message: TaskMessage, request: Any, url: str) -> str | None:
    """What the task returns instead of running the attempt: a redelivery whose attempt is
    recorded (its decision is sent again), a message taken late whose re-published copy ran."""
    if _redelivered(request) and not task_message.replay and worker.already_done(url, task_message):
        key = task_message.outcome_key()
        publish(orchestrator.replay(url, task_message.execution_id, key, ran_by=request.id))
        return "redelivered: this attempt was already recorded; its decision was sent again"
    lease = deadlines.lease(0, _timeout_of(request))
    if _late(request) and not task_message.replay and worker.taken_late(url, task_message, lease):
        # its lease runs from here on (one statement, only for a message that waited in line)
        return "late: this attempt waited in line past its lease; its re-published copy recorded it"
    return None


def _run_eagerly(taken: Dispatch, window: eager.Window, request: Any) -> None:
    """Run, here, the attempt a decision of this message took (engine/transport/eager.py), then the one its
    decision takes, and so on. Each is decided and published like any other attempt."""
    settings = current_settings()
    mark = eager.Mark(request.id)  # which attempt this process is in, should it die (worker_loss)
    try:
        _run_taken(taken, window, request, mark, settings)
    finally:
        mark.close()


def _run_taken(taken: Dispatch, window: eager.Window, request: Any, mark: eager.Mark, settings: Settings) -> None:
    dispatch: Dispatch | None = taken
    while dispatch is not None:
        ran = dispatch
        message = TaskMessage.from_dict(ran.message)
        started, ticks = time.time(), time.monotonic()
        mark.note(ran.message)
        try:
            payload = worker.run_attempt(settings.database_url, message, queue_id=request.id, node=request.hostname)
        except DBAPIError as exc:
            _store_delay(message, exc, ran.timeout)
            return
        decided, dispatch = decide(payload, window.take)
        log.info("ran eagerly: %s", verdict.conclude(payload, decided, raise_failures=False))
        if settings.eager_task_events:  # Flower shows it as a task of its own
            _announce(ran, message, request, settings, payload, decided, started, time.monotonic() - ticks)


def _announce(
    ran: Dispatch,
    message: TaskMessage,
    request: Any,
    settings: Settings,
    payload: dict[str, Any],
    decided: list[Dispatch] | None,
    started: float,
    runtime: float,
) -> None:
    """An eager attempt as a task of its own in Flower (NOETL_EAGER_TASK_EVENTS)."""
    shown = attempt_shown(ran, message, settings.dashboard_url)
    task_events.announce(
        celery_app(),
        request,
        name=shown["shadow"],
        args=shown["argsrepr"],
        kwargs=shown["kwargsrepr"],
        started=started,
        runtime=runtime,
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
    delay = store_delay(tries)
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
