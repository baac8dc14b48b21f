"""Tests of the example playbooks, written as a playbook author writes them: noetl_celery.testing
runs each playbook in this process, its HTTP calls mocked, its retry backoffs skipped.

    pytest playbooks/
"""

from __future__ import annotations

from pathlib import Path

from noetl_celery.testing import fails, run_playbook, sequence

HERE = Path(__file__).resolve().parent


def page(number: int, ids: range, more: bool) -> dict:
    """One page of the mock API's assessments, as the http tool returns it."""
    return {"data": [{"id": i} for i in ids], "paging": {"page": number, "hasMore": more}}


def test_hello_world_takes_the_long_branch_by_default():
    run = run_playbook(HERE / "hello_world.yaml")
    assert run.status == "completed" and run.exit_code == 0
    assert run.results["end"] == {"greeting": "HELLO WORLD FROM NOETL_CELERY", "branch": "long"}
    assert "short_greeting" not in run.results


def test_hello_world_takes_the_short_branch_for_a_short_message():
    run = run_playbook(HERE / "hello_world.yaml", set={"message": "Hi"})
    assert run.results["end"] == {"greeting": "Hi", "branch": "short"}


def test_http_mock_retries_a_503_and_collects_every_page(noetl_playbook):
    run = noetl_playbook(
        HERE / "http_mock.yaml",
        mocks={
            "fetch_flaky": sequence(fails("http", "HTTP 503", retryable=True, status=503), {"status_code": 200}),
            "fetch_all": sequence(page(1, range(1, 11), True), page(2, range(11, 16), False)),
        },
    )
    assert run.status == "completed", run.error
    assert run.results["summarize"] == {"flaky_status": 200, "items": 15, "first_id": 1, "last_id": 15}
    assert len(run.calls["fetch_flaky"]) == 2  # the failure, then the retry
    assert [call["params"]["page"] for call in run.calls["fetch_all"]] == [1, 2]  # the next page asked for
    assert "retry.scheduled" in run.event_types()


def test_a_step_that_keeps_failing_fails_the_run_with_its_error(noetl_playbook):
    run = noetl_playbook(
        HERE / "http_mock.yaml", mocks={"kind:http": fails("http", "HTTP 503", retryable=True, status=503)}
    )
    assert run.status == "failed" and run.exit_code == 1
    assert len(run.calls["fetch_flaky"]) == 3  # max_attempts
