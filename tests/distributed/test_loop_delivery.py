"""Loops under at-least-once delivery: real Redis, real PostgreSQL, real worker processes."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
LOOP = PLAYBOOKS / "loop_many.yaml"


def submit(env: dict[str, str], n: int, sleep: float = 0.0) -> int:
    proc = cli(["submit", str(LOOP), "--json", "--set", f"n={n}", "--set", f"sleep={sleep}"], env)
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["execution_id"])


def loop_log(url: str, execution_id: int) -> tuple[Counter, Counter]:
    """(completions per iteration index, event types) of the `work` loop."""
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text("SELECT event_type, iteration FROM noetl_event WHERE execution_id = :x AND step = 'work'"),
            {"x": execution_id},
        ).all()
    per_index = Counter(i for kind, i in rows if kind == "iteration.completed")
    return per_index, Counter(kind for kind, _ in rows)


def assert_exactly_once(url: str, execution_id: int, n: int) -> None:
    status = wait(url, execution_id, timeout=300)
    assert status["status"] == "completed", status
    per_index, kinds = loop_log(url, execution_id)
    assert set(per_index) == set(range(n)), f"missing: {sorted(set(range(n)) - set(per_index))[:10]}"
    assert max(per_index.values()) == 1, [i for i, c in per_index.items() if c > 1][:10]
    assert kinds["iterator.completed"] == 1
    assert kinds["step.completed"] == 1
    assert status["results"]["work"]["results"] == [2 * i for i in range(n)]
    assert status["results"]["work"]["stats"] == {"total": n, "success": n, "failed": 0}


@pytest.mark.slow
def test_1000_iterations_cap_50_two_workers_twenty_times(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=4, name="loop-a@%h")
    worker_factory(env=env, concurrency=4, name="loop-b@%h")
    for _ in range(20):
        execution_id = submit(env, 1000)
        assert_exactly_once(store_url, execution_id, 1000)


def test_a_worker_killed_mid_loop_loses_no_iteration(env, store_url, worker_factory):
    # a short visibility timeout so that Redis hands the killed worker's messages out again soon
    worker_env = {**env, "NOETL_VISIBILITY_TIMEOUT": "8", "NOETL_RESTORE_INTERVAL": "2"}
    victim = worker_factory(env=worker_env, concurrency=4, name="victim@%h")
    execution_id = submit(env, 200, sleep=0.05)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = sum(loop_log(store_url, execution_id)[0].values())
        if done >= 40:
            break
        time.sleep(0.05)
    assert 40 <= done < 200, f"{done} iterations done before the kill"
    victim.kill()
    killed_at = time.monotonic()
    worker_factory(env=worker_env, concurrency=4, name="rescuer@%h")
    assert_exactly_once(store_url, execution_id, 200)
    # back within the visibility timeout plus a couple of sweeps, not kombu's default ~100 s
    assert time.monotonic() - killed_at < 45


def test_outcomes_through_the_on_event_queue(env, store_url, worker_factory):
    # NOETL_EVENT_DISPATCH=queue: run_task sends its outcome to the on_event queue, served here by
    # a worker of its own (the queues scale separately)
    queue_env = {**env, "NOETL_EVENT_DISPATCH": "queue"}
    worker_factory(env=queue_env, concurrency=2, name="tools@%h", queues=("noetl.tasks",))
    worker_factory(env=queue_env, concurrency=2, name="events@%h", queues=("noetl.events",))
    execution_id = submit({**env, "NOETL_EVENT_DISPATCH": "queue"}, 300)
    assert_exactly_once(store_url, execution_id, 300)
