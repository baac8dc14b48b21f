"""Publishing decided messages: task messages, events for on_event, and `wake` events.

A dispatch due now goes out as Celery's own message through this process's producer
(engine/transport/publisher.py); one with a countdown through `apply_async`, held by the worker
until it is due by the store's clock (engine/transport/store_eta.py); a wait longer than the
broker can safely hold (Redis counts it toward the visibility timeout) is split: a `wake` event
re-checks the due time (engine/transport/deciding.py). Events for on_event (an outcome in queue
mode, a sub-playbook's start or end, a delayed event) go to the event queue.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from noetl_celery.compiler.names import RUN_TASK, attempt_shadow, event_shadow, execution_kwargsrepr
from noetl_celery.core.vocabulary import DispatchKind, PayloadKind
from noetl_celery.engine import deadlines
from noetl_celery.engine.messages import Dispatch, TaskMessage, stamp, wire
from noetl_celery.engine.transport import publisher
from noetl_celery.engine.transport.bound import binding, current_settings
from noetl_celery.store import clock

# publishing decided messages: about 16 s of retries ride out a broker restart; after that the
# sweeper re-publishes them from the stored dispatch list
PUBLISH_RETRY_POLICY = {"max_retries": 10, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2.0}
SUBMIT_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.3, "interval_max": 0.5}


class PublishFailed(Exception):
    """Decided messages could not be published (broker unreachable); they are in the store."""


def due_at(countdown: float) -> datetime:
    """When a message sent with this countdown is due, by the store's clock (store/clock.py):
    workers hold it until then by the store's clock too (store_eta.py), whatever their own says."""
    return clock.now() + timedelta(seconds=countdown)


def send_event(payload: dict[str, Any], countdown: float = 0.0, retry_policy: dict[str, Any] | None = None) -> None:
    bound = binding()
    options: dict[str, Any] = {"retry_policy": retry_policy} if retry_policy else {}
    bound.on_event.apply_async(
        kwargs={"execution_id": payload["execution_id"], "event": stamp(payload)},
        queue=current_settings().event_queue,
        eta=due_at(countdown) if countdown else None,
        shadow=event_shadow(payload.get("kind")),
        argsrepr=f"{payload.get('kind')} of execution {payload['execution_id']}",
        kwargsrepr=execution_kwargsrepr(payload["execution_id"]),
        producer=publisher.producer(bound.app),
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
    for dispatch in dispatches:
        if dispatch.kind == DispatchKind.EVENT:  # an event for on_event (a sub-playbook's start or end)
            send_event(dispatch.message, countdown=max(dispatch.countdown, 0.0), retry_policy=retry_policy)
            continue
        wait = (due - now) if due is not None else dispatch.countdown
        if wait > settings.max_countdown:
            _send_wake(dispatch, due if due is not None else now + wait, settings.max_countdown, retry_policy)
            continue
        _send_attempt(dispatch, wait, task_queue, retry_policy)


def _send_wake(dispatch: Dispatch, target: float, countdown: float, retry_policy: dict[str, Any] | None) -> None:
    """A `wake` event, due in the longest countdown the broker holds, for a dispatch due later."""
    send_event(
        {
            "kind": PayloadKind.WAKE,
            "execution_id": dispatch.message["execution_id"],
            "dispatch": dispatch.to_dict(),
            "due": target,
        },
        countdown=countdown,
        retry_policy=retry_policy,
    )


def _send_attempt(dispatch: Dispatch, wait: float, task_queue: str, retry_policy: dict[str, Any] | None) -> None:
    """One run_task message: due now without send_task's per-call work, or with its ETA."""
    bound, settings = binding(), current_settings()
    message = TaskMessage.from_dict(dispatch.message)
    shown = attempt_shown(dispatch, message, settings.dashboard_url)
    soft, hard = deadlines.time_limits(dispatch.timeout, settings.eager_window)
    kwargs = {"execution_id": message.execution_id, "message": wire(dispatch.message)}
    if wait <= 0:  # due now: Celery's message, without send_task's per-call work
        publisher.send_task(
            bound.app,
            RUN_TASK,
            kwargs,
            queue=task_queue,
            **shown,
            soft_time_limit=soft,
            time_limit=hard,
            retry_policy=retry_policy,
        )
        return
    options: dict[str, Any] = {"retry_policy": retry_policy} if retry_policy else {}
    bound.run_task.apply_async(
        kwargs=kwargs,
        queue=task_queue,
        eta=due_at(wait),
        **shown,
        soft_time_limit=soft,
        time_limit=hard,
        producer=publisher.producer(bound.app),
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
