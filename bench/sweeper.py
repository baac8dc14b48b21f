"""What the sweeper costs: CPU per sweep and per minute, in the sweeping process and in its
PostgreSQL backends, on Redis + PostgreSQL.

    python -m bench.sweeper [--n 2000] [--seconds 30] [--interval 5] [--json-out FILE]

Against a fresh database and a claimed Redis database, with no worker running (nothing moves but
the sweeps), this process runs `sweeping.sweep_once` every `interval` seconds for `seconds` in each of
three states:
- idle: no execution;
- waiting: N executions submitted (`runner.submit`), their first messages in the task queue and
  their leases not yet due;
- overdue in line: the same leases made overdue (`leases.expire`) while their messages are still
  queued: the sweeper reads them once and leaves them alone for a lease.
Reported per state: sweeps, CPU ms per sweep and per minute of the sweeping thread
(time.thread_time) and of the database's backends (psutil, by pg_stat_activity's pids). A
benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import psutil
from sqlalchemy import text

from bench.latency import CHAIN_PLAYBOOK
from bench.loops import _cpu, open_services


def backends_cpu(database_url: str) -> float:
    """CPU seconds so far of the client backends connected to the run's database (autovacuum's
    workers, which the submits of the `waiting` state wake, are not the sweeper's)."""
    from noetl_celery.store.db import get_engine

    with get_engine(database_url).connect() as conn:
        pids = [
            int(r[0])
            for r in conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity"
                    " WHERE datname = current_database() AND backend_type = 'client backend'"
                )
            )
        ]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += _cpu(psutil.Process(pid))
    return total


def measure(database_url: str, seconds: float, interval: float) -> dict[str, Any]:
    import noetl_celery.app  # noqa: F401  (binds the Celery app to the transport)
    from noetl_celery.engine.transport import sweeping as noetl_app

    sweeps, thread_s = 0, 0.0
    pg_before = backends_cpu(database_url)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.thread_time()
        noetl_app.sweep_once()
        thread_s += time.thread_time() - began
        sweeps += 1
        time.sleep(interval)
    pg_s = backends_cpu(database_url) - pg_before
    per_minute = 60.0 / interval
    return {
        "sweeps": sweeps,
        "thread_ms_per_sweep": round(1000 * thread_s / sweeps, 2),
        "pg_ms_per_sweep": round(1000 * pg_s / sweeps, 2),
        "thread_ms_per_minute": round(1000 * thread_s / sweeps * per_minute, 1),
        "pg_ms_per_minute": round(1000 * pg_s / sweeps * per_minute, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweeper", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="executions waiting in the queue (default 2000)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds measured per state (default 30)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between sweeps (default 5)")
    p.add_argument("--redis-db", type=int, default=13, help="Redis database index to claim (default 13)")
    p.add_argument("--json-out", help="also write the JSON results to this file")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"benchmark": "bench.sweeper", "config": vars(args), "states": {}}
    with contextlib.ExitStack() as stack:
        services = open_services(stack, "redis", args.redis_db)
        from noetl_celery import runner
        from noetl_celery.compiler import compile_playbook
        from noetl_celery.store import leases
        from noetl_celery.store.db import transaction
        from noetl_celery.store.kernel import utcnow

        url = services.database_url
        results["states"]["idle"] = measure(url, args.seconds, args.interval)
        plan = compile_playbook(CHAIN_PLAYBOOK)
        for _ in range(args.n):
            runner.submit(plan, services.settings)
        results["states"]["waiting"] = measure(url, args.seconds, args.interval)
        with transaction(url) as conn:
            leases.expire(conn, utcnow())
        results["states"]["overdue_in_line"] = measure(url, args.seconds, args.interval)
        with transaction(url) as conn:
            republished = conn.execute(
                text("SELECT count(*) FROM noetl_event WHERE event_type = 'attempt.republished'")
            ).scalar()
        results["republished"] = int(republished or 0)
    print(json.dumps(results, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
