"""A loop over a big python result at the default settings: real Redis, real PostgreSQL, two real
worker processes. The list (2,000 mappings of about 680 bytes, 1.3 MB of JSON: above the default
1 MB NOETL_MAX_RESULT_BYTES) is stored once by reference, every element runs once, the aggregated
results (as big) are read whole by the next step, and no worker process grows past a bound. The
size comes from wide elements rather than many: what is tested is the reference, not the loop's
rate. The same at 200,000 elements is bench.fanout (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from sqlalchemy import text

from noetl_celery.config import limits
from noetl_celery.runner import wait
from noetl_celery.store.db import get_engine
from tests.support.engines import cli

PLAYBOOK = Path(__file__).resolve().parents[1] / "playbooks" / "loop_big_python.yaml"
N = 2_000
PAD = 640  # bytes of filler per element: N elements make 1.3 MB
MAX_PROCESS_RSS = 400 * 1024 * 1024  # bytes: a worker process holding its caches, far below N copies


def peak_rss(workers) -> int:
    """The largest RSS of any worker process (main process or pool child) now."""
    largest = 0
    for worker in workers:
        root = psutil.Process(worker.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                largest = max(largest, p.memory_info().rss)
            except psutil.NoSuchProcess:
                continue
    return largest


@pytest.mark.slow
@pytest.mark.real_workers
def test_a_loop_over_a_big_python_result_at_the_default_settings(env, store_url, worker_factory):
    workers = [
        worker_factory(env=env, concurrency=2, name="big-a@%h"),
        worker_factory(env=env, concurrency=2, name="big-b@%h"),
    ]
    proc = cli(["submit", str(PLAYBOOK), "--json", "--set", f"n={N}", "--set", f"pad={PAD}"], env)
    assert proc.returncode == 0, proc.stderr
    execution_id = int(json.loads(proc.stdout)["execution_id"])
    peaks = []
    status = wait(store_url, execution_id, timeout=900, on_poll=lambda _: peaks.append(peak_rss(workers)))
    assert status["status"] == "completed", status
    with get_engine(store_url).connect() as conn:
        kinds = dict(
            conn.execute(
                text(
                    "SELECT event_type, count(*) FROM noetl_event WHERE execution_id = :x AND step = 'work' "
                    "GROUP BY event_type"
                ),
                {"x": execution_id},
            ).all()
        )
        distinct = conn.execute(
            text(
                "SELECT count(DISTINCT iteration) FROM noetl_event WHERE execution_id = :x "
                "AND event_type = 'iteration.completed'"
            ),
            {"x": execution_id},
        ).scalar_one()
        blobs = (
            conn.execute(text("SELECT sha256 FROM noetl_blob WHERE execution_id = :x"), {"x": execution_id})
            .scalars()
            .all()
        )
        start = conn.execute(
            text(
                "SELECT result FROM noetl_event WHERE execution_id = :x AND step = 'start' "
                "AND event_type = 'action.completed'"
            ),
            {"x": execution_id},
        ).scalar_one()
        collection = conn.execute(
            text("SELECT collection FROM noetl_loop WHERE execution_id = :x"), {"x": execution_id}
        ).scalar_one()
    assert kinds["iteration.completed"] == N and distinct == N
    assert status["results"]["check"] == {"count": N, "total": N * (N - 1) // 2, "last": f"item-{N - 1:06d}"}
    # the list is stored once, by reference; the loop's collection holds it in pages, each stored once
    assert start["__stored__"] is True and start["length"] == N and start["size"] > 1_000_000
    assert "note" in start["preview"] and len(json.dumps(start)) < 1000  # a reference, not the list
    assert limits.is_paged(collection) and collection["length"] == N and len(json.dumps(collection)) < 10_000
    pages = {page["sha256"] for page in collection["pages"]}
    assert len(pages) > 1 and start["sha256"] not in pages
    # the list, its pages, and the loop's aggregated results (the same elements, in order)
    assert len(blobs) == len(set(blobs)) == 2 + len(pages) and pages < set(blobs)
    assert max(peaks) < MAX_PROCESS_RSS, max(peaks)
