"""Redelivered events are no-ops: on_event and the worker driven by hand, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.playbooks import retry_once

LOOP = Path(__file__).resolve().parent / "playbooks" / "loop_many.yaml"


@pytest.fixture
def url(either_store: str) -> str:
    return either_store


def attempt(url: str, dispatch: Dispatch) -> dict:
    payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id="test")
    assert payload is not None
    return payload


def kinds(url: str, execution_id: int) -> Counter:
    with transaction(url) as conn:
        return Counter(e["event_type"] for e in repo.list_events(conn, execution_id))


def test_a_redelivered_iteration_completion_counts_once_and_replays_its_decision(url):
    plan = compile_playbook(LOOP, overrides={"n": 60})  # cap 50: 50 dispatched, 10 wait
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    iterations = orchestrator.handle_event(url, attempt(url, start[0]))
    assert len(iterations) == 50

    outcome = attempt(url, iterations[0])
    first = orchestrator.handle_event(url, outcome)
    again = orchestrator.handle_event(url, outcome)
    assert [d.message["iteration"] for d in first] == [50]  # one more under the cap
    assert [d.message["iteration"] for d in again] == [50]  # the same decision, published again...
    assert all(d.message["replay"] for d in again) and not first[0].message["replay"]  # ...flagged
    with transaction(url) as conn:
        loop = repo.get_loop(conn, iterations[0].message["run_id"])
    assert loop["done"] == 1 and loop["succeeded"] == 1

    # the replayed task message finds its attempt already reported... once it is
    assert worker.execute(url, TaskMessage.from_dict(again[0].message)) is not None
    pending = [first[0], *iterations[1:]]
    last_outcome = None
    while pending:
        dispatch = pending.pop(0)
        last_outcome = attempt(url, dispatch)
        pending += orchestrator.handle_event(url, last_outcome)
    assert worker.execute(url, TaskMessage.from_dict(again[0].as_replay().message)) is None

    # the last completion delivered again: no second loop completion, no second step
    assert orchestrator.handle_event(url, last_outcome) == []
    counted = kinds(url, execution_id)
    assert counted["iteration.completed"] == 60
    assert counted["iterator.completed"] == 1
    assert counted["execution.completed"] == 1
    with transaction(url) as conn:
        loop = repo.get_loop(conn, iterations[0].message["run_id"])
        head = repo.execution_head(conn, execution_id)
    assert (loop["done"], loop["succeeded"], loop["status"]) == (60, 60, "completed")
    assert head["status"] == "completed" and head["pending"] == 0


def test_a_redelivered_start_does_not_start_twice(url):
    plan = compile_playbook(LOOP, overrides={"n": 3})
    execution_id = create_execution(plan, url)
    first = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    again = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    assert [d.message["step"] for d in again] == [d.message["step"] for d in first] == ["start"]
    counted = kinds(url, execution_id)
    assert counted["execution.started"] == 1 and counted["step.started"] == 1
    with transaction(url) as conn:
        assert repo.execution_head(conn, execution_id)["pending"] == 1


def _loop_started(url: str, n: int = 5) -> tuple[int, list[Dispatch]]:
    plan = compile_playbook(LOOP, overrides={"n": n})
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return execution_id, orchestrator.handle_event(url, attempt(url, start[0]))


def _statements(monkeypatch) -> list[str]:
    """The SQL of every statement the hot path runs on the DBAPI cursor, recorded."""
    seen: list[str] = []
    real = repo._run

    def counting(conn, sql, params):
        seen.append(sql)
        return real(conn, sql, params)

    monkeypatch.setattr(repo, "_run", counting)
    return seen


def test_an_iteration_outcome_is_decided_without_a_separate_head_read(url, monkeypatch):
    execution_id, iterations = _loop_started(url)
    outcome = attempt(url, iterations[0])  # the worker cached the state: the decision defers its head
    seen = _statements(monkeypatch)
    assert orchestrator.handle_event(url, outcome) == []
    heads = [s for s in seen if s.lstrip().startswith("SELECT status")]
    if url.startswith("postgresql"):  # the head is read by the one statement that counts and records
        assert heads == [] and len(seen) == 1 and "FOR KEY SHARE" in seen[0] and "UPDATE noetl_loop" in seen[0]
    else:  # SQLite: a plain read inside BEGIN IMMEDIATE, before the counter
        assert len(heads) == 1 and seen.index(heads[0]) == 0
    with transaction(url) as conn:
        assert repo.get_loop(conn, iterations[0].message["run_id"])["done"] == 1


CURSOR_DEMO = Path(__file__).resolve().parents[1] / "playbooks" / "cursor_queue.yaml"


def _cursor_row_ready(url: str, queue_db: Path) -> tuple[int, Dispatch]:
    """A cursor loop (SQLite driver) whose first slot claimed a frame of two rows and ran the
    first in the claim's attempt: the task of the frame's second row."""
    plan = compile_playbook(CURSOR_DEMO, overrides={"jobs": 8, "queue_db": str(queue_db)})
    execution_id = create_execution(plan, url)
    [seed] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    claims = orchestrator.handle_event(url, attempt(url, seed))
    [row] = orchestrator.handle_event(url, attempt(url, claims[0]))
    assert row.message["slot"]["phase"] == "row" and row.message["slot"]["index"] == 1
    return execution_id, row


def test_a_cursor_rows_outcome_is_decided_without_a_separate_head_read(url, monkeypatch, tmp_path):
    execution_id, row = _cursor_row_ready(url, tmp_path / "queue.sqlite")
    outcome = attempt(url, row)
    seen = _statements(monkeypatch)
    [following] = orchestrator.handle_event(url, outcome)  # the slot's next claim
    assert following.message["slot"]["phase"] == "claim" and following.message["slot"]["index"] == 2
    heads = [s for s in seen if s.lstrip().startswith("SELECT status")]
    if url.startswith("postgresql"):
        assert heads == [] and "FOR KEY SHARE" in seen[0]
    else:
        assert len(heads) == 1 and seen.index(heads[0]) == 0
    with transaction(url) as conn:
        assert repo.get_loop(conn, row.message["run_id"])["done"] == 2
    assert kinds(url, execution_id)["cursor.item.done"] == 2


def test_nothing_is_dispatched_after_a_cancel_even_from_a_cached_cursor_row(url, tmp_path):
    from noetl_celery.engine.recovery.lifecycle import end_tree

    execution_id, row = _cursor_row_ready(url, tmp_path / "queue.sqlite")
    outcome = attempt(url, row)
    with transaction(url) as conn:
        end_tree(conn, execution_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "x"})
    assert orchestrator.handle_event(url, outcome) == []  # neither the next row nor a claim
    with transaction(url) as conn:
        assert repo.get_loop(conn, row.message["run_id"])["done"] == 1  # the claim's row, before the cancel


def test_nothing_is_dispatched_after_a_cancel_even_from_a_cached_state(url):
    from noetl_celery.engine.recovery.lifecycle import end_tree

    execution_id, iterations = _loop_started(url, n=60)  # 50 in flight, 10 waiting
    outcome = attempt(url, iterations[0])
    with transaction(url) as conn:
        end_tree(conn, execution_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "x"})
    assert orchestrator.handle_event(url, outcome) == []  # iteration 50 is not sent
    with transaction(url) as conn:
        loop = repo.get_loop(conn, iterations[0].message["run_id"])
        row = repo.find_event(conn, execution_id, TaskMessage.from_dict(iterations[0].message).outcome_key())
    assert loop["done"] == 0  # recorded, not counted: a resume decides it
    assert row is not None and row["meta"].get("ignored") is True


def test_a_decision_waits_for_a_cancel_in_flight_and_then_dispatches_nothing(migrated_postgres):
    import threading
    import time

    from noetl_celery.engine.recovery.lifecycle import end_tree

    url = migrated_postgres.url
    execution_id, iterations = _loop_started(url, n=60)
    outcome = attempt(url, iterations[0])
    locked, result = threading.Event(), {}

    def cancel() -> None:
        with transaction(url) as conn:
            repo.lock_execution(conn, execution_id)  # as `noetl-celery cancel` does, first
            locked.set()
            time.sleep(0.5)  # the decision starts meanwhile and must wait for this commit
            end_tree(conn, execution_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "x"})

    canceller = threading.Thread(target=cancel)
    canceller.start()
    assert locked.wait(5)
    result["dispatches"] = orchestrator.handle_event(url, outcome)
    canceller.join(10)
    assert result["dispatches"] == []
    with transaction(url) as conn:
        assert repo.get_loop(conn, iterations[0].message["run_id"])["done"] == 0


def test_a_newer_state_than_the_cached_one_is_decided_on_the_fresh_state(url):
    execution_id, iterations = _loop_started(url, n=60)
    outcome = attempt(url, iterations[0])
    with transaction(url) as conn:  # another decision changed variables after the worker's read
        repo.bump_execution(conn, execution_id, version=1)
        repo.put_variables(conn, execution_id, "vars", {"late": 1})
    dispatches = orchestrator.handle_event(url, outcome)
    assert [d.message["iteration"] for d in dispatches] == [50]
    assert all(d.message["version"] == iterations[0].message["version"] + 1 for d in dispatches)
    with transaction(url) as conn:
        assert repo.get_loop(conn, iterations[0].message["run_id"])["done"] == 1  # counted once


def test_iterations_finishing_out_of_order_send_each_index_once_under_the_cap(url, tmp_path):
    """The completion of index i sends index i + cap: whatever order iterations end in, every
    index is sent exactly once and at most `cap` are in flight."""
    path = tmp_path / "cap3.yaml"
    path.write_text(LOOP.read_text().replace("max_in_flight: 50", "max_in_flight: 3"))
    plan = compile_playbook(path, overrides={"n": 10})
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    flying = {d.message["iteration"]: d for d in orchestrator.handle_event(url, attempt(url, start[0]))}
    assert sorted(flying) == [0, 1, 2]
    sent = list(flying)
    while flying:
        index = max(flying) if len(sent) % 2 else min(flying)  # alternately the newest and the oldest
        for dispatch in orchestrator.handle_event(url, attempt(url, flying.pop(index))):
            if dispatch.message.get("iteration") is not None:
                flying[dispatch.message["iteration"]] = dispatch
                sent.append(dispatch.message["iteration"])
        assert len(flying) <= 3
    assert sorted(sent) == list(range(10))  # each index once
    assert sent != sorted(sent)  # ... not simply in index order
    with transaction(url) as conn:
        head = repo.execution_head(conn, execution_id)
        ends = [e["event_type"] for e in repo.list_events(conn, execution_id)].count("iterator.completed")
        variables = repo.load_variables(conn, execution_id)
    assert head["status"] == "completed" and ends == 1
    assert variables["result"]["work"]["results"] == [2 * i for i in range(10)]  # in collection order


RETRY_LATER = retry_once("replayed_backoff", delay=30, then="second")


def test_a_replayed_retry_keeps_its_backoff_and_its_delayed_original_is_dropped_once_it_ran(url, tmp_path):
    path = tmp_path / "retry_later.yaml"
    path.write_text(RETRY_LATER)
    execution_id = create_execution(compile_playbook(path), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    failed = attempt(url, first)
    [retry] = orchestrator.handle_event(url, failed)
    assert retry.countdown == 30 and retry.message["delayed"] and not retry.message.get("replay")

    [replayed] = orchestrator.handle_event(url, failed)  # the failed attempt's event, delivered again
    assert replayed.message["replay"] and replayed.message["attempt"] == 2
    assert 25 < replayed.countdown <= 30  # what is left of the backoff, not due at once

    # whichever of the two runs first is the one attempt: the other finds it recorded, while the
    # execution still runs
    [second] = orchestrator.handle_event(url, attempt(url, replayed))
    assert worker.execute(url, TaskMessage.from_dict(retry.message)) is None
    assert orchestrator.handle_event(url, attempt(url, second)) == []
    counted = kinds(url, execution_id)
    assert counted["action.completed"] == 2 and counted["execution.completed"] == 1
