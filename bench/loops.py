"""Loop throughput of noetl_celery against raw Celery, on Redis or RabbitMQ + PostgreSQL with real workers.

    python -m bench.loops [--broker redis|amqp] [--sizes 1000,10000] [--workers 1,2] [--concurrency 2]
                          [--modes inline,queue] [--memory-n 100000 | --skip-memory]
                          [--json-out bench/results/latest.json]

For every event-dispatch mode (a worker setting, so the workers are restarted per mode) and
every number of worker instances (`celery -A noetl_celery worker -c C -P prefork` each):

- raw Celery: N `noetl.bench_noop` tasks (each INCRs a Redis counter) sent as one plain
  `celery.group(...).apply_async()`; tasks/s from the first send to the counter reading N.
- noetl_celery: bench/playbooks/loop_noop.yaml with n=N (a parallel loop of N `result = x`
  python iterations, max_in_flight 100) submitted as `noetl-celery submit` does
  (`runner.submit`); iterations/s between the created_at of the loop's `iterator.started` and
  `iterator.completed` rows; event rows of the loop step per iteration; on_event latency per
  iteration (created_at of its `iteration.completed` row minus started_at + duration_ms).
- noetl_celery cursor loop (--cursor-n, default 10000; 0 skips it): bench/playbooks/cursor_noop.yaml,
  the same no-op python task per row, rows claimed from a PostgreSQL table by 100 slots (frames
  of up to --cursor-frame rows, default 20; 1: no frame, a row per claim; --cursor-row-bytes B:
  each claimed row carries a random payload of B characters besides its id); rows/s between
  `iterator.started` and `iterator.completed`, and event rows of the loop step per row.
- peak RSS of each worker instance (main process + pool children, summed; sampled every 0.2 s).

raw and noetl run back to back against the same worker processes. Then, unless
--skip-memory, one loop of --memory-n iterations on 1 worker instance with the worker RSS
sampled over time (RSS at 10/50/90 % of the iterations, and the max).

Broker (--broker, default redis): both the raw tasks and the noetl loop go through it. With
amqp, the workers and this process use a RabbitMQ virtual host of their own (created and deleted
like a test session's); the raw tasks still count themselves in Redis, so the baseline task is
the same on both brokers and Redis is needed either way.

Services: NOETL_TEST_REDIS_URL / NOETL_TEST_AMQP_URL / NOETL_TEST_POSTGRES_URL if set, else the
local servers. Redis database --redis-db (default 14) is claimed and flushed at start and flushed
at the end; a fresh PostgreSQL database is created, migrated and dropped. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = REPO_ROOT / "bench" / "playbooks" / "loop_noop.yaml"
COUNTER_URL_ENV = "BENCH_COUNTER_URL"  # the Redis the raw tasks count themselves in (bench/app.py)
CURSOR_PLAYBOOK = REPO_ROOT / "bench" / "playbooks" / "cursor_noop.yaml"
CURSOR_SLOTS = 100  # as written in the cursor playbook
CURSOR_CREDENTIAL_ENV = "NOETL_AUTH_BENCH_PG"  # the cursor playbook's `auth: bench_pg`
LOOP_STEP = "work"  # the loop step of the playbook
MAX_IN_FLIGHT = 100  # as written in the playbook
SAMPLE_INTERVAL = 0.2  # seconds between RSS samples
RAW_POLL = 0.005  # seconds between reads of the raw counter
NOETL_POLL = 0.1  # seconds between reads of the execution status
WORKER_START_TIMEOUT = 60.0
WARMUP_N = 200
STATEMENT_TIMEOUT_MS = 120_000  # the benchmark's own queries
MB = 1024 * 1024


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return "unknown"


def rabbitmq_version(amqp_url: str) -> str:
    from kombu import Connection

    with Connection(amqp_url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
        version = (conn.connection.server_properties or {}).get("version", "unknown")
    return version.decode() if isinstance(version, bytes) else str(version)


def machine_description(redis_url: str, postgres_url: str, amqp_url: str | None = None) -> dict[str, Any]:
    from tests.support.services import pg_connect, redis_client

    client = redis_client(redis_url)
    try:
        redis_version = client.info("server").get("redis_version", "unknown")
    finally:
        client.close()
    conn = pg_connect(postgres_url)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW server_version")
            pg_version = cur.fetchone()[0]
    finally:
        conn.close()
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_total_mb": round(psutil.virtual_memory().total / MB),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "celery": _version("celery"),
        "kombu": _version("kombu"),
        "redis_py": _version("redis"),
        "sqlalchemy": _version("sqlalchemy"),
        "psycopg2": _version("psycopg2-binary") if _version("psycopg2") == "unknown" else _version("psycopg2"),
        "redis_server": redis_version,
        "rabbitmq_server": rabbitmq_version(amqp_url) if amqp_url else None,
        "postgresql": pg_version,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


# --------------------------------------------------------------------------- RSS sampling


def tree_rss(pid: int) -> tuple[int, list[tuple[int, int]]]:
    """(sum, [(pid, rss), ...]) of the process `pid` and all its descendants, in bytes."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, []
    parts = []
    for p in procs:
        try:
            parts.append((p.pid, p.memory_info().rss))
        except psutil.Error:
            continue
    return sum(r for _, r in parts), parts


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_peaks(pid: int) -> list[float]:
    """The peak RSS (the kernel's high-water mark, VmHWM) of the process `pid` and of each of its
    descendants, in MB: what each process held at its worst moment, which sampling may miss."""
    peaks = []
    for p in _tree(pid):
        try:
            with open(f"/proc/{p.pid}/status") as status:
                kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration, ValueError):
            continue
        peaks.append(round(kb / 1024, 1))
    return peaks


def reset_peaks(pid: int) -> None:
    """Start the high-water mark of `pid` and its descendants again from their RSS now (writing 5
    to /proc/PID/clear_refs), so that `tree_peaks` later tells the peak of what came after."""
    for p in _tree(pid):
        try:
            with open(f"/proc/{p.pid}/clear_refs", "w") as refs:
                refs.write("5")
        except OSError:
            continue


class RssSampler:
    """Samples the RSS of each worker's process tree every `interval` s in a thread.

    `progress` (optional) is called at each sample (in the sampler thread) and stored with it.
    `phase_at` (with `progress`): when progress first reaches it, the peak of each process so far
    is kept (`phase_peaks`: per worker, main process first) and the peaks start again, so that
    `tree_peaks` at the end gives the peak of what came after.
    """

    def __init__(
        self,
        pids: list[int],
        interval: float = SAMPLE_INTERVAL,
        keep: bool = False,
        progress: Callable[[], Any] | None = None,
        phase_at: int | None = None,
    ):
        self.pids = pids
        self.phase_at = phase_at
        self.phase_peaks: list[list[float]] | None = None
        self.interval = interval
        self.keep = keep
        self.progress = progress
        self.peaks = [0] * len(pids)
        self.samples: list[dict[str, Any]] = []
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = 0.0
        self.error: str | None = None

    def _sample(self) -> None:
        per_worker = []
        for i, pid in enumerate(self.pids):
            total, parts = tree_rss(pid)
            self.peaks[i] = max(self.peaks[i], total)
            per_worker.append((total, parts))
        self.count += 1
        if self.keep:
            sample = {
                "t": round(time.monotonic() - self._t0, 3),
                "rss": [t for t, _ in per_worker],
                "processes": [[[pid, rss] for pid, rss in parts] for _, parts in per_worker],
            }
            if self.progress is not None:
                try:
                    sample["progress"] = self.progress()
                except Exception as exc:  # noqa: BLE001 - a missed reading is not fatal
                    sample["progress"] = None
                    self.error = f"{type(exc).__name__}: {exc}"
                done = sample["progress"]
                if self.phase_at is not None and self.phase_peaks is None and (done or 0) >= self.phase_at:
                    self.phase_peaks = [tree_peaks(pid) for pid in self.pids]
                    for pid in self.pids:
                        reset_peaks(pid)
                    sample["phase"] = True
            self.samples.append(sample)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._sample()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def __enter__(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()  # one last reading at the end


# --------------------------------------------------------------------------- CPU accounting

SERVER_NAMES = {"postgres": "postgresql", "redis-server": "redis", "beam.smp": "rabbitmq"}


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


class CpuMeter:
    """CPU seconds spent during a run by the worker processes (main and pool children), the
    PostgreSQL, Redis and RabbitMQ server processes (server-wide: other clients count too), this process,
    and the machine's overall utilisation."""

    def __init__(self, workers: list[Any], own: Callable[[], dict[str, list[int]]] | None = None):
        self.workers = workers
        # the processes that serve this run alone, by kind (`own_postgresql`: the backends of the
        # run's database; `own_redis`: a redis-server started for it), asked at each snapshot
        self.own = own

    def _snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"main": {}, "children": {}, "servers": {}, "own": {}}
        for kind, pids in (self.own() if self.own else {}).items():
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    snap["own"][pid] = (kind, _cpu(psutil.Process(pid)))
        for w in self.workers:
            try:
                root = psutil.Process(w.pid)
                snap["main"][root.pid] = _cpu(root)
                for c in root.children(recursive=True):
                    snap["children"][c.pid] = _cpu(c)
            except psutil.Error:
                continue
        for p in psutil.process_iter(["name"]):
            kind = SERVER_NAMES.get(p.info["name"] or "")
            if kind:
                snap["servers"][p.pid] = (kind, _cpu(p))
        snap["self"] = _cpu(psutil.Process())
        t = psutil.cpu_times()
        snap["machine_busy"] = (
            t.user + t.system + t.nice + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)
        )
        snap["wall"] = time.monotonic()
        return snap

    def __enter__(self) -> CpuMeter:
        self.before = self._snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.after = self._snapshot()

    def result(self, items: int) -> dict[str, Any]:
        b, a = self.before, self.after

        def delta(group: str) -> float:
            return sum(v - b[group].get(pid, 0.0) for pid, v in a[group].items())

        servers: dict[str, float] = {}
        for pid, (kind, v) in a["servers"].items():
            servers[kind] = servers.get(kind, 0.0) + v - b["servers"].get(pid, (kind, 0.0))[1]
        own: dict[str, float] = {}
        for pid, (kind, v) in a["own"].items():  # a process gone before the end counts nothing
            own[kind] = own.get(kind, 0.0) + v - b["own"].get(pid, (kind, 0.0))[1]
        wall = a["wall"] - b["wall"]
        cpu_s = {
            "worker_main": delta("main"),
            "worker_children": delta("children"),
            "postgresql": servers.get("postgresql", 0.0),
            "redis": servers.get("redis", 0.0),
            "rabbitmq": servers.get("rabbitmq", 0.0),
            "bench_process": a["self"] - b["self"],
        }
        machine = a["machine_busy"] - b["machine_busy"]
        server_wide = sum(cpu_s.values())
        cpu_s.update(own)  # a share of the server-wide figures above: not added to the machine's rest
        return {
            "wall_s": round(wall, 3),
            "cpu_s": {k: round(v, 2) for k, v in cpu_s.items()},
            "cpu_ms_per_item": {k: round(1000 * v / items, 3) for k, v in cpu_s.items()},
            "machine_cpu_s": round(machine, 2),
            "machine_utilisation_pct": round(100 * machine / (wall * (os.cpu_count() or 1)), 1) if wall else None,
            "other_cpu_s": round(machine - server_wide, 2),
        }


# --------------------------------------------------------------------------- PostgreSQL waits


class PgWaitSampler:
    """Samples pg_stat_activity of the benchmark database every `interval` s (diagnostic,
    --pg-waits): how many backends are active and what the active ones wait for."""

    def __init__(self, database_url: str, interval: float = SAMPLE_INTERVAL):
        self.database_url = database_url
        self.interval = interval
        self.counts: dict[str, int] = {}
        self.samples = 0
        self.active = 0
        self.lock_waits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-waits", daemon=True)

    def _run(self) -> None:
        reader = StoreReader(self.database_url)
        try:
            while not self._stop.is_set():
                rows = reader.all(
                    "SELECT coalesce(wait_event_type, 'CPU/none'), coalesce(wait_event, '-'), count(*) "
                    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND state = 'active' GROUP BY 1, 2"
                )
                self.samples += 1
                for kind, event, n in rows:
                    self.active += n
                    self.counts[f"{kind}:{event}"] = self.counts.get(f"{kind}:{event}", 0) + n
                    if kind == "Lock":
                        self.lock_waits += n
                self._stop.wait(self.interval)
        finally:
            reader.close()

    def __enter__(self) -> PgWaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def result(self) -> dict[str, Any]:
        n = self.samples or 1
        return {
            "samples": self.samples,
            "mean_active_backends": round(self.active / n, 2),
            "mean_backends_waiting_on_locks": round(self.lock_waits / n, 2),
            "active_backend_samples_by_wait": dict(sorted(self.counts.items(), key=lambda kv: -kv[1])),
        }


# --------------------------------------------------------------------------- workers


def start_workers(count: int, concurrency: int, env: dict[str, str], log_dir: Path, tag: str) -> list[Any]:
    from tests.support.workers import WorkerProcess

    workers: list[Any] = []
    try:
        for i in range(count):
            w = WorkerProcess(
                "bench.app",
                env=env,
                concurrency=concurrency,
                pool="prefork",
                name=f"bench-{tag}-{i + 1}-{os.getpid()}@%h",
                log_dir=log_dir,
                loglevel="INFO",
            )
            workers.append(w)
            w.start(timeout=WORKER_START_TIMEOUT)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: list[Any]) -> list[str]:
    errors = []
    for w in workers:
        try:
            w.stop(timeout=30)
        except Exception as exc:  # noqa: BLE001 - stop the others all the same
            errors.append(f"{w!r}: {exc}")
    return errors


def worker_children(workers: list[Any]) -> list[list[int]]:
    out = []
    for w in workers:
        try:
            out.append([c.pid for c in psutil.Process(w.pid).children(recursive=True)])
        except psutil.Error:
            out.append([])
    return out


def check_alive(workers: list[Any]) -> None:
    """Raise at once when a worker's main process has exited (e.g. killed from outside)."""
    for w in workers:
        if w.proc is not None and w.proc.poll() is not None:
            raise BenchError(
                f"worker {w.node} exited with {w.proc.returncode} during the run "
                "(a negative code is the signal that ended it); log tail:\n" + w.log_tail(8)
            )


LOG_LEVEL_RE = re.compile(r"\[[^\]]*: (ERROR|WARNING|CRITICAL)/")


class WorkerRun:
    """The part of a benchmark that runs on its workers: `with WorkerRun(results) as run:` ...
    `run.workers.extend(start_workers(...))`, `run.closing.append(reader.close)`. An interruption
    or an error that ends the run is recorded in `results` (`run.failed` is then true); at the
    end, whatever happened, `closing` is called, the workers' log problems recorded and the
    workers stopped."""

    def __init__(self, results: dict[str, Any]):
        self.results = results
        self.workers: list[Any] = []
        self.closing: list[Callable[[], Any]] = []
        self.failed = False

    def __enter__(self) -> WorkerRun:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if kind is KeyboardInterrupt:
            self.results["interrupted"] = True
            log("interrupted: workers stopped, services cleaned up")
        elif exc is not None and isinstance(exc, Exception):  # e.g. a worker that would not start
            self.results["fatal"] = f"{type(exc).__name__}: {exc}"
            log(f"FAILED: {self.results['fatal']}")
        self.failed = self.failed or exc is not None
        for close in self.closing:
            with contextlib.suppress(Exception):
                close()
        self.results["worker_log_problems"] = log_problems(self.workers)
        errors = stop_workers(self.workers)
        if errors:
            self.results["worker_stop_errors"] = errors
        return kind is KeyboardInterrupt or (exc is not None and isinstance(exc, Exception))


def log_problems(workers: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for w in workers:
        for m in LOG_LEVEL_RE.finditer(w.log_text()):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# --------------------------------------------------------------------------- raw Celery


def wait_count(
    what: str,
    count: Callable[[], int],
    n: int,
    t0: float,
    workers: list[Any],
    *,
    timeout: float,
    stall: float,
    poll: float = RAW_POLL,
) -> float:
    """Poll `count()` (how many tasks or executions have ended) until it reaches n; the
    time.perf_counter() then. BenchError past `timeout` seconds from `t0`, or when the count has
    not moved for `stall` seconds; a dead worker ends the wait too (check_alive)."""
    last, last_change, last_check = -1, time.perf_counter(), time.perf_counter()
    while True:
        done = count()
        now = time.perf_counter()
        if done >= n:
            return now
        if done != last:
            last, last_change = done, now
        if now - t0 > timeout:
            raise BenchError(f"{what}: {done} of {n} done after {timeout:.0f} s")
        if now - last_change > stall:
            raise BenchError(f"{what}: stuck at {done} of {n} for {stall:.0f} s")
        if now - last_check > 0.5:
            check_alive(workers)
            last_check = now
        time.sleep(poll)


def run_raw(ctx: Context, n: int, workers: list[Any]) -> dict[str, Any]:
    from celery import group

    from bench.app import bench_noop

    key = f"bench:noop:{uuid.uuid4().hex}"
    timeout = ctx.run_timeout(n)
    with RssSampler([w.pid for w in workers]) as sampler, CpuMeter(workers) as cpu:
        t0 = time.perf_counter()
        group(bench_noop.s(key) for _ in range(n)).apply_async()
        t_sent = time.perf_counter()
        wait_count(
            "raw", lambda: int(ctx.redis.get(key) or 0), n, t0, workers, timeout=timeout, stall=ctx.stall_timeout
        )
        t_end = time.perf_counter()
    ctx.redis.delete(key)
    elapsed = t_end - t0
    return {
        "n": n,
        "elapsed_s": round(elapsed, 3),
        "send_s": round(t_sent - t0, 3),
        "tasks_per_s": round(n / elapsed, 1),
        "peak_rss_mb": [round(p / MB, 1) for p in sampler.peaks],
        "cpu": cpu.result(n),
    }


# --------------------------------------------------------------------------- noetl_celery


def truncate_store(database_url: str) -> None:
    from tests.support.services import pg_connect

    conn = pg_connect(database_url)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("TRUNCATE noetl_event, noetl_execution, noetl_variable, noetl_loop, noetl_join")
    finally:
        conn.close()


class StoreBytes:
    """Bytes a run adds to the store: the noetl_* tables with their indexes and TOAST
    (pg_total_relation_size, after truncation before the run), the WAL written meanwhile
    (pg_current_wal_lsn; server-wide, so other clients of the server count too: run it alone),
    and the rows' own size (pg_column_size of the run's event rows), each per unit. With
    `settle` seconds, the sizes are read again after that wait, as the sweeper's pass over the
    run's rows (46 s after they are written) leaves them."""

    TABLES = (
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND c.relname LIKE 'noetl%%'"
    )

    RELATIONS = (  # each table, index and TOAST table of the store, by name
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'i') AND c.relname LIKE '%%noetl%%' "
        "UNION ALL SELECT 'toast of ' || c.relname, pg_total_relation_size(c.reltoastrelid) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.reltoastrelid <> 0 AND c.relname LIKE 'noetl%%'"
    )

    def __init__(self, reader: StoreReader):
        self.reader = reader
        self.size0, self.lsn0 = self._sample()
        self.relations0 = dict(self.reader.all(self.RELATIONS))

    def _sample(self) -> tuple[int, str]:
        size = int(self.reader.one(self.TABLES)[0])
        lsn = self.reader.one("SELECT pg_current_wal_lsn()::text")[0]
        return size, lsn

    def _figures(self, n: int) -> dict[str, Any]:
        size, lsn = self._sample()
        wal = self.reader.one("SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)", (lsn, self.lsn0))[0]
        grown = {
            name: round((int(bytes_) - int(self.relations0.get(name, 0))) / n, 1)
            for name, bytes_ in self.reader.all(self.RELATIONS)
        }
        return {
            "store_bytes_per_unit": round((size - self.size0) / n, 1),
            "wal_bytes_per_unit": round(float(wal) / n, 1),
            "wal_lsns": [self.lsn0, lsn],  # for pg_waldump --stats
            "store_bytes_by_relation": {k: v for k, v in sorted(grown.items(), key=lambda kv: -kv[1]) if v},
        }

    def result(self, execution_id: int, n: int, settle: float = 0.0) -> dict[str, Any]:
        self.reader.all_or_none("CHECKPOINT")  # not needed for the sizes; keeps the WAL figure of each run apart
        own = self.reader.one(
            "SELECT coalesce(sum(pg_column_size(e.*)), 0) FROM noetl_event e WHERE execution_id = %s",
            (execution_id,),
        )[0]
        out: dict[str, Any] = {"row_bytes_per_unit": round(int(own) / n, 1), **self._figures(n)}
        if settle > 0:
            time.sleep(settle)
            out["after_settle"] = {"seconds": settle, **self._figures(n)}
        floor = self.floor(execution_id, n, int(own))  # last: its copies' WAL is in no figure of the run's
        if floor:
            out["floor"] = floor
        return out

    FLOORS = (  # name, what the copy's table has besides the event table's columns
        ("heap alone", ""),
        ("heap and the event key", ", PRIMARY KEY (execution_id, event_id)"),
    )

    def floor(self, execution_id: int, n: int, own: int) -> dict[str, Any]:
        """What the run's event rows cost at the least in PostgreSQL: copied, in the order they
        were written and in one statement (one WAL record per row and no commit per decision),
        into a table of the event table's columns with no index at all, then into one with only
        the key that makes recording an event idempotent. Store bytes (pg_total_relation_size)
        and WAL (server-wide: run alone) per unit, and their ratio to the rows' own size, which
        no design that keeps these rows in PostgreSQL gets under."""
        out: dict[str, Any] = {}
        table = "bench_floor"  # in the benchmark's own database, dropped after each copy
        for name, extra in self.FLOORS:
            dropped = self.reader.all_or_none(f"DROP TABLE IF EXISTS {table}")
            if dropped is None or self.reader.all_or_none(f"CREATE TABLE {table} (LIKE noetl_event{extra})") is None:
                return {}
            lsn0 = self.reader.one("SELECT pg_current_wal_lsn()::text")[0]
            self.reader.one(
                f"WITH copied AS (INSERT INTO {table} SELECT * FROM noetl_event WHERE execution_id = %s "
                "ORDER BY id RETURNING 1) SELECT count(*) FROM copied",
                (execution_id,),
            )
            wal = float(self.reader.one("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn0,))[0])
            size = float(self.reader.one(f"SELECT pg_total_relation_size('{table}')")[0])
            self.reader.all_or_none(f"DROP TABLE {table}")
            out[name] = {
                "store_bytes_per_unit": round(size / n, 1),
                "wal_bytes_per_unit": round(wal / n, 1),
                "store_ratio": round(size / own, 2) if own else None,
                "wal_ratio": round(wal / own, 2) if own else None,
            }
        return out


class StoreReader:
    """A plain psycopg2 connection (autocommit) for the benchmark's own reads."""

    def __init__(self, database_url: str):
        from tests.support.services import pg_connect

        self.conn = pg_connect(database_url)
        self.conn.autocommit = True
        with self.conn.cursor() as cur:  # the benchmark's own reads are bounded too
            cur.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")

    def one(self, sql: str, params: tuple = ()) -> Any:
        with self.conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchone()

    def all(self, sql: str, params: tuple = ()) -> list[Any]:
        with self.conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchall()

    def all_or_none(self, sql: str, params: tuple = ()) -> list[Any] | None:
        """For statements without a result (or optional figures): None instead of an exception
        when the statement fails or times out."""
        import psycopg2

        try:
            with self.conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall() if cur.description else []
        except psycopg2.Error as exc:
            log(f"   (query failed, figure left out: {type(exc).__name__}: {str(exc).strip()[:200]})")
            return None

    def loop_progress(self, execution_id: int) -> int | None:
        row = self.one("SELECT done FROM noetl_loop WHERE execution_id = %s AND step = %s", (execution_id, LOOP_STEP))
        return int(row[0]) if row else None

    def loop_marks(self, execution_id: int) -> dict[str, Any]:
        return dict(
            self.all(
                "SELECT event_type, created_at FROM noetl_event WHERE execution_id = %s AND step = %s "
                "AND event_type IN ('iterator.started', 'iterator.completed')",
                (execution_id, LOOP_STEP),
            )
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def wait_execution(ctx: Context, reader: StoreReader, execution_id: int, n: int, workers: list[Any]) -> str:
    timeout = ctx.run_timeout(n)
    t0 = time.monotonic()
    last, last_change = -1, t0
    while True:
        row = reader.one("SELECT status FROM noetl_execution WHERE execution_id = %s", (execution_id,))
        status = row[0] if row else None
        if status not in (None, "running"):
            return status
        now = time.monotonic()
        done = reader.loop_progress(execution_id) or 0
        if done != last:
            last, last_change = done, now
        if now - t0 > timeout:
            raise BenchError(
                f"noetl: execution {execution_id} still {status} after {timeout:.0f} s ({done} of {n} iterations)"
            )
        if now - last_change > ctx.stall_timeout:
            raise BenchError(
                f"noetl: execution {execution_id} stuck at {done} of {n} iterations for {ctx.stall_timeout:.0f} s"
            )
        check_alive(workers)
        time.sleep(NOETL_POLL)


def loop_metrics(reader: StoreReader, execution_id: int, n: int) -> dict[str, Any]:
    # Fresh statistics first: the table was truncated before the run, and with stale ones the
    # planner picks a nested loop for the self-join below (quadratic in N).
    reader.all_or_none("ANALYZE noetl_event")
    rows = dict(
        reader.all(
            "SELECT event_type, count(*) FROM noetl_event WHERE execution_id = %s AND step = %s "
            "GROUP BY event_type ORDER BY event_type",
            (execution_id, LOOP_STEP),
        )
    )
    all_rows = reader.one("SELECT count(*) FROM noetl_event WHERE execution_id = %s", (execution_id,))[0]
    marks = dict(
        reader.all(
            "SELECT event_type, created_at FROM noetl_event WHERE execution_id = %s AND step = %s "
            "AND event_type IN ('iterator.started', 'iterator.completed')",
            (execution_id, LOOP_STEP),
        )
    )
    stats = reader.one(
        "SELECT meta FROM noetl_event WHERE execution_id = %s AND step = %s AND event_type = 'iterator.completed'",
        (execution_id, LOOP_STEP),
    )
    if "iterator.started" not in marks or "iterator.completed" not in marks:
        raise BenchError(f"noetl: execution {execution_id} has no iterator.started/completed rows: {rows}")
    loop_s = (marks["iterator.completed"] - marks["iterator.started"]).total_seconds()
    # on_event latency: end of the tool call (started_at + duration_ms) -> the decision's row
    lat = reader.one(
        "SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY lat), max(lat), count(*) "
        "FROM (SELECT EXTRACT(EPOCH FROM (created_at - started_at)) * 1000 - duration_ms AS lat "
        "      FROM noetl_event WHERE execution_id = %s AND step = %s "
        "      AND event_type = 'iteration.completed') s",
        (execution_id, LOOP_STEP),
    )
    tool = reader.one(
        "SELECT percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY duration_ms) FROM noetl_event "
        "WHERE execution_id = %s AND step = %s AND event_type = 'iteration.completed'",
        (execution_id, LOOP_STEP),
    )
    # decision recorded (iteration.started row) -> the tool call starts on a worker: broker + pickup
    pickup_rows = reader.all_or_none(
        "SELECT percentile_cont(ARRAY[0.5, 0.95]) WITHIN GROUP (ORDER BY ms) FROM ("
        "  SELECT EXTRACT(EPOCH FROM (d.started_at - s.created_at)) * 1000 AS ms "
        "  FROM noetl_event s JOIN noetl_event d ON d.execution_id = s.execution_id AND d.run_id = s.run_id "
        "   AND d.iteration = s.iteration AND d.event_type = 'iteration.completed' "
        "  WHERE s.execution_id = %s AND s.step = %s AND s.event_type = 'iteration.started') x",
        (execution_id, LOOP_STEP),
    )
    pickup = pickup_rows[0] if pickup_rows else (None,)
    step_rows = sum(rows.values())
    p = lat[0] or [None, None, None]
    return {
        "loop_s": round(loop_s, 3),
        "iterations_per_s": round(n / loop_s, 1) if loop_s > 0 else None,
        "loop_stats": stats[0] if stats else None,
        "event_rows_loop_step": step_rows,
        "event_rows_per_iteration": round(step_rows / n, 4),
        "event_rows_by_type": rows,
        "event_rows_execution": all_rows,
        "on_event_ms": {"p50": _r(p[0]), "p95": _r(p[1]), "p99": _r(p[2]), "max": _r(lat[1]), "count": lat[2]},
        "tool_call_ms": {"p50": _r((tool[0] or [None])[0]), "p95": _r((tool[0] or [None, None])[1])},
        "decision_to_tool_start_ms": {"p50": _r((pickup[0] or [None])[0]), "p95": _r((pickup[0] or [None, None])[1])},
    }


def _r(x: Any, nd: int = 2) -> float | None:
    return None if x is None else round(float(x), nd)


def loop_playbook(batch: str) -> Path:
    """The loop playbook, or with `batch` other than 1 a copy whose loop has `spec.batch`."""
    if batch == "1":
        return PLAYBOOK
    import yaml

    doc = yaml.safe_load(PLAYBOOK.read_text())
    step = next(s for s in doc["workflow"] if s["step"] == LOOP_STEP)
    step["loop"]["spec"]["batch"] = batch if batch == "auto" else int(batch)
    path = Path(tempfile.mkdtemp(prefix="noetl_bench_")) / f"loop_noop_batch_{batch}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def submit_loop(ctx: Context, n: int, batch: str = "1") -> int:
    from noetl_celery import runner
    from noetl_celery.compiler import compile_playbook

    plan = compile_playbook(loop_playbook(batch), overrides={"n": n})
    return runner.submit(plan, ctx.settings)


def run_noetl(
    ctx: Context,
    n: int,
    workers: list[Any],
    *,
    keep_samples: bool = False,
    profile_tag: str | None = None,
    partial: dict[str, Any] | None = None,
    batch: str = "1",
) -> dict[str, Any]:
    """One measured loop (`batch`: its loop.spec.batch). `partial` (optional) receives the RSS
    sampler, also when the run fails."""
    truncate_store(ctx.database_url)
    reader = StoreReader(ctx.database_url)
    progress_reader = StoreReader(ctx.database_url) if keep_samples else None
    execution: dict[str, int] = {}

    def progress() -> int | None:
        eid = execution.get("id")
        return progress_reader.loop_progress(eid) if (progress_reader and eid) else None

    profiles: list[subprocess.Popen] = []
    store_bytes = StoreBytes(reader)
    waits = PgWaitSampler(ctx.database_url) if ctx.args.pg_waits else contextlib.nullcontext()
    try:
        with (
            waits,
            RssSampler(
                [w.pid for w in workers],
                keep=keep_samples,
                progress=progress if keep_samples else None,
                phase_at=1 if keep_samples else None,
            ) as sampler,
            CpuMeter(workers) as cpu,
        ):
            if partial is not None:
                partial["sampler"] = sampler
            t0 = time.perf_counter()
            execution["id"] = execution_id = submit_loop(ctx, n, batch)
            if profile_tag and ctx.py_spy_dir:
                profiles = start_profiles(ctx, workers, profile_tag, reader, execution_id)
            status = wait_execution(ctx, reader, execution_id, n, workers)
            wall = time.perf_counter() - t0
        finish_profiles(profiles)
        if status != "completed":
            err = reader.one("SELECT error FROM noetl_execution WHERE execution_id = %s", (execution_id,))
            raise BenchError(f"noetl: execution {execution_id} ended {status}: {err[0] if err else None}")
        metrics = loop_metrics(reader, execution_id, n)
        metrics["bytes"] = store_bytes.result(execution_id, n, ctx.args.settle)
    finally:
        for p in profiles:
            with contextlib.suppress(Exception):
                p.kill()
        reader.close()
        if progress_reader:
            progress_reader.close()
    result = {
        "n": n,
        "batch": batch,
        "execution_id": execution_id,
        "submit_to_end_s": round(wall, 3),
        **metrics,
        "peak_rss_mb": [round(p / MB, 1) for p in sampler.peaks],
        "cpu": cpu.result(n),
    }
    if sampler.phase_peaks is not None:
        result["peak_per_process_to_first_iteration_mb"] = sampler.phase_peaks
    if isinstance(waits, PgWaitSampler):
        result["pg_waits"] = waits.result()
    if keep_samples:
        result["samples"] = sampler.samples
        result["sampler_error"] = sampler.error
    return result


CURSOR_FRAME = "frame: {max_rows: 20}"  # as written in the cursor playbook
CURSOR_RETURNING = "RETURNING w.id"  # the claimed row's columns, as written in the cursor playbook


def cursor_playbook(frame: int, row_bytes: int = 0) -> str:
    """The cursor playbook's text with frames of up to `frame` rows (1 or less: no frame), each
    claimed row carrying a `payload` of `row_bytes` characters besides its id (0: none)."""
    text = CURSOR_PLAYBOOK.read_text()
    for written in (CURSOR_FRAME, CURSOR_RETURNING):
        if written not in text:
            raise BenchError(f"{CURSOR_PLAYBOOK} no longer says {written!r}")
    if row_bytes > 0:
        # random hex, drawn for each row (the subquery names w.id), so that the store cannot
        # compress it away
        chunks = -(-row_bytes // 32)
        payload = (
            "substr((SELECT string_agg(md5(random()::text || g::text || w.id::text), '')"
            f" FROM generate_series(1, {chunks}) g), 1, {row_bytes})"
        )
        text = text.replace(CURSOR_RETURNING, f"{CURSOR_RETURNING}, {payload} AS payload")
    if frame > 1:
        return text.replace(CURSOR_FRAME, f"frame: {{max_rows: {frame}}}")
    return text.replace(", " + CURSOR_FRAME, "")


def run_cursor(ctx: Context, n: int, workers: list[Any], frame: int = 20, row_bytes: int = 0) -> dict[str, Any]:
    """One measured cursor loop of n rows (frames of up to `frame` rows; 1: none; each row with a
    payload of `row_bytes` characters): rows/s, event rows per row and bytes per row."""
    from noetl_celery import runner
    from noetl_celery.compiler import compile_playbook

    truncate_store(ctx.database_url)
    reader = StoreReader(ctx.database_url)
    store_bytes = StoreBytes(reader)
    try:
        t0 = time.perf_counter()
        plan = compile_playbook(CURSOR_PLAYBOOK, text=cursor_playbook(frame, row_bytes), overrides={"n": n})
        execution_id = runner.submit(plan, ctx.settings)
        deadline = time.monotonic() + ctx.run_timeout(n)
        while True:
            row = reader.one("SELECT status, error FROM noetl_execution WHERE execution_id = %s", (execution_id,))
            if row and row[0] != "running":
                break
            if time.monotonic() > deadline:
                raise BenchError(f"cursor: execution {execution_id} still running after {ctx.run_timeout(n):.0f} s")
            check_alive(workers)
            time.sleep(NOETL_POLL)
        wall = time.perf_counter() - t0
        if row[0] != "completed":
            raise BenchError(f"cursor: execution {execution_id} ended {row[0]}: {row[1]}")
        marks = reader.loop_marks(execution_id)
        rows = dict(
            reader.all(
                "SELECT event_type, count(*) FROM noetl_event WHERE execution_id = %s AND step = %s "
                "GROUP BY event_type ORDER BY event_type",
                (execution_id, LOOP_STEP),
            )
        )
        stats = reader.one(
            "SELECT meta FROM noetl_event WHERE execution_id = %s AND step = %s AND event_type = 'iterator.completed'",
            (execution_id, LOOP_STEP),
        )
        bytes_per_row = store_bytes.result(execution_id, n, ctx.args.settle)
    finally:
        reader.close()
    loop_s = (marks["iterator.completed"] - marks["iterator.started"]).total_seconds()
    step_rows = sum(rows.values())
    return {
        "n": n,
        "execution_id": execution_id,
        "slots": CURSOR_SLOTS,
        "submit_to_end_s": round(wall, 3),
        "loop_s": round(loop_s, 3),
        "rows_per_s": round(n / loop_s, 1) if loop_s > 0 else None,
        "loop_stats": stats[0] if stats else None,
        "event_rows_loop_step": step_rows,
        "event_rows_per_row": round(step_rows / n, 4),
        "event_rows_by_type": rows,
        "bytes": bytes_per_row,
    }


def start_profiles(
    ctx: Context, workers: list[Any], tag: str, reader: StoreReader, execution_id: int
) -> list[subprocess.Popen]:
    """py-spy record on every pool child once the loop is running (raw collapsed stacks)."""
    deadline = time.monotonic() + 60
    while (reader.loop_progress(execution_id) or 0) < 2 * MAX_IN_FLIGHT and time.monotonic() < deadline:
        time.sleep(0.05)
    procs = []
    ctx.py_spy_dir.mkdir(parents=True, exist_ok=True)
    for wi, children in enumerate(worker_children(workers)):
        for ci, pid in enumerate(children):
            out = ctx.py_spy_dir / f"{tag}-w{wi + 1}-c{ci + 1}.txt"
            procs.append(
                subprocess.Popen(
                    ["py-spy", "record", "-p", str(pid), "-d", str(ctx.py_spy_seconds), "-f", "raw", "-o", str(out)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    return procs


def finish_profiles(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# --------------------------------------------------------------------------- orchestration


class Context:
    def __init__(
        self,
        args: argparse.Namespace,
        redis_url: str,
        database_url: str,
        settings: Any,
        redis: Any,
        log_dir: Path,
        broker_url: str | None = None,
    ):
        self.args = args
        self.redis_url = redis_url  # the raw tasks' counter (and the broker, with --broker redis)
        self.broker_url = broker_url or redis_url
        self.database_url = database_url
        self.settings = settings
        self.redis = redis
        self.log_dir = log_dir
        self.stall_timeout = args.stall_timeout
        self.py_spy_dir: Path | None = Path(args.py_spy_dir) if args.py_spy_dir else None
        self.py_spy_seconds = args.py_spy_seconds
        self.libpq_url = ""  # the store as a libpq URL: the cursor playbook's credential

    def run_timeout(self, n: int) -> float:
        return self.args.timeout_base + n / self.args.min_rate

    def worker_env(self, mode: str) -> dict[str, str]:
        env = {
            "NOETL_BROKER_URL": self.broker_url,
            COUNTER_URL_ENV: self.redis_url,
            "NOETL_DATABASE_URL": self.database_url,
            "NOETL_EVENT_DISPATCH": mode,
            CURSOR_CREDENTIAL_ENV: self.libpq_url,
        }
        if self.args.task_events is not None:
            env["NOETL_TASK_EVENTS"] = self.args.task_events
        env.update(engine_env(self.args))
        return env


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's settings a benchmark may set, for the workers and the process that submits."""
    p.add_argument(
        "--eager-window",
        type=float,
        default=None,
        help="NOETL_EAGER_WINDOW for the workers and this process, seconds (0: off; default: unset, "
        "the engine's default of 2 s)",
    )
    p.add_argument(
        "--pg-prepare",
        choices=("auto", "on", "off"),
        default=None,
        help="NOETL_PG_PREPARE for the workers and this process (default: unset, the engine's auto)",
    )


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables of `add_engine_options` that `args` sets."""
    env = {}
    if getattr(args, "eager_window", None) is not None:
        env["NOETL_EAGER_WINDOW"] = str(args.eager_window)
    if getattr(args, "pg_prepare", None) is not None:
        env["NOETL_PG_PREPARE"] = args.pg_prepare
    return env


def clear_queues(ctx: Context) -> None:
    """After a failed run: drop what is left in the broker (the claim key stays)."""
    keys = [k for k in ctx.redis.keys("*") if not k.startswith(b"noetl:test:")]
    if keys:
        ctx.redis.delete(*keys)
    if ctx.broker_url != ctx.redis_url:  # RabbitMQ: empty the queues of the benchmark's own vhost
        from kombu import Connection

        with Connection(ctx.broker_url, connect_timeout=5) as conn:
            for queue in (ctx.settings.task_queue, ctx.settings.event_queue):
                channel = conn.channel()
                with contextlib.suppress(Exception):
                    channel.queue_purge(queue)
                with contextlib.suppress(Exception):
                    channel.close()


def warm_up(ctx: Context, workers: list[Any]) -> None:
    run_raw(ctx, WARMUP_N, workers)
    run_noetl(ctx, WARMUP_N, workers)


def bench_set(ctx: Context, mode: str, count: int, results: dict[str, Any]) -> None:
    args = ctx.args
    tag = f"{mode}-{count}w"
    log(f"== mode={mode} workers={count} (-c {args.concurrency}, prefork): starting workers")
    workers = start_workers(count, args.concurrency, ctx.worker_env(mode), ctx.log_dir, tag)
    try:
        warm_up(ctx, workers)
        for n in args.sizes:
            run: dict[str, Any] = {
                "mode": mode,
                "workers": count,
                "concurrency": args.concurrency,
                "n": n,
                "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            }
            results["runs"].append(run)
            try:
                time.sleep(args.pause)
                log(f"   raw    N={n} ...")
                run["raw"] = run_raw(ctx, n, workers)
                log(f"   raw    N={n}: {run['raw']['tasks_per_s']} tasks/s")
                time.sleep(args.pause)
                log(f"   noetl  N={n} ...")
                profile = f"{mode}-{count}w-{n}" if n == max(args.sizes) else None
                run["noetl"] = run_noetl(ctx, n, workers, profile_tag=profile)
                run["ratio"] = round(run["noetl"]["iterations_per_s"] / run["raw"]["tasks_per_s"], 3)
                log(
                    f"   noetl  N={n}: {run['noetl']['iterations_per_s']} it/s, ratio {run['ratio']}, "
                    f"rows/it {run['noetl']['event_rows_per_iteration']}, on_event p50/p95 "
                    f"{run['noetl']['on_event_ms']['p50']}/{run['noetl']['on_event_ms']['p95']} ms"
                )
                for batch in args.batch:
                    time.sleep(args.pause)
                    log(f"   noetl  N={n} batch={batch} ...")
                    batched = run.setdefault("batched", {})[batch] = run_noetl(ctx, n, workers, batch=batch)
                    batched["ratio"] = round(batched["iterations_per_s"] / run["raw"]["tasks_per_s"], 3)
                    log(
                        f"   noetl  N={n} batch={batch}: {batched['iterations_per_s']} it/s, ratio "
                        f"{batched['ratio']}, rows/it {batched['event_rows_per_iteration']}"
                    )
            except Exception as exc:  # noqa: BLE001 - record it, keep the results so far
                run["error"] = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
                log(f"   FAILED: {run['error']}")
                clear_queues(ctx)
                break
            finally:
                run["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        if args.cursor_n:
            cursor_run: dict[str, Any] = {
                "mode": mode,
                "workers": count,
                "concurrency": args.concurrency,
                "cursor_n": args.cursor_n,
                "cursor_frame": args.cursor_frame,
                "cursor_row_bytes": args.cursor_row_bytes,
            }
            results.setdefault("cursor_runs", []).append(cursor_run)
            try:
                time.sleep(args.pause)
                log(f"   cursor N={args.cursor_n} ...")
                cursor_run["cursor"] = run_cursor(ctx, args.cursor_n, workers, args.cursor_frame, args.cursor_row_bytes)
                log(
                    f"   cursor N={args.cursor_n}: {cursor_run['cursor']['rows_per_s']} rows/s, rows/row "
                    f"{cursor_run['cursor']['event_rows_per_row']}"
                )
            except Exception as exc:  # noqa: BLE001 - record it, keep the results so far
                cursor_run["error"] = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
                log(f"   FAILED: {cursor_run['error']}")
                clear_queues(ctx)
    finally:
        problems = log_problems(workers)
        errors = stop_workers(workers)
        results.setdefault("worker_log_problems", {})[tag] = problems
        if errors:
            results.setdefault("worker_stop_errors", []).extend(errors)


def memory_figures(samples: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """RSS of the (single) worker when 10, 50 and 90 % of the iterations were done, the max, the
    last reading, and a coarse series for plotting."""
    samples = [s for s in samples if s["rss"][0] > 0]  # a worker that is gone reads 0
    out: dict[str, Any] = {"sample_count": len(samples), "rss_at_progress_mb": {}, "processes_at_progress_mb": {}}
    if not samples:
        return out
    for frac in (0.1, 0.5, 0.9):
        hit = next((s for s in samples if (s.get("progress") or 0) >= frac * n), None)
        label = f"{int(frac * 100)}%"
        out["rss_at_progress_mb"][label] = round(hit["rss"][0] / MB, 1) if hit else None
        if hit:
            out["processes_at_progress_mb"][label] = [round(r / MB, 1) for _, r in hit["processes"][0]]
    out["rss_max_mb"] = round(max(s["rss"][0] for s in samples) / MB, 1)
    out["rss_end_mb"] = round(samples[-1]["rss"][0] / MB, 1)
    out["last_progress"] = next((s.get("progress") for s in reversed(samples) if s.get("progress") is not None), None)
    step = max(1, len(samples) // 50)  # about 50 points of (seconds, iterations done, RSS MB)
    out["series"] = [[s["t"], s.get("progress"), round(s["rss"][0] / MB, 1)] for s in samples[::step]]
    return out


def bench_memory(ctx: Context, results: dict[str, Any]) -> None:
    args = ctx.args
    n, mode, batch = args.memory_n, args.memory_mode, args.memory_batch
    log(f"== memory: mode={mode} workers=1 (-c {args.concurrency}) N={n} batch={batch}")
    mem: dict[str, Any] = {"mode": mode, "workers": 1, "concurrency": args.concurrency, "n": n, "batch": batch}
    results["memory"] = mem
    workers = start_workers(1, args.concurrency, ctx.worker_env(mode), ctx.log_dir, f"mem-{mode}")
    try:
        warm_up(ctx, workers)
        time.sleep(args.pause)
        mem["rss_idle_mb"] = round(tree_rss(workers[0].pid)[0] / MB, 1)
        mem["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
        partial: dict[str, Any] = {}
        try:
            run = run_noetl(ctx, n, workers, keep_samples=True, partial=partial, batch=batch)
        except Exception as exc:  # noqa: BLE001 - record it, keep the results so far
            mem["error"] = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
            log(f"   FAILED: {mem['error']}")
            clear_queues(ctx)
            sampler = partial.get("sampler")
            if sampler is not None and sampler.samples:  # what was seen before the failure
                mem.update(memory_figures(sampler.samples, n))
            return
        mem["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        samples = run.pop("samples")
        mem.update(
            {
                k: run[k]
                for k in (
                    "execution_id",
                    "loop_s",
                    "iterations_per_s",
                    "submit_to_end_s",
                    "event_rows_per_iteration",
                    "on_event_ms",
                    "cpu",
                )
            }
        )
        mem.update(memory_figures(samples, n))
        peaks = tree_peaks(workers[0].pid)  # the worker's main process first
        first = run.get("peak_per_process_to_first_iteration_mb")
        if first:  # the start step (its own code builds the collection), its storing, the loop's start
            mem["peak_per_process_to_first_iteration_mb"] = first[0]
            mem["peak_per_process_after_first_iteration_mb"] = peaks
            if len(first[0]) == len(peaks):  # the same processes: the whole run's peak of each
                peaks = [max(a, b) for a, b in zip(first[0], peaks, strict=True)]
        mem["peak_per_process_mb"] = peaks
        log(
            f"   memory: {mem['iterations_per_s']} it/s, RSS at 10/50/90 %: "
            f"{list(mem['rss_at_progress_mb'].values())} MB, max {mem['rss_max_mb']} MB, "
            f"peak per process {mem['peak_per_process_mb']} MB"
            + (
                f" (to the first iteration {mem['peak_per_process_to_first_iteration_mb']}, after it "
                f"{mem['peak_per_process_after_first_iteration_mb']})"
                if first
                else ""
            )
        )
    finally:
        problems = log_problems(workers)
        errors = stop_workers(workers)
        results.setdefault("worker_log_problems", {})[f"mem-{mode}"] = problems
        if errors:
            results.setdefault("worker_stop_errors", []).extend(errors)


# --------------------------------------------------------------------------- output


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def machine_lines(m: dict[str, Any]) -> list[str]:
    return [
        f"machine: {m['nproc']} CPUs (nproc; {m['usable_cpus']} usable), {m['cpu_model']}, "
        f"{m['memory_total_mb']} MB RAM, Linux {m['kernel']}",
        f"software: {m['python']}, celery {m['celery']} (kombu {m['kombu']}), redis-py {m['redis_py']}, "
        f"SQLAlchemy {m['sqlalchemy']}, psycopg2 {m['psycopg2']}",
        f"servers: redis-server {m['redis_server']}, "
        + (f"RabbitMQ {m['rabbitmq_server']}, " if m.get("rabbitmq_server") else "")
        + f"PostgreSQL {m['postgresql']}; "
        f"load average at start {m['loadavg_at_start']}",
    ]


def table(results: dict[str, Any]) -> str:
    head = [
        "mode",
        "workers",
        "N",
        "raw tasks/s",
        "noetl it/s",
        "noetl/raw",
        "rows/it",
        "on_event p50 ms",
        "on_event p95 ms",
        "peak RSS MB/worker (raw; noetl)",
    ]
    lines = [head]

    def row(r: dict[str, Any], label: str, raw: dict[str, Any], noetl: dict[str, Any], ratio: Any, rss: str) -> None:
        lines.append(
            [
                r["mode"],
                str(r["workers"]),
                label,
                _fmt(raw.get("tasks_per_s"), ".1f"),
                _fmt(noetl.get("iterations_per_s"), ".1f"),
                _fmt(ratio, ".3f"),
                _fmt(noetl.get("event_rows_per_iteration"), ".4f"),
                _fmt((noetl.get("on_event_ms") or {}).get("p50"), ".2f"),
                _fmt((noetl.get("on_event_ms") or {}).get("p95"), ".2f"),
                rss,
            ]
        )

    def peaks(part: dict[str, Any]) -> str:
        return ",".join(str(x) for x in part.get("peak_rss_mb", [])) or "-"

    for r in results["runs"]:
        raw, noetl = r.get("raw") or {}, r.get("noetl") or {}
        error = f"  ERROR: {r['error']}" if r.get("error") else ""
        row(r, str(r["n"]), raw, noetl, r.get("ratio"), f"{peaks(raw)}; {peaks(noetl)}{error}")
        for batch, b in (r.get("batched") or {}).items():
            row(r, f"{r['n']} batch={batch}", raw, b, b.get("ratio"), peaks(b))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(row)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [
        "",
        "CPU ms per task (raw) / per iteration (noetl): worker pool children + worker main "
        "processes, PostgreSQL, Redis, RabbitMQ (server-wide), this process, machine busy %",
    ]
    for r in results["runs"]:
        parts = []
        for label in ("raw", "noetl"):
            c = (r.get(label) or {}).get("cpu")
            if c:
                m = c["cpu_ms_per_item"]
                parts.append(
                    f"{label}: {m['worker_children']:.2f} + {m['worker_main']:.2f}, pg {m['postgresql']:.2f}, "
                    f"redis {m['redis']:.2f}, rabbitmq {m.get('rabbitmq', 0.0):.2f}, bench {m['bench_process']:.2f}, "
                    f"busy {c['machine_utilisation_pct']}%"
                )
        out.append(f"  {r['mode']:6} {r['workers']}w N={r['n']:<6} " + " | ".join(parts))
    out += ["", "Bytes per unit (noetl): the rows' own size, store (tables + indexes), WAL [after --settle]"]
    units = [
        (r, label, part)
        for r in results["runs"]
        for label, part in [
            ("iteration", r.get("noetl")),
            *((f"batch={b}", x) for b, x in (r.get("batched") or {}).items()),
        ]
    ]
    units += [({**r, "n": r["cursor_n"]}, "cursor row", r.get("cursor")) for r in results.get("cursor_runs", [])]
    for r, label, part in units:
        b = (part or {}).get("bytes")
        if b:
            settled = b.get("after_settle")
            tail = (
                f" [after {settled['seconds']:g} s: store {settled['store_bytes_per_unit']}, "
                f"WAL {settled['wal_bytes_per_unit']}]"
                if settled
                else ""
            )
            out.append(
                f"  {r['mode']:6} {r['workers']}w N={r['n']:<6} {label}: rows {b['row_bytes_per_unit']}, "
                f"store {b['store_bytes_per_unit']}, WAL {b['wal_bytes_per_unit']}{tail}"
            )
            for name, floor in (b.get("floor") or {}).items():
                out.append(
                    f"      the same rows, {name}: store {floor['store_bytes_per_unit']} "
                    f"({floor['store_ratio']}x the rows), WAL {floor['wal_bytes_per_unit']} ({floor['wal_ratio']}x)"
                )
    mem = results.get("memory")
    if mem:
        out.append("")
        if mem.get("error"):
            out.append(f"memory run (N={mem['n']}, {mem['mode']}, 1 worker): ERROR: {mem['error']}")
            if mem.get("rss_at_progress_mb"):
                out.append(
                    f"  before the failure ({mem.get('last_progress')} iterations done): worker RSS at "
                    f"10/50/90 %: {list(mem['rss_at_progress_mb'].values())} MB, max {mem.get('rss_max_mb')} MB"
                )
        else:
            at = mem["rss_at_progress_mb"]
            out.append(
                f"memory run: N={mem['n']}, batch {mem.get('batch', '1')}, mode {mem['mode']}, "
                f"1 worker -c {mem['concurrency']}: "
                f"{mem['iterations_per_s']} it/s; worker RSS (process tree) idle {mem['rss_idle_mb']} MB, "
                f"at 10% {at['10%']} MB, 50% {at['50%']} MB, 90% {at['90%']} MB, "
                f"max {mem['rss_max_mb']} MB, end {mem['rss_end_mb']} MB"
            )
            out.append(
                f"  per process (main, children) at 10/50/90 %: "
                f"{[mem['processes_at_progress_mb'].get(k) for k in ('10%', '50%', '90%')]}"
            )
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.loops", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--broker",
        choices=("redis", "amqp"),
        default="redis",
        help="the broker of the raw tasks and the noetl loop (default redis; amqp: RabbitMQ, NOETL_TEST_AMQP_URL "
        "or the local server, in a vhost of its own)",
    )
    p.add_argument("--sizes", default="1000,10000", help="loop sizes N, comma-separated (default 1000,10000)")
    p.add_argument("--workers", default="1,2", help="worker instance counts (default 1,2)")
    p.add_argument("--concurrency", type=int, default=2, help="prefork processes per worker (default 2)")
    p.add_argument("--modes", default="inline,queue", help="NOETL_EVENT_DISPATCH values (default inline,queue)")
    p.add_argument("--memory-n", type=int, default=100000, help="iterations of the memory run (default 100000)")
    p.add_argument("--memory-mode", default="inline", choices=("inline", "queue"))
    p.add_argument("--memory-batch", default="1", help="loop.spec.batch of the memory run (default 1: none)")
    p.add_argument("--skip-memory", action="store_true", help="no memory run")
    p.add_argument(
        "--cursor-n",
        type=int,
        default=10000,
        help="rows of the cursor loop run after the sizes, per worker set (default 10000; 0: none)",
    )
    p.add_argument(
        "--cursor-frame",
        type=int,
        default=20,
        help="rows a claim of the cursor loop may take (frame.max_rows; default 20; 1: no frame)",
    )
    p.add_argument(
        "--cursor-row-bytes",
        type=int,
        default=0,
        help="characters of a random payload each claimed cursor row carries besides its id (default 0: none)",
    )
    p.add_argument("--json-out", help="also write the JSON results to this file")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database index to claim (default 14)")
    p.add_argument(
        "--task-events",
        choices=("0", "1"),
        default=None,
        help="NOETL_TASK_EVENTS for the workers (default: unset, i.e. the worker default, on)",
    )
    add_engine_options(p)
    p.add_argument("--pause", type=float, default=1.0, help="seconds of rest before each measured run")
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="after each noetl run, wait this many seconds and measure the store's bytes per unit again "
        "(e.g. 60: after the sweeper's pass over the run's rows; default 0: no second measure)",
    )
    p.add_argument(
        "--timeout-base",
        type=float,
        default=60.0,
        help="a run may take timeout-base + N / min-rate seconds (default 60)",
    )
    p.add_argument("--min-rate", type=float, default=20.0, help="see --timeout-base (default 20/s)")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="give up when no task/iteration finishes for this many seconds (default 60)",
    )
    p.add_argument(
        "--py-spy-dir",
        help="record py-spy raw profiles of the pool children during the "
        "largest noetl run of each set (perturbs the figures: use in a separate run)",
    )
    p.add_argument("--py-spy-seconds", type=int, default=10)
    p.add_argument(
        "--pg-waits",
        action="store_true",
        help="sample pg_stat_activity of the benchmark "
        "database during the noetl runs (what the active backends wait for)",
    )
    p.add_argument(
        "--batch",
        default="auto",
        help="loop.spec.batch values of extra noetl runs after each plain one, comma-separated "
        "(default auto; none: no batched run)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the worker logs (path printed)")
    args = p.parse_args(argv)
    args.batch = [x.strip() for x in args.batch.split(",") if x.strip() and x.strip() not in ("none", "1")]
    for b in args.batch:
        if b != "auto" and not b.isdigit():
            p.error(f"unknown batch {b!r}: a whole number or auto")
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    args.workers = [int(x) for x in args.workers.split(",") if x.strip()]
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    for m in args.modes:
        if m not in ("inline", "queue"):
            p.error(f"unknown mode {m!r}: inline or queue")
    return args


def report(
    text: str, results: dict[str, Any], json_out: str | None, log_dir: Path, *, failed: bool, keep_logs: bool
) -> int:
    """Print a benchmark's table and JSON (also to `json_out`), keep or remove the worker logs;
    the exit status (1 when a run failed)."""
    print()
    print(text)
    print()
    print(json.dumps(results, indent=2, default=str))
    if json_out:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=str) + "\n")
        log(f"JSON written to {out}")
    if failed or keep_logs:
        log(f"worker logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


def find_servers(broker: str) -> tuple[str, str, str]:
    """The Redis, PostgreSQL and RabbitMQ server URLs a benchmark uses (the test settings'
    variables, else the local servers); exits when one it needs does not answer. Also drops this
    process's own NOETL_* settings: it submits like `noetl-celery submit`, with only the settings
    the benchmark gives."""
    from tests.support import services as svc

    for k in [k for k in os.environ if k.startswith("NOETL_") and not k.startswith("NOETL_TEST_")]:
        del os.environ[k]
    redis_server = svc.redis_base_url(os.environ.get(svc.REDIS_URL_ENV) or svc.DEFAULT_REDIS_URL)
    pg_server = os.environ.get(svc.POSTGRES_URL_ENV) or svc.DEFAULT_POSTGRES_URL
    if not svc.redis_answers(redis_server, 5.0):
        raise SystemExit(f"no Redis at {redis_server} (set {svc.REDIS_URL_ENV})")
    if not svc.postgres_answers(pg_server, 5.0):
        raise SystemExit(f"no PostgreSQL at {pg_server} that may create databases (set {svc.POSTGRES_URL_ENV})")
    amqp_server = os.environ.get(svc.AMQP_URL_ENV) or svc.DEFAULT_AMQP_URL
    if broker == "amqp" and not svc.amqp_answers(amqp_server, 5.0):
        raise SystemExit(f"no RabbitMQ at {amqp_server} (set {svc.AMQP_URL_ENV})")
    return redis_server, pg_server, amqp_server


@dataclass
class Services:
    """What one benchmark run uses: its own Redis database, PostgreSQL database (and RabbitMQ
    virtual host), with this process's settings and Celery app pointed at them."""

    redis_url: str
    database_url: str
    broker_url: str
    db: Any  # tests.support.services.FreshDatabase
    machine: dict[str, Any]
    settings: Any  # noetl_celery.config.settings.Settings


def open_services(
    stack: contextlib.ExitStack,
    broker: str,
    redis_db: int,
    engine: Mapping[str, str] | None = None,
    redis_server: str | None = None,
) -> Services:
    """Claim Redis database `redis_db` (flushed), create a fresh PostgreSQL database (and, for
    amqp, a RabbitMQ virtual host), migrate it, print the machine and the services, and point this
    process's environment and Celery app at them; `stack` undoes all of it. `engine`: this
    process's engine settings (`engine_env`: what it submits carries the eager window's time
    limits, and its statements are prepared or not as the workers' are). `redis_server`: a Redis
    of the run's own instead of the shared one."""
    from tests.support import services as svc

    shared_redis, pg_server, amqp_server = find_servers(broker)
    redis_server = redis_server or shared_redis
    claim = svc.claim_redis_db(redis_server, dbs=[redis_db])  # FLUSHDB + claim key
    stack.callback(claim.release)  # FLUSHDB at the end
    db = svc.fresh_database(pg_server, prefix="noetl_bench")
    stack.callback(db.drop)
    redis_url, database_url = claim.url, db.url
    broker_url = redis_url
    if broker == "amqp":
        vhost = svc.create_amqp_vhost(amqp_server, prefix="noetl_bench_")
        stack.callback(vhost.delete)
        broker_url = vhost.url

    machine = machine_description(redis_url, db.libpq_url, broker_url if broker == "amqp" else None)
    print("\n".join(machine_lines(machine)), flush=True)
    print(f"services: Redis {redis_url} (claimed, flushed), PostgreSQL database {db.name} (fresh)", flush=True)
    if broker == "amqp":
        vhost_name = svc.amqp_vhost_of(broker_url)
        print(f"broker: RabbitMQ vhost {vhost_name} (fresh; Redis counts the raw tasks)", flush=True)

    from noetl_celery.store.db import migrate

    migrate(database_url)
    os.environ.update(NOETL_BROKER_URL=broker_url, NOETL_DATABASE_URL=database_url, **{COUNTER_URL_ENV: redis_url})
    os.environ.update(engine or {})
    from noetl_celery.app import app, configure
    from noetl_celery.config import settings as noetl_settings

    settings = noetl_settings.load()
    configure(app, settings)
    stack.callback(app.pool.force_close_all)
    return Services(redis_url, database_url, broker_url, db, machine, settings)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"benchmark": "bench.loops", "started_at": _now(), "runs": []}
    log_dir = Path(tempfile.mkdtemp(prefix="noetl-bench-"))
    failed = False
    from tests.support import services as svc

    with contextlib.ExitStack() as stack:
        services = open_services(stack, args.broker, args.redis_db, engine_env(args))
        redis_url, database_url, broker_url = services.redis_url, services.database_url, services.broker_url
        settings, db = services.settings, services.db
        results["machine"] = services.machine
        results["config"] = {
            "broker": args.broker,
            "sizes": args.sizes,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "pool": "prefork",
            "modes": args.modes,
            "max_in_flight": MAX_IN_FLIGHT,
            "playbook": str(PLAYBOOK.relative_to(REPO_ROOT)),
            "memory_n": None if args.skip_memory else args.memory_n,
            "memory_mode": args.memory_mode,
            "task_events": args.task_events or "worker default (on)",
            "eager_window": settings.eager_window or "off",
            "pg_prepare": settings.pg_prepare,
            "worker_loglevel": "INFO",
            "prefetch_multiplier": settings.prefetch_multiplier,
            "rss_sample_interval_s": SAMPLE_INTERVAL,
            "warmup_n": WARMUP_N,
        }
        client = svc.redis_client(redis_url)
        stack.callback(client.close)
        ctx = Context(args, redis_url, database_url, settings, client, log_dir, broker_url=broker_url)
        ctx.libpq_url = db.libpq_url
        try:
            for mode in args.modes:
                for count in args.workers:
                    bench_set(ctx, mode, count, results)
            if not args.skip_memory:
                bench_memory(ctx, results)
        except KeyboardInterrupt:
            results["interrupted"] = True
            failed = True
            log("interrupted: workers stopped, services cleaned up")
        except Exception as exc:  # noqa: BLE001 - e.g. a worker that would not start: report what we have
            results["fatal"] = f"{type(exc).__name__}: {exc}"
            failed = True
            log(f"FAILED: {results['fatal']}")
        results["finished_at"] = _now()
        results["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]

    failed = (
        failed
        or any(r.get("error") for r in results["runs"] + results.get("cursor_runs", []))
        or bool((results.get("memory") or {}).get("error"))
    )
    return report(table(results), results, args.json_out, log_dir, failed=failed, keep_logs=args.keep_logs)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


if __name__ == "__main__":
    sys.exit(main())
