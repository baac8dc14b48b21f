"""Time limits of attempts: how long one may run, and by when its outcome row must exist.

Decides:
- the timeout of an attempt: the task's own `timeout:` (seconds) or its tool kind's default;
- the time limits Celery enforces on a prefork worker: soft (raised inside the task, the attempt
  fails with kind `timeout`) a little after the timeout, so a tool's own deadline (http) wins,
  and hard (the pool process is killed and replaced) a little after that;
- the deadline of a recorded decision: the latest `countdown + timeout + margin` of the messages
  it dispatched. The sweeper re-publishes an attempt still without an outcome after it.
Any dispatch may set its own `timeout` (a cursor slot's `lease_seconds` is one).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

DEFAULT_TIMEOUT = 30.0  # seconds an attempt of a kind not listed below may run
# seconds; a transfer copies a table in chunks (minutes, not the seconds of one statement);
# shell: NoETL's default for a shell call
KIND_TIMEOUTS = {
    "http": 30.0,
    "python": 30.0,
    "postgres": 30.0,
    "event_log": 10.0,
    "log": 10.0,
    "transfer": 300.0,
    "shell": 600.0,
}
SOFT_LIMIT_GRACE = 1.0  # seconds after the timeout before Celery raises inside the task
HARD_LIMIT_GRACE = 5.0  # seconds after the soft limit before the pool process is killed
OUTCOME_MARGIN = 10.0  # seconds after the hard limit for the outcome to be recorded
# seconds a message may wait in its broker's queue before the worker that takes it moves its
# decision's lease on to run from then: the rest of OUTCOME_MARGIN still covers the attempt
PICKUP_SLACK = OUTCOME_MARGIN / 2


def timeout_of(kind: str, config: dict[str, Any]) -> float:
    """The seconds one attempt of a task may run (a templated `timeout` counts as the default)."""
    raw = config.get("timeout")
    if raw is None and kind == "shell":
        raw = config.get("timeout_seconds")  # NoETL's name of the shell tool's timeout
    if isinstance(raw, bool):
        raw = None
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raw = None
    if isinstance(raw, (int, float)) and raw > 0:
        return float(raw)
    return KIND_TIMEOUTS.get(kind, DEFAULT_TIMEOUT)


def time_limits(timeout: float, window: float = 0.0) -> tuple[float, float]:
    """(soft, hard) Celery time limits, in seconds, for a message whose attempt may run `timeout`
    seconds and which may go on, for `window` seconds, running attempts it decides (engine/transport/eager.py).
    A window is at most OUTCOME_MARGIN: the lease of each attempt still covers its limits."""
    soft = timeout + SOFT_LIMIT_GRACE + window
    return soft, soft + HARD_LIMIT_GRACE


def lease(countdown: float, timeout: float) -> float:
    """Seconds from the decision until the attempt's outcome row is overdue."""
    return max(countdown, 0.0) + timeout + SOFT_LIMIT_GRACE + HARD_LIMIT_GRACE + OUTCOME_MARGIN


def decision_deadline(now: datetime, dispatches: list[Any]) -> datetime | None:
    """The deadline of a decision row: when every message it dispatched is overdue."""
    if not dispatches:
        return None
    return now + timedelta(seconds=max(lease(d.countdown, d.timeout) for d in dispatches))
