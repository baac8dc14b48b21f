"""A loop's result when it completes: each iteration's last end, read from rows held in memory."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from noetl_celery.core import vocabulary as ev
from noetl_celery.engine.decision.loops import _final_rows, _first_failures, _ordered_results
from tests.support.reads import ReadsInMemory


def _decider(rows: list[dict[str, Any]], decided: list[dict[str, Any]]) -> Any:
    return SimpleNamespace(reads=ReadsInMemory(rows), decided=lambda: decided)


def _message(iteration: int) -> Any:
    return SimpleNamespace(iteration=iteration, run_id="r")  # what the completion reads of the task message


def _end(row_id: int, iteration: int, *, failed: bool, payload: Any, run_id: str = "r") -> dict[str, Any]:
    kind = ev.ITERATION_FAILED if failed else ev.ITERATION_COMPLETED
    return {
        "id": row_id,
        "run_id": run_id,
        "event_type": kind,
        "iteration": iteration,
        "error" if failed else "result": payload,
    }


def test_the_last_end_of_each_iteration_wins_and_the_current_one_is_the_decision_s():
    rows = [
        _end(1, 0, failed=True, payload={"kind": "python", "message": "boom"}),
        _end(2, 1, failed=False, payload="one"),
        _end(3, 2, failed=True, payload={"kind": "http", "message": "502", "task": "t"}),
        _end(4, 0, failed=False, payload="zero, resumed"),  # a resumed iteration's new end
        _end(5, 1, failed=False, payload="elsewhere", run_id="other"),  # another run's row
    ]
    decided = [_end(0, 3, failed=False, payload="three, decided now")]  # not written yet: no row id
    final = _final_rows(_decider(rows, decided), "r")
    assert sorted(final) == [0, 1, 2, 3]

    current = _message(4)
    results = _ordered_results(final, current, 5, ok=True, data="four")
    assert results == ["zero, resumed", "one", None, "three, decided now", "four"]

    failures = _first_failures(final, current, ok=True, current=None)
    assert failures == [{"index": 2, "kind": "http", "message": "502", "task": "t"}]


def test_the_current_iteration_s_failure_is_named_and_its_result_is_none():
    rows = [_end(1, 0, failed=False, payload="a")]
    final = _final_rows(_decider(rows, []), "r")
    current = _message(1)
    error = {"kind": "python", "message": "late"}
    assert _ordered_results(final, current, 2, ok=False, data=None) == ["a", None]
    assert _first_failures(final, current, ok=False, current=error) == [
        {"index": 1, "kind": "python", "message": "late", "task": None}
    ]
