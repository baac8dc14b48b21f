"""Leases that count only the time an attempt is in a worker's hands: real Redis, real PostgreSQL,
real worker processes.

A message that waits in the task queue behind a backlog is never re-published for waiting (the
worker that takes it late moves its lease on; the sweeper leaves alone a lease whose messages may
still wait in the queue), and an attempt a killed worker held is still re-published within 60 s
of the kill at the default lease, while a backlog fills the queue."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import text

from noetl_celery.engine import deadlines
from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli, submit
from tests.support.workers import REPO_ROOT, worker_env

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
STEPS = PLAYBOOKS / "backlog_steps.yaml"  # three python steps, 2 s timeout each: an 18 s lease
STEP_TIMEOUT = 2.0
BACKLOG = 2000

SUBMIT_MANY = """
import json, sys
from noetl_celery import runner
from noetl_celery.config import settings as noetl_settings
from noetl_celery.app import app, configure
from noetl_celery.compiler import compile_playbook

settings = noetl_settings.load()
configure(app, settings)
plan = compile_playbook(sys.argv[1])
print(json.dumps([runner.submit(plan, settings) for _ in range(int(sys.argv[2]))]))
"""


def submit_many(env: dict[str, str], playbook: Path, n: int) -> list[int]:
    """N executions submitted back to back by one process (`runner.submit`, as `submit` does)."""
    proc = subprocess.run(
        [sys.executable, "-c", SUBMIT_MANY, str(playbook), str(n)],
        env=worker_env(env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [int(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]


def scalar(url: str, sql: str, **params) -> object:
    with get_engine(url).connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


def row(url: str, sql: str, **params) -> tuple:
    with get_engine(url).connect() as conn:
        return tuple(conn.execute(text(sql), params).one())


def wait_ended(url: str, ids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        running = scalar(
            url, "SELECT count(*) FROM noetl_execution WHERE execution_id = ANY(:ids) AND status = 'running'", ids=ids
        )
        if running == 0:
            return
        assert time.monotonic() < deadline, f"{running} of {len(ids)} executions still running"
        time.sleep(1.0)


@pytest.mark.slow
def test_a_backlog_of_executions_on_one_worker_is_never_republished(env, store_url, worker_factory):
    # the sweeper looks every second; each attempt's lease is 18 s, and the backlog of 2,000
    # executions (6,000 attempts) keeps messages waiting longer than that on one worker process
    worker_factory(env={**env, "NOETL_SWEEP_INTERVAL": "1"}, concurrency=1, name="backlog@%h")
    ids = submit_many(env, STEPS, BACKLOG)
    try:
        wait_ended(store_url, ids, timeout=900)
        statuses = scalar(
            store_url,
            "SELECT count(*) FROM noetl_execution WHERE execution_id = ANY(:ids) AND status = 'completed'",
            ids=ids,
        )
        assert statuses == BACKLOG
        span, longest = row(
            store_url,
            "SELECT extract(epoch FROM max(finished_at) - min(created_at)),"
            " extract(epoch FROM max(finished_at - created_at)) FROM noetl_execution"
            " WHERE execution_id = ANY(:ids)",
            ids=ids,
        )
        lease = deadlines.lease(0, STEP_TIMEOUT)
        print(
            f"{BACKLOG} executions drained in {float(span):.1f} s on one worker process (lease {lease:g} s);"
            f" the longest lived {float(longest):.1f} s"
        )
        # an execution's first attempt was published at its submit and waited in line until the
        # worker took it: the longest-lived execution's start waited past its lease, so without
        # leases from the pickup it would have been overdue while it waited
        assert float(longest) > lease, f"the longest execution took {float(longest):.1f} s: no wait past the lease"
        republished = scalar(
            store_url,
            "SELECT count(*) FROM noetl_event WHERE execution_id = ANY(:ids) AND event_type = 'attempt.republished'",
            ids=ids,
        )
        assert republished == 0
        # nothing twice: three attempts, three step ends and one end per execution
        per_execution = scalar(
            store_url,
            "SELECT count(*) FROM noetl_event WHERE execution_id = ANY(:ids) AND event_type = 'step.completed'",
            ids=ids,
        )
        assert per_execution == 3 * BACKLOG
    finally:
        with get_engine(store_url).begin() as conn:
            conn.execute(
                text(
                    "UPDATE noetl_execution SET status = 'cancelled' WHERE execution_id = ANY(:ids) AND status = 'running'"
                ),
                {"ids": ids},
            )


@pytest.mark.slow
def test_a_worker_killed_mid_attempt_under_a_backlog_is_recovered_within_60_s(env, store_url, worker_factory, tmp_path):
    marks = tmp_path / "marks.txt"
    client = redis.Redis.from_url(env["NOETL_BROKER_URL"])
    # the slow attempt (the default 30 s timeout: a 46 s lease) goes first into the queue and
    # waits there past PICKUP_SLACK, then 2,000 sleeping iterations queue behind it
    victim_run = submit(env, PLAYBOOKS / "slow_step.yaml", marks=str(marks), pause=20)
    time.sleep(deadlines.PICKUP_SLACK + 2)
    backlog = submit(env, PLAYBOOKS / "backlog.yaml", n=2000, sleep=0.1)
    try:
        assert client.llen("noetl.tasks") >= 2000
        victim = worker_factory(env=env, concurrency=1, name="victim@%h")
        deadline = time.monotonic() + 60
        while not marks.exists():
            assert time.monotonic() < deadline, "the slow attempt never started"
            time.sleep(0.05)
        victim.kill()
        killed_at = time.monotonic()
        worker_factory(env=env, concurrency=2, name="survivor@%h")
        while not scalar(
            store_url,
            "SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'",
            x=victim_run,
        ):
            assert time.monotonic() - killed_at < 90, "the killed worker's attempt was never re-published"
            time.sleep(0.2)
        took = time.monotonic() - killed_at
        queued = client.llen("noetl.tasks")
        print(f"the killed worker's attempt was re-published {took:.1f} s after the kill, {queued} messages queued")
        assert took < 60
        assert queued > 0, "the task queue had drained: no backlog"
        status = wait(store_url, victim_run, timeout=120)
        assert status["status"] == "completed", status
        assert marks.read_text().splitlines() == ["ran", "ran"]  # the killed run and its re-published copy
        assert (
            scalar(
                store_url,
                "SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'step.completed'",
                x=victim_run,
            )
            == 1
        )
        # the backlog's iterations, which waited in line behind the slow attempt, were not re-published
        assert (
            scalar(
                store_url,
                "SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'",
                x=backlog,
            )
            == 0
        )
    finally:
        for run in (victim_run, backlog):
            with contextlib.suppress(Exception):
                cli(["cancel", str(run)], env)
        client.delete("noetl.tasks")
        client.close()


LOOP = PLAYBOOKS / "backlog_loop.yaml"  # N iterations sent at once, a 3 s timeout: a 19 s lease they share
LOOP_TIMEOUT = 3.0


@pytest.mark.slow
def test_a_loops_iterations_behind_a_backlog_are_never_republished(env, store_url, worker_factory):
    # the loop's start sends its 2,000 iterations at once, under one lease of 19 s; one worker takes
    # them far longer than that, and its last iterations run 1.5 s each once the queue has drained:
    # without the lease they share moving on at each late pickup, the sweeper (every second) would
    # re-publish those still running
    worker_factory(env={**env, "NOETL_SWEEP_INTERVAL": "1"}, concurrency=2, name="loop-backlog@%h")
    # 2,000 x 30 ms of sleep on two processes: the run lasts at least 30 s, past the 19 s lease
    run = submit(env, LOOP, n=BACKLOG, sleep=0.03)
    try:
        status = wait(store_url, run, timeout=900)
        assert status["status"] == "completed", status
        span = scalar(
            store_url,
            "SELECT extract(epoch FROM finished_at - created_at) FROM noetl_execution WHERE execution_id = :x",
            x=run,
        )
        lease = deadlines.lease(0, LOOP_TIMEOUT)
        print(f"a loop of {BACKLOG} iterations sent at once drained in {float(span):.1f} s (lease {lease:g} s)")
        assert float(span) > lease, f"the loop drained in {float(span):.1f} s: no wait past the lease"
        republished = scalar(
            store_url,
            "SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'",
            x=run,
        )
        assert republished == 0
        iterations = scalar(
            store_url,
            "SELECT count(DISTINCT iteration) FROM noetl_event WHERE execution_id = :x"
            " AND event_type = 'iteration.completed'",
            x=run,
        )
        assert iterations == BACKLOG
    finally:
        with contextlib.suppress(Exception):
            cli(["cancel", str(run)], env)


@pytest.mark.slow
def test_a_worker_killed_mid_iteration_of_a_shared_lease_under_a_backlog_is_recovered_within_60_s(
    env, store_url, worker_factory, tmp_path
):
    marks = tmp_path / "marks.txt"
    client = redis.Redis.from_url(env["NOETL_BROKER_URL"])
    # a loop of two slow iterations (the default 30 s timeout: a 46 s lease they share) goes first
    # into the queue and waits there past PICKUP_SLACK, then 2,000 sleeping iterations queue behind
    victim_run = submit(env, PLAYBOOKS / "slow_loop.yaml", marks=str(marks), pause=20)
    time.sleep(deadlines.PICKUP_SLACK + 2)
    backlog = submit(env, PLAYBOOKS / "backlog.yaml", n=2000, sleep=0.1)
    try:
        assert client.llen("noetl.tasks") >= 2000
        victim = worker_factory(env=env, concurrency=1, name="victim@%h")
        deadline = time.monotonic() + 60
        while not marks.exists():
            assert time.monotonic() < deadline, "the slow iteration never started"
            time.sleep(0.05)
        victim.kill()
        killed_at = time.monotonic()
        worker_factory(env=env, concurrency=2, name="survivor@%h")
        while not scalar(
            store_url,
            "SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'",
            x=victim_run,
        ):
            assert time.monotonic() - killed_at < 90, "the killed worker's iteration was never re-published"
            time.sleep(0.2)
        took = time.monotonic() - killed_at
        queued = client.llen("noetl.tasks")
        print(f"the killed worker's iteration was re-published {took:.1f} s after the kill, {queued} messages queued")
        assert took < 60
        assert queued > 0, "the task queue had drained: no backlog"
        status = wait(store_url, victim_run, timeout=120)
        assert status["status"] == "completed", status
        ran = marks.read_text().splitlines()
        assert ran.count("ran 0") + ran.count("ran 1") == len(ran) and len(ran) >= 3  # the killed run and its copy
        assert (
            scalar(
                store_url,
                "SELECT count(DISTINCT iteration) FROM noetl_event WHERE execution_id = :x"
                " AND event_type = 'iteration.completed'",
                x=victim_run,
            )
            == 2
        )
    finally:
        for run in (victim_run, backlog):
            with contextlib.suppress(Exception):
                cli(["cancel", str(run)], env)
        client.delete("noetl.tasks")
        client.close()
