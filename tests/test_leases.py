"""The lease statements of store/leases.py on PostgreSQL: the statement that reads a batch of
overdue leases deletes, by itself, exactly the leases whose every attempt has the outcome row the
engine's own key names (engine/ids.py, TaskMessage.outcome_key), for every shape of message it
settles (a step, an iteration, a later hop and attempt, a compact wire message, a cursor row and
claim), and leaves every other lease (an outcome missing, a batch, a sub-playbook's end) to the
sweeper with its dispatch list; a lease of an ended execution is settled."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

import noetl_celery.app  # noqa: F401  (binds the Celery app to the transport)
from noetl_celery.engine.messages import Dispatch, TaskMessage, wire
from noetl_celery.store import leases, repo
from noetl_celery.store.db import transaction

PLAN = {"name": "leases", "steps": {}}


@pytest.fixture
def url(migrated_postgres) -> str:
    return migrated_postgres.url


def message(execution_id: int, **fields) -> dict:
    return TaskMessage(execution_id=execution_id, run_id="r0", step="s", **fields).to_dict()


def test_the_overdue_read_settles_exactly_the_leases_whose_attempts_have_outcomes(url):
    with transaction(url) as conn:
        repo.create_execution(conn, execution_id=1, plan=PLAN, workload={})
        repo.create_execution(conn, execution_id=2, plan=PLAN, workload={})
        conn.execute(repo.EXECUTIONS.update().where(repo.EXECUTIONS.c.execution_id == 2).values(status="completed"))
    x = 1
    shapes = {
        "step": message(x),
        "iteration": message(x, iteration=7),
        "later": message(x, iteration=0, seq=2, attempt=3),
        "compact": wire(message(x, iteration=9, attempt=2)),
        "row": message(x, iteration=3, slot={"id": 1, "claim": 2, "phase": "row", "index": 0, "rows": []}),
        "claim": message(x, slot={"id": 1, "claim": 2, "phase": "claim"}),
        "claim_retried": wire(message(x, attempt=2, slot={"id": 0, "claim": 5, "phase": "claim", "run": True})),
        "batch": message(x, iteration=20, batch=[{"iteration": 21}]),
    }
    past = repo.utcnow() - timedelta(seconds=5)
    rows = []
    for done in (True, False):
        for name, msg in shapes.items():
            msg = {**msg, "run_id": f"{name}.{done}"}
            dispatch = Dispatch(kind="run", message=msg, timeout=5.0)
            rows.append(
                {
                    "execution_id": x,
                    "event_id": f"decision.{name}.{done}",
                    "event_type": "step.done",
                    "meta": {"dispatch": [dispatch.to_dict()]},
                    repo.LEASE_KEY: past,
                }
            )
            if done:  # the outcome row at the engine's key for it
                rows.append({"execution_id": x, "event_id": dispatch.attempt_key() + ".done", "event_type": "x"})
    end = Dispatch(kind="event", message={"kind": "outcome", "execution_id": 1, "task": message(1)})
    rows.append({"execution_id": 1, "event_id": "child.end", "event_type": "x", "meta": {"dispatch": [end.to_dict()]}})
    rows[-1][repo.LEASE_KEY] = past
    ended = Dispatch(kind="run", message=message(2), timeout=5.0)
    rows.append({"execution_id": 2, "event_id": "ended", "event_type": "x", "meta": {"dispatch": [ended.to_dict()]}})
    rows[-1][repo.LEASE_KEY] = past
    with transaction(url) as conn:
        repo.insert_events(conn, rows)
    with transaction(url) as conn:
        batch = leases.overdue(conn, repo.utcnow(), 100)
    left = {o.event_id for o in batch.pending}
    kinds = ("step", "iteration", "later", "compact", "row", "claim", "claim_retried")
    settled = {f"decision.{n}.True" for n in kinds} | {"ended"}
    assert batch.settled == len(settled)
    assert left == {f"decision.{n}.False" for n in shapes} | {"decision.batch.True", "child.end"}
    assert all(o.dispatch for o in batch.pending)  # each with its dispatch list, for the sweeper
    with transaction(url) as conn:
        for key in settled:
            assert leases.deadline(conn, 1 if key != "ended" else 2, key) is None
        for key in left:
            assert leases.deadline(conn, 1, key) is not None


def _lease_stats(url: str) -> tuple[int, object]:
    from tests.support.services import pg_connect

    conn = pg_connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT n_dead_tup, last_vacuum FROM pg_stat_user_tables WHERE relname = 'noetl_lease'")
            dead, last = cur.fetchone()
            return int(dead), last
    finally:
        conn.close()


def _churn_leases(url: str, n: int, first: int = 0) -> None:
    """n leases written and settled, as decisions and their outcomes do, in a session of their own
    whose statistics reach the server when it ends; then waits until the server counts them."""
    import time

    from tests.support.services import pg_connect

    before = _lease_stats(url)[0]
    conn = pg_connect(url)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            for k in range(first, first + n):
                cur.execute(
                    "INSERT INTO noetl_lease (execution_id, event_id, deadline_at) VALUES (1, %s, now())", (f"d{k}",)
                )
            cur.execute("DELETE FROM noetl_lease")
    finally:
        conn.close()
    deadline = time.monotonic() + 30
    while _lease_stats(url)[0] < before + n:
        assert time.monotonic() < deadline, _lease_stats(url)
        time.sleep(0.2)


def test_the_sweeper_vacuums_the_lease_table_when_no_vacuum_has(url, sqlite_url):
    """Each decision's lease, deleted by its outcome, leaves dead rows and index entries that only
    a vacuum reclaims: with autovacuum off for the table, the sweeper's look vacuums it once the
    dead rows pass the threshold, and not again within the quiet period after a vacuum."""
    from tests.support.services import pg_connect

    conn = pg_connect(url)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("ALTER TABLE noetl_lease SET (autovacuum_enabled = false)")
    finally:
        conn.close()
    _churn_leases(url, 300)
    assert _lease_stats(url)[1] is None  # never vacuumed

    assert not leases.vacuum_if_needed(url, dead_rows=1000)  # under the threshold: nothing
    assert _lease_stats(url)[1] is None
    assert leases.vacuum_if_needed(url, dead_rows=100)
    dead, last = _lease_stats(url)
    assert last is not None and dead == 0

    _churn_leases(url, 300, first=300)
    assert not leases.vacuum_if_needed(url, dead_rows=100)  # over the threshold, but vacuumed a moment ago
    assert _lease_stats(url) == (300, last)
    assert leases.vacuum_if_needed(url, dead_rows=100, quiet=0.0)
    assert not leases.vacuum_if_needed(sqlite_url)  # SQLite: nothing to vacuum


def test_the_sweep_looks_at_the_lease_table_once_a_minute_and_a_failed_vacuum_is_logged(url, monkeypatch, caplog):
    from noetl_celery.engine.transport import sweeping as app

    looks: list[str] = []

    def look(u: str) -> bool:
        looks.append(u)
        if len(looks) > 1:
            raise RuntimeError("must be owner of table noetl_lease")
        return True

    def looked(thread: Any) -> None:  # the look runs on a thread of its own, not the sweep's
        assert thread is not None and thread is not threading.current_thread()
        thread.join(10)
        assert not thread.is_alive()

    monkeypatch.setattr(leases, "vacuum_if_needed", look)
    monkeypatch.setattr(app, "_next_lease_vacuum", 0.0)
    with caplog.at_level("INFO", logger=app.log.name):
        looked(app._vacuum_leases(url))
        assert app._vacuum_leases(url) is None  # within the minute: no look
        assert looks == [url] and "vacuumed noetl_lease" in caplog.text
        monkeypatch.setattr(app, "_next_lease_vacuum", 0.0)
        looked(app._vacuum_leases(url))  # fails: logged, the sweep goes on
    assert looks == [url, url]
    assert "VACUUM noetl_lease failed: must be owner of table noetl_lease" in caplog.text


def test_a_store_role_that_may_not_vacuum_the_lease_table_leaves_it_alone(url):
    import uuid

    from sqlalchemy.engine import make_url

    from noetl_celery.store.db import dispose_engine
    from tests.support.services import pg_connect

    role = f"noetl_reader_{uuid.uuid4().hex[:8]}"
    admin = pg_connect(url)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE ROLE {role} LOGIN")
            cur.execute(f"GRANT SELECT ON noetl_lease TO {role}")
        _churn_leases(url, 200)
        reader = make_url(url).set(username=role).render_as_string(hide_password=False)
        try:
            assert not leases.vacuum_if_needed(reader, dead_rows=100, quiet=0.0)
        finally:
            dispose_engine(reader)
        assert _lease_stats(url)[1] is None  # not vacuumed
        assert leases.vacuum_if_needed(url, dead_rows=100, quiet=0.0)  # the owner's role may
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP OWNED BY {role}")
            cur.execute(f"DROP ROLE {role}")
        admin.close()


def test_a_look_at_the_lease_table_while_the_last_vacuum_still_runs_is_skipped(url, monkeypatch):
    from noetl_celery.engine.transport import sweeping as app

    running, release = threading.Event(), threading.Event()

    def slow(u: str) -> bool:  # a long first vacuum of a bloated table
        running.set()
        release.wait(10)
        return True

    monkeypatch.setattr(leases, "vacuum_if_needed", slow)
    monkeypatch.setattr(app, "_next_lease_vacuum", 0.0)
    first = app._vacuum_leases(url)
    assert first is not None and running.wait(10)
    monkeypatch.setattr(app, "_next_lease_vacuum", 0.0)  # a minute later, the vacuum still running
    assert app._vacuum_leases(url) is None
    release.set()
    first.join(10)
    assert not first.is_alive()
