"""What Celery (and so Flower) is told about one attempt, once on_event has decided on it.

- ok: the task succeeds; its result is a short outcome line (`ok step=... 12.3 ms`).
- failed and retried: `AttemptRetried` (a Celery `Retry` that publishes nothing itself: the next
  attempt is on_event's decision, already published); Flower shows the task as RETRY.
- failed otherwise: `AttemptFailed`; Flower shows FAILURE with the error as exception text and,
  as traceback, the playbook code's own (a python task) or the error line, never the engine's.
  The worker logs it as one INFO line (run_task's `throws`): the playbook failed, not the engine.
The message is acknowledged in every case (acks_late + task_acks_on_failure_or_timeout), so the
decision, recorded once, is never taken twice.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Retry

from noetl_celery.core.errors import AttemptFailed
from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine.messages import BATCH_EVENT, Dispatch, TaskMessage

ERROR_TEXT_LIMIT = 300  # characters of an attempt's error shown as Flower's exception text


class AttemptRetried(Retry):
    """The attempt failed and on_event scheduled the next one (already published)."""

    def __init__(self, text: str, next_attempt: int, countdown: float):
        super().__init__(message=text, exc=AttemptFailed(text), when=countdown or None)
        self.next_attempt = next_attempt

    def humanize(self) -> str:
        return f"{self.message}; retried as attempt {self.next_attempt}"


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        kind = error.get("kind") or error.get("type") or "error"
        text = f"{kind}: {error.get('message') or error}"
    else:
        text = str(error)
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 3] + "..."


def _user_traceback(error: Any) -> str | None:
    """The traceback of the playbook's code the outcome carries (python tasks; already masked)."""
    found = error.get("traceback") if isinstance(error, dict) else None
    return found if isinstance(found, str) and found else None


def next_attempt(message: TaskMessage, dispatches: list[Dispatch] | None) -> Dispatch | None:
    """The dispatch that retries `message` (same unit, attempt + 1), if on_event decided one."""
    for dispatch in dispatches or []:
        m = dispatch.message
        if (
            dispatch.kind == DispatchKind.RUN
            and m.get("run_id") == message.run_id
            and m.get("step") == message.step
            and m.get("iteration") == message.iteration
            and m.get("seq") == message.seq
            and m.get("task_index") == message.task_index
            and m.get("attempt") == message.attempt + 1
        ):
            return dispatch
    return None


def conclude(payload: dict[str, Any], dispatches: list[Dispatch] | None, *, raise_failures: bool = True) -> str:
    """The outcome line of a successful attempt; raises for a failed one (see module docstring).
    `dispatches` is what on_event decided (None when it runs elsewhere, on the on_event queue).
    Without `raise_failures` (the embedded worker: no Flower to tell) a failure is a line too."""
    if payload.get("kind") == BATCH_EVENT:
        return _conclude_batch(payload["events"], raise_failures=raise_failures)
    message = TaskMessage.from_dict(payload["task"])
    outcome = payload.get("outcome") or {}
    duration = (payload.get("report") or {}).get("duration_ms")
    where = message.describe()
    if outcome.get("status") == "ok":
        took = f" {duration:.1f} ms" if isinstance(duration, (int, float)) else ""
        return f"ok {where}{took}"
    text = f"{_error_text(outcome.get('error'))} ({where})"
    retry = next_attempt(message, dispatches)
    if not raise_failures:
        return f"failed {text}" + (f"; retried as attempt {message.attempt + 1}" if retry else "")
    if retry is not None:
        raise AttemptRetried(text, message.attempt + 1, retry.countdown)
    raise AttemptFailed(text, _user_traceback(outcome.get("error")))


def _conclude_batch(events: list[dict[str, Any]], *, raise_failures: bool) -> str:
    """A batch (engine/decision/batching.py) succeeds when every iteration did; else it fails naming the
    first failure. A failed iteration's retry, if any, is its own message."""
    first = TaskMessage.from_dict(events[0]["task"])
    failed = [e for e in events if (e.get("outcome") or {}).get("status") != "ok"]
    where = f"{first.describe()} batch of {len(events)}"
    if not failed:
        took = sum(float((e.get("report") or {}).get("duration_ms") or 0) for e in events)
        return f"ok {where} {took:.1f} ms"
    worst = failed[0]
    text = (
        f"{len(failed)} of {len(events)} iterations failed; first: "
        f"{_error_text(worst['outcome'].get('error'))} ({TaskMessage.from_dict(worst['task']).describe()})"
    )
    if not raise_failures:
        return f"failed {where}: {text}"
    raise AttemptFailed(text)
