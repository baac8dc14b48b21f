"""The sweeper against a frozen peer and under load, with real Redis, PostgreSQL and worker
processes: a process frozen (SIGSTOP) holding the sweep lock inside a sweep transaction does not
stop the other workers' recovery, and a lost attempt is re-published and run within 60 s while
the task queue holds a backlog of 2,000 messages."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import text

from noetl_celery.app import configure
from noetl_celery.compiler import compile_playbook
from noetl_celery.compiler.names import RUN_TASK
from noetl_celery.config import settings as noetl_settings
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import TaskMessage, wire
from noetl_celery.engine.transport import publisher
from noetl_celery.engine.transport.attempts import _late
from noetl_celery.runner import create_execution, wait
from noetl_celery.store.db import get_engine
from tests.distributed.test_durability import freeze_holding_messages, rows
from tests.support.engines import cli, submit
from tests.support.playbooks import marked_chain
from tests.support.workers import REPO_ROOT, worker_env

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"

# A process that opens a sweep transaction the way every worker's sweeper does (the same function,
# the workers' default NOETL_SWEEP_TIMEOUT), takes the lock, and freezes itself inside it.
HOLDER = """
import os, signal, sys, time
from noetl_celery.engine.recovery import sweeper
while True:
    with sweeper.sweep_transaction(sys.argv[1]) as conn:
        if conn is not None:
            print(conn.connection.dbapi_connection.get_backend_pid(), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)
    time.sleep(0.05)
"""


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def held_outcome_keys(broker_url: str, execution_id: int) -> set[str]:
    """The outcome keys of the execution's attempts whose messages a (stopped) worker holds:
    kombu's Redis transport keeps each taken message in the `unacked` hash until it is acked."""
    client = redis.Redis.from_url(broker_url)
    try:
        keys = set()
        for raw in client.hvals("unacked"):
            envelope = json.loads(raw)[0]
            _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
            if kwargs.get("execution_id") == execution_id:
                keys.add(TaskMessage.from_dict(kwargs["message"]).outcome_key())
        return keys
    finally:
        client.close()


def outcome_rows(url: str, execution_id: int, keys: set[str]) -> list[dict]:
    with get_engine(url).connect() as conn:
        found = conn.execute(
            text("SELECT * FROM noetl_event WHERE execution_id = :x AND event_id = ANY(:k) ORDER BY id"),
            {"x": execution_id, "k": sorted(keys)},
        )
        return [dict(r._mapping) for r in found]


@pytest.mark.slow
def test_a_frozen_lock_holder_does_not_stop_recovery(env, store_url, worker_factory):
    victim = worker_factory(env=env, concurrency=2, name="victim@%h")
    execution_id = submit(env, PLAYBOOKS / "loop_short_lease.yaml", n=300, sleep=0.05)
    deadline = time.monotonic() + 120
    while len(rows(store_url, execution_id, "event_type = 'iteration.completed'")) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # the victim is stopped holding messages first: it is the execution's only worker, so nothing
    # runs on while the holder starts (its start-up, seconds on a busy machine, once let the loop
    # finish first and left no message to hold). Were the victim stopped inside its own sweep
    # transaction, PostgreSQL ends that after the sweep timeout and the holder takes the lock then.
    freeze_holding_messages(victim, env["NOETL_BROKER_URL"], execution_id)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, store_url],
        env=worker_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        backend = int(holder.stdout.readline())  # it holds the lock, in its transaction
        while state(holder.pid) != "T":
            time.sleep(0.01)
        frozen_at = time.monotonic()
        victim.kill()
        killed, killed_at = time.monotonic(), datetime.now(UTC)
        worker_factory(env=env, concurrency=2, name="survivor@%h")
        status = wait(store_url, execution_id, timeout=150)
        assert status["status"] == "completed", status
        assert state(holder.pid) == "T"  # frozen all along: it never let go of the lock itself
        republished = rows(store_url, execution_id, "event_type = 'attempt.republished'")
        assert republished, "the lost attempts came back only through the sweeper"
        first = (aware(republished[0]["created_at"]) - killed_at).total_seconds()
        print(f"holder frozen {killed - frozen_at:.1f} s before the kill; first re-publish {first:.1f} s after it")
        assert first < 60, f"first re-publish {first:.1f} s after the kill"
        with get_engine(store_url).connect() as conn:  # PostgreSQL ended the frozen holder's session
            left = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": backend})
            assert left.scalar() == 0
        per_index = [r["iteration"] for r in rows(store_url, execution_id, "event_type = 'iteration.completed'")]
        assert sorted(per_index) == list(range(300))
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_lost_attempt_runs_within_60_s_while_the_task_queue_holds_2000_messages(env, store_url, worker_factory):
    broker = env["NOETL_BROKER_URL"]
    victim = worker_factory(env=env, concurrency=2, name="victim@%h")
    execution_id = submit(env, PLAYBOOKS / "loop_short_lease.yaml", n=300, sleep=0.05)
    deadline = time.monotonic() + 120
    while len(rows(store_url, execution_id, "event_type = 'iteration.completed'")) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(50):  # frozen holding an attempt whose outcome is not recorded (not just unacked)
        freeze_holding_messages(victim, broker, execution_id)
        held = held_outcome_keys(broker, execution_id)
        if lost := held - {r["event_id"] for r in outcome_rows(store_url, execution_id, held)}:
            break
        os.killpg(victim.pid, signal.SIGCONT)
        time.sleep(0.05)
    assert lost, "the worker never held an attempt without an outcome"
    client = redis.Redis.from_url(broker)
    backlog = submit(env, PLAYBOOKS / "backlog.yaml", n=2000, sleep=0.1)  # the submit dispatches all 2,000
    try:
        assert client.llen("noetl.tasks") >= 2000  # queued ahead of anything the sweeper sends later
        victim.kill()
        killed_at = datetime.now(UTC)
        worker_factory(env=env, concurrency=2, name="survivor@%h")
        while len(recovered := outcome_rows(store_url, execution_id, lost)) < len(lost):
            assert (datetime.now(UTC) - killed_at).total_seconds() < 90, f"lost attempts {lost} did not run"
            time.sleep(0.2)
        queued = client.llen("noetl.tasks")
        seconds = max((aware(r["created_at"]) - killed_at).total_seconds() for r in recovered)
        print(
            f"{len(lost)} lost attempt(s) ran at most {seconds:.1f} s after the kill,"
            f" {queued} messages still in the task queue"
        )
        assert seconds < 60
        assert queued > 1000, "the task queue had drained: no backlog to overtake"
        assert len(rows(store_url, execution_id, "event_type = 'attempt.republished'")) >= len(lost)
    finally:
        for run in (execution_id, backlog):
            with contextlib.suppress(Exception):
                cli(["cancel", str(run)], env)
        client.delete("noetl.tasks")
        client.close()


def test_an_original_taken_after_its_copy_ran_does_not_run_again(env, store_url, worker_factory, tmp_path):
    """The sweeper re-published an attempt that was only waiting in line behind a backlog; the
    copy ran first (through the event queue). The original, taken later than half its lease,
    finds the outcome row and does not run the tool a second time."""
    marks = tmp_path / "marks.txt"
    playbook = tmp_path / "late.yaml"
    playbook.write_text(marked_chain("late_original", ["start", "second"]))
    execution_id = create_execution(compile_playbook(playbook, overrides={"marks": str(marks)}), store_url)
    [first] = orchestrator.handle_event(store_url, orchestrator.start_payload(execution_id))
    payload = worker.execute(store_url, TaskMessage.from_dict(first.message))  # the copy ran here
    assert payload is not None
    orchestrator.handle_event(store_url, payload)
    STATE.clear()
    assert marks.read_text().splitlines() == ["start"]
    settings = noetl_settings.load(env)
    app = Celery("late-original-test")
    configure(app, settings)
    with app.connection_for_write() as conn:  # the original, published 10 minutes ago
        app.send_task(
            RUN_TASK,
            kwargs={"execution_id": execution_id, "message": wire(first.message)},
            queue=settings.task_queue,
            headers={publisher.SENT_HEADER: time.time() - 600},
            producer=conn.Producer(),
        )
    late = worker_factory(env=env, concurrency=1, name="late@%h")
    late.wait_for_log("late: this attempt waited in line past its lease", timeout=30)
    assert marks.read_text().splitlines() == ["start"]
    cli(["cancel", str(execution_id)], env)


def test_a_message_is_late_once_it_waited_past_the_pickup_slack():
    class Request:
        def __init__(self, sent, soft=None):
            self.noetl_sent = sent
            self.timelimit = (None, soft)

    now = time.time()
    assert not _late(Request(now))
    assert not _late(Request(now - 4))  # within PICKUP_SLACK (5 s): the lease from the decision covers it
    assert _late(Request(now - 6))  # its lease is moved on to run from the pickup
    assert _late(Request(now - 6, soft=2.0))  # whatever the attempt's timeout
    assert not _late(Request(None)) and not _late(object())
