"""Cursor loops on both deployments: the SQLite driver (demo queue), failed rows, failed claims."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.support.engines import event_types

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "playbooks" / "cursor_queue.yaml"
FAILURES = ROOT / "tests" / "playbooks" / "cursor_failures.yaml"


@pytest.mark.smoke
def test_demo_queue_drains_every_row_once(engine, tmp_path):
    run = engine.run(DEMO, {"jobs": 30, "queue_db": str(tmp_path / f"queue-{engine.mode}.sqlite")})
    assert run.returncode == 0, run.stderr
    assert run.results["report"]["done"] == 30
    assert run.results["report"]["sum_of_squares"] == sum(i * i for i in range(1, 31))
    assert run.results["drain"] == {"stats": {"processed": 30, "failed": 0, "slots": 4}}

    events = engine.events(run.execution_id)
    kinds = Counter(event_types(events, "drain"))
    assert kinds["cursor.item.done"] == 30
    assert kinds["cursor.slot.ended"] == 4  # each slot ends once, on its empty claim
    assert kinds["iterator.completed"] == 1  # loop.done exactly once
    # frames of up to 2 rows: at least 15 claims took rows, each ran its first row in the same
    # attempt, recorded as that row's item (meta.claimed): no row of its own; no start rows
    assert not kinds["cursor.claimed"]
    assert not kinds["iteration.started"] and not kinds["action.started"]
    items = [e for e in events if e["event_type"] == "cursor.item.done"]
    claims = [e["meta"]["claimed"] for e in items if "claimed" in e["meta"]]
    assert 15 <= len(claims) <= 30 and sum(c["rows"] for c in claims) == 30
    assert sorted(e["meta"]["row"]["id"] for e in items) == list(range(1, 31))
    assert {e["meta"]["slot"] for e in items} <= {0, 1, 2, 3}
    # one row per item, plus a constant handful per slot and loop
    assert sum(kinds.values()) <= 30 + 4 + 4
    report = next(e for e in events if e["step"] == "drain" and e["event_type"] == "iterator.completed")
    assert report["meta"] == {"processed": 30, "failed": 0, "slots": 4}


def test_aggregate_adds_every_done_rows_result_to_the_loops_result(engine, tmp_path):
    text = DEMO.read_text()
    assert "      iterator: job\n" in text
    playbook = tmp_path / "cursor_aggregate.yaml"
    playbook.write_text(text.replace("      iterator: job\n", "      iterator: job\n      aggregate: true\n", 1))
    run = engine.run(playbook, {"jobs": 12, "queue_db": str(tmp_path / f"agg-{engine.mode}.sqlite")})
    assert run.returncode == 0, run.stderr
    drain = run.results["drain"]
    assert drain["stats"] == {"processed": 12, "failed": 0, "slots": 4}
    assert sorted(r["id"] for r in drain["results"]) == list(range(1, 13))
    assert all(r["square"] == r["id"] ** 2 for r in drain["results"])


def test_failed_rows_are_counted_and_fail_the_step_at_loop_done(engine, tmp_path):
    run = engine.run(FAILURES, {"queue_db": str(tmp_path / f"fail-{engine.mode}.sqlite")})
    assert run.returncode == 1
    assert run.status["failed_step"] == "drain"
    assert run.status["error"]["stats"] == {"processed": 6, "failed": 2, "slots": 2}
    events = engine.events(run.execution_id)
    failed = [e for e in events if e["event_type"] == "cursor.item.failed"]
    assert sorted(e["meta"]["row"]["id"] for e in failed) == [3, 6]
    assert all("poison" in e["error"]["message"] for e in failed)
    assert Counter(event_types(events, "drain"))["cursor.item.done"] == 4


def test_a_claim_that_errors_is_retried_then_fails_the_step_with_the_database_message(engine, tmp_path):
    run = engine.run(FAILURES, {"queue_db": str(tmp_path / f"bad-{engine.mode}.sqlite"), "bad_claim": True})
    assert run.returncode == 1
    assert run.status["failed_step"] == "drain"
    assert "no such table: no_such_table" in run.status["error"]["message"]
    events = engine.events(run.execution_id)
    claim_failures = [e for e in events if e["event_type"] == "cursor.claim.failed"]
    assert {e["attempt"] for e in claim_failures} >= {1, 2, 3}
    assert not any(e["event_type"] == "iterator.completed" for e in events)


def test_cursor_retry_sets_how_often_and_when_an_erroring_claim_is_tried_again(engine, tmp_path):
    text = FAILURES.read_text()
    anchor = '        auth: {dsn: "{{ queue_db }}"}\n'
    assert anchor in text
    playbook = tmp_path / "cursor_claim_retry.yaml"
    retry = "        retry: {max_attempts: 5, initial_delay: 0.2, backoff: linear}\n"
    playbook.write_text(text.replace(anchor, anchor + retry, 1))
    run = engine.run(playbook, {"queue_db": str(tmp_path / f"retry-{engine.mode}.sqlite"), "bad_claim": True})
    assert run.returncode == 1
    assert "failed after 5 attempts" in run.status["error"]["message"]
    assert "no such table: no_such_table" in run.status["error"]["message"]
    # the slot whose fifth try failed the step (the other slot stops retrying once the step failed)
    slot = int(re.search(r"cursor claim of slot (\d+) failed after 5 attempts", run.status["error"]["message"])[1])
    events = engine.events(run.execution_id)
    failures = [e for e in events if e["event_type"] == "cursor.claim.failed" and e["meta"]["slot"] == slot]
    assert sorted(e["attempt"] for e in failures) == [1, 2, 3, 4, 5]
    # linear backoff from 0.2 s: the wait before attempt n + 1 is 0.2 * n
    assert [e["meta"].get("retry_in") for e in sorted(failures, key=lambda e: e["attempt"])] == [
        0.2,
        0.4,
        0.6,
        0.8,
        None,
    ]
