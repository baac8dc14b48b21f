"""`noetl-celery replay`: a recorded execution decided again by the code that runs now.

Executions are recorded in-process (tests/support/harness.py) on SQLite; replay makes their
decisions again on the execution held in memory and compares. Zero differences for the examples and for an
execution with retries (jittered ones too) and a loop; exactly one, at the first retry's
decision, when the retry rule's code changes between recording and replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from noetl_celery import replay
from noetl_celery.compiler import compile_source
from noetl_celery.engine.decision import policy_eval
from noetl_celery.store import db, repo
from tests.support.engines import REPO_ROOT, cli
from tests.support.harness import Harness, run_playbook
from tests.support.mockapi import start_mock_api

EXAMPLES = REPO_ROOT / "playbooks"
# the examples that run without a server of their own (http_mock runs against the bundled mock API)
STANDALONE = ["branching.yaml", "cursor_queue.yaml", "fan_out_join.yaml", "hello_world.yaml", "loop_parallel.yaml"]

RETRIES_AND_A_LOOP = """
apiVersion: noetl.io/v10
kind: Playbook
metadata: {name: replay_retries}
workload:
  items: [1, 2, 3, 4, 5]
workflow:
  - step: start
    tool: {kind: python, code: "result = 1"}
    next:
      arcs: [{step: each}]
  - step: each
    loop: {in: "{{ workload.items }}", iterator: n, spec: {mode: parallel, max_in_flight: 2}}
    tool:
      kind: python
      args: {n: "{{ iter.n }}", attempt: "{{ _attempt }}"}
      code: |
        if n % 2 and attempt < 3:
            raise ValueError(f"item {n} fails its attempt {attempt}")
        result = n * 10
      spec:
        policy:
          rules:
            - when: "{{ outcome.status == 'error' }}"
              then: {do: retry, attempts: 4, backoff: exponential, delay: 0.5, jitter: JITTER}
    next:
      arcs: [{step: total}]
  - step: total
    tool:
      kind: python
      args: {values: "{{ each.results }}"}
      code: "result = sum(values)"
"""


@pytest.fixture
def store(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'recorded.sqlite'}"
    db.migrate(url)
    return url


def record(url: str, playbook: Path, sets: dict[str, Any] | None = None) -> int:
    code, status = run_playbook(url, playbook, sets)
    assert code == 0, status
    return int(status["execution_id"])


def record_text(url: str, tmp_path: Path, text: str) -> int:
    path = tmp_path / "replay_retries.yaml"
    path.write_text(text)
    return record(url, path)


def snapshot(url: str, execution_id: int) -> tuple[Any, ...]:
    with db.transaction(url) as conn:
        return repo.get_execution(conn, execution_id), repo.list_events(conn, execution_id)


@pytest.mark.parametrize("name", STANDALONE)
def test_the_examples_replay_without_a_difference(store, name):
    execution_id = record(store, EXAMPLES / name)
    before = snapshot(store, execution_id)
    report = replay.replay(store, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))
    assert report.decisions > 2
    assert snapshot(store, execution_id) == before  # nothing written to the replayed store


def test_the_batched_loop_example_replays_without_a_difference(store):
    execution_id = record(store, EXAMPLES / "loop_batched.yaml", {"n": 120})
    report = replay.replay(store, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))


def test_the_http_example_with_a_retry_and_pages_replays_without_a_difference(store):
    with start_mock_api() as api:
        execution_id = record(store, EXAMPLES / "http_mock.yaml", {"api_url": api.url})
    with db.transaction(store) as conn:
        types = {row["event_type"] for row in repo.list_events(conn, execution_id)}
    assert {"retry.scheduled", "page.completed"} <= types
    report = replay.replay(store, execution_id)  # the API is gone: no tool runs
    assert report.difference is None, "\n".join(replay.describe(report))


def test_a_paginated_loop_replays_from_what_its_attempts_reported(store):
    """An iteration's row shows the collected pages as its result; the last page, which the
    attempt reported and the decision reads, is kept in its meta.reported."""
    with start_mock_api() as api:
        execution_id = record(store, REPO_ROOT / "tests/playbooks/pagination_loop_parallel.yaml", {"api_url": api.url})
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, execution_id)
    (last_page, *_) = [r for r in rows if r["event_type"] == "iteration.completed"]
    assert isinstance(last_page["result"], list)
    assert last_page["meta"]["reported"]["result"]["status_code"] == 200  # the last page's response
    report = replay.replay(store, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))


@pytest.mark.parametrize("jitter", ["false", "true"])
def test_retries_in_a_loop_replay_without_a_difference(store, tmp_path, jitter):
    execution_id = record_text(store, tmp_path, RETRIES_AND_A_LOOP.replace("JITTER", jitter))
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, execution_id)
    retries = [r for r in rows if r["event_type"] == "retry.scheduled"]
    assert len(retries) == 6  # items 1, 3 and 5, twice each
    report = replay.replay(store, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))
    assert report.decisions == 1 + sum(r["event_type"] in replay.OUTCOME_TYPES for r in rows)  # the start, each outcome


def test_rows_of_two_decisions_whose_inserts_interleaved_are_told_apart(store, tmp_path):
    """Two retries of one loop are not serialized by a row lock: on PostgreSQL their rows' ids
    may interleave. Each row goes to the decision that wrote its parent."""
    execution_id = record_text(store, tmp_path, RETRIES_AND_A_LOOP.replace("JITTER", "false"))
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, execution_id)
        decisions = replay.recorded_decisions(conn, rows)
        index = next(
            i
            for i, d in enumerate(decisions)
            if [r["event_type"] for r in d.rows] == ["action.failed", "retry.scheduled"]
        )
        a, b = decisions[index], decisions[index + 1]
        first = next(i for i, r in enumerate(rows) if r["id"] == a.rows[0]["id"])
        mixed = [
            *rows[:first],
            a.rows[0],
            b.rows[0],
            a.rows[1],
            *b.rows[1:],
            *rows[first + len(a.rows) + len(b.rows) :],
        ]
        assert len(mixed) == len(rows) and len(b.rows) > 1
        again = replay.recorded_decisions(conn, mixed)
    assert [[r["id"] for r in d.rows] for d in again] == [[r["id"] for r in d.rows] for d in decisions]


def test_a_changed_retry_rule_is_the_one_difference_reported(store, tmp_path, monkeypatch):
    execution_id = record_text(store, tmp_path, RETRIES_AND_A_LOOP.replace("JITTER", "false"))
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, execution_id)
    first_failure = next(r for r in rows if r["event_type"] == "action.failed" or r["event_type"] == "iteration.failed")
    decided = policy_eval.next_backoff
    monkeypatch.setattr(
        policy_eval, "next_backoff", lambda action, attempt, retry_after=None: decided(action, attempt) * 2
    )

    report = replay.replay(store, execution_id)

    difference = report.difference
    assert difference is not None
    assert difference.event_id == first_failure["event_id"]
    recorded = [r for r in difference.recorded_rows if r["event_type"] == "retry.scheduled"]
    new = [r for r in difference.new_rows if r["event_type"] == "retry.scheduled"]
    assert [r["meta"]["delay"] for r in recorded] == [0.5]
    assert [r["meta"]["delay"] for r in new] == [1.0]
    assert [d["countdown"] for d in difference.recorded_dispatches] == [0.5]
    assert [d["countdown"] for d in difference.new_dispatches] == [1.0]
    assert "meta" in difference.reason
    shown = "\n".join(replay.describe(report))
    assert f"first difference: the decision on row {first_failure['id']}" in shown
    assert "delay': 0.5" in shown and "delay': 1.0" in shown and "countdown=1.0" in shown
    assert json.loads(json.dumps(report.to_dict(), default=str))["same"] is False
    # every decision before it was the same: the start's, the outcomes' before it, then this one
    assert report.decisions == 2 + sum(
        1 for r in rows if r["id"] < first_failure["id"] and r["event_type"] in replay.OUTCOME_TYPES
    )


def test_a_retry_limit_lowered_in_the_code_fails_where_the_record_retried(store, tmp_path, monkeypatch):
    execution_id = record_text(store, tmp_path, RETRIES_AND_A_LOOP.replace("JITTER", "false"))
    original = policy_eval.decide

    def lowered(policy, outcome, context):  # type: ignore[no-untyped-def]
        verdict = original(policy, outcome, context)
        if verdict.action.do == "retry":
            return policy_eval.Verdict(verdict.action.model_copy(update={"attempts": 1}), verdict.rule, [])
        return verdict

    monkeypatch.setattr(policy_eval, "decide", lowered)
    report = replay.replay(store, execution_id)
    difference = report.difference
    assert difference is not None
    assert "retry.exhausted" in {r["event_type"] for r in difference.new_rows}
    assert "retry.scheduled" in {r["event_type"] for r in difference.recorded_rows}
    assert difference.new_dispatches != difference.recorded_dispatches


@pytest.mark.parametrize("sets", [{}, {"fail_at": 2}], ids=["completed", "a_child_fails"])
def test_a_parent_and_its_children_replay_without_a_difference(store, sets):
    code, status = run_playbook(store, REPO_ROOT / "tests/playbooks/sub/parent.yaml", sets)
    assert code == (1 if sets else 0)
    with db.transaction(store) as conn:
        children = [c["execution_id"] for c in repo.child_executions(conn, status["execution_id"])]
    assert len(children) == 4
    for execution_id in [status["execution_id"], *children]:
        report = replay.replay(store, execution_id)
        assert report.difference is None, "\n".join(replay.describe(report))


def test_an_execution_recorded_on_postgresql_replays_without_a_difference(migrated_postgres, tmp_path):
    execution_id = record_text(migrated_postgres.url, tmp_path, RETRIES_AND_A_LOOP.replace("JITTER", "true"))
    report = replay.replay(migrated_postgres.url, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))
    assert report.decisions > 10
    assert json.loads(json.dumps(report.to_dict()))["same"] is True  # what `replay --json` prints


def cancelled_after_three_decisions(store: str, tmp_path: Path) -> int:
    """An execution of RETRIES_AND_A_LOOP cancelled after three decisions, then drained: the
    outcomes that arrive after the cancel are recorded and ignored. Returns its id."""
    from noetl_celery import runner

    path = tmp_path / "replay_retries.yaml"
    path.write_text(RETRIES_AND_A_LOOP.replace("JITTER", "false"))
    harness = Harness(store)
    execution_id = harness.start(compile_source(str(path), {}, None))
    for _ in range(3):
        harness.step()
    runner.cancel(store, execution_id, "enough")
    harness.drain()
    return execution_id


def test_a_cancelled_execution_replays_its_ignored_outcomes(store, tmp_path):
    execution_id = cancelled_after_three_decisions(store, tmp_path)
    with db.transaction(store) as conn:
        rows = repo.list_events(conn, execution_id)
    assert any((r["meta"] or {}).get("ignored") for r in rows)
    report = replay.replay(store, execution_id)
    assert report.difference is None, "\n".join(replay.describe(report))


def test_a_resumed_execution_is_refused_naming_its_resume(store):
    from noetl_celery.engine.recovery.resume import resume

    code, status = run_playbook(store, REPO_ROOT / "tests/playbooks/loop_failures.yaml")
    assert code == 1
    execution_id = int(status["execution_id"])
    harness = Harness(store)
    _, dispatches = resume(store, execution_id)
    harness.send(dispatches)
    harness.drain()
    with pytest.raises(replay.ReplayError, match=rf"execution {execution_id} was resumed \(row \d+\): resume archives"):
        replay.replay(store, execution_id)


def test_the_command_replays_an_execution_its_embedded_worker_ran(tmp_path):
    """Recorded by `noetl-celery run` (a Celery worker, inline decisions on cached state), replayed
    by `noetl-celery replay` from that store; an unknown id exits 2."""
    store = f"sqlite:///{tmp_path / 'recorded.sqlite'}"
    path = tmp_path / "replay_retries.yaml"
    path.write_text(RETRIES_AND_A_LOOP.replace("JITTER", "true").replace("delay: 0.5", "delay: 0.05"))
    env = {"NOETL_HOME": str(tmp_path / "home"), "NOETL_DATABASE_URL": store}
    ran = cli(["run", "--json", "--quiet", str(path)], env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    execution_id = json.loads(ran.stdout)["execution_id"]
    env = {"NOETL_HOME": str(tmp_path / "elsewhere")}
    proc = cli(["replay", str(execution_id), "--from-store", store], env)
    assert proc.returncode == 0, proc.stderr
    assert "no decision differs" in proc.stdout
    missing = cli(["replay", "42", "--from-store", store], env)
    assert missing.returncode == 2
    assert "no execution 42" in missing.stderr
