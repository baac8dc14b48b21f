"""Executions that always end: time limits, poison messages, cancel, and recovery by the sweeper,
with real Redis, real PostgreSQL and real worker processes."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery.config import settings as noetl_settings
from noetl_celery.engine import deadlines
from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli, submit

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


def rows(url: str, execution_id: int, where: str = "TRUE") -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(f"SELECT * FROM noetl_event WHERE execution_id = :x AND {where} ORDER BY id"), {"x": execution_id}
        )
        return [dict(r._mapping) for r in result]


def test_a_step_that_never_returns_times_out_is_retried_and_the_worker_serves_on(env, store_url, worker_factory):
    worker = worker_factory(env=env, concurrency=1, name="limits@%h")
    execution_id = submit(env, PLAYBOOKS / "never_returns.yaml")
    status = wait(store_url, execution_id, timeout=60)
    assert status["status"] == "failed", status
    assert status["error"]["kind"] == "timeout", status["error"]
    attempts = rows(store_url, execution_id, "step = 'spin' AND event_type = 'action.failed'")
    assert [a["attempt"] for a in attempts] == [1, 2]  # the retry policy applied to the timeout
    # cut off at its soft limit: the timeout (2 s), its grace, and the eager window the message's
    # limits are raised by (an attempt may be stopped up to the window late: docs/operations.md)
    soft, _ = deadlines.time_limits(2, noetl_settings.load({}).eager_window)
    for attempt in attempts:
        assert attempt["error"]["kind"] == "timeout"
        assert attempt["duration_ms"] < (soft + 1) * 1000, attempt["duration_ms"]
    # the same (single-process) worker runs the next execution's task
    follow = submit(env, PLAYBOOKS / "loop_many.yaml", n=3)
    after = wait(store_url, follow, timeout=60)
    assert after["status"] == "completed", after
    assert worker.running


def test_a_step_that_kills_its_process_ends_as_worker_lost(env, store_url, worker_factory):
    worker_factory(env={**env, "NOETL_MAX_DELIVERIES": "3"}, concurrency=2, name="poison@%h")
    execution_id = submit(env, PLAYBOOKS / "exits_worker.yaml")
    status = wait(store_url, execution_id, timeout=90)
    assert status["status"] == "failed", status
    assert status["error"]["kind"] == "worker_lost", status["error"]
    lost = rows(store_url, execution_id, "event_type = 'attempt.worker_lost'")
    assert [r["meta"]["delivery"] for r in lost] == [1, 2, 3]
    failed = rows(store_url, execution_id, "step = 'die' AND event_type = 'action.failed'")
    assert len(failed) == 1 and failed[0]["error"]["kind"] == "worker_lost"


def test_a_batch_whose_iteration_kills_its_process_isolates_it_and_runs_the_others_once(env, store_url, worker_factory):
    worker_factory(env={**env, "NOETL_MAX_DELIVERIES": "3"}, concurrency=2, name="poison-batch@%h")
    execution_id = submit(env, PLAYBOOKS / "poison_batch.yaml")
    status = wait(store_url, execution_id, timeout=120)
    assert status["status"] == "failed", status
    assert status["error"]["failures"] == [
        {"index": 3, "kind": "worker_lost", "message": status["error"]["failures"][0]["message"], "task": "work"}
    ], status["error"]
    # the batch lost its worker 3 times, then each of its iterations got the outcome and was
    # retried alone: 7 completed once each, the poison one lost its worker 3 more times
    lost = rows(store_url, execution_id, "event_type = 'attempt.worker_lost'")
    assert [(r["iteration"], r["attempt"], r["meta"].get("batch")) for r in lost] == [
        *[(0, 1, list(range(8)))] * 3,
        *[(3, 2, None)] * 3,
    ]
    completed = Counter(r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.completed'"))
    assert completed == Counter([0, 1, 2, 4, 5, 6, 7])
    failed = rows(store_url, execution_id, "event_type = 'iteration.failed'")
    assert [(r["iteration"], r["attempt"]) for r in failed] == [(3, 2)]


def test_cancel_during_a_10000_iteration_loop(env, store_url, worker_factory):
    worker_factory(env=env, concurrency=4, name="cancel@%h")
    execution_id = submit(env, PLAYBOOKS / "loop_many.yaml", n=10000)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(rows(store_url, execution_id, "event_type = 'iteration.completed'")) >= 100:
            break
        time.sleep(0.2)
    proc = cli(["cancel", str(execution_id), "--reason", "enough"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cancelled_at = time.monotonic()
    status = wait(store_url, execution_id, timeout=5)
    assert status["status"] == "cancelled" and time.monotonic() - cancelled_at < 5
    assert status["error"] == {"kind": "cancelled", "message": "enough"}
    marker = rows(store_url, execution_id, "event_type = 'execution.cancelled'")
    assert len(marker) == 1
    time.sleep(3)  # in-flight attempts finish
    later = rows(store_url, execution_id, f"id > {marker[0]['id']}")
    kinds = Counter(r["event_type"] for r in later)
    assert set(kinds) <= {"action.completed"}, kinds  # outcomes only, nothing dispatched
    assert all(not (r["meta"] or {}).get("dispatch") for r in later)
    assert len(later) <= 50  # at most the loop's cap was in flight
    proc = cli(["status", str(execution_id)], env)
    assert proc.returncode == 4


@pytest.mark.slow
def freeze_holding_messages(worker, broker_url: str, execution_id: int) -> int:
    """Stop (SIGSTOP) the worker's process group at a moment it holds unacknowledged messages of
    the execution, so that killing it loses them for certain; returns how many it holds. It must
    be the execution's only worker: its messages in the transport's `unacked` hash are then the
    ones naming the execution (in their headers' argsrepr)."""
    import redis

    client = redis.Redis.from_url(broker_url)
    mark = f"execution={execution_id}".encode()
    try:
        for _ in range(100):
            os.killpg(worker.pid, signal.SIGSTOP)
            held = sum(1 for value in client.hvals("unacked") if mark in value)
            if held:
                return held
            os.killpg(worker.pid, signal.SIGCONT)  # between two messages: let it take the next
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"{worker!r} never held a message")


def test_a_worker_killed_for_good_is_recovered_by_the_sweeper(env, store_url, worker_factory):
    # the default visibility timeout (1 h): only the sweeper can bring the lost messages back.
    # The victim runs alone until it is killed holding messages; the survivor starts after.
    victim = worker_factory(env=env, concurrency=2, name="victim@%h")
    execution_id = submit(env, PLAYBOOKS / "loop_many.yaml", n=300, sleep=0.05)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(rows(store_url, execution_id, "event_type = 'iteration.completed'")) >= 20:
            break
        time.sleep(0.05)
    freeze_holding_messages(victim, env["NOETL_BROKER_URL"], execution_id)
    victim.kill()
    killed, killed_at = time.monotonic(), datetime.now(UTC)
    worker_factory(env=env, concurrency=2, name="survivor@%h")
    status = wait(store_url, execution_id, timeout=180)
    assert status["status"] == "completed", status
    per_index = Counter(r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.completed'"))
    assert set(per_index) == set(range(300)) and max(per_index.values()) == 1
    republished = rows(store_url, execution_id, "event_type = 'attempt.republished'")
    assert republished  # the lost attempts came back through the sweeper, not the broker
    recovered = republished[0]["created_at"] - rows(store_url, execution_id, "TRUE")[0]["created_at"]
    print(
        f"killed -> completed: {time.monotonic() - killed:.1f} s; first re-publish "
        f"{recovered.total_seconds():.1f} s after the start"
    )
    assert time.monotonic() - killed < 60 + 30  # the lease (46 s) and a sweep, plus the loop's own work
    # the execution moved again within 60 s of the kill: the sweeper's first re-publish
    first = republished[0]["created_at"]
    first = first if first.tzinfo else first.replace(tzinfo=UTC)
    assert (first - killed_at).total_seconds() < 60, f"first re-publish {(first - killed_at).total_seconds():.1f} s"


def test_code_that_swallows_the_soft_limit_is_killed_and_recorded_as_timeout(env, store_url, worker_factory):
    worker = worker_factory(env=env, concurrency=1, name="stubborn@%h")
    execution_id = submit(env, PLAYBOOKS / "swallows_time_limit.yaml")
    status = wait(store_url, execution_id, timeout=60)
    assert status["status"] == "failed", status
    assert status["error"]["kind"] == "timeout", status["error"]
    assert "killed" in status["error"]["message"]
    done = rows(store_url, execution_id, "step = 'stubborn' AND event_type = 'action.failed'")
    assert len(done) == 1 and done[0]["worker"] == "time-limit"
    follow = submit(env, PLAYBOOKS / "loop_many.yaml", n=3)  # the replaced pool process serves on
    assert wait(store_url, follow, timeout=60)["status"] == "completed"
    assert worker.running
