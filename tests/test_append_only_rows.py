"""A decision's event rows are append-only: each is built once, with its final content.

Unit tests of `engine/decision/rows.py` and the `Decision` value (no store): a recorded row and
its meta refuse a change, an outcome row changes only while it is open and through its named
calls, the causing row is built by the write with its dispatch list, and the write refuses a
row that was never built. Then executions in the in-process harness (SQLite) whose decisions
note policy rules, turn outcomes into pages and into iteration rows, and dispatch: every row the
write inserts was built once, and the log holds what the decisions completed the rows with.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

from noetl_celery.compiler import compile_source
from noetl_celery.core import vocabulary as ev
from noetl_celery.engine.decision import rows as rows_module
from noetl_celery.engine.decision.rows import OpenRow, RowOpen, RowRecorded
from noetl_celery.engine.decision.units import REPORTED_META
from noetl_celery.engine.decision.value import Decision
from noetl_celery.store import db, repo
from tests.support.engines import REPO_ROOT
from tests.support.harness import Harness, run_playbook
from tests.support.mockapi import start_mock_api

EXAMPLES = REPO_ROOT / "playbooks"


def _row(key: str, **columns: Any) -> dict[str, Any]:
    return {"execution_id": 1, "event_id": key, "event_type": ev.ACTION_COMPLETED, **columns}


def test_a_recorded_row_and_its_meta_refuse_a_change() -> None:
    decision = Decision()
    decision.record(_row("cause"))
    meta = {"next": ["b"]}
    decision.record(_row("x.step.done", event_type=ev.STEP_COMPLETED, meta=meta))
    row = decision.rows[1]
    with pytest.raises(TypeError):
        row["event_type"] = ev.STEP_FAILED  # type: ignore[index]
    with pytest.raises(TypeError):
        row["meta"]["next"] = []
    meta["next"] = ["c"]  # the caller's dict is not the row's
    assert row["meta"] == {"next": ["b"]}
    decision.seal_cause([], None)
    assert decision.writable_rows()[1]["meta"] == {"next": ["b"]}


def test_an_outcome_row_changes_only_while_open_then_is_built_once() -> None:
    decision = Decision()
    decision.record(_row("cause"))
    row = decision.open(_row("o.done", status="failed", result={"n": 1}, error={"kind": "x"}, meta={"pid": 7}))
    row.note(policy={"rule": 0, "do": "continue"})
    row.end_unit(event_type=ev.ITERATION_COMPLETED, status="completed", result=None, error=None)
    row.note(tolerated=True)
    assert row["event_type"] == ev.ITERATION_COMPLETED  # reads see the row as decided so far
    with pytest.raises(TypeError):
        row["meta"]["pid"] = 8
    decision.settle(row)
    built = decision.rows[1]
    assert isinstance(built, MappingProxyType) and built is not row
    assert built["event_type"] == ev.ITERATION_COMPLETED and built["status"] == "completed"
    assert built["meta"] == {
        "pid": 7,
        "policy": {"rule": 0, "do": "continue"},
        REPORTED_META: {"status": "failed", "result": {"n": 1}, "error": {"kind": "x"}},
        "tolerated": True,
    }
    for late in (lambda: row.note(late=True), lambda: row.retype(ev.PAGE_COMPLETED), lambda: row.end_unit(result=2)):
        with pytest.raises(RowRecorded):
            late()
    with pytest.raises(RowRecorded):
        row.build()


def test_the_causing_row_is_built_by_the_write_with_its_dispatch_list() -> None:
    decision = Decision()
    cause = decision.open(_row("cause.done", meta={"pid": 7}))
    cause.retype(ev.PAGE_COMPLETED)
    decision.record(_row("next.start", event_type=ev.ACTION_STARTED))
    decision.settle(cause)  # decided, but its dispatch list is the write's
    assert decision.rows[0] is cause
    with pytest.raises(RowRecorded):
        cause.note(late=True)
    with pytest.raises(RowOpen):
        decision.writable_rows()
    decision.seal_cause([{"kind": "run", "message": {"step": "a"}}], "deadline")
    written = decision.writable_rows()
    assert written[0]["event_type"] == ev.PAGE_COMPLETED
    assert written[0]["meta"] == {"pid": 7, "dispatch": [{"kind": "run", "message": {"step": "a"}}]}
    assert written[0]["deadline_at"] == "deadline"
    assert all(type(r) is dict and type(r.get("meta") or {}) is dict for r in written)
    with pytest.raises(RowRecorded):
        decision.seal_cause([], None)


def test_a_causing_row_without_dispatches_gets_no_dispatch_key_and_no_deadline() -> None:
    decision = Decision()
    decision.record(_row("execution.started", event_type=ev.EXECUTION_STARTED, meta={"playbook": "p"}))
    with pytest.raises(RowOpen):  # even a complete first row waits for the write
        decision.writable_rows()
    decision.seal_cause([], None)
    (written,) = decision.writable_rows()
    assert written["meta"] == {"playbook": "p"} and "deadline_at" not in written


def test_a_row_noted_on_without_a_place_changes_no_decision() -> None:
    decision = Decision()
    decision.record(_row("cause"))
    inline = OpenRow({"event_id": "parent.start"})  # a routing-only task: no row of its own
    inline.note(policy={"rule": 0})
    decision.settle(inline)
    assert [r["event_id"] for r in decision.rows] == ["cause"]


TOLERATED_LOOP = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: append_only}
workload:
  items: [1, 2, 3, 4]
workflow:
  - step: start
    loop: {in: "{{ workload.items }}", iterator: n, spec: {mode: parallel, max_in_flight: 2}}
    tool:
      kind: python
      args: {n: "{{ iter.n }}"}
      code: |
        if n == 3:
            raise ValueError("three")
        result = n * 10
      spec:
        policy:
          rules:
            - when: "{{ outcome.status == 'error' }}"
              then: {do: continue}
    next:
      arcs: [{step: end}]
  - step: end
    tool: {kind: noop}
"""


@pytest.fixture
def built_once(monkeypatch) -> list[Any]:
    """Every row the write inserts, checked to be a row built once (read-only, never open)."""
    written: list[Any] = []
    writable = rows_module.writable

    def checked(row: Any) -> dict[str, Any]:
        assert isinstance(row, MappingProxyType), f"row {row['event_id']!r} was not built once"
        written.append(row)
        return writable(row)

    monkeypatch.setattr("noetl_celery.engine.decision.value.writable", checked)
    return written


def _events(url: str, execution_id: int) -> tuple[str, list[dict[str, Any]]]:
    with db.transaction(url) as conn:
        status = (repo.get_execution(conn, execution_id) or {})["status"]
        return status, repo.list_events(conn, execution_id)


def test_retries_and_pages_reach_the_log_from_rows_built_once(tmp_path, built_once) -> None:
    """The http example: a retry by policy rule, then pages collected; each page's row has its
    type, its rule, its collect spec and the dispatch of the next call, built once."""
    url = f"sqlite:///{tmp_path / 'events.sqlite'}"
    db.migrate(url)
    with start_mock_api() as api:
        code, status = run_playbook(url, EXAMPLES / "http_mock.yaml", {"api_url": api.url})
    assert code == 0, status
    state, events = _events(url, int(status["execution_id"]))
    assert state == "completed"
    assert len(built_once) == len(events)
    pages = [e for e in events if e["event_type"] == ev.PAGE_COMPLETED]
    assert len(pages) >= 2
    for page in pages:
        assert page["meta"]["collect"]["strategy"] == "append"
        assert page["meta"]["policy"]["do"] == "retry"
        (sent,) = page["meta"]["dispatch"]  # the next page's call, decided with this row
        assert sent["message"]["page"] == page["page"] + 1
    retried = [e for e in events if e["event_type"] == ev.RETRY_SCHEDULED]
    assert retried and all(e["meta"]["rule"] is not None for e in retried)


def test_a_tolerated_loop_reaches_the_log_from_rows_built_once(tmp_path, built_once) -> None:
    """Iteration rows are the attempts' outcome rows completed by the decision (their end,
    what the attempt reported, the rule that tolerated a failure), built once."""
    url = f"sqlite:///{tmp_path / 'events.sqlite'}"
    db.migrate(url)
    path = tmp_path / "append_only.yaml"
    path.write_text(TOLERATED_LOOP)
    harness = Harness(url)
    execution_id = harness.start(compile_source(str(path)))
    harness.drain()
    state, events = _events(url, execution_id)
    assert state == "completed"
    assert len(built_once) == len(events)
    done = sorted((e for e in events if e["event_type"] == ev.ITERATION_COMPLETED), key=lambda e: e["iteration"])
    assert [(e["iteration"], e["result"]) for e in done] == [(0, 10), (1, 20), (3, 40)]
    (three,) = [e for e in events if e["event_type"] == ev.ITERATION_FAILED]  # tolerated: the step goes on
    assert three["iteration"] == 2 and three["meta"]["tolerated"] is True
    assert three["meta"]["policy"]["do"] == "continue"
    assert three["error"]["task"] == "start" and "three" in three["error"]["message"]
    assert three["meta"][REPORTED_META]["error"]["kind"] == "exception"  # what the attempt reported
