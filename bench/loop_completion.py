"""The peak RSS of a collection loop's completion alone: `python -m bench.loop_completion`.

A benchmark, not a test. For each N of --sizes, a fresh PostgreSQL database gets the N - 1 end
rows of a finished loop (small results, as bench/playbooks/loop_noop.yaml's), then a process of
its own completes the loop as the decision does, in a decision transaction: `streamed` (the
engine's way: engine/decision/loops.py `LoopEnds`, blobs.put_streamed) and `whole` (every end
row read at once, the result list built, then blobs.put of the whole value). It prints one JSON
line per run: the RSS before, the peak (ru_maxrss) and the difference, the seconds, the stored
value's digest (the same for both ways). The database is dropped after.

    python -m bench.loop_completion --sizes 10000,100000,300000,1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432/"
RUN = "1.each"
ROWS_PER_INSERT = 20_000


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _server(sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres")
    conn.autocommit = True
    try:
        conn.cursor().execute(sql)
    finally:
        conn.close()


def prepare(url: str, n: int) -> None:
    from noetl_celery.store import db, repo

    db.migrate(url)
    with db.transaction(url) as conn:
        repo.create_execution(conn, execution_id=1, plan={"name": "p", "steps": {}}, workload={})
    for start in range(0, n - 1, ROWS_PER_INSERT):
        rows = [
            {
                "execution_id": 1,
                "event_id": f"{RUN}.{i}.done",
                "event_type": "iteration.completed",
                "run_id": RUN,
                "iteration": i,
                "status": "completed",
                "result": {"i": i, "ok": True},
            }
            for i in range(start, min(start + ROWS_PER_INSERT, n - 1))
        ]
        with db.transaction(url) as conn:
            repo.insert_events(conn, rows)


def complete(url: str, n: int, how: str) -> dict[str, object]:
    from noetl_celery.engine.decision import loops
    from noetl_celery.engine.decision.store_reads import StoreReads
    from noetl_celery.store import blobs
    from noetl_celery.store.db import decision_transaction

    with decision_transaction(url) as conn:  # the engine and its pool, before the measure
        conn.exec_driver_sql("SELECT 1")
    before = _rss_mb()
    started = time.monotonic()
    message = SimpleNamespace(iteration=n - 1, run_id=RUN)
    stats = {"total": n, "success": n, "failed": 0}
    data = {"i": n - 1, "ok": True}
    with decision_transaction(url) as conn:
        decider = SimpleNamespace(reads=StoreReads(lambda: conn, 1), decided=list)
        if how == "whole":
            final = loops._final_rows(decider, RUN)
            results = loops._ordered_results(final, message, n, ok=True, data=data)
            loops._first_failures(final, message, ok=True, current=None)
            kept = blobs.put(conn, 1, {"results": results, "stats": stats})
        else:
            ends = loops.LoopEnds(decider, message, n, ok=True, data=data, error=None)
            within = ends.within(1_000_000)
            if within is None:
                kept = blobs.put_streamed(conn, 1, {"results": None, "stats": stats}, "results", ends.results)
            else:
                kept = blobs.put(conn, 1, {"results": within, "stats": stats})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "n": n,
        "how": how,
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak, 1),
        "above_mb": round(peak - before, 1),
        "s": round(time.monotonic() - started, 1),
        "stored": kept.get("sha256", "inline")[:12] if isinstance(kept, dict) else "inline",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,100000,300000", help="loop sizes N, comma-separated")
    p.add_argument("--one", nargs=3, metavar=("URL", "N", "HOW"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        url, n, how = args.one
        print(json.dumps(complete(url, int(n), how)), flush=True)
        return
    for n in (int(s) for s in args.sizes.split(",")):
        name = f"noetl_completion_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        _server(f"CREATE DATABASE {name}")
        try:
            prepare(SERVER + name, n)
            for how in ("streamed", "whole"):  # each in a process of its own: its own peak
                subprocess.run([sys.executable, "-m", "bench.loop_completion", "--one", SERVER + name, str(n), how])
        finally:
            from noetl_celery.store.db import dispose_engine

            dispose_engine(SERVER + name)
            _server(f"DROP DATABASE IF EXISTS {name}")


if __name__ == "__main__":
    main()
