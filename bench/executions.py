"""Many small executions against as many raw Celery chains, on Redis or RabbitMQ + PostgreSQL.

    python -m bench.executions [--broker redis|amqp] [--n 2000] [--pairs 2] [--workers 1]
                               [--concurrency 2] [--eager-window S] [--shared-redis] [--json-out FILE]

Against the same worker processes (`celery -A bench.app worker`), each pair runs, in alternating
order:
- noetl: N executions of bench/playbooks/three_steps.yaml (three python steps, one after
  another), submitted back to back by this process as `noetl-celery submit` does
  (`runner.submit`, one call per execution), until every one has its end row;
- raw: N chains of three no-op `noetl.bench_chain_step` tasks (`chain(...).apply_async()`, one
  call per chain), the last link counting itself in Redis, until the count is N.

Reported per side: wall time from the first submit to the last end (executions/s), the time the
submitting calls took, CPU seconds of the worker processes, the database, the broker and this
process (bench.loops.CpuMeter), and rows written per execution. Beside the rates, CPU per unit
(per execution or chain) of what serves this run alone: the worker's main process, its pool,
the PostgreSQL backends of the run's own database and the run's own redis-server (started for
it unless --shared-redis): on a loaded machine wall time is distorted, CPU per unit much less.
The end of the noetl side is polled by the executions still running (the status index: a poll
costs what is left, not what has ended), every POLL seconds. The ratio is noetl's rate over
raw's in the same pair. A benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.latency import CHAIN_PLAYBOOK
from bench.loops import (
    COUNTER_URL_ENV,
    BenchError,
    CpuMeter,
    StoreReader,
    WorkerRun,
    _now,
    add_engine_options,
    engine_env,
    log,
    open_services,
    report,
    start_workers,
    wait_count,
)

POLL = 0.2  # seconds between two looks at how many executions (or chains) have ended
CONFIG_ARGS = ("broker", "n", "pairs", "workers", "concurrency", "eager_window", "pg_prepare", "timeout")


class Runs:
    def __init__(self, args: argparse.Namespace, redis: Any, settings: Any, database_url: str, workers: list[Any]):
        from noetl_celery.compiler import compile_playbook

        self.args = args
        self.redis = redis
        self.settings = settings
        self.workers = workers
        self.reader = StoreReader(database_url)
        self.redis_pid: int | None = None  # the run's own redis-server
        self.plan = compile_playbook(CHAIN_PLAYBOOK)

    def own(self) -> dict[str, list[int]]:
        """The processes serving this run alone: the run database's backends (but this reader's),
        and its own redis-server."""
        rows = self.reader.all(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        found = {"own_postgresql": [int(r[0]) for r in rows]}
        if self.redis_pid is not None:
            found["own_redis"] = [self.redis_pid]
        return found

    def close(self) -> None:
        self.reader.close()

    def _wait(self, what: str, done: Any, n: int, t0: float) -> float:
        """Poll `done()` (how many have ended) until it reaches n; the time.perf_counter() then."""
        return wait_count(what, done, n, t0, self.workers, timeout=self.args.timeout, stall=60.0, poll=POLL)

    def noetl(self, n: int) -> dict[str, Any]:
        from noetl_celery import runner

        first_id = None
        with CpuMeter(self.workers, self.own) as cpu:
            t0 = time.perf_counter()
            ids = [runner.submit(self.plan, self.settings) for _ in range(n)]
            t_sent = time.perf_counter()
            first_id = min(ids)

            def ended() -> int:  # by the (status, created_at) index: only running rows are read
                row = self.reader.one(
                    "SELECT count(*) FROM noetl_execution WHERE status = 'running' AND execution_id >= %s",
                    (first_id,),
                )
                return n - (int(row[0]) if row else n)

            t_end = self._wait("noetl", ended, n, t0)
        failed = self.reader.one(
            "SELECT count(*) FROM noetl_event WHERE execution_id >= %s AND event_type <> 'execution.completed' "
            "AND event_type IN ('execution.failed', 'execution.cancelled')",
            (first_id,),
        )
        if failed and failed[0]:
            raise BenchError(f"noetl: {failed[0]} of {n} executions did not complete")
        rows = self.reader.one("SELECT count(*) FROM noetl_event WHERE execution_id >= %s", (first_id,))
        elapsed = t_end - t0
        return {
            "n": n,
            "elapsed_s": round(elapsed, 3),
            "submit_s": round(t_sent - t0, 3),
            "per_s": round(n / elapsed, 1),
            "rows_per_execution": round(int(rows[0]) / n, 3) if rows else None,
            "cpu": cpu.result(n),
        }

    def raw(self, n: int) -> dict[str, Any]:
        from celery import chain

        from bench.app import bench_chain_step

        key = f"bench:executions:{uuid.uuid4().hex}"
        with CpuMeter(self.workers, self.own) as cpu:
            t0 = time.perf_counter()
            for _ in range(n):
                chain(bench_chain_step.s(1), bench_chain_step.s(), bench_chain_step.s(counter_key=key)).apply_async()
            t_sent = time.perf_counter()
            t_end = self._wait("raw", lambda: int(self.redis.get(key) or 0), n, t0)
        self.redis.delete(key)
        elapsed = t_end - t0
        return {
            "n": n,
            "elapsed_s": round(elapsed, 3),
            "submit_s": round(t_sent - t0, 3),
            "per_s": round(n / elapsed, 1),
            "cpu": cpu.result(n),
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def table(results: dict[str, Any]) -> str:
    lines = [
        "| pair | noetl executions/s | raw chains/s | rate noetl/raw | submit noetl/raw "
        "| worker CPU ms per execution, noetl / raw | CPU ms per unit, noetl / raw: main, pool, own PG, own Redis "
        "| rows per execution |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, pair in enumerate(results["pairs"], 1):
        if "error" in pair:
            lines.append(f"| {i} | {pair['error']} | | | | | | |")
            continue
        no, raw = pair["noetl"], pair["raw"]

        def worker_ms(side: dict[str, Any]) -> float:
            per = side["cpu"]["cpu_ms_per_item"]
            return round(per["worker_main"] + per["worker_children"], 2)

        def units(side: dict[str, Any]) -> str:
            per = side["cpu"]["cpu_ms_per_item"]
            keys = ("worker_main", "worker_children", "own_postgresql", "own_redis")
            return ", ".join(f"{per[k]:g}" if k in per else "-" for k in keys)

        lines.append(
            f"| {i} ({pair['order']}) | {no['per_s']} | {raw['per_s']} | {pair['rate_ratio']} | "
            f"{_ratio(no['submit_s'], raw['submit_s'])} | {worker_ms(no)} / {worker_ms(raw)} | "
            f"{units(no)} / {units(raw)} | {no['rows_per_execution']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.executions", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    p.add_argument("--n", type=int, default=2000, help="executions (and raw chains) per side (default 2000)")
    p.add_argument("--pairs", type=int, default=2, help="noetl/raw pairs, order alternating (default 2)")
    p.add_argument("--warmup", type=int, default=50, help="unreported executions and chains first (default 50)")
    p.add_argument("--workers", type=int, default=1, help="worker instances (default 1)")
    p.add_argument("--concurrency", type=int, default=2, help="prefork processes per worker (default 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one side may take (default 900)")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database index to claim (default 14)")
    p.add_argument(
        "--shared-redis", action="store_true", help="use the shared Redis (default: a redis-server of the run's own)"
    )
    p.add_argument("--json-out", help="also write the JSON results to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the worker logs (path printed)")
    add_engine_options(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"benchmark": "bench.executions", "started_at": _now(), "pairs": []}
    log_dir = Path(tempfile.mkdtemp(prefix="noetl-executions-"))
    from tests.support import services as svc

    with contextlib.ExitStack() as stack:
        own_redis = None
        if not args.shared_redis:
            own_redis = svc.OwnRedis(aof=False)
            own_redis.start()
            stack.callback(own_redis.cleanup)
        services = open_services(
            stack, args.broker, args.redis_db, engine_env(args), redis_server=own_redis and own_redis.url
        )
        results["machine"] = services.machine
        results["config"] = {k: getattr(args, k) for k in CONFIG_ARGS}
        client = svc.redis_client(services.redis_url)
        stack.callback(client.close)
        env = {
            "NOETL_BROKER_URL": services.broker_url,
            COUNTER_URL_ENV: services.redis_url,
            "NOETL_DATABASE_URL": services.database_url,
        }
        env.update(engine_env(args))
        with WorkerRun(results) as run:
            log(f"== {args.workers} worker(s) -c {args.concurrency} prefork, broker {args.broker}, N={args.n}")
            run.workers.extend(start_workers(args.workers, args.concurrency, env, log_dir, "executions"))
            runs = Runs(args, client, services.settings, services.database_url, run.workers)
            if own_redis is not None and own_redis.proc is not None:
                runs.redis_pid = own_redis.proc.pid
            run.closing.append(runs.close)
            if args.warmup:
                runs.noetl(args.warmup)
                runs.raw(args.warmup)
            for i in range(args.pairs):
                order = ("noetl", "raw") if i % 2 == 0 else ("raw", "noetl")
                pair: dict[str, Any] = {"order": "/".join(order)}
                try:
                    for side in order:
                        time.sleep(1.0)
                        pair[side] = getattr(runs, side)(args.n)
                        log(f"   pair {i + 1} {side}: {pair[side]['per_s']}/s")
                    pair["rate_ratio"] = _ratio(pair["noetl"]["per_s"], pair["raw"]["per_s"])
                except BenchError as exc:
                    pair["error"] = str(exc)
                    run.failed = True
                    log(f"   FAILED: {exc}")
                results["pairs"].append(pair)
    return report(table(results), results, args.json_out, log_dir, failed=run.failed, keep_logs=args.keep_logs)


if __name__ == "__main__":
    raise SystemExit(main())
