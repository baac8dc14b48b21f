"""What one loop iteration costs the PostgreSQL store: backend CPU, rows, bytes, WAL.

    python -m bench.capacity [--iterations 2000] [--json-out FILE]

In one process, on a fresh PostgreSQL database (as bench.recovery), tests/playbooks/loop_many.yaml
(one python task per iteration, 50 in flight) runs to its end with no broker: each dispatched
attempt is executed in process (`worker.execute`, as a worker's pool process does) and its
outcome decided (`orchestrator.handle_event`, as on_event does), in dispatch order. Then the
sweeper's pass over the execution's leases (made overdue) is measured the same way, and
`noetl-celery prune`'s removal of the finished execution.

Reported per iteration: the CPU time of the database's backends (utime + stime of their
processes, /proc: the server runs on this machine), the rows written to noetl_event, the bytes
the store grew by (`pg_total_relation_size` of every table of the store), the WAL written
(`pg_current_wal_lsn`); and decisions per second of backend CPU (what one PostgreSQL core can
decide). A benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench.recovery import scratch_database, wal_lsn
from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.engine.recovery import sweeper
from noetl_celery.runner import create_execution
from noetl_celery.store import leases, retention
from noetl_celery.store.db import migrate, transaction
from noetl_celery.store.executions import get_execution
from noetl_celery.store.kernel import utcnow

LOOP = Path(__file__).resolve().parents[1] / "tests" / "playbooks" / "loop_many.yaml"
TABLES = ("noetl_event", "noetl_lease", "noetl_execution", "noetl_variable", "noetl_loop", "noetl_join")
TICKS = os.sysconf("SC_CLK_TCK")


def backend_cpu(url: str, database: str) -> float:
    """CPU seconds used so far by the server processes serving `database`."""
    with transaction(url) as conn:
        pids = [
            r[0] for r in conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = :d"), {"d": database})
        ]
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / TICKS


def store_bytes(url: str) -> int:
    with transaction(url) as conn:
        return sum(int(conn.execute(text("SELECT pg_total_relation_size(:t)"), {"t": t}).scalar() or 0) for t in TABLES)


def event_rows(url: str) -> int:
    with transaction(url) as conn:
        return int(conn.execute(text("SELECT count(*) FROM noetl_event")).scalar() or 0)


def snapshot(url: str, database: str) -> dict[str, float]:
    return {
        "cpu": backend_cpu(url, database),
        "client_cpu": time.process_time(),
        "wall": time.perf_counter(),
        "bytes": store_bytes(url),
        "wal": wal_lsn(url),
        "rows": event_rows(url),
    }


def per(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {k: (after[k] - before[k]) / n for k in before}


def run_loop(url: str, n: int) -> int:
    plan = compile_playbook(str(LOOP), overrides={"n": n})
    execution_id = create_execution(plan, url)
    queue = deque(orchestrator.handle_event(url, orchestrator.start_payload(execution_id)))
    while queue:
        dispatch = queue.popleft()
        if dispatch.kind != "run":
            continue
        payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id="bench")
        if payload is not None:
            queue.extend(orchestrator.handle_event(url, payload))
    return execution_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"iterations": args.iterations}
    with scratch_database("bench_capacity") as (name, url):
        migrate(url)
        run_loop(url, 20)  # warm: caches, the pool's connections
        n = args.iterations
        before = snapshot(url, name)
        execution_id = run_loop(url, n)
        after = snapshot(url, name)
        with transaction(url) as conn:
            status = get_execution(conn, execution_id)["status"]  # type: ignore[index]
            left = leases.expire(conn, utcnow())
        swept_from = snapshot(url, name)
        result = sweeper.sweep(url, interval=5.0)
        swept = snapshot(url, name)
        pruned_from = snapshot(url, name)
        pruned = retention.prune(url, timedelta(0), now=utcnow() + timedelta(seconds=1))
        pruned_to = snapshot(url, name)
        removed = sum(pruned.rows.values())
        prune = per(pruned_from, pruned_to, max(removed, 1))
        loop = per(before, after, n)
        sweep = per(swept_from, swept, max(left, 1))
        report.update(
            status=status,
            iteration=loop,
            decisions_per_backend_cpu_s=1 / loop["cpu"] if loop["cpu"] else None,
            iterations_per_s_one_process=1 / loop["wall"],
            leases_left=left,
            sweep_settled=result.cleared,
            sweep_per_lease=sweep,
            pruned_rows=pruned.rows,
            prune_per_row=prune,
            prune_rows_per_s=removed / (pruned_to["wall"] - pruned_from["wall"]),
        )
        print(
            f"{n} iterations ({status}): {1 / loop['wall']:,.0f}/s in one process;"
            f" backend CPU {loop['cpu'] * 1000:.3f} ms, client CPU {loop['client_cpu'] * 1000:.3f} ms per iteration"
            f" ({report['decisions_per_backend_cpu_s'] or 0:,.0f} iterations per backend CPU second);"
            f" {loop['rows']:.3f} event rows, {loop['bytes']:,.0f} B of store,"
            f" {loop['wal']:,.0f} B of WAL per iteration;"
            f" sweep of {left} leases ({result.cleared} settled): {sweep['bytes']:,.0f} B of store,"
            f" {sweep['wal']:,.0f} B of WAL, {sweep['cpu'] * 1000:.3f} ms of backend CPU per lease;"
            f" prune: {removed} rows at {report['prune_rows_per_s']:,.0f} rows/s,"
            f" {prune['wal']:,.0f} B of WAL and {prune['cpu'] * 1000:.3f} ms of backend CPU per row",
            flush=True,
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
