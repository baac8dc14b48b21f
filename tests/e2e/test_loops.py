"""Loops fanned out by on_event, on both deployments."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.test_core import corpus
from tests.support.engines import event_types

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
ITEMS = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.smoke
def test_sequential_parallel_and_chunked_loops(engine):
    run = engine.run(PLAYBOOKS / "loop_modes.yaml")
    assert run.returncode == 0, run.stderr
    summary = run.results["summary"]
    assert summary["squares"] == [n * n for n in ITEMS]  # in collection order
    assert summary["shifted"] == [n + 100 for n in ITEMS]
    assert summary["sums"] == [8, 15, 8]  # chunks of 3, 3 and 2
    assert summary["stats"] == {"total": 8, "success": 8, "failed": 0}

    events = engine.events(run.execution_id)
    seq = [e for e in events if e["step"] == "sequential"]
    started = next(e for e in seq if e["event_type"] == "iterator.started")
    assert started["meta"] == {"total": 8, "mode": "sequential", "cap": 1}
    done = [e for e in seq if e["event_type"] == "iteration.completed"]
    assert sorted(e["iteration"] for e in done) == list(range(8))
    # sequential: each iteration starts only after the previous one completed
    order = [(e["event_type"], e["iteration"]) for e in seq if e["event_type"].startswith("iteration.")]
    assert order == [(kind, i) for i in range(8) for kind in ("iteration.started", "iteration.completed")]
    # the sink ran in the iteration's job with the element and the result in scope
    sinks = sorted((e["result"]["index"], e["result"]["square"]) for e in seq if e["event_type"] == "sink.event_log")
    assert sinks == [(i, n * n) for i, n in enumerate(ITEMS)]
    # event budget: iteration rows are 2 per iteration; per loop a constant 4 (step/iterator start/end)
    for step, total in (("parallel", 8), ("chunked", 3)):
        kinds = Counter(event_types(events, step))
        assert kinds["iteration.started"] == kinds["iteration.completed"] == total
        assert sum(kinds.values()) == 2 * total + 4, kinds
    chunked_start = next(e for e in events if e["step"] == "chunked" and e["event_type"] == "iterator.started")
    assert chunked_start["meta"]["mode"] == "chunked" and chunked_start["meta"]["total"] == 3


def test_messages_carry_their_element_not_the_collection(engine):
    run = engine.run(PLAYBOOKS / "loop_modes.yaml")
    events = engine.events(run.execution_id)
    started = [e for e in events if e["step"] == "parallel" and e["event_type"] == "iteration.started"]
    assert sorted(e["context"]["element"] for e in started) == sorted(ITEMS)
    dispatched = [
        d["message"]
        for e in events
        for d in ((e["meta"] or {}).get("dispatch") or [])
        if d["message"]["step"] == "parallel"
    ]
    assert dispatched and all(not isinstance(m["element"], list) for m in dispatched)


def test_empty_loop_completes_and_a_loop_entered_twice_keeps_separate_state(engine):
    run = engine.run(PLAYBOOKS / "loop_edges.yaml")
    assert run.returncode == 0, run.stderr
    assert run.results["done"]["empty"] == {"results": [], "stats": {"total": 0, "success": 0, "failed": 0}}
    assert run.results["done"]["seen"] == [[0, 1, 2], [10, 11, 12]]
    events = engine.events(run.execution_id)
    loop_runs = {e["run_id"] for e in events if e["step"] == "again" and e["event_type"] == "iterator.completed"}
    assert len(loop_runs) == 2


def test_two_loops_in_one_execution_are_isolated(engine):
    run = engine.run(corpus("v10-2026-02/loop_instance_isolation.yaml"))
    assert run.returncode == 0, run.stderr
    verify = run.results["verify_results"]
    assert verify["verification"] == "Both loops completed independently"
    assert [r["name"] for r in run.results["process_items_users"]["results"]] == ["Alice", "Bob"]
    assert [r["name"] for r in run.results["process_items_products"]["results"]] == ["Laptop", "Mouse"]


def test_a_failed_iteration_fails_the_step_with_the_count(engine):
    run = engine.run(PLAYBOOKS / "loop_failures.yaml")
    assert run.returncode == 1
    assert run.status["failed_step"] == "strict"
    assert run.status["error"]["stats"] == {"total": 4, "success": 3, "failed": 1}
    events = engine.events(run.execution_id)
    failed = [e for e in events if e["event_type"] == "iteration.failed"]
    assert [e["iteration"] for e in failed] == [2]
    assert "ZeroDivisionError" in failed[0]["error"]["message"]
    assert next(e for e in events if e["event_type"] == "iterator.completed")["status"] == "failed"


def test_a_policy_that_continues_keeps_the_loop_going_and_counts_the_failure(engine):
    run = engine.run(PLAYBOOKS / "loop_failures.yaml", {"tolerate": True})
    assert run.returncode == 0, run.stderr
    tolerant = run.results["tolerant"]
    assert tolerant["stats"] == {"total": 4, "success": 3, "failed": 1}
    assert tolerant["results"] == [12, 6, None, 3]
    assert run.results["after"] == "after"


@pytest.mark.real_workers
def test_the_concurrency_cap_is_what_the_api_sees(engine, mock_api):
    run = engine.run(PLAYBOOKS / "loop_probe.yaml", {"api_url": mock_api.url})
    assert run.returncode == 0, run.stderr
    stats = run.results["stats"]["data"]
    assert stats["total"] == 24
    assert stats["max_active"] == 4, stats  # the cap, and never more


@pytest.mark.parametrize("dialect", ["legacy-2025-12", "v10-2026-02"])
def test_per_iteration_postgres_sink(engine, dialect, pg_dsn):
    import psycopg2

    run = engine.run(corpus(f"{dialect}/iterator_save_test.yaml"))
    assert run.returncode == 0, run.stderr
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT item_name, item_value FROM public.iterator_save_test WHERE execution_id = %s ORDER BY item_name",
            (str(run.execution_id),),
        )
        assert cur.fetchall() == [("item1", 100), ("item2", 200), ("item3", 300)]
