"""How fast the dashboard opens an execution with many events (default 100,000), on PostgreSQL.

    python -m bench.dashboard_page [--events 100000] [--repeat 5]

A fresh database is created, migrated and dropped. One execution of a parallel loop is written
the way the engine writes it (execution.started, step rows, iterator rows, one iteration.started
and one iteration.completed row per iteration, the noetl_loop counters), then
`noetl-celery dashboard` runs as a process and each page is fetched over HTTP `--repeat` times;
the median and the maximum wall time per page are printed (the first fetch included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import requests
from sqlalchemy import create_engine, text

from noetl_celery.compiler import compile_playbook
from noetl_celery.store.db import migrate, transaction
from noetl_celery.store.events import insert_events
from noetl_celery.store.executions import create_execution
from noetl_celery.store.loops import create_loop

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER = os.environ.get("NOETL_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BATCH = 5000  # rows per insert
PAGES = (
    "/executions/{id}",
    "/executions/{id}/live",
    "/api/executions/{id}",
    "/executions/{id}?event_type=iteration.completed&after={mid}",
    "/",
)


def populate(url: str, events: int) -> tuple[int, int]:
    plan = compile_playbook(str(REPO_ROOT / "tests/playbooks/loop_many.yaml")).model_dump(mode="json")
    execution_id = int(time.time() * 1000)
    iterations = max(events // 2 - 4, 1)
    start = datetime.now(UTC) - timedelta(seconds=iterations / 500)
    run_id = uuid.uuid4().hex[:16]
    with transaction(url) as conn:
        create_execution(conn, execution_id=execution_id, plan=plan, workload=plan["workload"])
        head = [
            ("execution.started", "running", None),
            ("step.started", "started", "start"),
            ("step.completed", "completed", "start"),
            ("step.started", "started", "work"),
        ]
        insert_events(
            conn,
            [
                {
                    "execution_id": execution_id,
                    "event_id": f"h{i}",
                    "event_type": t,
                    "status": st,
                    "step": step,
                    "created_at": start,
                }
                for i, (t, st, step) in enumerate(head)
            ],
        )
        create_loop(
            conn,
            {
                "run_id": run_id,
                "execution_id": execution_id,
                "step": "work",
                "mode": "parallel",
                "total": iterations,
                "max_in_flight": 50,
                "collection": None,
                "context": None,
            },
        )
    rows = []
    for i in range(iterations):
        at = start + timedelta(milliseconds=2 * i)
        common = {
            "execution_id": execution_id,
            "step": "work",
            "task": "work",
            "run_id": run_id,
            "attempt": 1,
            "iteration": i,
            "page": 1,
        }
        rows.append(
            {
                **common,
                "event_id": f"{run_id}.i{i}.start",
                "event_type": "iteration.started",
                "status": "started",
                "created_at": at,
                "context": {"element": i},
            }
        )
        rows.append(
            {
                **common,
                "event_id": f"{run_id}.i{i}.done",
                "event_type": "iteration.completed",
                "status": "completed",
                "created_at": at + timedelta(milliseconds=20),
                "started_at": at,
                "duration_ms": 3.0,
                "worker": f"w{i % 2}@bench",
                "queue_id": str(uuid.uuid4()),
                "result": i * 2,
            }
        )
        if len(rows) >= BATCH:
            with transaction(url) as conn:
                insert_events(conn, rows)
            rows = []
    with transaction(url) as conn:
        insert_events(conn, rows)
        conn.execute(
            text("UPDATE noetl_loop SET done = total, succeeded = total, dispatched = total WHERE run_id = :r"),
            {"r": run_id},
        )
        total = conn.execute(
            text("SELECT count(*), max(id) FROM noetl_event WHERE execution_id = :x"), {"x": execution_id}
        ).one()
    print(f"execution {execution_id}: {total[0]} events")
    return execution_id, int(total[1]) // 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--port", type=int, default=18099)
    args = parser.parse_args()
    name = f"noetl_bench_dash_{os.getpid()}"
    admin = create_engine(SERVER.replace("postgresql://", "postgresql+psycopg2://"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = SERVER.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://") + f"/{name}"
    proc = None
    try:
        migrate(url)
        execution_id, mid = populate(url, args.events)
        env = {**os.environ, "NOETL_DATABASE_URL": url}
        proc = subprocess.Popen(
            [sys.executable, "-m", "noetl_celery.cli", "dashboard", "--port", str(args.port)],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{args.port}"
        for _ in range(100):
            try:
                requests.get(base + "/api/executions/1", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        for page in PAGES:
            path = page.format(id=execution_id, mid=mid)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                response = requests.get(base + path, timeout=60)
                times.append(time.perf_counter() - t0)
                assert response.status_code == 200, (path, response.status_code)
            print(
                f"{path:70} median {statistics.median(times) * 1000:7.1f} ms  max {max(times) * 1000:7.1f} ms "
                f"({len(response.content)} bytes)"
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        with admin.connect() as conn:
            conn.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))


if __name__ == "__main__":
    main()
