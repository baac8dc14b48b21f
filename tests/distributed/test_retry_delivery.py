"""Retries and pages under real delivery: long backoffs past the broker's visibility timeout, and a
worker killed in the middle of a pagination. The engine tests run on Redis and on RabbitMQ."""

from __future__ import annotations

import time
from pathlib import Path

import redis
from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import submit
from tests.support.mockapi import start_mock_api
from tests.support.services import on_both_brokers, queued_messages

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


def step_rows(url: str, execution_id: int, step: str) -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(
                "SELECT event_type, attempt, page, meta FROM noetl_event "
                "WHERE execution_id = :x AND step = :s ORDER BY id"
            ),
            {"x": execution_id, "s": step},
        )
        return [dict(r._mapping) for r in result]


def queued(broker_url: str) -> int:
    return queued_messages(broker_url, ("noetl.tasks", "noetl.events"))


def test_control_redis_redelivers_a_countdown_held_past_the_visibility_timeout(redis_url, worker_factory):
    # The Celery fact the engine designs around, shown with a plain Celery app: a message whose
    # countdown (9 s) outlasts the visibility timeout (4 s) runs more than once.
    worker_factory(
        "tests.support.echo_app",
        env={"NOETL_BROKER_URL": redis_url, "ECHO_VISIBILITY_TIMEOUT": "4"},
        concurrency=2,
        name="plain@%h",
    )
    from tests.support.echo_app import make_app

    client = make_app(redis_url)
    key = f"control:{time.time_ns()}"
    client.send_task("echo.count", args=[key], countdown=9)
    time.sleep(16)
    runs = int(redis.Redis.from_url(redis_url).get(key) or 0)
    assert runs > 1, runs


@on_both_brokers
def test_a_backoff_longer_than_the_visibility_timeout_runs_the_retry_exactly_once(
    broker, env, store_url, worker_factory
):
    # the engine holds at most NOETL_MAX_COUNTDOWN (1 s) in the broker and re-checks the due time
    if broker == "redis":
        worker_env = {**env, "NOETL_VISIBILITY_TIMEOUT": "4", "NOETL_RESTORE_INTERVAL": "1", "NOETL_MAX_COUNTDOWN": "1"}
    else:
        # RabbitMQ's limit is its consumer_timeout (a server setting, 30 min by default, which the
        # shared test server keeps): the same split of the 9 s backoff into 1 s countdowns, and the
        # same single run of the retry
        worker_env = {**env, "NOETL_MAX_COUNTDOWN": "1"}
    worker_factory(env=worker_env, concurrency=2, name="patient@%h")
    with start_mock_api() as api:
        execution_id = submit(env, PLAYBOOKS / "long_backoff.yaml", api_url=api.url)
        status = wait(store_url, execution_id, timeout=90)
        time.sleep(6)  # a redelivery would come after the visibility timeout: give it the chance
        runs = api.state.concurrency_stats()["total"]
    assert status["status"] == "completed", status
    assert runs == 1  # the retry ran exactly once
    rows = step_rows(store_url, execution_id, "fetch")
    kinds = [r["event_type"] for r in rows]
    assert kinds.count("action.failed") == 1 and kinds.count("action.completed") == 1
    assert kinds.count("retry.scheduled") == 1
    retry = next(r for r in rows if r["event_type"] == "retry.scheduled")
    assert retry["meta"]["delay"] == 9.0
    assert queued(env["NOETL_BROKER_URL"]) == 0
    with get_engine(store_url).connect() as conn:
        started, ended = conn.execute(
            text(
                "SELECT MIN(started_at), MAX(started_at) FROM noetl_event WHERE execution_id = :x "
                "AND step = 'fetch' AND event_type IN ('action.failed', 'action.completed')"
            ),
            {"x": execution_id},
        ).one()
    assert 9.0 <= (ended - started).total_seconds() < 20


@on_both_brokers
def test_a_worker_killed_mid_pagination_loses_and_duplicates_no_page(
    broker, env, store_url, worker_factory, broker_url
):
    if broker == "redis":
        worker_env = {**env, "NOETL_VISIBILITY_TIMEOUT": "6", "NOETL_RESTORE_INTERVAL": "1"}
    else:  # RabbitMQ requeues the unacknowledged page at once when the worker's connection dies
        worker_env = env
    victim = worker_factory(env=worker_env, concurrency=2, name="pager@%h")
    with start_mock_api() as api:
        execution_id = submit(env, PLAYBOOKS / "slow_pages.yaml", api_url=api.url, delay=0.15)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pages = [r for r in step_rows(store_url, execution_id, "pages") if r["event_type"] == "page.completed"]
            if len(pages) >= 8:
                break
            time.sleep(0.05)
        victim.kill()
        killed_at = time.monotonic()
        worker_factory(env=worker_env, concurrency=2, name="pager-2@%h")
        status = wait(store_url, execution_id, timeout=120)
        recovered_in = time.monotonic() - killed_at
    assert status["status"] == "completed", status
    assert [item["id"] for item in status["results"]["pages"]] == list(range(1, 36))
    done = [
        r["page"]
        for r in step_rows(store_url, execution_id, "pages")
        if r["event_type"] in ("page.completed", "action.completed")
    ]
    assert done == list(range(1, 36))  # every page once, in order
    assert queued(broker_url) == 0
    if broker == "amqp":  # redelivered by RabbitMQ at once, not re-published after the 46 s lease
        kinds = [r["event_type"] for r in step_rows(store_url, execution_id, "pages")]
        assert "attempt.republished" not in kinds
        assert recovered_in < 30, recovered_in


def test_a_poison_task_leaves_nothing_in_flight(env, store_url, worker_factory, redis_url):
    worker_factory(env=env, concurrency=2, name="poison@%h")
    execution_id = submit(env, PLAYBOOKS / "poison.yaml")
    status = wait(store_url, execution_id, timeout=60)
    assert status["status"] == "failed" and status["failed_step"] == "poison"
    time.sleep(1.0)
    with get_engine(store_url).connect() as conn:
        pending = conn.execute(
            text("SELECT pending FROM noetl_execution WHERE execution_id = :x"), {"x": execution_id}
        ).scalar_one()
    assert pending == 0
    assert queued(redis_url) == 0
