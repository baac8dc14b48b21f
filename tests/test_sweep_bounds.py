"""The sweeper on PostgreSQL under load and against a frozen peer: a sweep over thousands of
overdue rows is a fixed number of set-based statements in short transactions, and a sweep
transaction left open by a frozen sweeper is ended by the server, which frees the lock."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.recovery import sweeper
from noetl_celery.runner import create_execution
from noetl_celery.store import leases, repo
from noetl_celery.store.db import get_engine, migrate, transaction
from tests.test_sweeper import PLAYBOOK

BACKLOG = 2000


@pytest.fixture(scope="module")
def url(postgres_url) -> str:
    migrate(postgres_url)
    return postgres_url


@pytest.fixture(autouse=True)
def fresh_watch(monkeypatch):
    monkeypatch.setattr(sweeper, "_watch", sweeper._LockWatch())


def clear_deadlines(url: str) -> None:
    """Other tests' overdue rows (same database) must not count here."""
    with transaction(url) as conn:
        conn.execute(text("DELETE FROM noetl_lease"))


def backlog(url: str, tmp_path, n: int, done: int) -> int:
    """An execution with `n` overdue decision rows, each having dispatched one attempt; the
    attempts of the first `done` have their outcome row."""
    path = tmp_path / "sweep.yaml"
    path.write_text(PLAYBOOK)
    execution_id = create_execution(compile_playbook(str(path)), url)
    [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    past = repo.utcnow() - timedelta(seconds=5)
    rows = []
    for i in range(n):
        dispatch = replace(first, message={**first.message, "iteration": i, "parent_event_id": f"synthetic.{i}"})
        rows.append(
            {
                "execution_id": execution_id,
                "event_id": f"synthetic.{i}",
                "event_type": "iteration.started",
                "status": "started",
                "step": "start",
                "meta": {"dispatch": [dispatch.to_dict()]},
                "deadline_at": past,
            }
        )
        if i < done:
            rows.append(
                {
                    "execution_id": execution_id,
                    "event_id": dispatch.attempt_key() + ".done",
                    "event_type": "action.completed",
                    "status": "completed",
                    "step": "start",
                }
            )
    with transaction(url) as conn:
        repo.insert_events(conn, rows)
    return execution_id


class Statements:
    """Every statement sent to the store, through Core and on the driver's cursor (repo._run),
    and, for each transaction, how many of them it held and how long it lasted."""

    def __init__(self, url: str, monkeypatch) -> None:
        self.count = 0
        self.transactions: list[float] = []
        self.statements: list[int] = []  # statements of each transaction, in order
        self._began: float | None = None
        self._in_transaction = 0
        engine = get_engine(url)
        original = repo._run

        def counted(conn, sql, params):
            self._statement()
            return original(conn, sql, params)

        monkeypatch.setattr(repo, "_run", counted)
        listeners = [
            (engine, "before_cursor_execute", self._statement),
            (engine, "begin", self._begin),
            (engine, "commit", self._end),
            (engine, "rollback", self._end),
        ]
        for target, name, fn in listeners:
            event.listen(target, name, fn)
        self.remove = lambda: [event.remove(t, n, f) for t, n, f in listeners]

    def _statement(self, *args) -> None:
        self.count += 1
        self._in_transaction += 1

    def _begin(self, conn) -> None:
        self._began = time.monotonic()
        self._in_transaction = 0

    def _end(self, conn) -> None:
        if self._began is not None:
            self.transactions.append(time.monotonic() - self._began)
            self.statements.append(self._in_transaction)
            self._began = None


def test_a_sweep_over_2000_overdue_rows_is_a_bounded_number_of_statements(url, tmp_path, monkeypatch):
    clear_deadlines(url)
    execution_id = backlog(url, tmp_path, BACKLOG, done=BACKLOG // 4)
    counter = Statements(url, monkeypatch)
    # a sweep stops going on with full batches after its time budget (the sweep interval, at
    # least SWEEP_BUDGET_MIN), leaving the rest to the next sweep: on a loaded machine four
    # batches of 500 outlast it, and the sweep ends before the batch that finds none. That is
    # the machine's speed, not the statements counted here: the budget is lifted for this sweep
    monkeypatch.setattr(sweeper, "SWEEP_BUDGET_MIN", 3600.0)
    try:
        result = sweeper.sweep(url)
    finally:
        counter.remove()
    assert not result.skipped
    assert result.rows == BACKLOG
    assert len(result.republished) == BACKLOG - BACKLOG // 4 and result.cleared == BACKLOG // 4
    assert {d.message["iteration"] for d in result.republished} == set(range(BACKLOG // 4, BACKLOG))
    with transaction(url) as conn:
        recorded = conn.execute(
            text("SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = :t"),
            {"x": execution_id, "t": sweeper.REPUBLISHED},
        ).scalar()
        left = leases.count(conn, overdue_at=repo.utcnow())
    assert recorded == BACKLOG - BACKLOG // 4 and left == 0
    # the executions' checks, then one transaction per batch of 500 rows (and one that finds none)
    batches = -(-BACKLOG // sweeper.BATCH)
    assert result.transactions == 1 + batches + 1
    # per batch: the lock, the rows, the existing keys, the insert (500 rows a statement), the
    # clearing update and one update per distinct postponement: not two per row (4,000 before)
    bound = 3 + batches * 7 + 2
    print(
        f"{counter.count} statements, per transaction {counter.statements},"
        f" transactions {[round(t, 3) for t in counter.transactions]} s"
    )
    assert counter.count <= bound, counter.count
    # short transactions, each batch committed: as many commits as the sweep's transactions, and
    # none holds more than one batch's statements (counted, not timed: a loaded machine stretches
    # each one's seconds, not its work)
    assert len(counter.statements) == result.transactions, counter.statements
    assert max(counter.statements) <= 7, counter.statements


def test_a_skipped_sweep_is_logged_at_debug_and_a_long_wait_at_warning(url, monkeypatch, caplog):
    clear_deadlines(url)
    caplog.set_level(logging.DEBUG, logger=sweeper.log.name)
    with sweeper.sweep_transaction(url) as held:
        assert held is not None
        holder = held.connection.dbapi_connection.get_backend_pid()
        assert sweeper.sweep(url).skipped
        [skipped] = [r for r in caplog.records if "sweep skipped" in r.getMessage()]
        assert skipped.levelno == logging.DEBUG
        monkeypatch.setattr(sweeper, "LOCK_WARN_AFTER", 0.0)
        caplog.clear()
        assert sweeper.sweep(url).skipped
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "could not take the sweep lock" in warning.getMessage()
        assert f"backend pid {holder} (idle in transaction" in warning.getMessage()
    caplog.clear()
    assert not sweeper.sweep(url).skipped
    assert any("took the sweep lock again" in r.getMessage() for r in caplog.records)


def test_a_frozen_sweep_transaction_is_ended_by_the_server_and_frees_the_lock(url):
    clear_deadlines(url)
    frozen = sweeper.sweep_transaction(url, timeout=1.0)
    held = frozen.__enter__()  # a sweeper that stops here: its session idles inside the transaction
    assert held is not None
    holder = held.connection.dbapi_connection.get_backend_pid()
    assert sweeper.sweep(url).skipped
    began = time.monotonic()
    while sweeper.sweep(url).skipped:  # the server ends the idle holder after 1 s
        assert time.monotonic() - began < 15, "the frozen sweep still holds the lock"
        time.sleep(0.1)
    with get_engine(url).connect() as conn:
        alive = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": holder}).scalar()
    assert alive == 0
    with pytest.raises(DBAPIError):  # the thawed sweeper finds its transaction gone, nothing written
        frozen.__exit__(None, None, None)


def test_a_sweep_transaction_is_bounded_by_the_server(url):
    with sweeper.sweep_transaction(url, timeout=2.5) as conn:
        assert conn is not None
        values = conn.execute(
            text(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
                " current_setting('idle_in_transaction_session_timeout')"
            )
        ).one()
    assert tuple(values) == ("2500ms", "2500ms", "2500ms")
    with get_engine(url).connect() as conn:  # SET LOCAL: the pooled session is left as it was
        assert conn.execute(text("SELECT current_setting('statement_timeout')")).scalar() == "0"


def test_a_sweep_transaction_compiles_nothing_and_holds_its_bounds(url):
    # stale statistics would make a sweep's statements read whole tables, and JIT compile them
    with sweeper.sweep_transaction(url, timeout=7.0) as conn:
        assert conn is not None
        assert conn.execute(text("SELECT current_setting('jit')")).scalar() == "off"
        assert conn.execute(text("SELECT current_setting('enable_seqscan')")).scalar() == "off"
        assert conn.execute(text("SELECT current_setting('statement_timeout')")).scalar() == "7s"
    with get_engine(url).connect() as conn:  # set locally: nothing outlives the transaction
        assert conn.execute(text("SELECT current_setting('statement_timeout')")).scalar() != "7s"
