"""Sub-playbooks on both deployments: child executions started and finished by on_event."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.corpus import corpus_file
from tests.support.engines import cli

SUB = Path(__file__).resolve().parents[1] / "playbooks" / "sub"


@pytest.mark.smoke
def test_a_loop_of_sub_playbooks_returns_each_childs_return_step(engine):
    run = engine.run(SUB / "parent.yaml", {"n": 5})
    assert run.returncode == 0, run.stderr
    assert run.results["done"] == {"values": [0, 2, 4, 6, 8]}
    children = run.status["children"]
    assert len(children) == 5 and {c["status"] for c in children} == {"completed"}
    child = engine.status(children[0]["execution_id"])
    assert child["parent_execution_id"] == run.execution_id
    assert child["results"]["end"]["value"] in {0, 2, 4, 6, 8}
    # the parent's task row names its child; the child's rows carry the parent's id
    events = engine.events(run.execution_id)
    started = [e for e in events if (e["meta"] or {}).get("child_execution_id")]
    assert sorted(e["meta"]["child_execution_id"] for e in started) == sorted(c["execution_id"] for c in children)
    done = [e for e in events if e["event_type"] == "iteration.completed"]
    assert {e["meta"]["child"]["execution_id"] for e in done} == {c["execution_id"] for c in children}
    child_rows = engine.events(children[0]["execution_id"])
    assert child_rows and all(r["parent_execution_id"] == run.execution_id for r in child_rows)


def test_a_failed_child_fails_the_parents_task_with_the_childs_error_and_id(engine):
    run = engine.run(SUB / "parent.yaml", {"n": 3, "fail_at": 1})
    assert run.returncode == 1
    assert run.status["failed_step"] == "start"
    events = engine.events(run.execution_id)
    failed = [e for e in events if e["event_type"] == "iteration.failed"]
    assert len(failed) == 1
    error = failed[0]["error"]
    assert error["kind"] == "playbook" and "child refuses 1" in error["message"]
    failed_child = [c for c in run.status["children"] if c["status"] == "failed"]
    assert [c["execution_id"] for c in failed_child] == [error["child_execution_id"]]


def test_a_playbook_calling_itself_stops_at_the_nesting_limit(engine):
    run = engine.run(SUB / "recursive.yaml")
    assert run.returncode == 1
    assert "nesting limit (16)" in run.status["error"]["message"]
    depth, execution_id = 0, run.execution_id
    while True:
        children = engine.status(execution_id)["children"]
        if not children:
            break
        assert len(children) == 1
        execution_id, depth = children[0]["execution_id"], depth + 1
    assert depth == 16


def test_a_missing_static_child_is_refused_with_the_parents_line(engine):
    proc = cli(["validate", str(SUB / "missing_child.yaml")], engine.env)
    assert proc.returncode == 2
    assert "missing_child.yaml:12: call.tool.path: sub-playbook 'tests/sub/does_not_exist' not found" in proc.stderr


@pytest.mark.smoke
def test_a_registered_playbook_runs_by_its_catalog_path(engine, tmp_path):
    copy = tmp_path / "elsewhere.yaml"  # not beside any parent: only the catalog can find it
    copy.write_text((SUB / "child.yaml").read_text().replace("tests/sub/child", "tests/sub/registered"))
    proc = cli(["register", str(copy)], engine.env)
    assert proc.returncode == 0, proc.stderr
    assert "registered tests/sub/registered" in proc.stdout
    run = engine.run("tests/sub/registered", {"x": 21})
    assert run.returncode == 0, run.stderr
    assert run.results["end"] == {"value": 42}


def test_a_playbook_task_with_a_sink_writes_each_childs_result(engine):
    run = engine.run(SUB / "parent_sink.yaml")
    assert run.returncode == 0, run.stderr
    assert [r["value"] for r in run.results["each"]["results"]] == [2, 4, 6]
    sinks = [e for e in engine.events(run.execution_id) if e["event_type"] == "sink.event_log"]
    assert sorted((e["result"]["n"], e["result"]["value"]) for e in sinks) == [(1, 2), (2, 4), (3, 6)]


def test_noetl_playbook_composition_runs_its_children_and_passes_its_own_validation(engine, pg_dsn):
    import psycopg2

    run = engine.run(corpus_file("legacy-2025-12/playbook_composition.yaml"))
    assert run.returncode == 0, run.stderr
    # the playbook's own checks: every child's score validated, then the end step's verdict
    validation = run.results["validate_results"]
    assert validation["status"] == "success" and validation["all_valid"] is True
    assert validation["valid_users"] == validation["total_users"] == 4
    assert run.results["end"]["validation_passed"] is True
    assert len(run.status["children"]) == 4
    # the per-iteration sink wrote each child's result (`this`) once
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT user_name, profile_score FROM public.user_profile_results WHERE execution_id = %s "
            "ORDER BY user_name",
            (str(run.execution_id),),
        )
        rows = cur.fetchall()
    scores = {r["user_name"]: r["profile_score"] for r in validation["validation_details"]}
    assert rows == sorted(scores.items())
    if engine.mode == "distributed":  # the parent and its children ran on both worker instances
        ids = [run.execution_id] + [c["execution_id"] for c in run.status["children"]]
        nodes = {(e["worker"] or "").split("@")[0] for i in ids for e in engine.events(i)}
        assert {"e2e-a", "e2e-b"} <= nodes, nodes


@pytest.mark.real_workers
def test_a_child_past_its_timeout_fails_and_fails_the_parents_task(engine):
    run = engine.run(SUB / "timeout_parent.yaml", {"seconds": 8, "limit": 1})
    assert run.returncode == 1, run.stderr
    assert run.status["failed_step"] == "start"
    error = run.status["error"]
    assert error["kind"] == "playbook" and error["root"]["kind"] == "timeout", error
    assert "ran past its playbook timeout" in error["message"]
    [child] = run.status["children"]
    assert child["status"] == "failed" and child["execution_id"] == error["child_execution_id"]
    assert engine.status(child["execution_id"])["error"]["kind"] == "timeout"


def test_a_child_within_its_timeout_completes(engine):
    run = engine.run(SUB / "timeout_parent.yaml", {"seconds": 0, "limit": 30})
    assert run.returncode == 0, run.stderr
    assert run.results["start"] == {"start": {"slept": 0}}
