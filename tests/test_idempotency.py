"""Redelivered events are no-ops: on_event and the worker driven by hand, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine import orchestrator, worker
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import migrate, transaction

LOOP = Path(__file__).resolve().parent / "playbooks" / "loop_many.yaml"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'noetl.sqlite'}"
    url = request.getfixturevalue("fresh_postgres").url
    migrate(url)  # only `migrate` changes a server's schema
    return url


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
