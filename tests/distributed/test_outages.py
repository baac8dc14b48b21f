"""Broker and database outages in the middle of a loop: the execution completes, every index once.

The broker tests start their own redis-server or RabbitMQ node on free ports (they stop them);
the database test terminates the backends of this session's own database on the shared
PostgreSQL.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli
from tests.support.services import OwnRedis, amqp_answers, free_port

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
# a 5 s timeout, so a 21 s lease: the attempts a broker without persistence lost are re-published
# by the sweeper 21 s after their decision rather than 46 s (the 60 s promise at the default
# lease is test_durability's, a worker killed for good)
LOOP = PLAYBOOKS / "loop_short_lease.yaml"
BATCHED = PLAYBOOKS / "loop_batched.yaml"  # the same loop, 8 iterations to a message
N = 1000
OUTAGE_ITERATION_SLEEP = 0.02  # seconds each iteration of the broker outage tests sleeps
RECOVERY_TARGET = 60.0  # seconds from the fault's end until the execution completes
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")  # Debian's, without the su wrapper


class OwnRabbit:
    """A RabbitMQ node of its own (name, AMQP and distribution ports, data and log directories),
    run as this user, that can be stopped and started again on the same ports and data: durable
    queues and persistent messages survive, as on a restarted production broker."""

    def __init__(self) -> None:
        if not RABBITMQ_SERVER.exists():
            pytest.skip(f"{RABBITMQ_SERVER} is not installed")
        self.port = free_port()
        self.dist_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="noetl-outage-rabbit-"))
        (self.dir / "plugins").write_text("[].\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> None:
        env = {
            **os.environ,
            "HOME": str(self.dir),  # the node's Erlang cookie
            "RABBITMQ_NODENAME": f"noetl_outage_{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "none"),  # no configuration: the defaults
        }
        with open(self.dir / "server.out", "ab") as out:
            self.proc = subprocess.Popen(
                [str(RABBITMQ_SERVER)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while not amqp_answers(self.url, 1.0):
            log = (self.dir / "server.out").read_text(errors="replace")[-2000:]
            assert self.proc.poll() is None, f"the RabbitMQ node exited:\n{log}"
            assert time.monotonic() < deadline, f"the RabbitMQ node did not start:\n{log}"
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: the node shuts down as for a restart; SIGKILL: it crashes."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        deadline = time.monotonic() + 30  # the Erlang VM outlives the script for a moment
        while amqp_answers(self.url, 0.5):
            assert time.monotonic() < deadline, "the RabbitMQ node did not stop"
            time.sleep(0.2)
        self.proc = None

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def submit(env: dict[str, str], n: int, playbook: Path = LOOP, sleep: float = 0) -> int:
    proc = cli(["submit", str(playbook), "--json", "--set", f"n={n}", "--set", f"sleep={sleep}"], env)
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["execution_id"])


def completions(url: str, execution_id: int) -> Counter:
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            text(
                "SELECT iteration FROM noetl_event WHERE execution_id = :x AND step = 'work' "
                "AND event_type = 'iteration.completed'"
            ),
            {"x": execution_id},
        ).all()
    return Counter(r[0] for r in rows)


def wait_for_progress(url: str, execution_id: int, count: int) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            if len(completions(url, execution_id)) >= count:
                return
        except DBAPIError:  # this test's own read was cut by the backend terminations
            pass
        assert time.monotonic() < deadline, "the loop made no progress"
        time.sleep(0.1)


def assert_every_index_once(url: str, execution_id: int, n: int, timeout: float) -> dict:
    status = wait(url, execution_id, timeout=timeout)
    assert status["status"] == "completed", status
    per_index = completions(url, execution_id)
    assert set(per_index) == set(range(n)), sorted(set(range(n)) - set(per_index))[:10]
    assert max(per_index.values()) == 1
    assert status["results"]["work"]["results"] == [2 * i for i in range(n)]
    return status


def two_workers(broker_url: str, store_url: str, worker_factory, tag: str) -> tuple[dict[str, str], list]:
    """Two workers of two processes each on this broker and store; the environment and the workers."""
    env = {"NOETL_BROKER_URL": broker_url, "NOETL_DATABASE_URL": store_url}
    return env, [worker_factory(env=env, concurrency=2, name=f"{tag}-{k}@%h") for k in "ab"]


def run_through_a_broker_outage(
    broker_url: str,
    stop: Callable[[], None],
    start: Callable[[], None],
    tag: str,
    playbook: Path,
    store_url,
    worker_factory,
) -> None:
    """Two workers run a 1,000-iteration loop; after 200 iterations the broker is stopped, started
    again 2 s later, and the loop must complete within the recovery target, every index once."""
    env, _ = two_workers(broker_url, store_url, worker_factory, f"outage-{tag}")
    # 20 ms an iteration: the 800 left after the 200th take seconds even in batches of 8, so the
    # outage falls in the loop's middle however slowly this test reads the progress
    execution_id = submit(env, N, playbook, sleep=OUTAGE_ITERATION_SLEEP)
    wait_for_progress(store_url, execution_id, 200)
    stop()
    assert len(completions(store_url, execution_id)) < N  # the outage fell in the loop's middle
    time.sleep(2)
    start()
    restarted = time.monotonic()
    assert_every_index_once(store_url, execution_id, N, timeout=RECOVERY_TARGET + 120)
    took = time.monotonic() - restarted
    print(f"{tag}: completed {took:.1f} s after the restart, {_republished(store_url, execution_id)} re-published")
    assert took < RECOVERY_TARGET + 30  # the rest of the loop's own work included


@pytest.mark.slow
def test_workers_stay_up_through_redis_restarts_with_messages_in_hand(store_url, worker_factory):
    """Redis is restarted three times while two workers hold messages not yet acknowledged. On
    kombu's own Redis transport the first restart stopped both workers ("Unrecoverable error":
    AttributeError from a channel of the collected connection, noetl_celery/engine/transport/redis_transport.py);
    here each worker reconnects every time and the loop completes, every index once."""
    redis = OwnRedis(aof=False)
    redis.start()
    try:
        env, workers = two_workers(redis.url, store_url, worker_factory, "restarts")
        execution_id = submit(env, N, sleep=0.005)
        wait_for_progress(store_url, execution_id, 100)
        for restart in range(3):
            redis.stop()
            time.sleep(1)
            redis.start()
            time.sleep(2)
            for w in workers:
                stopped = not w.running() or "Unrecoverable error" in w.log_text()
                assert not stopped, f"restart {restart + 1}: worker {w.node} stopped:\n{w.log_tail()}"
        assert len(completions(store_url, execution_id)) < N  # the restarts fell in the loop's middle
        assert_every_index_once(store_url, execution_id, N, timeout=RECOVERY_TARGET + 120)
        for w in workers:
            assert w.log_text().count("Connection to broker lost") >= 3
    finally:
        redis.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("aof", "playbook"),
    [(False, LOOP), (True, LOOP), (False, BATCHED)],
    ids=["no-persistence", "aof-always", "no-persistence-batched"],
)
def test_redis_stopped_for_2s_in_a_1000_iteration_loop(aof, playbook, store_url, worker_factory):
    redis = OwnRedis(aof)
    redis.start()
    try:
        tag = f"redis-{'aof' if aof else 'none'}-{playbook.stem}"
        run_through_a_broker_outage(redis.url, redis.stop, redis.start, tag, playbook, store_url, worker_factory)
    finally:
        redis.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "playbook"),
    [(signal.SIGTERM, LOOP), (signal.SIGKILL, LOOP), (signal.SIGTERM, BATCHED)],
    ids=["restarted", "killed", "restarted-batched"],
)
def test_rabbitmq_down_for_2s_in_a_1000_iteration_loop(sig, playbook, store_url, worker_factory):
    rabbit = OwnRabbit()
    rabbit.start()
    try:
        tag = f"rabbit-{sig.name.lower()}-{playbook.stem}"
        stop = functools.partial(rabbit.stop, sig)
        run_through_a_broker_outage(rabbit.url, stop, rabbit.start, tag, playbook, store_url, worker_factory)
    finally:
        rabbit.cleanup()


def _republished(url: str, execution_id: int) -> int:
    """Attempts the sweeper sent again (the broker had lost them) in this execution."""
    with get_engine(url).connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM noetl_event WHERE execution_id = :x AND event_type = 'attempt.republished'"),
                {"x": execution_id},
            ).scalar()
            or 0
        )


def _terminate_backends(url: str) -> int:
    with get_engine(url).connect() as conn:
        killed = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).scalar()
        conn.commit()
    return int(killed or 0)


@pytest.mark.parametrize("playbook", [LOOP, BATCHED], ids=["one-per-message", "batched"])
def test_database_connections_dropped_before_the_first_read_and_in_a_loop(playbook, env, store_url, worker_factory):
    worker_factory(env=env, concurrency=2, name="pgdrop-a@%h")
    worker_factory(env=env, concurrency=2, name="pgdrop-b@%h")
    warm = submit(env, 3)  # every worker process holds pooled connections now
    assert wait(store_url, warm, timeout=60)["status"] == "completed"
    assert _terminate_backends(store_url) > 0  # dropped before the next execution's first read
    execution_id = submit(env, 300, playbook)
    stop = threading.Event()
    terminated: list[int] = []

    def terminate_repeatedly() -> None:  # at once, then every 0.25 s: a fast loop is cut too
        while True:
            # this thread's own pooled connection may be one of those terminated before
            with contextlib.suppress(DBAPIError):
                terminated.append(_terminate_backends(store_url))
            if stop.wait(0.25):
                return

    killer = threading.Thread(target=terminate_repeatedly, daemon=True)
    killer.start()
    try:
        wait_for_progress(store_url, execution_id, 150)
    finally:
        stop.set()
        killer.join()
    get_engine(store_url).dispose()  # this process's own pooled connections were cut as well
    assert sum(terminated) > 0
    assert_every_index_once(store_url, execution_id, 300, timeout=180)
