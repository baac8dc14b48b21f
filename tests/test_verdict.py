"""What Celery is told about an attempt once on_event has decided (engine/transport/verdict.py)."""

from __future__ import annotations

import pytest
from celery.exceptions import Retry

from noetl_celery.core.errors import AttemptFailed
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.transport.verdict import AttemptRetried, conclude


def payload(status: str, *, attempt: int = 1, error: dict | None = None) -> dict:
    message = TaskMessage(execution_id=7, run_id="r1", step="work", iteration=17, attempt=attempt)
    return {"task": message.to_dict(), "outcome": {"status": status, "error": error}, "report": {"duration_ms": 12.34}}


def test_a_successful_attempt_is_a_short_outcome_line():
    assert conclude(payload("ok"), []) == "ok execution=7 step=work attempt=1 iteration=17 12.3 ms"


def test_a_failed_attempt_that_is_not_retried_raises_attempt_failed_with_its_error():
    with pytest.raises(AttemptFailed) as info:
        conclude(payload("error", error={"kind": "exception", "message": "ValueError: bad record 17"}), [])
    assert str(info.value) == "exception: ValueError: bad record 17 (execution=7 step=work attempt=1 iteration=17)"


def test_a_failed_attempt_that_on_event_retried_is_a_celery_retry():
    retry = TaskMessage(execution_id=7, run_id="r1", step="work", iteration=17, attempt=2)
    other = TaskMessage(execution_id=7, run_id="r1", step="work", iteration=18, attempt=2)
    failed = payload("error", error={"kind": "http", "message": "HTTP 500"})
    with pytest.raises(AttemptRetried) as info:
        conclude(failed, [Dispatch.task(other), Dispatch.task(retry, countdown=2.0)])
    assert isinstance(info.value, Retry) and info.value.next_attempt == 2
    assert isinstance(info.value.exc, AttemptFailed) and "HTTP 500" in str(info.value.exc)
    with pytest.raises(AttemptFailed):  # a retry of another iteration is not this attempt's
        conclude(failed, [Dispatch.task(other)])


def test_without_raising_a_failure_is_a_line_too():
    line = conclude(payload("error", error={"kind": "exception", "message": "boom"}), None, raise_failures=False)
    assert line == "failed exception: boom (execution=7 step=work attempt=1 iteration=17)"


def test_long_errors_are_cut():
    with pytest.raises(AttemptFailed) as info:
        conclude(payload("error", error={"kind": "exception", "message": "x" * 5000}), [])
    assert len(str(info.value)) < 400
