"""Retries and pagination decided by on_event, on both deployments, against the mock API."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from tests.e2e.test_core import corpus
from tests.support.engines import event_types

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"
REMAPPED = PLAYBOOKS / "corpus"
TOLERANCE = 0.6  # seconds of scheduling slack allowed around a backoff delay


def api(mock_api) -> dict[str, str]:
    return {"api_url": mock_api.url, "test_url": f"{mock_api.url}/health"}


def rows(events, step, *kinds):
    return [e for e in events if e["step"] == step and (not kinds or e["event_type"] in kinds)]


@pytest.mark.real_workers
def test_the_retry_timeline_with_exponential_backoff(engine, mock_api):
    run = engine.run(PLAYBOOKS / "retry_timeline.yaml", api(mock_api))
    assert run.returncode == 0, run.stderr
    assert run.results["fetch"]["status_code"] == 200
    events = engine.events(run.execution_id)
    timeline = [(e["event_type"], e["attempt"]) for e in rows(events, "fetch") if e["event_type"] != "step.started"]
    assert timeline == [
        ("action.started", 1),
        ("action.failed", 1),
        ("retry.scheduled", 2),
        ("action.failed", 2),
        ("retry.scheduled", 3),
        ("action.completed", 3),
        ("step.completed", None),
    ]
    failed = rows(events, "fetch", "action.failed")
    assert [f["error"]["status"] for f in failed] == [503, 503]
    assert all(f["meta"]["http"]["status"] == 503 for f in failed)
    scheduled = rows(events, "fetch", "retry.scheduled")
    assert [s["meta"]["delay"] for s in scheduled] == [1.0, 2.0]
    assert all(s["meta"]["rule"] == 0 for s in scheduled)
    # the waits really happened: the next attempt started `delay` after the failed one ended
    attempts = rows(events, "fetch", "action.failed", "action.completed")
    for before, after, delay in zip(attempts, attempts[1:], (1.0, 2.0), strict=False):
        ended = before["started_at"] + timedelta(milliseconds=before["duration_ms"])
        waited = (after["started_at"] - ended).total_seconds()
        assert delay - 0.05 <= waited <= delay + TOLERANCE, (delay, waited)
    # every attempt links to the first one
    first = rows(events, "fetch", "action.started")[0]["event_id"]
    assert {a["parent_event_id"] for a in attempts} == {first}


def test_a_poison_task_stops_after_its_attempts_and_fails_the_execution(engine):
    run = engine.run(PLAYBOOKS / "poison.yaml")
    assert run.returncode == 1
    assert run.status["failed_step"] == "poison"
    assert "poison pill" in run.status["error"]["message"]
    events = engine.events(run.execution_id)
    poison = [e["event_type"] for e in rows(events, "poison")]
    assert poison.count("action.failed") == 3 and poison.count("retry.scheduled") == 2
    assert poison[-3:] == ["retry.exhausted", "step.failed", "execution.failed"]
    exhausted = next(e for e in events if e["event_type"] == "retry.exhausted")
    assert exhausted["attempt"] == 3 and exhausted["meta"] == {"limit": 3, "kind": "attempts"}
    assert run.results["bystander"] == "fine"
    assert "after" not in {e["step"] for e in events}
    assert events[-1]["event_type"] == "execution.failed"


@pytest.mark.parametrize(
    "name, key, expected",
    [
        ("pagination_basic", "fetch_all_assessments", 35),
        ("pagination_offset", "fetch_all_users", 35),
        ("pagination_cursor", "fetch_all_events", 35),
        ("pagination_max_iterations", "fetch_with_limit", 20),
    ],
)
def test_legacy_pagination_collects_every_page_in_order(engine, mock_api, name, key, expected):
    run = engine.run(corpus(f"legacy-2025-12/{name}.yaml"), api(mock_api))
    assert run.returncode == 0, run.stderr
    items = run.results[key]
    assert [item["id"] for item in items] == list(range(1, expected + 1))
    pages = rows(engine.events(run.execution_id), key, "page.completed", "action.completed")
    assert [p["page"] for p in pages] == list(range(1, len(pages) + 1))  # one row per page


def test_retry_on_error_and_pagination_combined(engine, mock_api):
    run = engine.run(corpus("legacy-2025-12/pagination_retry.yaml"), api(mock_api))
    assert run.returncode == 0, run.stderr
    assert run.results["validate_results"] == {"status": "success", "total_items": 35, "retry_worked": True}
    events = rows(engine.events(run.execution_id), "fetch_with_retry")
    failed = [e for e in events if e["event_type"] == "action.failed"]
    assert [(f["page"], f["attempt"]) for f in failed] == [(2, 1)]  # page 2 failed once, then succeeded
    assert sum(e["event_type"] == "retry.scheduled" for e in events) == 1


@pytest.mark.parametrize(
    "path",
    [
        "legacy-2025-12/v2case_pagination_retry.yaml",
        "legacy-2025-12/v2case_loop_with_pagination.yaml",
        "v10-2026-02/pagination_basic.yaml",
        "v10-2026-02/pagination_retry.yaml",
    ],
)
def test_corpus_pagination_playbooks_reach_their_assertions(engine, mock_api, path):
    run = engine.run(corpus(path), api(mock_api))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    result = run.results["validate_results"]
    assert result["status"] == "success" or "Successfully validated" in result.get("message", "")


@pytest.mark.parametrize("path", ["legacy_loop_with_pagination.yaml", "http_pagination_jump.yaml"])
def test_remapped_corpus_playbooks(engine, mock_api, path):
    run = engine.run(REMAPPED / path, api(mock_api))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    if path.startswith("legacy"):
        assert run.results["validate_saved_data"]["records_validated"] == 2
    else:
        assert run.results["process_results"] == {"count": 35, "status": "processed"}
        jumps = [
            e
            for e in engine.events(run.execution_id)
            if e["task"] == "fetch_page" and e["event_type"] == "action.completed"
        ]
        assert len(jumps) == 4  # pages of 10: 10, 10, 10, 5


def test_v10_loop_with_pagination_reads_noetls_postgres_result_shape(engine, mock_api):
    # unmodified: the playbook reads `validate_results.data.result.command_0.rows`
    run = engine.run(corpus("v10-2026-02/loop_with_pagination.yaml"), api(mock_api))
    assert run.returncode == 0, (run.status.get("error"), run.stderr)
    assert run.results["check_results"]["endpoints_tested"] == [
        {"endpoint": "assessments", "items_count": 35, "pages_count": 2}
    ]


def test_retry_corpus_playbooks(engine, mock_api):
    legacy = engine.run(corpus("legacy-2025-12/retry_simple_config.yaml"), api(mock_api))
    assert legacy.returncode == 0, legacy.stderr
    canonical = engine.run(corpus("v10-2026-02/retry_simple_config.yaml"), api(mock_api))
    assert canonical.returncode == 0, canonical.stderr
    events = engine.events(canonical.execution_id)
    # fail_on page 1: the flaky endpoint fails the first request only (per server instance)
    assert sum(e["event_type"] == "retry.scheduled" for e in events) <= 1
    assert all(
        canonical.results[s]["status_code"] == 200 for s in ("boolean_retry", "integer_retry", "full_config_retry")
    )


def test_python_exception_retry_either_succeeds_or_exhausts(engine):
    run = engine.run(corpus("legacy-2025-12/retry_python_exception.yaml"))  # random 70 % failures
    events = rows(engine.events(run.execution_id), "start")
    failures = sum(e["event_type"] == "action.failed" for e in events)
    if run.status["status"] == "completed":
        assert run.results["start"]["success"] is True and failures < 5
    else:
        assert failures == 5 and "retry.exhausted" in event_types(events)


@pytest.mark.real_workers
def test_pipeline_error_policies(engine, mock_api):
    run = engine.run(corpus("v10-2026-02/pipeline_error_handling.yaml"), api(mock_api))
    # the playbook's last test step fails on a 401 by design (`do: fail` on auth errors)
    assert run.returncode == 1
    assert run.status["failed_step"] == "test_fail_auth"
    assert run.status["error"]["kind"] == "auth" and run.status["error"]["status"] == 401
    assert run.results["test_retry_transient"]["status"] == "passed"
    assert run.results["test_rate_limit"]["status"] == "passed"
    assert run.results["test_skip_transform"] == {
        "test": "skip_transform_error",
        "status": "passed",
        "skipped": True,
        "prev_after_skip": None,
        "message": "Transform error was skipped successfully",
    }
    events = engine.events(run.execution_id)
    assert not [e for e in events if e["task"] == "should_not_reach"]
    transient = [e for e in events if e["task"] == "fetch_flaky"]
    # a later task of the step's pipeline: the previous task's outcome row is its start
    assert [e["event_type"] for e in transient] == [
        "action.failed",
        "retry.scheduled",
        "action.completed",
    ]


@pytest.mark.smoke
def test_a_parallel_loop_whose_iterations_paginate(engine, mock_api):
    run = engine.run(PLAYBOOKS / "pagination_loop_parallel.yaml", api(mock_api))
    assert run.returncode == 0, run.stderr
    assert run.results["summary"] == [list(range(1, 36))] * 3
    events = rows(engine.events(run.execution_id), "fetch")
    pages = {}
    for e in events:
        if e["event_type"] in ("page.completed", "iteration.completed"):
            pages.setdefault(e["iteration"], []).append(e["page"])
    assert pages == {0: list(range(1, 8)), 1: list(range(1, 6)), 2: list(range(1, 4))}
    assert sum(e["event_type"] == "iterator.completed" for e in events) == 1


def test_each_page_runs_its_sink_in_its_own_job_and_into_names_the_collection(engine, mock_api):
    run = engine.run(PLAYBOOKS / "pagination_page_sink.yaml", api(mock_api))
    assert run.returncode == 0, run.stderr
    assert run.results["count"] == 35
    events = engine.events(run.execution_id)
    sinks = [e["result"] for e in events if e["event_type"] == "sink.event_log"]
    assert [s["page"] for s in sinks] == [1, 2, 3, 4]
    assert [len(s["ids"]) for s in sinks] == [10, 10, 10, 5]
    pages = [e for e in events if e["step"] == "fetch" and e["event_type"] in ("page.completed", "action.completed")]
    sink_parents = [e["parent_event_id"] for e in events if e["event_type"] == "sink.event_log"]
    assert sink_parents == [p["event_id"] for p in pages]  # one sink per page, recorded with it
