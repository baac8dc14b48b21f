"""on_event's body: record one event, decide what runs next, publish it.

An event store that is down or busy delays the event (it is sent again to the on_event queue
with a growing countdown: `store_delay`); a value the store refuses, or any other failure, fails
the execution, recorded. A decision recorded whose messages could not be published raises
PublishFailed: on_event rejects its message for redelivery, and the sweeper sends the stored
messages when their deadline passes. A `wake` event publishes the dispatch it carries once its
due time is within what the broker can hold (engine/transport/publish.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import Reject
from sqlalchemy.exc import DataError, DBAPIError

from noetl_celery.core.jsonable import storable
from noetl_celery.core.vocabulary import ErrorKind, PayloadKind
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, MessageError, check_version
from noetl_celery.engine.transport import process
from noetl_celery.engine.transport.bound import current_settings
from noetl_celery.engine.transport.publish import PublishFailed, publish, send_event
from noetl_celery.observe import metrics

log = logging.getLogger(__name__)

# an event (or an attempt) is delayed while the event store is unreachable: 0.2 s doubling up to
# EVENT_DB_MAX_WAIT, EVENT_DB_RETRIES times (about 13 minutes in all), so that work goes on within
# EVENT_DB_MAX_WAIT seconds of the store coming back, however long it was away
EVENT_DB_RETRIES = 156
EVENT_DB_MAX_WAIT = 5.0


def store_delay(tries: int) -> float:
    """The countdown of the `tries`-th delay of a message while the event store is unavailable."""
    return min(2**tries * 0.1, EVENT_DB_MAX_WAIT)


def on_event(execution_id: int, event: dict[str, Any]) -> None:
    """Record one event and publish what it decides. If the publish fails after the decision was
    recorded, the event is not acknowledged: it goes back to the queue, and its redelivery
    re-publishes the stored messages."""
    process.defer_termination()  # a group-wide SIGTERM lets this decision finish (engine/transport/process.py)
    try:
        check_version(event, "on_event payload")
        if event.get("kind") == PayloadKind.WAKE:
            wake(event)
            return
        process_event(event)
    except MessageError as exc:
        refuse_message(execution_id, event, exc)
    except PublishFailed as exc:
        raise Reject(str(exc), requeue=True) from exc


def wake(event: dict[str, Any]) -> None:
    """A `wake` event: publish its dispatch (again split when still too far ahead), unless the
    execution ended meanwhile."""
    if worker.still_running(current_settings().database_url, int(event["execution_id"])):
        publish([Dispatch.from_dict(event["dispatch"])], due=event.get("due"))


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


def decide(
    event: dict[str, Any], take: Callable[[list[Dispatch]], Dispatch | None] | None = None
) -> tuple[list[Dispatch] | None, Dispatch | None]:
    """Record one event and publish what it decides. A database that is down or busy delays the
    event (it is sent again to the on_event queue with a growing countdown); any other failure
    fails the execution, recorded. Raises PublishFailed when the decision is recorded but its
    messages could not be sent: the sweeper sends them from the stored dispatch list when their
    deadline passes. Returns what was decided (None when the event was delayed or failed) and the
    dispatch `take` chose to run in this process (engine/transport/eager.py), which is not published."""
    dispatches = _decided(event)
    if dispatches is None:
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


def _decided(event: dict[str, Any]) -> list[Dispatch] | None:
    """The event recorded and decided; None when it was delayed or failed its execution."""
    url = current_settings().database_url
    started = time.perf_counter()
    try:
        dispatches = orchestrator.handle_event(url, event)
        metrics.decision_took(time.perf_counter() - started)
        return dispatches
    except DataError as exc:  # the store refused a value: sending the event again cannot help
        reason = refused_value(exc)
        log.error("execution %s: %s", event.get("execution_id"), reason)
        orchestrator.fail_internally(url, event, reason, kind=ErrorKind.STORE_REFUSED)
    except DBAPIError as exc:
        _delay_event(url, event, exc)
    except Exception as exc:
        log.exception("on_event failed")
        orchestrator.fail_internally(url, event, f"{type(exc).__name__}: {exc}")
    return None


def _delay_event(url: str, event: dict[str, Any], exc: DBAPIError) -> None:
    """The event store is unavailable: the event again, later; past EVENT_DB_RETRIES, the
    execution fails with the store's error."""
    tries = int(event.get("tries", 0)) + 1
    if tries > EVENT_DB_RETRIES:
        orchestrator.fail_internally(url, event, f"event store unavailable: {exc.orig!r}")
        return
    delay = store_delay(tries)
    log.warning("event store error, event delayed %.1fs (try %d): %s", delay, tries, exc.orig)
    send_event({**event, "tries": tries}, countdown=delay)


def refused_value(exc: DataError) -> str:
    """What the event store said when it refused a value of an event (PostgreSQL: invalid JSON
    such as NaN, a \\u0000 escape, a lone surrogate), first lines only."""
    said = storable(" ".join(str(exc.orig).strip().splitlines()[:2]), 1)
    return f"the event store refused a value of this event (not an outage, not retried): {said}"
