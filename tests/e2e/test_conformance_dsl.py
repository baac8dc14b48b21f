"""NoETL conformance, the DSL and template side, end to end on both deployments: each wrong
behaviour found against NoETL's own playbooks has a minimal playbook here, and the corpus files
that need only local services run to the outcome their own checks assert."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from noetl_celery.engine.context import JOB_UUID_NAMESPACE
from tests.support.corpus import corpus_file

PLAYBOOKS = Path(__file__).resolve().parents[1] / "playbooks" / "conformance"


def corpus(name: str) -> Path:
    return corpus_file(name)


def completed(run) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.status["status"] == "completed" and run.status["error"] is None, run.status
    return run.results


def test_template_names_noetl_provides(engine):
    run = engine.run(PLAYBOOKS / "template_names.yaml")
    results = completed(run)
    end = results["end"]
    assert end["data_alias"] == [1, 2, 3]  # `{{ start.data }}` of a list result is the list
    assert end["first"] == 1 and end["count"] == 3  # bare set: keys, `output` in set: and in arcs
    assert end["url"] == "http://example.invalid/api/x"  # root ctx key as a bare name
    assert end["uuid"] == str(uuid.uuid5(JOB_UUID_NAMESPACE, str(run.execution_id)))
    assert end["same_id"] is True
    # loop_index, and main(num, pos, base) filled from the iteration and the workload
    assert end["results"] == [{"num": n, "pos": n - 1, "scaled": n * 10} for n in (1, 2, 3)]


def test_arc_args_reach_the_target_steps_args_also_beside_then(engine):
    run = engine.run(PLAYBOOKS / "arc_args.yaml")
    results = completed(run)
    assert results["direct"] == {"x": 42}  # next: [{step, args: {x: 41}}] -> main(x) with x = 41
    assert results["beside"] == {"y": 42}  # args: written beside then: are kept
    started = {e["step"]: e for e in engine.events(run.execution_id) if e["event_type"] == "step.started"}
    assert started["direct"]["context"] == {"args": {"x": 41}}
    assert started["beside"]["context"] == {"args": {"y": 42}}


@pytest.mark.parametrize(
    "playbook",
    [
        "iteration_error.yaml",  # set_iter fails after a worker's call
        "iteration_error_inline.yaml",
    ],
)  # a routing-only task, on_event
def test_every_failed_iteration_records_its_error_and_the_step_names_them(engine, playbook):
    run = engine.run(PLAYBOOKS / playbook)
    assert run.status["status"] == "failed", run.status
    events = engine.events(run.execution_id)
    failed = [e for e in events if e["event_type"] == "iteration.failed"]
    assert sorted(e["iteration"] for e in failed) == [0, 1]
    for row in failed:
        assert row["error"]["kind"] == "template"
        assert "no_such_name" in row["error"]["message"]
        assert row["error"]["task"] == "work"
    (step_failed,) = [e for e in events if e["event_type"] == "step.failed"]
    message = step_failed["error"]["message"]
    assert message.startswith("2 of 2 iterations failed: [0] ") and "[1] " in message
    assert "no_such_name" in message
    assert [f["index"] for f in step_failed["error"]["failures"]] == [0, 1]


def test_v2_case_then_list_set_and_result_and_a_result_hint(engine):
    results = completed(engine.run(PLAYBOOKS / "case_actions.yaml"))
    assert results["start"] == {"n": 2, "tag": "shaped"}  # then.result replaced the call's data
    assert results["pick"] == [5, 6]  # result: {output_select: data.items}
    assert results["end"] == {"doubled": 4, "seen": "shaped", "shaped": {"n": 2, "tag": "shaped"}, "picked": [5, 6]}


@pytest.mark.smoke
def test_renames_era_pagination_with_bare_set_keys(engine, mock_api):
    run = engine.run(corpus("renames-2026-04/pagination_basic_set.yaml"), {"api_url": mock_api.url})
    results = completed(run)
    assert results["validate_results"] == {
        "status": "success",
        "total_items": 35,
        "first_id": 1,
        "last_id": 35,
        "expected": 35,
    }
    events = engine.events(run.execution_id)
    pages = [e for e in events if e["event_type"] == "action.completed" and e["step"] == "fetch_page"]
    assert len(pages) == 4  # 35 items, 10 a page


def test_legacy_sub_playbook_runs_standalone_with_its_defaults(engine):
    results = completed(engine.run(corpus("legacy-2025-12/user_profile_scorer.yaml")))
    final = results["finalize_result"]
    assert final["processing_status"] == "completed" and final["user_name"] == "TestUser"
    # 5 years: 25 * 0.4 ... as the playbook's own workbook computes them
    assert final["score_breakdown"] == {"experience": 6.0, "performance": 6.58, "department": 2.25, "age": 1.0}
    assert final["profile_score"] == 15.8 and final["score_category"] == "Junior"
