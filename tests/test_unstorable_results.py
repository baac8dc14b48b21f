"""Results the event store refuses (NaN, Infinity, NUL, lone surrogates, deep nesting) fail one
attempt as `invalid_result`, naming the value and its path; a value refused in a decision fails
the execution at once instead of being retried as a store outage.

In-process: the worker's attempt and on_event's decision called directly, on SQLite and on a
real PostgreSQL (which refuses in JSON what SQLite accepts)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import DataError

from noetl_celery.compiler import compile_playbook
from noetl_celery.core.jsonable import storable, unstorable
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.transport import deciding as app_module
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import transaction

DEEP = "v = []\nfor _ in range(DEPTH):\n    v = [v]\nresult = {'deep': v}"
CASES = {
    "nan": ("result = {'rows': [{'price': 1.5}, {'price': float('nan')}]}", "NaN", "result.rows[1].price"),
    "infinity": ("result = [1, float('inf')]", "Infinity", "result[1]"),
    "nul": ("result = {'text': 'a' + chr(0) + 'b'}", "a NUL character", "result.text"),
    "surrogate": ("result = {'name': 'x' + chr(0xDC80)}", "a lone surrogate (\\udc80)", "result.name"),
    "surrogate key": ("result = {'k' + chr(0xD800): 1}", "a lone surrogate (\\ud800)", "of the key"),
    "deep": (DEEP.replace("DEPTH", "600"), "nesting deeper than 200 levels (NOETL_MAX_RESULT_DEPTH)", "result.deep"),
}


def playbook(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "unstorable.yaml"
    path.write_text(
        "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: unstorable}\nworkflow:\n"
        "  - step: start\n    tool:\n      kind: python\n      code: |\n"
        + textwrap.indent(code, " " * 8)
        + "\n    next: {arcs: [{step: after}]}\n"
        "  - step: after\n    tool: {kind: python, code: \"result = 'after'\"}\n"
    )
    return path


@pytest.fixture(autouse=True)
def empty_cache():
    STATE.clear()
    yield
    STATE.clear()


def attempt(url: str, dispatch: Dispatch) -> dict:
    payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id="test")
    assert payload is not None
    return payload


def started(url: str, tmp_path: Path, code: str) -> tuple[int, Dispatch]:
    execution_id = create_execution(compile_playbook(playbook(tmp_path, code)), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return execution_id, first


def execution(url: str, execution_id: int) -> tuple[dict, list[dict]]:
    with transaction(url) as conn:
        head = repo.get_execution(conn, execution_id)
        events = repo.list_events(conn, execution_id)
    assert head is not None
    return head, events


@pytest.mark.parametrize("case", list(CASES))
def test_an_unstorable_result_is_one_invalid_result_failure(either_store, tmp_path, case):
    url = either_store
    code, named, path = CASES[case]
    execution_id, first = started(url, tmp_path, code)
    payload = attempt(url, first)
    outcome = payload["outcome"]
    assert outcome["status"] == "error" and outcome["data"] is None
    error = outcome["error"]
    assert error["kind"] == "invalid_result" and error["retryable"] is False
    assert error["message"].startswith("python: the result cannot be stored: "), error["message"]
    assert named in error["message"] and path in error["message"], error["message"]
    assert unstorable(outcome, 200) is None  # what leaves the worker is storable

    assert orchestrator.handle_event(url, payload) == []  # recorded and decided: nothing to re-run
    head, events = execution(url, execution_id)
    assert head["status"] == "failed" and head["failed_step"] == "start"
    assert [e["event_type"] for e in events].count("action.failed") == 1
    assert "after" not in {e["step"] for e in events}


def test_a_deeper_limit_can_be_configured(either_store, tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_RESULT_DEPTH", "1000")
    url = either_store
    execution_id, first = started(url, tmp_path, DEEP.replace("DEPTH", "900"))
    payload = attempt(url, first)
    assert payload["outcome"]["status"] == "ok"
    [after] = orchestrator.handle_event(url, payload)
    orchestrator.handle_event(url, attempt(url, after))
    head, _ = execution(url, execution_id)
    assert head["status"] == "completed"
    with transaction(url) as conn:
        stored = [e for e in repo.list_events(conn, execution_id) if e["event_type"] == "action.completed"][0]
    depth, value = 0, stored["result"]["deep"]
    while value:
        depth, value = depth + 1, value[0]
    assert depth == 900


def test_the_engines_own_fields_spell_out_what_the_store_refuses(either_store, tmp_path):
    url = either_store
    code = "import sys\nprint('a' + chr(0) + 'b')\nraise ValueError('bad ' + chr(0xDC80) + chr(0))"
    execution_id, first = started(url, tmp_path, code)
    payload = attempt(url, first)
    error = payload["outcome"]["error"]
    assert error["kind"] == "exception" and "ValueError: bad \\udc80\\u0000" in error["message"]
    assert payload["outcome"]["meta"]["stdout"] == "a\\u0000b\n"
    orchestrator.handle_event(url, payload)
    head, _ = execution(url, execution_id)
    assert head["status"] == "failed" and head["error"]["kind"] != "internal"


def test_storable_spells_values_and_cuts_deep_nesting():
    value = {"a": float("nan"), "b": ["x\x00", "\ud800"], "c": [[[1]]]}
    assert storable(value, 2) == {"a": "NaN", "b": ["x\\u0000", "\\ud800"], "c": ["<nested deeper than 2 levels>"]}
    assert unstorable(storable(value, 2), 2) is None
    assert unstorable(10**5000, 10) == "an integer of about 5000 digits (longer than JSON text may hold) at result"
    assert unstorable({"a": "the text \\u0000 is six characters"}, 10) is None  # the screen's false alarm
    assert unstorable([[[]]], 2) == "nesting deeper than 2 levels (NOETL_MAX_RESULT_DEPTH) at result[0][0]"
    assert unstorable({"rows": [{"id": i, "tags": ["a"], "price": 1.5} for i in range(1000)]}, 4) is None


def test_a_value_postgresql_refuses_in_a_decision_fails_the_execution_at_once(fresh_postgres, tmp_path, monkeypatch):
    """An outcome from a worker without the check (or a value a decision builds): PostgreSQL
    refuses it (DataError); on_event fails the execution naming the cause, without re-sending the
    event as it does for an outage."""
    from noetl_celery.store.db import migrate

    url = fresh_postgres.url
    migrate(url)
    execution_id, first = started(url, tmp_path, "result = 1")
    payload = attempt(url, first)
    payload["outcome"]["data"] = {"x": float("nan")}
    with pytest.raises(DataError):
        orchestrator.handle_event(url, dict(payload))

    sent: list[dict] = []
    monkeypatch.setattr(app_module, "current_settings", lambda: SimpleNamespace(database_url=url))
    monkeypatch.setattr(app_module, "send_event", lambda event, **kw: sent.append(event))
    monkeypatch.setattr(app_module, "publish", lambda dispatches, **kw: sent.extend(d.to_dict() for d in dispatches))
    assert app_module.decide(payload) == (None, None)
    assert sent == []  # neither re-sent as an outage nor anything dispatched
    head, events = execution(url, execution_id)
    assert head["status"] == "failed" and head["error"]["kind"] == "store_refused"
    assert "the event store refused a value of this event (not an outage, not retried)" in head["error"]["message"]
    assert "NaN" in head["error"]["message"]
    assert events[-1]["event_type"] == "execution.failed"
