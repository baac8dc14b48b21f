"""One clock, the store's: a real worker whose wall clock is shifted by +-300 s (a small shim
loaded at its start-up, tests/support/shifted_clock) keeps the event store's time for every
deadline, due time and timestamp. Real Redis, real PostgreSQL, real worker processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import submit

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
RETRY_GAPS = PLAYBOOKS / "retry_gaps.yaml"  # two failures retried after 8 s each, a 200 s playbook timeout
SHIM = Path(__file__).resolve().parents[1] / "support" / "shifted_clock"
DELAY = 8.0
RUNS = 3


def shifted(env: dict[str, str], seconds: float) -> dict[str, str]:
    """A worker's environment whose processes run with their wall clock `seconds` off."""
    path = os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "NOETL_TEST_CLOCK_SHIFT": str(seconds)}


def attempt_rows(url: str, execution_id: int) -> list[tuple[str, float, float]]:
    """(event type, created_at as epoch, seconds from the store's now) of the step's outcome rows."""
    with get_engine(url).connect() as conn:
        return [
            (kind, float(at), float(age))
            for kind, at, age in conn.execute(
                text(
                    "SELECT event_type, extract(epoch FROM created_at), extract(epoch FROM now() - created_at)"
                    " FROM noetl_event WHERE execution_id = :x AND step = 'start'"
                    " AND event_type IN ('action.failed', 'action.completed') ORDER BY created_at"
                ),
                {"x": execution_id},
            )
        ]


def count(url: str, execution_id: int, event_type: str) -> int:
    with get_engine(url).connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = :t"),
            {"x": execution_id, "t": event_type},
        ).scalar_one()


@pytest.mark.slow
@pytest.mark.parametrize("shift", [300.0, -300.0], ids=["ahead", "behind"])
def test_a_worker_with_a_shifted_clock_keeps_the_store_s_time(shift, env, store_url, worker_factory):
    worker = worker_factory(env=shifted(env, shift), concurrency=2, name="skewed@%h")
    worker.wait_for_log("clock is 300.0 s " + ("ahead of" if shift > 0 else "behind"), timeout=30)
    ids = [submit(env, RETRY_GAPS) for _ in range(RUNS)]
    gaps = []
    for execution_id in ids:
        status = wait(store_url, execution_id, timeout=180)
        # no early failure: the playbook's 200 s are counted on the store's clock
        assert status["status"] == "completed", status
        rows = attempt_rows(store_url, execution_id)
        assert [kind for kind, *_ in rows] == ["action.failed", "action.failed", "action.completed"]
        # event timestamps are the store's: written within the last minute by its clock
        assert all(-1.0 < age < 60.0 for *_, age in rows), rows
        gaps += [later[1] - earlier[1] for earlier, later in zip(rows, rows[1:], strict=False)]
        assert count(store_url, execution_id, "attempt.republished") == 0
    print(f"clock {shift:+g} s: retry gaps {[round(g, 2) for g in gaps]} (asked {DELAY:g} s)")
    # each retry waited the asked delay, within 10 %
    assert all(0.9 * DELAY <= gap <= 1.1 * DELAY for gap in gaps), gaps
    # one warning for the worker: its pool processes inherit the measure and do not repeat it
    assert worker.log_text().count("clock is 300.0 s") == 1
