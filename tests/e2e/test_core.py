"""The core slice end to end, on the embedded default and on Redis + PostgreSQL with real workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import API_TOKEN
from tests.support.corpus import corpus_file
from tests.support.engines import event_types, step_order

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks"


def corpus(name: str) -> Path:
    return corpus_file(name)


@pytest.mark.smoke
@pytest.mark.parametrize("dialect", ["legacy-2025-12", "v10-2026-02"])
def test_hello_world_runs_and_its_log_explains_it(engine, dialect):
    run = engine.run(corpus(f"{dialect}/hello_world.yaml"))
    assert run.returncode == 0, run.stderr
    assert run.status["status"] == "completed"
    assert run.status["error"] is None
    message = run.results["test_step"]["data"]["message"]
    assert message == "Hello World"

    events = engine.events(run.execution_id)
    assert events[0]["event_type"] == "execution.started"
    assert events[-1]["event_type"] == "execution.completed"
    assert step_order(events) == ["start", "test_step", "end"]
    assert step_order(events, "step.completed") == ["start", "test_step", "end"]
    assert event_types(events, "test_step") == ["step.started", "action.started", "action.completed", "step.completed"]
    attempt = next(e for e in events if e["event_type"] == "action.completed" and e["step"] == "test_step")
    assert attempt["attempt"] == 1 and attempt["queue_id"] and attempt["worker"]
    assert attempt["duration_ms"] is not None and attempt["started_at"] is not None
    assert attempt["result"]["data"]["message"] == "Hello World"
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len({e["event_id"] for e in events}) == len(events)
    if dialect == "legacy-2025-12":  # the end step's sink writes into the event log
        sink = [e for e in events if e["event_type"] == "sink.event_log"]
        assert [s["result"] for s in sink] == [{"status": "success", "message": "Hello World"}]


@pytest.mark.parametrize("dialect", ["legacy-2025-12", "v10-2026-02"])
@pytest.mark.parametrize("temperature, branch", [(30, "hot"), (10, "cold")])
def test_control_flow_routes_on_results_and_joins_the_parallel_branches(engine, dialect, temperature, branch):
    run = engine.run(corpus(f"{dialect}/control_flow_workbook.yaml"), {"temperature_c": temperature})
    assert run.returncode == 0, run.stderr
    events = engine.events(run.execution_id)
    started = step_order(events)
    assert run.results["eval_flag"]["message"] == branch
    if branch == "hot":
        assert set(started) == {"start", "eval_flag", "hot_path", "hot_task_a", "hot_task_b", "end"}
        assert run.results["hot_task_a"] == {"who": "A"} and run.results["hot_task_b"] == {"who": "B"}
        # the join: `end` starts once, after both parallel branches completed
        assert started.count("end") == 1
        end_start = next(e["id"] for e in events if e["event_type"] == "step.started" and e["step"] == "end")
        for branch_step in ("hot_task_a", "hot_task_b"):
            done = next(e["id"] for e in events if e["event_type"] == "step.completed" and e["step"] == branch_step)
            assert done < end_start
        arrivals = [e for e in events if e["event_type"] == "join.arrived"]
        assert [a["status"] for a in arrivals] == ["waiting", "ready"]
    else:
        assert started == ["start", "eval_flag", "cold_path", "cold_task", "end"]
        assert "hot_path" not in run.results


@pytest.mark.parametrize("amount, route", [(250, "manual"), (50, "auto")])
def test_legacy_when_then_else(engine, amount, route):
    run = engine.run(PLAYBOOKS / "branching_legacy.yaml", {"amount": amount})
    assert run.returncode == 0, run.stderr
    assert run.results["done"] == {"route": route}
    started = step_order(engine.events(run.execution_id))
    assert started == ["start", "classify", f"approve_{'manually' if route == 'manual' else 'automatically'}", "done"]


def test_exclusive_and_inclusive_arcs(engine):
    run = engine.run(PLAYBOOKS / "arcs_modes.yaml")
    assert run.returncode == 0, run.stderr
    events = engine.events(run.execution_id)
    started = step_order(events)
    assert "any_score" not in started  # exclusive: only the first matching arc
    assert "notify_never" not in started  # inclusive: only the arcs whose condition holds
    assert {"notify_email", "notify_chat"} <= set(started)
    assert started.count("summary") == 1
    assert run.results["summary"] == {"sent": ["chat", "email"]}
    high_done = next(e for e in events if e["event_type"] == "step.completed" and e["step"] == "high")
    assert sorted(high_done["meta"]["next"]) == ["notify_chat", "notify_email"]


@pytest.mark.smoke
def test_http_step_against_the_mock_api_and_the_secret_stays_out_of_the_log(engine, mock_api):
    run = engine.run(PLAYBOOKS / "http_mock.yaml", {"api_url": mock_api.url})
    assert run.returncode == 0, run.stderr
    http = run.results["start"]
    assert http["status_code"] == 200 and http["url"].startswith(mock_api.url)
    assert set(http) >= {"status_code", "headers", "url", "elapsed", "data"}
    assert run.results["summarize"] == {"ids": [6, 7, 8, 9, 10], "page": 2}
    for row in engine.events(run.execution_id):
        assert API_TOKEN not in json.dumps(row, default=str)


@pytest.mark.smoke
def test_postgres_steps_with_bind_parameters(engine):
    run = engine.run(PLAYBOOKS / "postgres_params.yaml", {"table": f"e2e_orders_{engine.mode}"})
    assert run.returncode == 0, run.stderr
    assert run.results["check"] == {"total": 42, "customer": "O'Brien", "n": 3}
    assert run.status["vars"]["total"] == 42
    events = engine.events(run.execution_id)
    assert step_order(events) == ["start", "create", "insert", "report", "check"]


def test_a_failing_step_fails_the_execution_with_its_error(engine):
    run = engine.run(PLAYBOOKS / "failing_step.yaml")
    assert run.returncode == 1
    assert run.status["status"] == "failed"
    assert run.status["failed_step"] == "explode"
    assert "ValueError: the ledger does not balance" in run.status["error"]["message"]
    events = engine.events(run.execution_id)
    assert event_types(events)[-3:] == ["action.failed", "step.failed", "execution.failed"]
    assert "never" not in step_order(events)


def test_invalid_sql_fails_the_execution_with_the_database_error(engine):
    run = engine.run(corpus("legacy-2025-12/broken_sql.yaml"))
    assert run.returncode == 1
    assert run.status["failed_step"] == "verify_pg_data"
    assert run.status["error"]["kind"] == "sql_error"
    assert run.status["error"]["code"] == "42601"  # syntax_error
