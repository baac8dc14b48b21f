"""The sweeper's decisions on a real SQLite event store: overdue attempts are re-published (a row
each), then `lost`; finished decisions are cleared; playbook timeouts and lost starts are found."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

import noetl_celery.app  # noqa: F401  (binds the Celery app to the transport)
from noetl_celery.compiler import compile_playbook
from noetl_celery.engine import deadlines
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch
from noetl_celery.engine.recovery import sweeper
from noetl_celery.engine.recovery.lifecycle import end_tree
from noetl_celery.runner import create_execution
from noetl_celery.store import leases, repo
from noetl_celery.store.db import transaction

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: sweep}
workflow:
  - step: start
    tool: {kind: python, code: "result = 1", timeout: 7}
"""


def started(tmp_path, timeout: float | None = None) -> tuple[str, int, list[Dispatch]]:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "sweep.yaml"
    path.write_text(PLAYBOOK + (f"timeout: {timeout}\n" if timeout else ""))
    plan = compile_playbook(str(path))
    execution_id = create_execution(plan, url)
    dispatches = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return url, execution_id, dispatches


def overdue(url: str, execution_id: int) -> None:
    """Move every deadline of the execution into the past."""
    with transaction(url) as conn:
        leases.expire(conn, repo.utcnow(), execution_id)


def events(url: str, execution_id: int, event_type: str) -> list[dict]:
    with transaction(url) as conn:
        return [r for r in repo.list_events(conn, execution_id) if r["event_type"] == event_type]


def test_a_decision_row_carries_the_deadline_of_its_dispatches(tmp_path):
    url, execution_id, dispatches = started(tmp_path)
    assert [d.timeout for d in dispatches] == [7.0]
    soft, hard = deadlines.time_limits(7.0)
    assert 7.0 < soft < hard
    row = events(url, execution_id, "execution.started")[0]
    assert row["meta"]["dispatch"][0]["timeout"] == 7.0
    with transaction(url) as conn:
        deadline = leases.deadline(conn, execution_id, row["event_id"])
    assert deadline is not None
    lease = (deadline - row["created_at"]).total_seconds()
    assert abs(lease - deadlines.lease(0, 7.0)) < 1.0


def test_an_attempt_without_outcome_is_republished_then_lost(tmp_path):
    url, execution_id, dispatches = started(tmp_path)
    assert sweeper.sweep(url).republished == []  # not overdue yet
    for count in (1, 2):
        overdue(url, execution_id)
        result = sweeper.sweep(url, max_republishes=2)
        assert [d.message["step"] for d in result.republished] == ["start"]
        assert result.republished[0].message["replay"] is True
        assert len(events(url, execution_id, sweeper.REPUBLISHED)) == count
    overdue(url, execution_id)
    result = sweeper.sweep(url, max_republishes=2)
    assert result.republished == [] and len(result.lost) == 1
    orchestrator.handle_event(url, result.lost[0])  # decided like any outcome
    with transaction(url) as conn:
        execution = repo.get_execution(conn, execution_id)
    assert execution["status"] == "failed" and execution["error"]["kind"] == "lost"


def test_a_busy_queue_republishes_once_and_a_finished_decision_is_cleared(tmp_path):
    url, execution_id, dispatches = started(tmp_path)
    overdue(url, execution_id)
    # the attempt may be waiting in line, or lost: it is re-published once (through the event
    # queue, ahead of the backlog); further re-publishes and `lost` wait for the queues to drain
    assert len(sweeper.sweep(url, queue_busy=True, max_republishes=1).republished) == 1
    for _ in range(2):
        overdue(url, execution_id)
        result = sweeper.sweep(url, queue_busy=True, max_republishes=1)
        assert result.republished == [] and result.lost == []
    assert len(events(url, execution_id, sweeper.REPUBLISHED)) == 1
    message = {k: v for k, v in dispatches[0].message.items() if k != "lease"}  # as sent from the store
    outcome = sweeper.lost_outcome(message, "x", "y", "test")
    outcome["outcome"] = {"status": "ok", "data": 1, "error": None, "http": None, "pg": None, "meta": {}}
    orchestrator.handle_event(url, outcome)
    overdue(url, execution_id)
    result = sweeper.sweep(url)
    assert result.republished == [] and result.cleared >= 1
    with transaction(url) as conn:
        left = leases.count(conn)
    assert left == 0


def test_playbook_timeout_fails_the_execution_and_its_children(tmp_path):
    url, execution_id, _ = started(tmp_path, timeout=60)
    plan = compile_playbook(str(tmp_path / "sweep.yaml"))
    child = create_execution(plan, url, parent_execution_id=execution_id)
    with transaction(url) as conn:
        conn.execute(
            update(repo.EXECUTIONS)
            .where(repo.EXECUTIONS.c.execution_id == execution_id)
            .values(deadline_at=repo.utcnow() - timedelta(seconds=1))
        )
    result = sweeper.sweep(url)
    assert sorted(result.timed_out) == sorted([execution_id, child])
    with transaction(url) as conn:
        for eid in (execution_id, child):
            row = repo.get_execution(conn, eid)
            assert row["status"] == "failed" and row["error"]["kind"] == "timeout"


def test_a_lost_start_is_sent_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "sweep.yaml"
    path.write_text(PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    assert sweeper.sweep(url).starts == []  # within the grace period
    with transaction(url) as conn:
        conn.execute(
            update(repo.EXECUTIONS).values(created_at=repo.utcnow() - timedelta(seconds=sweeper.START_GRACE + 1))
        )
    assert sweeper.sweep(url).starts == [execution_id]


def test_cancel_ends_the_tree_once(tmp_path):
    url, execution_id, _ = started(tmp_path)
    plan = compile_playbook(str(tmp_path / "sweep.yaml"))
    child = create_execution(plan, url, parent_execution_id=execution_id)
    grandchild = create_execution(plan, url, parent_execution_id=child)
    error = {"kind": "cancelled", "message": "stop"}
    with transaction(url) as conn:
        assert end_tree(conn, execution_id, "cancelled", "execution.cancelled", error) == [
            execution_id,
            child,
            grandchild,
        ]
    with transaction(url) as conn:
        assert end_tree(conn, execution_id, "cancelled", "execution.cancelled", error) == []
    assert len(events(url, grandchild, "execution.cancelled")) == 1


CHILD = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: child, path: tests/sweep_child}
workflow:
  - step: start
    tool: {kind: python, code: "result = 41"}
"""
PARENT = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: parent}
workflow:
  - step: start
    tool: {kind: playbook, path: tests/sweep_child}
"""


def _outcome_of(dispatch: Dispatch, data) -> dict:
    payload = sweeper.lost_outcome(dispatch.message, "x", "y", "test")
    payload["outcome"] = {"status": "ok", "data": data, "error": None, "http": None, "pg": None, "meta": {}}
    return payload


def test_a_lost_sub_playbook_end_is_sent_again_until_the_parent_records_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    (tmp_path / "child.yaml").write_text(CHILD)
    (tmp_path / "parent.yaml").write_text(PARENT)
    parent_id = create_execution(compile_playbook(str(tmp_path / "parent.yaml")), url)
    [child_start] = orchestrator.handle_event(url, orchestrator.start_payload(parent_id))
    assert child_start.kind == sweeper.EVENT
    child_id = child_start.message["execution_id"]
    [child_task] = orchestrator.handle_event(url, child_start.message)
    [end] = orchestrator.handle_event(url, _outcome_of(child_task, 41))
    assert end.kind == sweeper.EVENT and end.message["execution_id"] == parent_id
    # the end event is lost: the parent still runs, and the sweeper sends it again
    overdue(url, child_id)
    result = sweeper.sweep(url)
    assert result.republished == [end]
    rows = events(url, parent_id, sweeper.REPUBLISHED)
    assert len(rows) == 1 and rows[0]["meta"]["child_end"] is True
    orchestrator.handle_event(url, result.republished[0].message)  # delivered this time
    orchestrator.handle_event(url, result.republished[0].message)  # and a late duplicate is a no-op
    with transaction(url) as conn:
        parent = repo.get_execution(conn, parent_id)
    assert parent["status"] == "completed"
    overdue(url, child_id)
    assert sweeper.sweep(url).republished == []  # delivered: nothing more to send
    assert len(events(url, parent_id, sweeper.REPUBLISHED)) == 1


def test_a_child_cancelled_on_its_own_fails_its_parents_task(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    (tmp_path / "child.yaml").write_text(CHILD)
    (tmp_path / "parent.yaml").write_text(PARENT)
    parent_id = create_execution(compile_playbook(str(tmp_path / "parent.yaml")), url)
    [child_start] = orchestrator.handle_event(url, orchestrator.start_payload(parent_id))
    child_id = child_start.message["execution_id"]
    orchestrator.handle_event(url, child_start.message)
    with transaction(url) as conn:  # the child alone is cancelled (noetl-celery cancel CHILD)
        assert end_tree(conn, child_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "no"})
    # the next sweep tells the parent, whose task fails with the child's id and status
    [end] = sweeper.sweep(url).republished
    assert end.message["execution_id"] == parent_id
    orchestrator.handle_event(url, end.message)
    with transaction(url) as conn:
        parent = repo.get_execution(conn, parent_id)
    assert parent["status"] == "failed"
    assert parent["error"]["child_execution_id"] == child_id
    assert f"(execution {child_id}) cancelled: no" in parent["error"]["message"]
    assert sweeper.sweep(url).republished == []  # recorded: nothing more to send


def test_a_parent_cancelled_with_its_children_is_not_told_of_their_end(tmp_path):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    (tmp_path / "child.yaml").write_text(CHILD)
    (tmp_path / "parent.yaml").write_text(PARENT)
    parent_id = create_execution(compile_playbook(str(tmp_path / "parent.yaml")), url)
    [child_start] = orchestrator.handle_event(url, orchestrator.start_payload(parent_id))
    orchestrator.handle_event(url, child_start.message)
    with transaction(url) as conn:
        ended = end_tree(conn, parent_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "x"})
    assert ended == [parent_id, child_start.message["execution_id"]]
    assert sweeper.sweep(url).republished == []


def test_a_re_publish_while_the_queues_hold_messages_is_logged_as_routine_and_otherwise_as_a_warning(
    monkeypatch, caplog
):
    """An overdue attempt found while the queues hold messages is most likely waiting in line (a
    loop with more iterations in flight than pool processes, under the eager window): its copy is
    published the same way either time, and the log says which case it is."""
    from noetl_celery.engine.transport import sweeping as app

    published: list[tuple[int, str]] = []
    monkeypatch.setattr(app, "publish", lambda dispatches, queue: published.append((len(dispatches), queue)))
    result = sweeper.SweepResult(republished=[Dispatch(kind="run", message={"execution_id": 1})])
    queue = app.current_settings().event_queue
    with caplog.at_level("INFO", logger=app.log.name):
        app._act_on_sweep(result, queues_busy=True)
        app._act_on_sweep(result)
    busy, idle = [r for r in caplog.records if "re-publishing" in r.getMessage()]
    assert busy.levelname == "INFO" and "may be waiting in line" in busy.getMessage()
    assert idle.levelname == "WARNING" and idle.getMessage() == "sweeper: re-publishing 1 overdue attempt(s)"
    assert published == [(1, queue), (1, queue)]


def test_an_overdue_lease_whose_messages_may_still_wait_in_line_is_left_alone(tmp_path):
    """Redis tells the publish time of the oldest message still queued (`waiting_since`): a
    decision recorded after it may have its messages in the queue and is not re-published; one
    recorded before it had its messages taken by a worker, and is."""
    url, execution_id, _ = started(tmp_path)
    decided = events(url, execution_id, "execution.started")[0]["created_at"]
    decided_epoch = sweeper._epoch(decided)
    overdue(url, execution_id)
    for ahead, left_alone in ((1.0, sweeper.SWEEP_INTERVAL), (15.0, 15.0), (500.0, deadlines.lease(0, 7.0))):
        # left alone about as long as the queue needs to reach it: a sweep at least, a lease at most
        overdue(url, execution_id)
        result = sweeper.sweep(url, queue_busy=True, waiting_since=decided_epoch - ahead)
        assert result.republished == [] and result.lost == []
        with transaction(url) as conn:
            deadline = leases.deadline(conn, execution_id, "execution.started")
        assert deadline is not None
        left = sweeper._epoch(deadline) - sweeper._epoch(repo.utcnow())
        assert left_alone - 2 < left <= left_alone + 1, (ahead, left)
    assert events(url, execution_id, sweeper.REPUBLISHED) == []
    overdue(url, execution_id)  # the queue moved on past it: taken by a worker, and overdue
    later = decided_epoch + sweeper.IN_LINE_SLACK + 0.5
    assert len(sweeper.sweep(url, queue_busy=True, waiting_since=later).republished) == 1


def test_a_message_taken_late_moves_its_lease_on_and_finds_no_outcome(tmp_path):
    url, execution_id, dispatches = started(tmp_path)
    overdue(url, execution_id)
    message = dispatches[0].message
    with transaction(url) as conn:
        done = leases.taken(conn, execution_id, message["lease"], "no-such-outcome", 30.0)
        deadline = leases.deadline(conn, execution_id, message["lease"])
    assert done is False
    assert deadline is not None
    assert 28.0 < sweeper._epoch(deadline) - sweeper._epoch(repo.utcnow()) <= 30.5
    assert sweeper.sweep(url).republished == []  # no longer overdue


def test_the_lost_start_check_reads_what_is_new_and_everything_once_per_full_check(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    path = tmp_path / "sweep.yaml"
    path.write_text(PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    assert sweeper.sweep(url).starts == []  # the first check reads every running execution
    old = repo.utcnow() - timedelta(seconds=sweeper.START_GRACE + sweeper.START_WINDOW_MARGIN + 60)
    with transaction(url) as conn:
        conn.execute(update(repo.EXECUTIONS).values(created_at=old))
    # created (as its row now says) long before the previous check: past the window
    assert sweeper.sweep(url).starts == []
    monkeypatch.setattr(sweeper, "START_FULL_CHECK", 0.0)  # the next check reads every running one
    assert sweeper.sweep(url).starts == [execution_id]
