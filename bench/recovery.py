"""How fast the sweeper works off overdue leases, with a synthetic backlog on PostgreSQL.

    python -m bench.recovery [--decisions 50000] [--executions 50] [--done 1.0] [--rounds 1] [--batch 500]
                             [--json-out FILE]

A fresh PostgreSQL database (NOETL_TEST_POSTGRES_URL's server, else 127.0.0.1:5432), migrated,
then dropped. --executions running executions of bench/playbooks/three_steps.yaml are started
(their first decision through `orchestrator.handle_event`, as a worker makes it); then
--decisions decision rows are written as decisions write them (`events.insert_events`, a lease
each), spread over those executions, each having dispatched one attempt of the first step
(the start's own dispatch, with its own iteration number), and --done of them get their
attempt's outcome row. Every lease is then made overdue (`leases.expire`), and the sweeper is
timed until none is left overdue: `sweeper.sweep` again and again, as the sweeper thread calls it
(publishing is not part of it: `committed` is None).

Reported: leases/s of the sweeps (the sweeper's throughput: settled leases deleted, missing
attempts given a re-publish row and their lease moved on), per batch transaction; the WAL the
sweeps wrote per lease and the WAL and table bytes per lease written (`pg_current_wal_lsn`,
`pg_total_relation_size`). A benchmark, not a test: it never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.recovery import sweeper
from noetl_celery.runner import create_execution
from noetl_celery.store import leases
from noetl_celery.store.db import dispose_engine, migrate, transaction
from noetl_celery.store.events import LEASE_KEY, insert_events
from noetl_celery.store.kernel import utcnow

PLAYBOOK = Path(__file__).parent / "playbooks" / "three_steps.yaml"
WRITE_CHUNK = 500  # decision rows per insert transaction


def server_url() -> str:
    return os.environ.get("NOETL_TEST_POSTGRES_URL") or "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


@contextlib.contextmanager
def scratch_database(prefix: str) -> Iterator[tuple[str, str]]:
    """A fresh PostgreSQL database of its own for one benchmark run: (its name, its URL), dropped
    at the end whatever happened."""
    server = make_url(server_url())
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        yield name, url
    finally:
        dispose_engine(url)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def wal_lsn(url: str) -> int:
    with transaction(url) as conn:
        return int(conn.execute(text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar() or 0)


def relation_bytes(url: str, name: str) -> int:
    with transaction(url) as conn:
        return int(conn.execute(text("SELECT pg_total_relation_size(:n)"), {"n": name}).scalar() or 0)


def backlog(url: str, decisions: int, executions: int, done: float) -> dict[str, Any]:
    plan = compile_playbook(str(PLAYBOOK))
    firsts = []
    for _ in range(executions):
        execution_id = create_execution(plan, url)
        [first] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
        firsts.append((execution_id, first))
    with transaction(url) as conn:
        conn.execute(text("DELETE FROM noetl_lease"))  # only the synthetic ones are measured
    lease_before, events_before, wal_before = (
        relation_bytes(url, "noetl_lease"),
        relation_bytes(url, "noetl_event"),
        wal_lsn(url),
    )
    outcomes = int(decisions * done)
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for i in range(decisions):
        execution_id, first = firsts[i % executions]
        key = f"bench.decision.{i}"
        dispatch = replace(first, message={**first.message, "iteration": i, "parent_event_id": key})
        rows.append(
            {
                "execution_id": execution_id,
                "event_id": key,
                "event_type": "iteration.completed",
                "status": "completed",
                "step": "a",
                "meta": {"dispatch": [dispatch.to_dict()]},
                LEASE_KEY: utcnow() + timedelta(seconds=3600),
            }
        )
        if i < outcomes:
            rows.append(
                {
                    "execution_id": execution_id,
                    "event_id": dispatch.attempt_key() + ".done",
                    "event_type": "action.completed",
                    "status": "completed",
                    "step": "a",
                }
            )
        if len(rows) >= WRITE_CHUNK or i == decisions - 1:
            with transaction(url) as conn:
                insert_events(conn, rows)
            rows = []
    written = time.perf_counter() - began
    with transaction(url) as conn:
        conn.execute(text("ANALYZE noetl_lease"))
        conn.execute(text("ANALYZE noetl_event"))
    return {
        "write_s": written,
        "wal_written_per_decision": (wal_lsn(url) - wal_before) / decisions,
        "lease_table_bytes_per_lease": (relation_bytes(url, "noetl_lease") - lease_before) / decisions,
        "event_table_bytes_per_decision": (relation_bytes(url, "noetl_event") - events_before) / decisions,
    }


def sweep_all(url: str) -> dict[str, Any]:
    with transaction(url) as conn:
        expired = leases.expire(conn, utcnow())
    wal_before = wal_lsn(url)
    began = time.perf_counter()
    total = sweeper.SweepResult()
    batches: list[float] = []
    while True:
        last = time.perf_counter()

        def committed(part: sweeper.SweepResult) -> None:
            nonlocal last
            now = time.perf_counter()
            if part.rows:
                batches.append(now - last)
            last = now

        result = sweeper.sweep(url, interval=5.0, committed=committed)
        total.add(result)
        with transaction(url) as conn:
            left = leases.count(conn, overdue_at=utcnow())
        if left == 0:
            break
    seconds = time.perf_counter() - began
    return {
        "leases": expired,
        "seconds": seconds,
        "leases_per_s": total.rows / seconds,
        "settled": total.cleared,
        "republished": len(total.republished),
        "batch_rows": sweeper.BATCH,
        "batch_s_p50": statistics.median(batches) if batches else None,
        "batch_s_max": max(batches) if batches else None,
        "wal_per_lease_swept": (wal_lsn(url) - wal_before) / max(total.rows, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=50000)
    parser.add_argument("--executions", type=int, default=50)
    parser.add_argument("--done", type=float, default=1.0, help="share of decisions whose attempt has an outcome")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=sweeper.BATCH, help="leases per sweep transaction")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    sweeper.BATCH = args.batch
    report: dict[str, Any] = {
        "decisions": args.decisions,
        "executions": args.executions,
        "done": args.done,
        "batch": args.batch,
    }
    with scratch_database("bench_recovery") as (_, url):
        migrate(url)
        rounds = []
        for n in range(args.rounds):
            with transaction(url) as conn:
                conn.execute(text("TRUNCATE noetl_event, noetl_lease, noetl_execution, noetl_variable, noetl_loop"))
            written = backlog(url, args.decisions, args.executions, args.done)
            swept = sweep_all(url)
            rounds.append({**written, **swept})
            print(
                f"round {n + 1}: {swept['leases']} overdue leases swept in {swept['seconds']:.2f} s:"
                f" {swept['leases_per_s']:,.0f} leases/s ({swept['settled']} settled,"
                f" {swept['republished']} re-published); batch of {sweeper.BATCH}: p50"
                f" {swept['batch_s_p50'] or 0:.3f} s, max {swept['batch_s_max'] or 0:.3f} s;"
                f" WAL {swept['wal_per_lease_swept']:.0f} B per lease swept,"
                f" {written['wal_written_per_decision']:.0f} B per decision written;"
                f" lease table {written['lease_table_bytes_per_lease']:.0f} B per lease",
                flush=True,
            )
        report["rounds"] = rounds
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
