"""Resume (same execution, next epoch) decided on a real SQLite store; outcomes are fed to
on_event's decision function as a worker would send them."""

from __future__ import annotations

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.recovery.resume import ResumeRefused, resume
from noetl_celery.engine.recovery.sweeper import lost_outcome
from noetl_celery.runner import cancel, create_execution, execution_status
from noetl_celery.store import repo
from noetl_celery.store.db import transaction

PLAYBOOK = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: two}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs: [{step: second}]
  - step: second
    tool: {kind: python, code: "result = 2"}
"""


def outcome(dispatch, ok: bool, data=None) -> dict:
    payload = lost_outcome(dispatch.message, "exception", "boom", "test")
    if ok:
        payload["outcome"] = {"status": "ok", "data": data, "error": None, "http": None, "pg": None, "meta": {}}
    return payload


@pytest.fixture
def started(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "two.yaml"
    path.write_text(PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return url, execution_id, first


def types(url: str, execution_id: int) -> list[str]:
    with transaction(url) as conn:
        return [r["event_type"] for r in repo.list_events(conn, execution_id)]


def test_a_cancelled_execution_decides_the_outcome_it_ignored_and_goes_on(started):
    url, execution_id, first = started
    assert cancel(url, execution_id, "pause") == [execution_id]
    assert orchestrator.handle_event(url, outcome(first, ok=True, data=1)) == []  # recorded, not acted on
    epoch, dispatches = resume(url, execution_id)
    assert epoch == 1 and [d.message["step"] for d in dispatches] == ["second"]
    assert execution_status(url, execution_id)["status"] == "running"
    assert orchestrator.handle_event(url, outcome(dispatches[0], ok=True, data=2)) == []
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"] == {"start": 1, "second": 2}
    kinds = types(url, execution_id)
    assert kinds.count("execution.cancelled") == 1 and kinds.count("execution.resumed") == 1
    assert kinds[-1] == "execution.completed"


def test_an_attempt_without_outcome_is_sent_again_as_a_replay(started):
    url, execution_id, first = started
    cancel(url, execution_id)
    _, dispatches = resume(url, execution_id)
    assert [(d.message["step"], d.message["attempt"], d.message["replay"]) for d in dispatches] == [("start", 1, True)]


def test_a_failed_step_runs_its_next_attempt(started):
    url, execution_id, first = started
    orchestrator.handle_event(url, outcome(first, ok=False))
    assert execution_status(url, execution_id)["status"] == "failed"
    epoch, [again] = resume(url, execution_id)
    assert (again.message["step"], again.message["attempt"]) == ("start", 2)
    [second] = orchestrator.handle_event(url, outcome(again, ok=True, data=1))
    orchestrator.handle_event(url, outcome(second, ok=True, data=2))
    status = execution_status(url, execution_id)
    assert status["status"] == "completed" and status["error"] is None
    with transaction(url) as conn:
        keys = {r["event_id"] for r in repo.list_events(conn, execution_id)}
    assert "execution.failed.e1" in keys  # the old ending is kept under an archived key


def test_running_and_completed_executions_are_refused(started):
    url, execution_id, first = started
    with pytest.raises(ResumeRefused, match="is running"):
        resume(url, execution_id)


LOOP_PLAYBOOK = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: loop}
workflow:
  - step: start
    loop: {in: "{{ [0, 1, 2, 3, 4, 5] }}", iterator: n, mode: parallel, max_in_flight: 2}
    tool: {kind: python, code: "result = n"}
    next:
      arcs: [{step: after}]
  - step: after
    tool: {kind: python, code: "result = 'after'"}
"""


def drive(url: str, dispatches: list, fail: set[int], seen: list) -> None:
    """Answer every dispatch as a worker would (iterations in `fail` fail) until none is left."""
    queue = list(dispatches)
    while queue:
        d = queue.pop(0)
        seen.append((d.message["step"], d.message.get("iteration"), d.message["attempt"]))
        index = d.message.get("iteration")
        data = index if index is not None else "after"
        queue += orchestrator.handle_event(url, outcome(d, ok=index not in fail, data=data))


@pytest.fixture
def looping(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "loop.yaml"
    path.write_text(LOOP_PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    return url, execution_id, orchestrator.handle_event(url, orchestrator.start_payload(execution_id))


def test_a_failed_loop_runs_only_its_failed_iterations_and_finishes_once(looping):
    url, execution_id, first = looping
    seen: list = []
    drive(url, first, {1, 4}, seen)
    status = execution_status(url, execution_id)
    assert status["status"] == "failed" and status["failed_step"] == "start", status
    epoch, again = resume(url, execution_id)
    assert epoch == 1
    assert [(d.message["iteration"], d.message["attempt"]) for d in again] == [(1, 2), (4, 2)]
    seen.clear()
    drive(url, again, set(), seen)
    assert seen == [("start", 1, 2), ("start", 4, 2), ("after", None, 1)]  # nothing that completed ran again
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"]["results"] == [0, 1, 2, 3, 4, 5]
    assert status["results"]["start"]["stats"] == {"total": 6, "success": 6, "failed": 0}
    kinds = types(url, execution_id)
    assert kinds.count("iterator.completed") == 2  # the failed end (archived) and the completed one
    with transaction(url) as conn:
        keys = {r["event_id"] for r in repo.list_events(conn, execution_id)}
        loop = repo.execution_loops(conn, execution_id)[0]
    assert {k for k in keys if k.endswith(".loop.done.e1")}  # the failed end is kept, archived
    assert (loop["done"], loop["succeeded"], loop["failed"], loop["status"]) == (6, 6, 0, "completed")


def test_a_cancelled_loop_sends_its_undispatched_indexes_under_the_cap(looping):
    url, execution_id, first = looping
    assert len(first) == 2  # the cap
    seen: list = []
    [zero, one] = first
    more = orchestrator.handle_event(url, outcome(zero, ok=True, data=0))  # sends index 2
    assert [d.message["iteration"] for d in more] == [2]
    cancel(url, execution_id, "pause")
    orchestrator.handle_event(url, outcome(one, ok=False))  # recorded after the cancel, not acted on
    _, again = resume(url, execution_id)
    # index 2 was in flight (sent again as a replay); index 1's failure is decided now and fails the
    # iteration; one slot is free: index 3 goes
    assert sorted((d.message["iteration"], d.message["replay"]) for d in again) == [(2, True), (3, False)]
    drive(url, again, set(), seen)
    status = execution_status(url, execution_id)
    assert status["status"] == "failed", status  # iteration 1 failed in this epoch
    assert sorted(i for s, i, _ in seen if s == "start") == [2, 3, 4, 5]
    _, last = resume(url, execution_id)
    assert [(d.message["iteration"], d.message["attempt"]) for d in last] == [(1, 2)]
    drive(url, last, set(), seen)
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"]["results"] == [0, 1, 2, 3, 4, 5]


PIPELINE_PLAYBOOK = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: pipeline}
workflow:
  - step: start
    loop: {in: "{{ [0, 1, 2] }}", iterator: n, mode: parallel, max_in_flight: 3}
    tool:
      - a: {kind: python, code: "result = n * 10"}
      - b: {kind: python, args: {p: "{{ _prev }}"}, code: "result = p + 1"}
"""


def test_a_failed_pipeline_iteration_runs_again_from_its_failed_task_with_the_earlier_results(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE_PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    queue = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    ran: list = []
    while queue:
        d = queue.pop(0)
        m = d.message
        ran.append((m["iteration"], m["task_index"], m["attempt"]))
        data = m["iteration"] * 10 if m["task_index"] == 0 else m["prev"] + 1
        queue += orchestrator.handle_event(url, outcome(d, ok=(m["iteration"], m["task_index"]) != (1, 1), data=data))
    assert execution_status(url, execution_id)["status"] == "failed"
    _, [again] = resume(url, execution_id)
    m = again.message
    assert (m["iteration"], m["task_index"], m["seq"], m["attempt"], m["prev"]) == (1, 1, 1, 2, 10)
    orchestrator.handle_event(url, outcome(again, ok=True, data=m["prev"] + 1))
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"]["results"] == [1, 11, 21]
    assert sorted(ran) == [(i, t, 1) for i in range(3) for t in range(2)]  # task a of index 1 ran once


PARENT_PLAYBOOK = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: parent}
workflow:
  - step: start
    loop: {in: "{{ [0, 1, 2, 3, 4, 5] }}", iterator: n, mode: parallel, max_in_flight: 2}
    tool: {kind: playbook, path: t/child, return_step: start, input: {x: "{{ iter.n }}"}}
    next:
      arcs: [{step: after}]
  - step: after
    tool: {kind: python, code: "result = 'after'"}
"""

CHILD_PLAYBOOK = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: child, path: t/child}
workload: {x: 0}
workflow:
  - step: start
    tool: {kind: python, code: "result = 'child'"}
"""


def answer(url: str, dispatches: list) -> None:
    """Deliver events to on_event and answer attempts as a worker would, until none is left."""
    queue = list(dispatches)
    while queue:
        d = queue.pop(0)
        if d.kind == "event":
            queue += orchestrator.handle_event(url, d.message)
        else:
            queue += orchestrator.handle_event(url, outcome(d, ok=True, data="child"))


def parent_rows(url: str, execution_id: int, event_type: str) -> list[dict]:
    with transaction(url) as conn:
        return [r for r in repo.list_events(conn, execution_id) if r["event_type"] == event_type]


def test_a_cancelled_loop_of_sub_playbooks_runs_its_cancelled_children_again_and_completes_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    (tmp_path / "child.yaml").write_text(CHILD_PLAYBOOK)
    path = tmp_path / "parent.yaml"
    path.write_text(PARENT_PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    start_zero, start_one = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    [run_zero] = orchestrator.handle_event(url, start_zero.message)  # child 0 runs
    [end_zero] = orchestrator.handle_event(url, outcome(run_zero, ok=True, data="child"))  # ... and ends
    [run_one] = orchestrator.handle_event(url, start_one.message)  # child 1 runs
    cancelled = cancel(url, execution_id, "pause")
    assert len(cancelled) == 2 and cancelled[0] == execution_id  # the parent and child 1 (child 0 had ended)
    child_one = cancelled[1]
    assert execution_status(url, child_one)["error"] == {
        "kind": "cancelled",
        "message": "pause",
        "ended_with": execution_id,
    }
    assert orchestrator.handle_event(url, end_zero.message) == []  # child 0's end: recorded, not acted on
    assert orchestrator.handle_event(url, outcome(run_one, ok=True, data="child")) == []  # child 1 is cancelled

    _, again = resume(url, execution_id)
    # child 0's end is decided now (index 2 goes), index 1 runs again as its next attempt: a new child
    assert sorted((d.message["kind"], d.label) for d in again) == [("start", "start:playbook")] * 2
    answer(url, again)
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"]["results"] == ["child"] * 6
    assert status["results"]["start"]["stats"] == {"total": 6, "success": 6, "failed": 0}
    completed = [r["iteration"] for r in parent_rows(url, execution_id, "iteration.completed")]
    assert sorted(completed) == list(range(6))  # every index counted once
    assert [r["attempt"] for r in parent_rows(url, execution_id, "iteration.completed") if r["iteration"] == 1] == [2]
    assert len(parent_rows(url, execution_id, "iterator.completed")) == 1
    assert len(parent_rows(url, execution_id, "execution.completed")) == 1
    children = execution_status(url, execution_id)["children"]
    assert sorted(c["status"] for c in children) == ["cancelled"] + ["completed"] * 6
    assert execution_status(url, child_one)["status"] == "cancelled"  # not run again itself


TIMED_PLAYBOOK = PLAYBOOK.replace("workflow:", "timeout: 60\nworkflow:", 1)


def _age(url: str, execution_id: int, seconds: float) -> None:
    """The execution's clock, as the sweeper sees it, `seconds` later."""
    from datetime import timedelta

    from sqlalchemy import update

    with transaction(url) as conn:
        row = repo.get_execution(conn, execution_id) or {}
        conn.execute(
            update(repo.EXECUTIONS)
            .where(repo.EXECUTIONS.c.execution_id == execution_id)
            .values(
                created_at=row["created_at"] - timedelta(seconds=seconds),
                deadline_at=row["deadline_at"] - timedelta(seconds=seconds),
            )
        )


def _seconds_left(url: str, execution_id: int) -> float:
    with transaction(url) as conn:
        deadline = (repo.get_execution(conn, execution_id) or {})["deadline_at"]
    return (deadline.replace(tzinfo=None) - repo.utcnow().replace(tzinfo=None)).total_seconds()


def test_a_resumed_execution_gets_its_playbook_timeout_again_from_the_resume(tmp_path):
    from noetl_celery.engine.recovery.sweeper import sweep

    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "timed.yaml"
    path.write_text(TIMED_PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    for epoch in (1, 2):  # timed out, resumed, timed out again, resumed again
        _age(url, execution_id, 61)
        assert sweep(url).timed_out == [execution_id]
        status = execution_status(url, execution_id)
        assert (status["status"], status["error"]["kind"]) == ("failed", "timeout"), status
        assert resume(url, execution_id)[0] == epoch
        assert 55 < _seconds_left(url, execution_id) <= 60  # the playbook's 60 s, counted from this resume
        assert sweep(url).timed_out == []
        assert execution_status(url, execution_id)["status"] == "running"
    _, [again] = resume_after_cancel(url, execution_id)
    [second] = orchestrator.handle_event(url, outcome(again, ok=True, data=1))
    orchestrator.handle_event(url, outcome(second, ok=True, data=2))
    assert execution_status(url, execution_id)["status"] == "completed"


def resume_after_cancel(url: str, execution_id: int):
    cancel(url, execution_id, "pause")
    return resume(url, execution_id)


SINGLE_PARENT = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: single}
workflow:
  - step: start
    tool: {kind: playbook, path: t/child, return_step: start}
"""


def test_a_cancelled_sub_playbook_step_starts_a_new_child_and_a_child_ending_meanwhile_is_awaited(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    (tmp_path / "child.yaml").write_text(CHILD_PLAYBOOK)
    path = tmp_path / "single.yaml"
    path.write_text(SINGLE_PARENT)
    execution_id = create_execution(compile_playbook(str(path)), url)
    [start] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    orchestrator.handle_event(url, start.message)  # the child runs
    assert len(cancel(url, execution_id, "pause")) == 2  # the parent and its running child
    _, [again] = resume(url, execution_id)  # the child ended with its parent: a new child
    assert again.message["kind"] == "start" and again.message["execution_id"] != start.message["execution_id"]
    [run_again] = orchestrator.handle_event(url, again.message)
    [end] = orchestrator.handle_event(url, outcome(run_again, ok=True, data="child"))  # its end, on its way
    cancel(url, execution_id, "again")  # the child had completed: it did not end with its parent
    assert resume(url, execution_id)[1] == []  # nothing to send: the child's end is awaited
    answer(url, [end])
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["start"] == "child"
    assert sorted(c["status"] for c in status["children"]) == ["cancelled", "completed"]
