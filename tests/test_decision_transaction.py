"""Decision transactions on PostgreSQL with psycopg2 (store/db.py `decision_transaction`): BEGIN
travels with the first statement and, for decisions that set no variables, COMMIT with the
strict insert of their rows (store/repo.py `record_decision`). What the driver sends is read
back from psycopg2's `cursor.query`; with the connection in autocommit mode, psycopg2 sends
nothing else, so each query recorded is one round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import event, text

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import commit_suffix, decision_transaction, defer, get_engine, migrate, transaction
from tests.support.playbooks import retry_once

LOOP = Path(__file__).resolve().parent / "playbooks" / "loop_many.yaml"

RETRY_ONCE = retry_once("decision_retry_once")

CHAIN = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: decision_chain}
workflow:
  - step: start
    tool: {kind: python, code: "result = {'n': 1, 'name': 'first'}"}
    next: {arcs: [{step: second}]}
  - step: second
    tool: {kind: python, code: "result = 2"}
    next: {arcs: [{step: third}]}
  - step: third
    tool: {kind: python, code: "result = 3"}
"""


@pytest.fixture
def url(migrated_postgres) -> str:
    return migrated_postgres.url


@pytest.fixture(autouse=True)
def empty_cache():
    STATE.clear()
    yield
    STATE.clear()


class Wire:
    """The queries the driver sent, in order: (query, autocommit at the time). A statement that
    failed is recorded as "failed: <its SQL>"."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool]] = []

    @property
    def queries(self) -> list[str]:
        return [q for q, _ in self.sent]

    def clear(self) -> None:
        self.sent.clear()


@pytest.fixture
def wire(url, monkeypatch):
    recorded = Wire()
    real = repo._run

    def recording(conn, sql, params):
        autocommit = conn.connection.dbapi_connection.autocommit
        try:
            cursor = real(conn, sql, params)
        except Exception:
            recorded.sent.append((f"failed: {sql}", autocommit))
            raise
        recorded.sent.append((cursor.query.decode(), autocommit))
        return cursor

    def after(conn, cursor, _statement, _parameters, _context, _executemany):
        recorded.sent.append((cursor.query.decode(), conn.connection.dbapi_connection.autocommit))

    monkeypatch.setattr(repo, "_run", recording)
    engine = get_engine(url)
    event.listen(engine, "after_cursor_execute", after)
    yield recorded
    event.remove(engine, "after_cursor_execute", after)


def attempt(url: str, dispatch: Dispatch) -> dict:
    payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id="test")
    assert payload is not None
    return payload


def _loop_started(url: str, n: int) -> tuple[int, list[Dispatch]]:
    plan = compile_playbook(LOOP, overrides={"n": n})
    execution_id = create_execution(plan, url)
    start = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return execution_id, orchestrator.handle_event(url, attempt(url, start[0]))


def _failed_first_attempt(url: str, tmp_path: Path) -> tuple[int, dict]:
    path = tmp_path / "retry_once.yaml"
    path.write_text(RETRY_ONCE)
    execution_id = create_execution(compile_playbook(path), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    payload = attempt(url, first)
    assert payload["outcome"]["status"] == "error"
    return execution_id, payload


def _chain_started(url: str, tmp_path: Path) -> tuple[int, Dispatch]:
    path = tmp_path / "chain.yaml"
    path.write_text(CHAIN)
    execution_id = create_execution(compile_playbook(path), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return execution_id, first


def _chain_at_third(url: str, tmp_path: Path) -> tuple[int, dict]:
    """The chain with its third step's outcome in hand, not decided yet."""
    execution_id, first = _chain_started(url, tmp_path)
    [second] = orchestrator.handle_event(url, attempt(url, first))
    [third] = orchestrator.handle_event(url, attempt(url, second))
    return execution_id, attempt(url, third)


def _execution_row(url: str, execution_id: int):
    with transaction(url) as conn:
        return conn.execute(
            text(
                "SELECT status, pending, state_version, finished_at, failed_step, error FROM noetl_execution "
                "WHERE execution_id = :e"
            ),
            {"e": execution_id},
        ).one()


def _event_types(url: str, execution_id: int) -> list[str]:
    with transaction(url) as conn:
        return [e["event_type"] for e in repo.list_events(conn, execution_id)]


def _loop_row(url: str, run_id: str) -> dict:
    with transaction(url) as conn:
        loop = repo.get_loop(conn, run_id)
    assert loop is not None
    return loop


def test_an_iteration_is_counted_and_recorded_in_one_round_trip(url, wire):
    _, iterations = _loop_started(url, n=60)  # cap 50: each completion sends one more
    outcome = attempt(url, iterations[0])
    wire.clear()
    [following] = orchestrator.handle_event(url, outcome)
    assert following.message["iteration"] == 50
    [only] = wire.queries
    assert only.startswith("BEGIN; WITH head AS (SELECT status") and "counted AS (UPDATE noetl_loop" in only
    assert "INSERT INTO noetl_event" in only and "ON CONFLICT" not in only and only.endswith("; COMMIT")
    assert all(autocommit for _, autocommit in wire.sent)
    loop = _loop_row(url, iterations[0].message["run_id"])
    assert (loop["done"], loop["succeeded"], loop["failed"]) == (1, 1, 0)


def test_the_last_iteration_is_refused_by_the_one_statement_and_finishes_the_loop_once(url, wire):
    execution_id, iterations = _loop_started(url, n=3)
    outcomes = [attempt(url, d) for d in iterations]
    for outcome in outcomes[:2]:
        assert orchestrator.handle_event(url, outcome) == []
    wire.clear()
    following = orchestrator.handle_event(url, outcomes[2])  # the loop's last: the step after it
    assert wire.queries[0].startswith("failed: WITH head AS") and "counted AS" in wire.queries[0]
    assert "ROLLBACK" in wire.queries
    loop = _loop_row(url, iterations[0].message["run_id"])
    assert (loop["done"], loop["status"]) == (3, "completed")
    with transaction(url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert kinds.count("iteration.completed") == 3 and kinds.count("iterator.completed") == 1
    for dispatch in following:  # what comes after the loop runs to the end
        for more in orchestrator.handle_event(url, attempt(url, dispatch)):
            orchestrator.handle_event(url, attempt(url, more))
    with transaction(url) as conn:
        assert repo.execution_head(conn, execution_id)["status"] == "completed"


def test_a_retry_is_decided_in_one_round_trip(url, wire, tmp_path):
    execution_id, failed = _failed_first_attempt(url, tmp_path)
    wire.clear()
    [retry] = orchestrator.handle_event(url, failed)
    assert retry.message["attempt"] == 2 and retry.countdown == 0
    [only] = wire.queries
    assert only.startswith("BEGIN; WITH head AS (SELECT status") and "FOR KEY SHARE" in only
    assert "INSERT INTO noetl_event" in only and only.endswith("; COMMIT")
    with transaction(url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert kinds.count("retry.scheduled") == 1

    ended = orchestrator.handle_event(url, attempt(url, retry))  # the second attempt ends the run
    assert ended == []
    with transaction(url) as conn:
        assert repo.execution_head(conn, execution_id)["status"] == "completed"


def test_a_redelivered_iteration_is_refused_by_the_strict_insert_and_replayed(url, wire):
    _, iterations = _loop_started(url, n=60)
    outcome = attempt(url, iterations[0])
    first = orchestrator.handle_event(url, outcome)
    wire.clear()
    again = orchestrator.handle_event(url, outcome)
    assert [d.message["iteration"] for d in again] == [d.message["iteration"] for d in first] == [50]
    assert all(d.message["replay"] for d in again)
    failed = [q for q in wire.queries if q.startswith("failed: ")]
    assert len(failed) == 1 and "INSERT INTO noetl_event" in failed[0]  # the strict try, rolled back
    assert "ROLLBACK" in wire.queries
    loop = _loop_row(url, iterations[0].message["run_id"])
    assert (loop["done"], loop["succeeded"]) == (1, 1)  # the strict try's count was rolled back


def test_a_retry_on_a_stale_cached_state_is_decided_again_on_the_fresh_one(url, wire, tmp_path):
    execution_id, failed = _failed_first_attempt(url, tmp_path)
    assert STATE.peek(url, execution_id, min_version=0) is not None  # the worker cached the state
    with transaction(url) as conn:  # another process's decision moved the state on
        conn.execute(
            text("UPDATE noetl_execution SET state_version = state_version + 1 WHERE execution_id = :e"),
            {"e": execution_id},
        )
    wire.clear()
    [retry] = orchestrator.handle_event(url, failed)
    assert retry.message["attempt"] == 2
    assert wire.queries[0].startswith("failed: WITH head AS")  # the head check refused the insert
    assert "ROLLBACK" in wire.queries
    with transaction(url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert kinds.count("retry.scheduled") == 1


def test_a_retry_after_a_cancel_is_recorded_and_sends_nothing(url, tmp_path):
    execution_id, failed = _failed_first_attempt(url, tmp_path)
    with transaction(url) as conn:
        repo.finish_execution(conn, execution_id, "cancelled")
    assert orchestrator.handle_event(url, failed) == []
    with transaction(url) as conn:
        kinds = [e["event_type"] for e in repo.list_events(conn, execution_id)]
    assert "retry.scheduled" not in kinds


def test_a_failed_decision_transaction_writes_nothing_and_leaves_its_connection_clean(url):
    engine = get_engine(url)
    engine.dispose()
    with pytest.raises(RuntimeError), decision_transaction(url) as conn:
        conn.execute(text("CREATE TABLE decision_probe (k int primary key)"))
        assert conn.connection.dbapi_connection.info.transaction_status != 0  # BEGIN went with it
        raise RuntimeError("the decision failed")
    with transaction(url) as conn:
        dbapi_connection = conn.connection.dbapi_connection
        assert dbapi_connection.autocommit is False  # the pool's only connection, reset
        assert conn.execute(text("SELECT to_regclass('decision_probe')")).scalar() is None
    assert engine.pool.checkedout() == 0


def test_a_decision_transaction_without_a_commit_of_its_own_commits_at_the_end(url):
    with decision_transaction(url) as conn:
        conn.execute(text("CREATE TABLE decision_probe (k int primary key)"))
        conn.execute(text("INSERT INTO decision_probe VALUES (1)"))
        assert commit_suffix(conn) == "; COMMIT"
    with transaction(url) as conn:
        assert conn.execute(text("SELECT k FROM decision_probe")).scalar() == 1
        assert commit_suffix(conn) is None  # a plain transaction commits on its own


PERCENT = "100% of '%s' and %(x)s"  # what psycopg2 would read as placeholders, were it not escaped


@pytest.mark.parametrize("then", ["a bound statement", "a plain statement", "the commit"])
def test_a_deferred_statement_travels_with_the_next_one_and_keeps_its_values(url, then):
    with transaction(url) as conn:
        conn.execute(text("CREATE TABLE decision_probe (k int primary key, v text)"))
    sent: list[str] = []
    engine = get_engine(url)

    def after(_conn, cursor, _statement, _parameters, _context, _executemany):
        sent.append(cursor.query.decode())

    event.listen(engine, "after_cursor_execute", after)
    try:
        with decision_transaction(url) as conn:
            assert defer(conn, "INSERT INTO decision_probe VALUES (%s, %s)", [1, PERCENT])
            assert sent == []  # nothing sent yet
            if then == "a bound statement":
                conn.execute(text("INSERT INTO decision_probe VALUES (:k, :v)"), {"k": 2, "v": "%s"})
            elif then == "a plain statement":
                conn.exec_driver_sql("INSERT INTO decision_probe VALUES (2, 'plain')")
    finally:
        event.remove(engine, "after_cursor_execute", after)
    assert sent[0].startswith("BEGIN; INSERT INTO decision_probe VALUES (1, ")
    if then == "the commit":  # nothing came after it: it went with the COMMIT
        assert len(sent) == 1 and sent[0].endswith("; COMMIT")
    else:
        assert sent[0].endswith("VALUES (2, '%s')" if then == "a bound statement" else "VALUES (2, 'plain')")
        assert sent[1:] == ["COMMIT"]
    with transaction(url) as conn:
        rows = dict(conn.execute(text("SELECT k, v FROM decision_probe")).all())
    assert rows[1] == PERCENT
    assert rows.get(2) == {"a bound statement": "%s", "a plain statement": "plain", "the commit": None}[then]


def test_a_deferred_statement_is_rolled_back_with_the_statement_that_carried_it(url):
    with transaction(url) as conn:
        conn.execute(text("CREATE TABLE decision_probe (k int primary key)"))
    with pytest.raises(Exception, match="duplicate key"), decision_transaction(url) as conn:
        assert defer(conn, "INSERT INTO decision_probe VALUES (%s)", [1])
        conn.exec_driver_sql("INSERT INTO decision_probe VALUES (1)")  # the key the deferred one took
    with transaction(url) as conn:
        assert conn.execute(text("SELECT count(*) FROM decision_probe")).scalar() == 0
        assert defer(conn, "SELECT 1", []) is False  # only a decision transaction defers


def test_on_sqlite_a_decision_transaction_is_a_plain_one(sqlite_url):
    migrate(sqlite_url)
    with decision_transaction(sqlite_url) as conn:
        assert commit_suffix(conn) is None
        conn.execute(text("CREATE TABLE decision_probe (k int)"))
    with transaction(sqlite_url) as conn:
        assert conn.execute(text("SELECT count(*) FROM decision_probe")).scalar() == 0


def test_a_step_that_stores_its_result_and_starts_the_next_is_decided_in_one_round_trip(url, wire, tmp_path):
    execution_id, first = _chain_started(url, tmp_path)
    outcome = attempt(url, first)
    wire.clear()
    [second] = orchestrator.handle_event(url, outcome)
    assert second.message["step"] == "second"
    [only] = wire.queries
    assert (
        only.startswith("BEGIN; WITH bumped AS (UPDATE noetl_execution") and "v AS (INSERT INTO noetl_variable" in only
    )
    assert "INSERT INTO noetl_event" in only and "ON CONFLICT (execution_id, event_id)" not in only
    assert "; COMMIT; SELECT e.state_version, e.pending" in only  # the stored values, read back
    assert all(autocommit for _, autocommit in wire.sent)
    row = _execution_row(url, execution_id)
    assert (row.status, row.pending, row.state_version) == ("running", 1, second.message["version"])
    cached = STATE.peek(url, execution_id, min_version=second.message["version"])
    assert cached is not None and cached.pending == 1
    assert cached.results["start"] == {"n": 1, "name": "first"}
    kept = (cached.results, cached.vars, cached.ctx)
    STATE.clear()  # the state as a process that never saw the execution reads it
    fresh = STATE.get(url, execution_id, min_version=second.message["version"])
    assert (fresh.results, fresh.vars, fresh.ctx) == kept and fresh.pending == 1


def test_the_last_step_completes_the_execution_in_one_round_trip(url, wire, tmp_path):
    execution_id, outcome = _chain_at_third(url, tmp_path)
    wire.clear()
    assert orchestrator.handle_event(url, outcome) == []
    [only] = wire.queries
    assert only.startswith("BEGIN; WITH bumped AS (UPDATE noetl_execution") and "status = 'completed'" in only
    row = _execution_row(url, execution_id)
    assert (row.status, row.pending, row.failed_step, row.error) == ("completed", 0, None, None)
    assert row.finished_at is not None
    kinds = _event_types(url, execution_id)
    assert kinds[-1] == "execution.completed" and kinds.count("execution.completed") == 1
    assert kinds.count("step.completed") == 3


def test_a_wrong_guess_of_the_pending_count_is_refused_and_decided_again(url, wire, tmp_path):
    execution_id, outcome = _chain_at_third(url, tmp_path)
    with transaction(url) as conn:  # a decision without variables moved pending, not the version
        conn.execute(
            text("UPDATE noetl_execution SET pending = pending + 1 WHERE execution_id = :e"), {"e": execution_id}
        )
    wire.clear()
    assert orchestrator.handle_event(url, outcome) == []
    assert wire.queries[0].startswith("failed: WITH bumped AS") and "status = 'completed'" in wire.queries[0]
    assert "ROLLBACK" in wire.queries
    row = _execution_row(url, execution_id)
    assert (row.status, row.pending) == ("running", 1)  # the other unit is still pending
    kinds = _event_types(url, execution_id)
    assert "execution.completed" not in kinds and kinds.count("step.completed") == 3


def test_a_redelivered_step_outcome_is_refused_by_the_strict_write_and_replayed(url, wire, tmp_path):
    execution_id, first = _chain_started(url, tmp_path)
    outcome = attempt(url, first)
    [second] = orchestrator.handle_event(url, outcome)
    before = _execution_row(url, execution_id)
    wire.clear()
    [again] = orchestrator.handle_event(url, outcome)
    assert again.message["replay"] and again.message["step"] == second.message["step"]
    assert wire.queries[0].startswith("failed: WITH bumped AS") and "ROLLBACK" in wire.queries
    after = _execution_row(url, execution_id)
    assert (after.pending, after.state_version) == (before.pending, before.state_version)
    assert _event_types(url, execution_id).count("step.completed") == 1


def test_submit_records_the_execution_and_its_start_in_one_round_trip(url, wire, tmp_path, monkeypatch):
    from noetl_celery import runner
    from noetl_celery.config import settings as noetl_settings
    from noetl_celery.engine.transport import publish as app_module

    path = tmp_path / "chain.yaml"
    path.write_text(CHAIN)
    plan = compile_playbook(path)
    published: list[Dispatch] = []
    monkeypatch.setattr(app_module, "publish", lambda dispatches, **_: published.extend(dispatches))
    settings = noetl_settings.load({"NOETL_DATABASE_URL": url})
    runner.submit(plan, settings)  # the first: the schema check reads the store once per process
    wire.clear()
    execution_id = runner.submit(plan, settings)
    [sent] = wire.queries  # the execution's row was deferred to travel with its start's rows
    assert sent.startswith("BEGIN; INSERT INTO noetl_execution")
    assert "INSERT INTO noetl_event" in sent and sent.endswith("; COMMIT")  # as text, or prepared (a second submit)
    assert [d.message["step"] for d in published] == ["start", "start"]
    assert _event_types(url, execution_id) == ["execution.started", "step.started", "action.started"]
