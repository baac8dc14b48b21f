"""Latency of noetl_celery against raw Celery, on Redis or RabbitMQ + PostgreSQL with real workers.

    python -m bench.latency [--broker redis|amqp] [--runs 50] [--warmup 5] [--workers 1]
                            [--concurrency 2] [--mode inline|queue] [--eager-window S]
                            [--json-out FILE]

Against the same worker processes (`celery -A bench.app worker`, started and stopped with
bench.loops' helpers), one execution or one raw task at a time, noetl and raw interleaved (the
order alternates every round), after --warmup unreported rounds:

1. chain: bench/playbooks/three_steps.yaml (three python steps `result = x`, one after another)
   submitted as `noetl-celery submit` does (`runner.submit`), against a raw Celery chain of
   three no-op `noetl.bench_chain_step` tasks (`chain(...).apply_async()`).
   - end (recorded): from just before the submit / apply_async to the time the end was written
     by the worker: the `created_at` of the `execution.completed` row (taken just before the
     decision's commit), or the time the last raw task wrote to its Redis key.
   - end (seen): from the same start to this process seeing that end (polled every --poll s,
     the same for both).
2. retry: bench/playbooks/retry_once.yaml (one python step whose first attempt raises, retried at
   once by its policy: `do: retry, attempts: 2, backoff: fixed, delay: 0`), against a raw task
   `noetl.bench_retry_once` whose first attempt calls `self.retry(countdown=0)`.
   - gap: from the end of the failed attempt's work to the start of the retried attempt's work
     (noetl: the `action.failed` row's started_at + duration_ms to the `action.completed` row's
     started_at; raw: times taken in the task, carried in the retry's kwargs).
   - cycle: from the start of the failed attempt to the end of the retried one.
   - end (recorded): submit / apply_async to the end written by the worker, as for the chain.

Ratios are noetl/raw of the same percentile. Times on both sides come from the same machine
clock (time.time() in the workers and here; the store's timestamps are the worker's utcnow()).

Services as bench.loops: NOETL_TEST_REDIS_URL / NOETL_TEST_AMQP_URL / NOETL_TEST_POSTGRES_URL if
set, else the local servers; Redis database --redis-db (default 14) claimed and flushed; a fresh
PostgreSQL database created, migrated and dropped; with amqp a vhost of its own. Every wait is
bounded; the workers are stopped in `finally`. A benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.loops import (
    COUNTER_URL_ENV,
    REPO_ROOT,
    BenchError,
    StoreReader,
    WorkerRun,
    _now,
    add_engine_options,
    check_alive,
    engine_env,
    log,
    open_services,
    report,
    start_workers,
)

CHAIN_PLAYBOOK = REPO_ROOT / "bench" / "playbooks" / "three_steps.yaml"
RETRY_PLAYBOOK = REPO_ROOT / "bench" / "playbooks" / "retry_once.yaml"
CHAIN_STEPS = ("start", "second", "third")
RETRY_STEP = "start"
PERCENTILES = (50, 95)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (PostgreSQL's percentile_cont)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {f"p{q}": _r(percentile(values, q)) for q in PERCENTILES}
    out.update(
        {
            "min": _r(min(values)) if values else None,
            "max": _r(max(values)) if values else None,
            "count": len(values),
        }
    )
    return out


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


# --------------------------------------------------------------------------- context


class Bench:
    def __init__(self, args: argparse.Namespace, redis: Any, database_url: str, settings: Any, workers: list[Any]):
        self.args = args
        self.redis = redis
        self.database_url = database_url
        self.settings = settings
        self.workers = workers
        self.reader = StoreReader(database_url)
        from noetl_celery.compiler import compile_playbook

        self.chain_plan = compile_playbook(CHAIN_PLAYBOOK)
        self.retry_plan = compile_playbook(RETRY_PLAYBOOK)

    def close(self) -> None:
        self.reader.close()

    def wait_for(self, what: str, probe: Callable[[], Any]) -> tuple[Any, float]:
        """Poll `probe` every --poll s until it returns something; (that, time.time() when seen)."""
        deadline = time.monotonic() + self.args.run_timeout
        last_check = time.monotonic()
        while True:
            got = probe()
            if got is not None:
                return got, time.time()
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"{what}: no end after {self.args.run_timeout:.0f} s")
            if now - last_check > 0.5:
                check_alive(self.workers)
                last_check = now
            time.sleep(self.args.poll)

    # ------------------------------------------------------------------ noetl
    def _noetl_end(self, execution_id: int) -> Any:
        row = self.reader.one(
            "SELECT event_type, created_at FROM noetl_event WHERE execution_id = %s "
            "AND event_type IN ('execution.completed', 'execution.failed', 'execution.cancelled')",
            (execution_id,),
        )
        return row

    def _submit_and_wait(self, plan: Any, what: str) -> tuple[int, float, float, float]:
        """(execution id, t0, recorded end, seen end), all time.time(); the time `submit` took
        is kept in `self.submit_ms`."""
        from noetl_celery import runner

        t0 = time.time()
        execution_id = runner.submit(plan, self.settings)
        self.submit_ms = (time.time() - t0) * 1000
        (event_type, created_at), seen = self.wait_for(
            f"noetl {what} execution {execution_id}", lambda: self._noetl_end(execution_id)
        )
        if event_type != "execution.completed":
            err = self.reader.one("SELECT error FROM noetl_execution WHERE execution_id = %s", (execution_id,))
            raise BenchError(f"noetl {what}: execution {execution_id} ended {event_type}: {err[0] if err else None}")
        return execution_id, t0, created_at.timestamp(), seen

    def _tool_times(self, execution_id: int) -> list[tuple[str, str, int | None, float, float]]:
        """(step, event_type, attempt, tool start, tool end) of every attempt's outcome row, in order."""
        rows = self.reader.all(
            "SELECT step, event_type, attempt, started_at, duration_ms FROM noetl_event WHERE execution_id = %s "
            "AND started_at IS NOT NULL AND duration_ms IS NOT NULL "
            "AND event_type IN ('action.completed', 'action.failed') ORDER BY started_at",
            (execution_id,),
        )
        return [(s, e, a, st.timestamp(), st.timestamp() + d / 1000) for s, e, a, st, d in rows]

    def noetl_chain(self) -> dict[str, Any]:
        execution_id, t0, end, seen = self._submit_and_wait(self.chain_plan, "chain")
        tools = self._tool_times(execution_id)
        steps = [t[0] for t in tools]
        out: dict[str, Any] = {
            "execution_id": execution_id,
            "recorded_ms": (end - t0) * 1000,
            "seen_ms": (seen - t0) * 1000,
        }
        if steps == list(CHAIN_STEPS):  # breakdown: submit -> first tool, hops, last tool -> end row
            out["submit_to_first_tool_ms"] = (tools[0][3] - t0) * 1000
            out["submit_call_ms"] = self.submit_ms  # of it: the submit call (the store, the publish)
            out["hop_ms"] = [(b[3] - a[4]) * 1000 for a, b in zip(tools, tools[1:], strict=False)]
            out["last_tool_to_end_ms"] = (end - tools[-1][4]) * 1000
            out["rows"] = self.reader.one("SELECT count(*) FROM noetl_event WHERE execution_id = %s", (execution_id,))[
                0
            ]
        else:
            out["breakdown_error"] = f"unexpected attempt rows: {tools}"
        return out

    def noetl_retry(self) -> dict[str, Any]:
        execution_id, t0, end, seen = self._submit_and_wait(self.retry_plan, "retry")
        tools = [t for t in self._tool_times(execution_id) if t[0] == RETRY_STEP]
        kinds = [(t[1], t[2]) for t in tools]
        if kinds != [("action.failed", 1), ("action.completed", 2)]:
            raise BenchError(f"noetl retry: execution {execution_id}: unexpected attempts {kinds}")
        first, second = tools
        return {
            "execution_id": execution_id,
            "gap_ms": (second[3] - first[4]) * 1000,
            "cycle_ms": (second[4] - first[3]) * 1000,
            "recorded_ms": (end - t0) * 1000,
            "seen_ms": (seen - t0) * 1000,
        }

    # ------------------------------------------------------------------ raw Celery
    def raw_chain(self) -> dict[str, Any]:
        from celery import chain

        from bench.app import bench_chain_step

        key = f"bench:latency:chain:{uuid.uuid4().hex}"
        t0 = time.time()
        chain(bench_chain_step.s(1), bench_chain_step.s(), bench_chain_step.s(key=key)).apply_async()
        value, seen = self.wait_for("raw chain", lambda: self.redis.get(key))
        self.redis.delete(key)
        end = float(value)
        return {"recorded_ms": (end - t0) * 1000, "seen_ms": (seen - t0) * 1000}

    def raw_retry(self) -> dict[str, Any]:
        from bench.app import bench_retry_once

        key = f"bench:latency:retry:{uuid.uuid4().hex}"
        t0 = time.time()
        bench_retry_once.apply_async(kwargs={"key": key})
        value, seen = self.wait_for("raw retry", lambda: self.redis.hgetall(key) or None)
        self.redis.delete(key)
        t = {k.decode(): float(v) for k, v in value.items()}
        return {
            "gap_ms": (t["start2"] - t["end1"]) * 1000,
            "cycle_ms": (t["end2"] - t["start1"]) * 1000,
            "recorded_ms": (t["end2"] - t0) * 1000,
            "seen_ms": (seen - t0) * 1000,
        }


# --------------------------------------------------------------------------- runs

CONFIG_ARGS = (
    "broker",
    "runs",
    "warmup",
    "cases",
    "workers",
    "concurrency",
    "mode",
    "poll",
    "pause",
    "eager_window",
    "pg_prepare",
)
CASES: dict[str, tuple[str, str]] = {"chain": ("noetl_chain", "raw_chain"), "retry": ("noetl_retry", "raw_retry")}
CASE_METRICS = {
    "chain": ("recorded_ms", "seen_ms"),
    "retry": ("gap_ms", "cycle_ms", "recorded_ms", "seen_ms"),
}


def run_case(bench: Bench, case: str, runs: int, warmup: int, pause: float) -> dict[str, Any]:
    noetl_fn, raw_fn = (getattr(bench, name) for name in CASES[case])
    samples: dict[str, list[dict[str, Any]]] = {"noetl": [], "raw": []}
    result: dict[str, Any] = {"runs": runs, "warmup": warmup, "loadavg_before": _load()}
    for i in range(warmup + runs):
        order = [("raw", raw_fn), ("noetl", noetl_fn)] if i % 2 == 0 else [("noetl", noetl_fn), ("raw", raw_fn)]
        for side, fn in order:
            time.sleep(pause)
            sample = fn()
            if i >= warmup:
                samples[side].append(sample)
    result["loadavg_after"] = _load()
    for side in ("noetl", "raw"):
        result[side] = {m: summary([s[m] for s in samples[side]]) for m in CASE_METRICS[case]}
    result["ratio"] = {
        m: {f"p{q}": _ratio(result["noetl"][m][f"p{q}"], result["raw"][m][f"p{q}"]) for q in PERCENTILES}
        for m in CASE_METRICS[case]
    }
    if case == "chain":
        n = samples["noetl"]
        ok = [s for s in n if "hop_ms" in s]
        result["noetl_breakdown"] = {
            "submit_to_first_tool_ms": summary([s["submit_to_first_tool_ms"] for s in ok]),
            "submit_call_ms": summary([s["submit_call_ms"] for s in ok]),
            "hop_ms": summary([h for s in ok for h in s["hop_ms"]]),
            "last_tool_to_end_ms": summary([s["last_tool_to_end_ms"] for s in ok]),
            "event_rows": sorted({s["rows"] for s in ok}),
            "breakdown_errors": [s["breakdown_error"] for s in n if "breakdown_error" in s][:3],
        }
    result["samples_ms"] = {
        side: {m: [round(s[m], 2) for s in samples[side]] for m in CASE_METRICS[case]} for side in samples
    }
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------- output

METRIC_LABELS = {
    "recorded_ms": "submit -> end (recorded by the worker)",
    "seen_ms": "submit -> end (seen by polling)",
    "gap_ms": "failed attempt end -> retried attempt start",
    "cycle_ms": "failed attempt start -> retried attempt end",
}


def table(results: dict[str, Any]) -> str:
    head = ["case", "measure", "noetl p50", "noetl p95", "raw p50", "raw p95", "noetl/raw p50", "noetl/raw p95"]
    lines = [head]
    for case, r in results.get("cases", {}).items():
        if r.get("error"):
            lines.append([case, f"ERROR: {r['error']}", "", "", "", "", "", ""])
            continue
        for m in CASE_METRICS[case]:
            n, w, q = r["noetl"][m], r["raw"][m], r["ratio"][m]
            lines.append(
                [
                    case,
                    METRIC_LABELS[m],
                    f"{n['p50']:.1f} ms",
                    f"{n['p95']:.1f} ms",
                    f"{w['p50']:.1f} ms",
                    f"{w['p95']:.1f} ms",
                    _fmt(q["p50"]),
                    _fmt(q["p95"]),
                ]
            )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(row)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    bd = (results.get("cases", {}).get("chain") or {}).get("noetl_breakdown")
    if bd:
        out += [
            "",
            "noetl chain, p50 / p95 ms: submit -> first tool start "
            f"{bd['submit_to_first_tool_ms']['p50']} / {bd['submit_to_first_tool_ms']['p95']} "
            f"(of it the submit call {bd['submit_call_ms']['p50']} / {bd['submit_call_ms']['p95']}), "
            f"tool end -> next tool start {bd['hop_ms']['p50']} / {bd['hop_ms']['p95']}, "
            f"last tool end -> execution.completed row {bd['last_tool_to_end_ms']['p50']} / "
            f"{bd['last_tool_to_end_ms']['p95']}; event rows per execution {bd['event_rows']}",
        ]
    return "\n".join(out)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis", help="broker of both sides (default redis)")
    p.add_argument("--runs", type=int, default=50, help="measured runs per side and case (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="unreported rounds before each case (default 5)")
    p.add_argument("--cases", default="chain,retry", help="chain, retry or both (default chain,retry)")
    p.add_argument("--workers", type=int, default=1, help="worker instances (default 1)")
    p.add_argument("--concurrency", type=int, default=2, help="prefork processes per worker (default 2)")
    p.add_argument("--mode", choices=("inline", "queue"), default="inline", help="NOETL_EVENT_DISPATCH (inline)")
    p.add_argument("--poll", type=float, default=0.002, help="seconds between reads of an end (default 0.002)")
    p.add_argument("--pause", type=float, default=0.05, help="seconds of rest before each run (default 0.05)")
    p.add_argument("--run-timeout", type=float, default=30.0, help="give up on a run after this many s (30)")
    p.add_argument("--redis-db", type=int, default=14, help="Redis database index to claim (default 14)")
    add_engine_options(p)
    p.add_argument("--json-out", help="also write the JSON results to this file")
    p.add_argument("--keep-logs", action="store_true", help="keep the worker logs (path printed)")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in args.cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}: chain or retry")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {"benchmark": "bench.latency", "started_at": _now(), "cases": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="noetl-latency-"))
    from tests.support import services as svc

    with contextlib.ExitStack() as stack:
        services = open_services(stack, args.broker, args.redis_db, engine_env(args))
        redis_url, database_url, broker_url = services.redis_url, services.database_url, services.broker_url
        settings = services.settings
        results["machine"] = services.machine
        results["config"] = {k: getattr(args, k) for k in CONFIG_ARGS}
        results["config"].update(
            pool="prefork",
            prefetch_multiplier=settings.prefetch_multiplier,
            playbooks=[str(p.relative_to(REPO_ROOT)) for p in (CHAIN_PLAYBOOK, RETRY_PLAYBOOK)],
        )
        client = svc.redis_client(redis_url)
        stack.callback(client.close)
        env = {
            "NOETL_BROKER_URL": broker_url,
            COUNTER_URL_ENV: redis_url,
            "NOETL_DATABASE_URL": database_url,
            "NOETL_EVENT_DISPATCH": args.mode,
        }
        env.update(engine_env(args))
        with WorkerRun(results) as run:
            log(f"== {args.workers} worker(s) -c {args.concurrency} prefork, mode {args.mode}, broker {args.broker}")
            run.workers.extend(start_workers(args.workers, args.concurrency, env, log_dir, f"lat-{args.mode}"))
            bench = Bench(args, client, database_url, settings, run.workers)
            run.closing.append(bench.close)
            for case in args.cases:
                log(f"   {case}: {args.warmup} warm-up + {args.runs} measured rounds (noetl and raw interleaved)")
                try:
                    results["cases"][case] = r = run_case(bench, case, args.runs, args.warmup, args.pause)
                    m = CASE_METRICS[case][0]
                    log(
                        f"   {case}: {m} p50 noetl {r['noetl'][m]['p50']} ms, raw {r['raw'][m]['p50']} ms, "
                        f"ratio p50 {r['ratio'][m]['p50']}, p95 {r['ratio'][m]['p95']}"
                    )
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next case
                    err = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
                    results["cases"][case] = {"error": err}
                    run.failed = True
                    log(f"   FAILED: {err}")
        results["finished_at"] = _now()
        results["loadavg_at_end"] = _load()

    return report(table(results), results, args.json_out, log_dir, failed=run.failed, keep_logs=args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
