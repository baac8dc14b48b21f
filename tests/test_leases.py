"""The lease statements of store/leases.py on PostgreSQL: the statement that reads a batch of
overdue leases deletes, by itself, exactly the leases whose every attempt has the outcome row the
engine's own key names (engine/ids.py, TaskMessage.outcome_key), for every shape of message it
settles (a step, an iteration, a later hop and attempt, a compact wire message, a cursor row and
claim), and leaves every other lease (an outcome missing, a batch, a sub-playbook's end) to the
sweeper with its dispatch list; a lease of an ended execution is settled."""

from __future__ import annotations

from datetime import timedelta

import pytest

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
