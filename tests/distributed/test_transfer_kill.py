"""A transfer whose worker is SIGKILLed in the middle of the copy, on Redis + PostgreSQL with real
worker processes, PostgreSQL -> MariaDB: the target holds part of the rows when the worker dies,
the sweeper brings the attempt back to a second worker, and the upsert by key leaves each row in
the target exactly once."""

from __future__ import annotations

import json
import time

from sqlalchemy import text

from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support import services as svc
from tests.support.engines import submit
from tests.test_transfer_playbook import PLAYBOOK, credentials_env, fill_source

ROWS = 200_000


def target_count(mysql_url: str) -> int:
    return int(svc.mysql_query(mysql_url, "SELECT COUNT(*) AS n FROM transfer_dst")[0]["n"])


def events(url: str, execution_id: int, where: str) -> list[dict]:
    with get_engine(url).connect() as conn:
        result = conn.execute(
            text(f"SELECT * FROM noetl_event WHERE execution_id = :x AND {where} ORDER BY id"), {"x": execution_id}
        )
        return [dict(r._mapping) for r in result]


def test_a_worker_killed_mid_transfer_leaves_each_row_once_after_the_retry(
    env, store_url, worker_factory, fresh_postgres, tmp_path
):
    fill_source(fresh_postgres.dsn, ROWS)
    with svc.fresh_mysql_database(svc.mysql_server_url(), prefix="transfer_k_") as mysql_url:
        svc.mysql_query(
            mysql_url, "CREATE TABLE transfer_dst (id INT PRIMARY KEY, name VARCHAR(40), amount DECIMAL(10,2))"
        )
        worker_env = {**env, **credentials_env(fresh_postgres, mysql_url)}
        victim = worker_factory(env=worker_env, concurrency=1, name="transfer-victim@%h")
        check = tmp_path / "check.jsonl"
        execution_id = submit(worker_env, PLAYBOOK, chunk_size=1000, check_file=str(check))
        deadline = time.monotonic() + 120
        while target_count(mysql_url) == 0:
            assert time.monotonic() < deadline, victim.log_tail()
            time.sleep(0.05)
        victim.kill()
        partial = target_count(mysql_url)
        assert 0 < partial < ROWS, partial  # killed in the middle: some chunks committed, not all
        worker_factory(env=worker_env, concurrency=1, name="transfer-survivor@%h")
        status = wait(store_url, execution_id, timeout=240)
        assert status["status"] == "completed", status
        got = svc.mysql_query(
            mysql_url, "SELECT COUNT(*) AS n, COUNT(DISTINCT id) AS ids, SUM(amount) AS s FROM transfer_dst"
        )[0]
        assert (got["n"], got["ids"]) == (ROWS, ROWS)
        assert float(got["s"]) == sum(i / 4 for i in range(1, ROWS + 1))
        assert json.loads(check.read_text()) == {"n": ROWS, "ids": ROWS}
        done = events(store_url, execution_id, "step = 'copy' AND event_type = 'action.completed'")
        assert len(done) == 1 and done[0]["result"]["rows_transferred"] == ROWS, done
        assert events(store_url, execution_id, "event_type = 'attempt.republished'")  # it ran again
        print(f"killed with {partial} of {ROWS} rows copied; the retry left {got['n']} rows")
