"""Loops under at-least-once delivery: real Redis or RabbitMQ, real PostgreSQL, real worker processes.

The delivery tests run on both brokers (`on_both_brokers`); on RabbitMQ they are smaller, to keep
the suite's time in check (each says how)."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text

from noetl_celery.config import limits
from noetl_celery.engine import deadlines
from noetl_celery.runner import wait
from noetl_celery.store import blobs
from noetl_celery.store.db import get_engine
from tests.support.engines import cli
from tests.support.services import on_both_brokers

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
LOOP = PLAYBOOKS / "loop_many.yaml"
BATCHED = PLAYBOOKS / "loop_batched.yaml"  # the same loop, 8 iterations to a message
SHORT_LEASE = PLAYBOOKS / "loop_short_lease.yaml"  # the same loop, each iteration with a 5 s timeout
# the seconds of one message's attempts that make its lease (deadlines.lease): what the sweeper
# waits before it sends again a message that a killed worker had recorded and not yet sent
MESSAGE_TIMEOUT = {SHORT_LEASE: 5.0, BATCHED: 8 * 3.0}  # a batch: 8 iterations of 3 s


def submit(env: dict[str, str], n: int, sleep: float = 0.0, playbook: Path = LOOP) -> int:
    proc = cli(["submit", str(playbook), "--json", "--set", f"n={n}", "--set", f"sleep={sleep}"], env)
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


def republished(url: str, execution_id: int) -> int:
    """`attempt.republished` rows of the execution: attempts the sweeper had to send again."""
    with get_engine(url).connect() as conn:
        return conn.execute(
            text("SELECT COUNT(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'"),
            {"x": execution_id},
        ).scalar_one()


def assert_exactly_once(url: str, execution_id: int, n: int) -> None:
    status = wait(url, execution_id, timeout=300)
    assert status["status"] == "completed", status
    per_index, kinds = loop_log(url, execution_id)
    assert set(per_index) == set(range(n)), f"missing: {sorted(set(range(n)) - set(per_index))[:10]}"
    assert max(per_index.values()) == 1, [i for i, c in per_index.items() if c > 1][:10]
    assert kinds["iterator.completed"] == 1
    assert kinds["step.completed"] == 1
    work = status["results"]["work"]
    if limits.is_reference(work):  # above the row cap (a test that lowers it): read it whole
        work = blobs.url_reader(url)(work)
    assert work["results"] == [2 * i for i in range(n)]
    assert work["stats"] == {"total": n, "success": n, "failed": 0}


@pytest.mark.slow
@on_both_brokers
def test_1000_iterations_cap_50_two_workers_four_loops_at_once(broker, env, store_url, worker_factory):
    # four 1,000-iteration loops submitted at once (4,000 iterations, the loops' decisions
    # interleaved on the same workers and rows), each loop exactly once
    worker_factory(env=env, concurrency=4, name="loop-a@%h")
    worker_factory(env=env, concurrency=4, name="loop-b@%h")
    execution_ids = [submit(env, 1000) for _ in range(4)]
    for execution_id in execution_ids:
        assert_exactly_once(store_url, execution_id, 1000)


def batched_iterations(url: str, execution_id: int) -> Counter:
    """How often each iteration was sent inside a batched message (stored dispatch lists)."""
    with get_engine(url).connect() as conn:
        metas = conn.execute(
            text("SELECT meta FROM noetl_event WHERE execution_id = :x AND meta IS NOT NULL"), {"x": execution_id}
        ).scalars()
        found = [meta if isinstance(meta, dict) else json.loads(meta) for meta in metas if meta is not None]
    dispatches = [d for meta in found if isinstance(meta, dict) for d in meta.get("dispatch") or []]
    return Counter(
        i
        for d in dispatches
        if d["message"].get("batch")
        for i in [d["message"]["iteration"], *(m["iteration"] for m in d["message"]["batch"])]
    )


def assert_batched(url: str, execution_id: int, n: int) -> None:
    """Iterations went out in batches, each in one only (the collection's tail may leave one
    iteration to travel alone)."""
    sent = batched_iterations(url, execution_id)
    assert max(sent.values()) == 1, [i for i, c in sent.items() if c > 1][:10]
    assert len(sent) >= n - 8, f"only {len(sent)} of {n} iterations were sent in batches"


@on_both_brokers
@pytest.mark.parametrize("playbook", [SHORT_LEASE, BATCHED], ids=["one-per-message", "batched"])
def test_a_worker_killed_mid_loop_loses_no_iteration(broker, playbook, env, store_url, worker_factory):
    # the collection (400 integers, 1.9 kB of JSON) above the row cap: stored in pages of about
    # 300 bytes, which the killed worker and its rescuer read one at a time; each value stored by
    # reference above 200 stored bytes goes by COPY, and the loop's source is read 200 at a time
    paged = {
        **env,
        "NOETL_MAX_RESULT_BYTES": "1000",
        "NOETL_LOOP_PAGE_BYTES": "300",
        "NOETL_STORE_PIECE_BYTES": "200",
    }
    if broker == "redis":
        # a short visibility timeout so that Redis hands the killed worker's messages out again soon
        worker_env = {**paged, "NOETL_VISIBILITY_TIMEOUT": "8", "NOETL_RESTORE_INTERVAL": "2"}
    else:
        # RabbitMQ needs no setting: the messages a consumer took and did not acknowledge go back
        # to the queue as soon as its connection dies (the SIGKILL closes the socket)
        worker_env = paged
    victim = worker_factory(env=worker_env, concurrency=4, name="victim@%h")
    # 400 iterations of 50 ms on 4 processes: at least 5 s of work, so that the kill, after 40,
    # lands mid-loop even when a poll is slow (each lane goes on in its own job: eager attempts)
    n = 400
    execution_id = submit(env, n, sleep=0.05, playbook=playbook)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = sum(loop_log(store_url, execution_id)[0].values())
        if done >= 40:
            break
        time.sleep(0.05)
    assert 40 <= done < n, f"{done} iterations done before the kill"
    victim.kill()
    killed_at = time.monotonic()
    worker_factory(env=worker_env, concurrency=4, name="rescuer@%h")
    assert_exactly_once(store_url, execution_id, n)
    if broker == "redis":
        took = time.monotonic() - killed_at
        if republished(store_url, execution_id) == 0:
            # back within the visibility timeout plus a couple of sweeps, not kombu's default ~100 s
            assert took < 45
        else:
            # an attempt the victim had recorded and not yet sent (killed between the decision's
            # commit and its publish) comes back through the sweeper, once its lease is over
            assert took < deadlines.lease(0.0, MESSAGE_TIMEOUT[playbook]) + 20
    else:
        # redelivered at once by RabbitMQ, not re-published by the sweeper (which would wait for
        # the attempts' lease)
        assert republished(store_url, execution_id) == 0
        assert time.monotonic() - killed_at < 30
    if playbook == BATCHED:  # the killed batches ran again whole: no iteration was sent twice
        assert_batched(store_url, execution_id, n)
    with get_engine(store_url).connect() as conn:
        collection = conn.execute(
            text("SELECT collection FROM noetl_loop WHERE execution_id = :x"), {"x": execution_id}
        ).scalar_one()
    assert limits.is_paged(collection) and len(collection["pages"]) >= 5, collection
    with get_engine(store_url).connect() as conn:
        stored = conn.execute(
            text("SELECT max(length(data)) FROM noetl_blob WHERE execution_id = :x"), {"x": execution_id}
        ).scalar_one()
    assert stored > 200  # the source went by COPY and was read in pieces (store/blobs.py)


def test_outcomes_through_the_on_event_queue(env, store_url, worker_factory):
    # NOETL_EVENT_DISPATCH=queue: run_task sends its outcome to the on_event queue, served here by
    # a worker of its own (the queues scale separately)
    queue_env = {**env, "NOETL_EVENT_DISPATCH": "queue"}
    worker_factory(env=queue_env, concurrency=2, name="tools@%h", queues=("noetl.tasks",))
    worker_factory(env=queue_env, concurrency=2, name="events@%h", queues=("noetl.events",))
    execution_id = submit({**env, "NOETL_EVENT_DISPATCH": "queue"}, 300)
    assert_exactly_once(store_url, execution_id, 300)
    # a batch's outcomes travel as one on_event payload
    batched = submit({**env, "NOETL_EVENT_DISPATCH": "queue"}, 300, playbook=BATCHED)
    assert_exactly_once(store_url, batched, 300)
    assert_batched(store_url, batched, 300)
