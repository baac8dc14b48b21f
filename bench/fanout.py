"""A fan-out from a python step's big result, against a raw Celery `group` + chord, at the default settings.

    python -m bench.fanout [--n 200000] [--pad 0] [--workers 2] [--concurrency 2] [--redis-db 14]
                           [--skip-raw] [--out bench/results/fanout.json]

noetl_celery: bench/playbooks/fanout_python.yaml: a python step returns list(range(n)) (1.29 MB of
JSON for 200,000: above the default NOETL_MAX_RESULT_BYTES, so it is stored once by reference,
store/blobs.py), a parallel loop (100 in flight) returns each element, and the next step reads
the aggregated results whole. No NOETL_* setting is changed but the broker and the store. With
`--pad P` the elements are zero-padded text of P digits, so that a smaller n is above the cap too.

Raw Celery: this process builds the same list and sends `chord(group(echo.s(x) for x in items),
collect.s(key))` to the same workers (result backend: the same Redis); `collect` writes how many
results it received and their sum.

Reported: wall time and elements per second of each, their ratio (noetl ÷ raw), the peak RSS of
every worker process (main and pool children, sampled every 0.2 s; the largest one and each
worker instance's sum) and, for raw Celery, of this sending process. Services as bench.loops
(Redis database --redis-db claimed and flushed, a fresh PostgreSQL database migrated and dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench.loops import BenchError, check_alive, open_services, start_workers, stop_workers

PLAYBOOK = Path(__file__).resolve().parent / "playbooks" / "fanout_python.yaml"
MB = 1024 * 1024
SAMPLE_INTERVAL = 0.2
POLL = 0.5


class ProcessPeaks:
    """The peak RSS of each process of the given process trees (and of this process), sampled."""

    def __init__(self, roots: list[int], interval: float = SAMPLE_INTERVAL):
        self.roots = roots
        self.interval = interval
        self.peaks: dict[int, int] = {}
        self.tree_peaks = [0] * len(roots)
        self.own_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for i, root in enumerate(self.roots):
            total = 0
            try:
                procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), rss)
            self.tree_peaks[i] = max(self.tree_peaks[i], total)
        self.own_peak = max(self.own_peak, psutil.Process().memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> ProcessPeaks:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def result(self) -> dict[str, Any]:
        return {
            "largest_process_mb": round(max(self.peaks.values(), default=0) / MB, 1),
            "per_instance_mb": [round(p / MB, 1) for p in self.tree_peaks],
            "sender_mb": round(self.own_peak / MB, 1),
        }


def elements(n: int, pad: int) -> list[Any]:
    return list(range(n)) if not pad else [str(i).zfill(pad) for i in range(n)]


def run_noetl(settings: Any, database_url: str, n: int, pad: int, workers: list[Any], timeout: float) -> dict[str, Any]:
    from noetl_celery import runner
    from noetl_celery.compiler import compile_playbook

    with ProcessPeaks([w.pid for w in workers]) as peaks:
        t0 = time.perf_counter()
        execution_id = runner.submit(compile_playbook(PLAYBOOK, overrides={"n": n, "pad": pad}), settings)
        while True:
            status = runner.execution_status(database_url, execution_id)
            if status["status"] != "running":
                break
            if time.perf_counter() - t0 > timeout:
                raise BenchError(f"noetl: execution {execution_id} still running after {timeout:.0f} s")
            check_alive(workers)
            time.sleep(POLL)
        wall = time.perf_counter() - t0
    if status["status"] != "completed":
        raise BenchError(f"noetl: execution {execution_id} ended {status['status']}: {status.get('error')}")
    total = status["results"]["total"]
    expected = {"count": n, "sum": n * (n - 1) // 2}
    if total != expected:
        raise BenchError(f"noetl: the total step read {total}, not {expected}")
    from sqlalchemy import text

    from noetl_celery.store.db import get_engine

    with get_engine(database_url).connect() as conn:
        stored = conn.execute(
            text("SELECT size, length(data) FROM noetl_blob WHERE execution_id = :x ORDER BY size"),
            {"x": execution_id},
        ).all()
    return {
        "n": n,
        "execution_id": execution_id,
        "elapsed_s": round(wall, 2),
        "elements_per_s": round(n / wall, 1),
        "stored_by_reference": [{"json_bytes": s, "stored_bytes": b} for s, b in stored],
        "memory": peaks.result(),
    }


def run_raw(redis: Any, n: int, pad: int, workers: list[Any], timeout: float) -> dict[str, Any]:
    from celery import chord, group

    from bench.app import bench_collect, bench_echo

    key = f"bench:fanout:{uuid.uuid4().hex}"
    with ProcessPeaks([w.pid for w in workers]) as peaks:
        t0 = time.perf_counter()
        items = elements(n, pad)
        chord(group(bench_echo.s(x) for x in items), bench_collect.s(key)).apply_async()
        sent = time.perf_counter()
        while (found := redis.get(key)) is None:
            if time.perf_counter() - t0 > timeout:
                raise BenchError(f"raw: the chord's callback did not run within {timeout:.0f} s")
            check_alive(workers)
            time.sleep(POLL)
        wall = time.perf_counter() - t0
    count, total = (int(v) for v in found.split())
    if (count, total) != (n, n * (n - 1) // 2):
        raise BenchError(f"raw: the callback got {count} results summing to {total}")
    return {
        "n": n,
        "elapsed_s": round(wall, 2),
        "send_s": round(sent - t0, 2),
        "elements_per_s": round(n / wall, 1),
        "memory": peaks.result(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="elements of the python step's list (default 200000)")
    p.add_argument("--pad", type=int, default=0, help="elements as zero-padded text of this many digits (0: ints)")
    p.add_argument("--workers", type=int, default=2, help="worker instances (default 2)")
    p.add_argument("--concurrency", type=int, default=2, help="prefork pool processes per instance (default 2)")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database index to claim (default 14)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds each run may take (default 7200)")
    p.add_argument("--skip-raw", action="store_true", help="run noetl_celery only")
    p.add_argument("--out", type=Path, help="write the figures as JSON here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="noetl-bench-fanout-"))
    results: dict[str, Any] = {"benchmark": "bench.fanout", "argv": sys.argv[1:], "n": args.n, "pad": args.pad}
    with contextlib.ExitStack() as stack:
        services = open_services(stack, "redis", args.redis_db)
        os.environ["NOETL_RESULT_BACKEND"] = services.redis_url  # the raw chord's results
        from noetl_celery.app import app, configure
        from noetl_celery.config import settings as noetl_settings

        settings = noetl_settings.load()
        configure(app, settings)
        results["machine"] = services.machine
        env = {
            "NOETL_BROKER_URL": services.broker_url,
            "NOETL_DATABASE_URL": services.database_url,
            "NOETL_RESULT_BACKEND": services.redis_url,
            "BENCH_COUNTER_URL": services.redis_url,
        }
        workers = start_workers(args.workers, args.concurrency, env, log_dir, "fanout")
        stack.callback(stop_workers, workers)
        results["noetl"] = run_noetl(settings, services.database_url, args.n, args.pad, workers, args.timeout)
        print(json.dumps({"noetl": results["noetl"]}), flush=True)
        if not args.skip_raw:
            import redis

            client = redis.Redis.from_url(services.redis_url)
            results["raw"] = run_raw(client, args.n, args.pad, workers, args.timeout)
            print(json.dumps({"raw": results["raw"]}), flush=True)
            results["rate_ratio"] = round(results["noetl"]["elements_per_s"] / results["raw"]["elements_per_s"], 3)
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
