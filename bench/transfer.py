"""Throughput and memory of the transfer tool: a copy of --rows rows from the local PostgreSQL
to the local MariaDB/MySQL, then back, each in chunks of --chunk-size.

    python -m bench.transfer [--rows 1000000] [--chunk-size 5000] [--mode append|upsert]
                             [--directions pg-mysql,mysql-pg]

The tool is called in this process (`tools.base.run_tool`, as a worker's pool process calls it),
so the figures are the copy's own: rows/s from the tool's start to its end, and the peak RSS of
this process (ru_maxrss) against its RSS just before the first copy, which is what holding a
chunk (not the table) costs. The source table (id, name, amount numeric, created timestamptz,
note) is made with generate_series in a fresh PostgreSQL database; the MariaDB target in a fresh
database of its own; both are dropped at the end. Services: NOETL_TEST_POSTGRES_URL and
NOETL_TEST_MYSQL_URL if set, else the local servers. A benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import psycopg2

from noetl_celery.tools.base import ToolCall, run_tool
from tests.support import services as svc

SOURCE_DDL = (
    "CREATE TABLE bench_src (id bigint PRIMARY KEY, name text, amount numeric(12,2), created timestamptz, note text)"
)
SOURCE_FILL = (
    "INSERT INTO bench_src SELECT i, 'name ' || i, i * 0.25, now() - i * interval '1 second', "
    "md5(i::text) FROM generate_series(1, %s) i"
)
TARGET_DDL = (
    "CREATE TABLE bench_dst (id BIGINT PRIMARY KEY, name VARCHAR(64), amount DECIMAL(12,2), "
    "created DATETIME(6), note VARCHAR(64))"
)
BACK_DDL = (
    "CREATE TABLE bench_back (id bigint PRIMARY KEY, name text, amount numeric(12,2), created timestamp, note text)"
)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def copy(config: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    outcome = run_tool(ToolCall(kind="transfer", config=config))
    seconds = time.perf_counter() - started
    if outcome.status != "ok":
        raise SystemExit(f"transfer failed: {outcome.error}")
    rows = outcome.data["rows_transferred"]
    return {
        "rows": rows,
        "seconds": round(seconds, 2),
        "rows_per_s": round(rows / seconds),
        "peak_rss_mib": round(rss_mib(), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chunk-size", type=int, default=5000)
    parser.add_argument("--mode", default="append", choices=["append", "upsert"])
    parser.add_argument("--directions", default="pg-mysql,mysql-pg")
    args = parser.parse_args()
    pg_server = os.environ.get(svc.POSTGRES_URL_ENV, svc.DEFAULT_POSTGRES_URL)
    fresh_mysql = svc.fresh_mysql_database(svc.mysql_server_url(), prefix="bench_transfer_")
    with svc.fresh_database(pg_server, prefix="bench_transfer") as pg, fresh_mysql as mysql_url:
        dsn = pg.dsn
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute(SOURCE_DDL)
            cur.execute(SOURCE_FILL, [args.rows])
            cur.execute(BACK_DDL)
        svc.mysql_query(mysql_url, TARGET_DDL)
        report: dict[str, Any] = {"rows": args.rows, "chunk_size": args.chunk_size, "mode": args.mode}
        report["rss_before_mib"] = round(rss_mib(), 1)
        common = {"chunk_size": args.chunk_size, "mode": args.mode, "key": "id"}
        if "pg-mysql" in args.directions:
            report["postgres_to_mysql"] = copy(
                {
                    "source": {"type": "postgres", "auth": {"dsn": dsn}, "query": "SELECT * FROM bench_src"},
                    "target": {"type": "mysql", "auth": {"url": mysql_url}, "table": "bench_dst"},
                    **common,
                }
            )
        if "mysql-pg" in args.directions:
            report["mysql_to_postgres"] = copy(
                {
                    "source": {"type": "mysql", "auth": {"url": mysql_url}, "query": "SELECT * FROM bench_dst"},
                    "target": {"type": "postgres", "auth": {"dsn": dsn}, "table": "bench_back"},
                    **common,
                }
            )
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
