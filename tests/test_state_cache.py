"""The per-process execution state cache (engine/context.py): one-statement reads, and the state a
decision of this process wrote kept instead of read again. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from noetl_celery import runner
from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import single_read, transaction

CHAIN = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: state_cache_chain}
workload: {x: 1}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'b': 1, 'a': {'z': [3, 2], 'y': None}, 'c': 'text'}"}
    next: {arcs: [{step: second}]}
  - step: second
    tool: {kind: python, args: {prev: "{{ start.a.z }}"}, code: "result = {'zz': prev, 'aa': 2.5}"}
    next: {arcs: [{step: third}]}
  - step: third
    tool: {kind: python, args: {n: "{{ second.aa }}"}, code: "result = n"}
"""


@pytest.fixture
def url(either_store: str) -> str:
    return either_store


@pytest.fixture
def plan(tmp_path):
    path = tmp_path / "chain.yaml"
    path.write_text(CHAIN)
    return compile_playbook(path)


@pytest.fixture(autouse=True)
def empty_cache():
    STATE.clear()
    yield
    STATE.clear()


def as_read(url: str, execution_id: int) -> dict:
    """The variables and version a process that never saw the execution reads."""
    with transaction(url) as conn:
        state = repo.read_state(conn, execution_id, full=False)
    assert state is not None
    return state


def ordered(value):
    """`value` with every dict's key order made visible (JSONB orders keys its own way)."""
    if isinstance(value, dict):
        return [(k, ordered(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [ordered(v) for v in value]
    return value


def by_name(variables: dict) -> dict:
    """Variables by name, each value's key order visible (rows come back in any order)."""
    return {name: ordered(value) for name, value in variables.items()}


def test_one_statement_reads_what_the_table_reads_give(url, plan):
    execution_id = create_execution(plan, url)
    with transaction(url) as conn:
        repo.put_variables(conn, execution_id, "vars", {"v": {"b": 1, "a": [1, {"d": 2, "c": 3}]}, "w": None})
        repo.put_variables(conn, execution_id, "result", {"start": "done"})
        repo.bump_execution(conn, execution_id, version=2)
    with single_read(url) as conn:
        full = repo.read_state(conn, execution_id, full=True)
        head_only = repo.read_state(conn, execution_id, full=False)
        missing = repo.read_state(conn, execution_id + 1, full=True)
    with transaction(url) as conn:
        variables = repo.load_variables(conn, execution_id)
        row = repo.get_execution(conn, execution_id)
    assert missing is None
    assert full is not None and head_only is not None
    for scope in ("vars", "result"):
        assert by_name(full["variables"][scope]) == by_name(variables[scope]) == by_name(head_only["variables"][scope])
    assert set(full["variables"]) == set(variables) == set(head_only["variables"]) == {"vars", "result"}
    assert full["variables"]["vars"]["w"] is None
    assert full["state_version"] == head_only["state_version"] == row["state_version"] == 2
    assert full["plan"] == row["plan"] and full["workload"] == row["workload"] == {"x": 1}
    assert full["parent_execution_id"] is None
    assert "plan" not in head_only


def test_the_state_a_decision_wrote_is_kept_as_a_read_would_give_it(url, plan, monkeypatch):
    execution_id = create_execution(plan, url)
    pending = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    reads = []
    real_read = repo.read_state
    monkeypatch.setattr(repo, "read_state", lambda *a, **k: reads.append(a[1]) or real_read(*a, **k))
    steps = []
    while pending:
        dispatch = pending.pop(0)
        message = TaskMessage.from_dict(dispatch.message)
        before = len(reads)
        payload = worker.execute(url, message, queue_id="test")
        assert payload is not None and payload["outcome"]["status"] == "ok", payload
        steps.append((message.step, len(reads) - before))
        pending += orchestrator.handle_event(url, payload)
        kept = STATE.peek(url, execution_id)
        assert kept is not None, f"the decision on {message.step} dropped the state"
        read = as_read(url, execution_id)
        assert kept.version == read["state_version"]
        assert by_name(kept.results) == by_name(read["variables"].get("result", {}))
        assert by_name(kept.task_results) == by_name(read["variables"].get("tasks", {}))
        assert by_name(kept.vars) == by_name(read["variables"].get("vars", {}))
    # the start's decision read the execution; every attempt after it ran on the state kept
    assert steps == [("start", 0), ("second", 0), ("third", 0)]
    with transaction(url) as conn:
        assert repo.get_execution(conn, execution_id)["status"] == "completed"
        assert repo.load_variables(conn, execution_id)["result"]["third"] == 2.5


def test_a_decision_another_one_came_between_drops_the_state(migrated_postgres, plan, monkeypatch):
    """Another process's decision commits between this one's head read and its own write: the
    kept state would miss that decision's variables, so it is dropped and read again."""
    url = migrated_postgres.url
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    payload = worker.execute(url, TaskMessage.from_dict(start[0].message), queue_id="test")
    assert payload is not None
    other = create_engine(url)
    real_bump = repo.bump_execution
    came_between = []

    def another_decision_first(conn, eid, **kwargs):
        if eid == execution_id and kwargs.get("version") and not came_between:
            came_between.append(eid)
            with other.begin() as elsewhere:  # not blocked: the head is only locked FOR KEY SHARE
                repo.put_variables(elsewhere, execution_id, "vars", {"elsewhere": True})
                real_bump(elsewhere, execution_id, version=1)
        return real_bump(conn, eid, **kwargs)

    monkeypatch.setattr(repo, "bump_execution", another_decision_first)
    STATE.forget(url, execution_id)  # no cached state: the decision reads the head first
    try:
        dispatches: list[Dispatch] = orchestrator.handle_event(url, payload)
    finally:
        other.dispose()
    assert came_between
    assert [d.message["step"] for d in dispatches] == ["second"]
    assert STATE.peek(url, execution_id) is None
    state = STATE.get(url, execution_id, min_version=dispatches[0].message["version"])
    assert state.vars == {"elsewhere": True}
    assert state.results["start"] == {"b": 1, "a": {"z": [3, 2], "y": None}, "c": "text"}


def test_a_decision_on_the_cached_state_reads_no_head_and_redecides_when_it_moved(url, plan, monkeypatch):
    """The process has the state the attempt ran on: the decision reads no head first (the
    counters' update returns it). When another decision moved the execution on meanwhile, the
    transaction is rolled back and the event decided again on the state read afresh."""
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    first = worker.execute(url, TaskMessage.from_dict(start[0].message), queue_id="test")
    assert first is not None
    heads = []
    real_head = repo.execution_head
    monkeypatch.setattr(repo, "execution_head", lambda *a, **k: heads.append(a[1]) or real_head(*a, **k))
    second = orchestrator.handle_event(url, first)
    assert heads == [] and [d.message["step"] for d in second] == ["second"]

    payload = worker.execute(url, TaskMessage.from_dict(second[0].message), queue_id="test")
    assert payload is not None
    with transaction(url) as conn:  # another process's decision, after this one's attempt ran
        repo.put_variables(conn, execution_id, "vars", {"elsewhere": True})
        repo.bump_execution(conn, execution_id, version=1)
    third = orchestrator.handle_event(url, payload)
    assert heads == [execution_id]  # the deferred decision was refused, the classic one read the head
    assert [d.message["step"] for d in third] == ["third"]
    with transaction(url) as conn:
        variables = repo.load_variables(conn, execution_id)
        events = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert variables["vars"] == {"elsewhere": True} and variables["result"]["second"] == {"zz": [3, 2], "aa": 2.5}
    assert events.count("step.completed") == 2 and events.count("step.started") == 3
    kept = STATE.peek(url, execution_id, min_version=third[0].message["version"])
    assert kept is not None and kept.vars == {"elsewhere": True}


@pytest.mark.parametrize("extra_rows", [0, repo.INSERT_ROWS_PER_STATEMENT])
def test_a_decisions_rows_and_variables_are_written_together_and_a_redelivery_writes_neither(url, plan, extra_rows):
    """`record_decision` (one statement on PostgreSQL when the rows fit one insert, else the
    two inserts): the variables come back as stored; a decision whose first row exists
    already is refused, and the caller's rollback then drops its variables as well."""
    execution_id = create_execution(plan, url)
    rows = [
        {"execution_id": execution_id, "event_id": f"k{i}", "event_type": "test.row"} for i in range(2 + extra_rows)
    ]
    variables = {"result": {"start": {"b": 1, "a": 2}}, "vars": {"token": "plain"}}
    with transaction(url) as conn:
        new, stored, _ = repo.record_decision(conn, rows, variables)
    assert new
    assert {scope: by_name(values) for scope, values in stored.items()} == {
        "result": {"start": [("a", 2), ("b", 1)] if url.startswith("postgresql") else [("b", 1), ("a", 2)]},
        "vars": {"token": "plain"},
    }
    again = [{**rows[0], "event_id": "k0"}, {"execution_id": execution_id, "event_id": "fresh", "event_type": "t"}]
    with pytest.raises(RuntimeError), transaction(url) as conn:  # the caller rolls back a refused decision
        new, stored, _ = repo.record_decision(conn, again, {"vars": {"token": "second"}})
        assert (new, stored) == (False, {})
        raise RuntimeError("roll back")
    with transaction(url) as conn:
        assert repo.load_variables(conn, execution_id)["vars"] == {"token": "plain"}
        keys = {e["event_id"] for e in repo.list_events(conn, execution_id)}
    assert len(keys) == len(rows) and "fresh" not in keys


INLINE_ONLY = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: state_cache_inline}
workflow:
  - step: start
    next: {arcs: [{step: end}]}
  - step: end
"""


@pytest.mark.parametrize("playbook", ["chain", "inline_only"])
def test_submit_writes_the_execution_row_with_the_counters_its_start_leaves(url, tmp_path, plan, playbook, monkeypatch):
    """`runner.submit` decides the start before the row exists and inserts the row with its
    counters: the chain's first step pending; a playbook of steps without work completed."""
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.engine.transport import publish as app_module

    if playbook == "inline_only":
        (tmp_path / "inline.yaml").write_text(INLINE_ONLY)
        plan = compile_playbook(tmp_path / "inline.yaml")
    published: list[Dispatch] = []
    monkeypatch.setattr(app_module, "publish", lambda dispatches, **_: published.extend(dispatches))
    execution_id = runner.submit(plan, noetl_settings.load({"NOETL_DATABASE_URL": url}))
    with transaction(url) as conn:
        head = repo.execution_head(conn, execution_id)
        events = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    if playbook == "chain":
        assert [d.message["step"] for d in published] == ["start"]
        assert head == {"status": "running", "pending": 1, "state_version": 0}
        assert events == ["execution.started", "step.started", "action.started"]
    else:
        assert published == []
        assert head is not None and head["status"] == "completed" and head["pending"] == 0
        assert events[0] == "execution.started" and events[-1] == "execution.completed"


def test_a_new_executions_first_message_is_run_without_a_read_by_a_process_that_holds_its_plan(
    url, tmp_path, plan, monkeypatch
):
    """A submit's first messages carry a seed (the plan's digest, the version and pending count
    its start wrote). A process that read an execution of the same plan before (same workload)
    builds the state from it and reads nothing; one that did not, or another plan, reads as
    before; the stored dispatch keeps no seed."""
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.engine.transport import publish as app_module

    published: list[Dispatch] = []
    monkeypatch.setattr(app_module, "publish", lambda dispatches, **_: published.extend(dispatches))
    settings = noetl_settings.load({"NOETL_DATABASE_URL": url})
    first, second = runner.submit(plan, settings), runner.submit(plan, settings)
    other_plan = compile_playbook(tmp_path / "chain.yaml", overrides={"x": 2})
    other = runner.submit(other_plan, settings)
    messages = {TaskMessage.from_dict(d.message).execution_id: TaskMessage.from_dict(d.message) for d in published}
    seeds = {execution_id: m.seed for execution_id, m in messages.items()}
    assert all(seed is not None for seed in seeds.values()), seeds
    assert seeds[first] == seeds[second] == {"plan": seeds[first]["plan"], "version": 0, "pending": 1}
    assert seeds[other]["plan"] != seeds[first]["plan"]  # the workload is part of the plan's digest
    with transaction(url) as conn:
        stored = repo.list_events(conn, second)
    dispatched = [d for row in stored for d in (row.get("meta") or {}).get("dispatch") or []]
    assert dispatched and all("seed" not in d["message"] for d in dispatched)

    reads: list[int] = []
    real_read = repo.read_state
    monkeypatch.setattr(repo, "read_state", lambda *a, **k: reads.append(a[1]) or real_read(*a, **k))
    STATE.clear()  # a worker process that never saw this plan
    payloads = {}
    for execution_id, expected_reads in ((first, [first]), (second, []), (other, [other])):
        reads.clear()
        payloads[execution_id] = worker.execute(url, messages[execution_id], queue_id="test")
        assert payloads[execution_id] is not None and payloads[execution_id]["outcome"]["status"] == "ok"
        assert reads == expected_reads, execution_id
    kept = STATE.peek(url, second)
    read = as_read(url, second)
    assert kept is not None and (kept.version, kept.pending) == (read["state_version"], read["pending"])
    assert kept.workload == {"x": 1} and read["variables"] == {}

    # the seeded execution goes on to its end as any other
    pending = orchestrator.handle_event(url, payloads[second])
    while pending:
        message = TaskMessage.from_dict(pending.pop(0).message)
        payload = worker.execute(url, message, queue_id="test")
        assert payload is not None
        pending += orchestrator.handle_event(url, payload)
    with transaction(url) as conn:
        assert repo.get_execution(conn, second)["status"] == "completed"
        assert repo.load_variables(conn, second)["result"]["third"] == 2.5


def test_a_seed_is_used_only_for_a_plan_held_and_at_the_version_asked(url, plan, monkeypatch):
    """A seed of a plan this process does not hold, or of another version than its message
    asks for, is not used: the state is read."""
    first, second = create_execution(plan, url), create_execution(plan, url)
    STATE.clear()
    digest = STATE.get(url, first).digest  # a full read: the process holds the plan now
    assert digest is not None
    reads: list[int] = []
    real_read = repo.read_state
    monkeypatch.setattr(repo, "read_state", lambda *a, **k: reads.append(a[1]) or real_read(*a, **k))
    with pytest.raises(LookupError):  # an unknown plan: read, and there is no such execution
        STATE.get(url, 10**15, seed={"plan": "0" * 32, "version": 0, "pending": 1})
    with pytest.raises(LookupError):  # a seed of another version: read too
        STATE.get(url, 10**15, min_version=3, seed={"plan": digest, "version": 2, "pending": 1})
    assert reads == [10**15, 10**15]
    state = STATE.get(url, second, seed={"plan": digest, "version": 0, "pending": 0})
    assert reads == [10**15, 10**15] and (state.version, state.pending, state.workload) == (0, 0, {"x": 1})
