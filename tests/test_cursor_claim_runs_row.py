"""A cursor claim that runs its first row (engine/decision/cursor_loop.py, `run`): the claim's job
runs the first claimed row's first task too, and reports that row's outcome, recorded under the
claim's key. A row with a one-task body is then one job and one event row, with a frame or
without; a redelivered claim job runs nothing again; a claim whose job died is tried again and
takes its slot's rows back. In-process, on SQLite and PostgreSQL (the demo queue's SQLite driver)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import cursor_loop, orchestrator
from noetl_celery.engine.ids import claim_key
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.recovery.sweeper import lost_outcome
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.support.harness import run_playbook

DEMO = Path(__file__).resolve().parents[1] / "playbooks" / "cursor_queue.yaml"
FRAME = "        frame: {max_rows: 2, lease_seconds: 60}\n"


@pytest.fixture
def url(either_store: str) -> str:
    return either_store


def without_frame(tmp_path: Path) -> Path:
    """The demo queue with no frame: each claim takes one row."""
    text = DEMO.read_text()
    assert FRAME in text and "LIMIT {{ __frame_max_rows }})" in text
    path = tmp_path / "cursor_queue_no_frame.yaml"
    path.write_text(text.replace(FRAME, "").replace("{{ __frame_max_rows }}", "1"))
    return path


def attempt(url: str, dispatch: Dispatch) -> dict:
    payload = worker.execute(url, TaskMessage.from_dict(dispatch.message), queue_id="test")
    assert payload is not None
    return payload


def drain_rows(url: str, execution_id: int) -> list[dict]:
    with transaction(url) as conn:
        return [e for e in repo.list_events(conn, execution_id) if e["step"] == "drain"]


@pytest.mark.parametrize("framed", [False, True])
def test_a_cursor_row_with_a_one_task_body_is_one_event_row_frame_or_not(tmp_path, framed):
    jobs = 24
    playbook = DEMO if framed else without_frame(tmp_path)
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    code, status = run_playbook(url, playbook, {"jobs": jobs, "queue_db": str(tmp_path / "queue.sqlite")})
    assert code == 0 and status["status"] == "completed", status
    assert status["results"]["report"]["done"] == jobs
    rows = drain_rows(url, status["execution_id"])
    kinds = Counter(e["event_type"] for e in rows)
    assert kinds == {  # one row per row, plus one per slot and four for the step and its loop
        "cursor.item.done": jobs,
        "cursor.slot.ended": 4,
        "step.started": 1,
        "iterator.started": 1,
        "iterator.completed": 1,
        "step.completed": 1,
    }, kinds
    items = [e for e in rows if e["event_type"] == "cursor.item.done"]
    claimed = [e for e in items if "claimed" in e["meta"]]
    # each claim that took rows ran its first one, recorded under the claim's own key
    assert sum(e["meta"]["claimed"]["rows"] for e in claimed) == jobs
    assert jobs / 2 <= len(claimed) <= jobs if framed else len(claimed) == jobs  # frames of 2: half
    for e in claimed:
        key = claim_key(e["run_id"], e["meta"]["slot"], e["meta"]["claim"], e["meta"]["claimed"]["attempt"])
        assert e["event_id"] == key + ".done"
    assert sorted(e["meta"]["row"]["id"] for e in items) == list(range(1, jobs + 1))


def _first_claim(url: str, tmp_path: Path) -> tuple[int, Dispatch]:
    plan = compile_playbook(without_frame(tmp_path), overrides={"jobs": 6, "queue_db": str(tmp_path / "q.sqlite")})
    execution_id = create_execution(plan, url)
    [seed] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    claims = orchestrator.handle_event(url, attempt(url, seed))
    assert len(claims) == 4 and all(
        c.message["slot"] == {"id": n, "claim": 0, "phase": "claim", "index": 0, "run": True}
        for n, c in enumerate(claims)
    )
    return execution_id, claims[0]


def test_the_claims_job_reports_its_rows_outcome_and_a_redelivered_job_runs_nothing_again(url, tmp_path):
    execution_id, claim = _first_claim(url, tmp_path)
    message = TaskMessage.from_dict(claim.message)
    payload = attempt(url, claim)
    reported = TaskMessage.from_dict(payload["task"])
    assert reported.slot == {"id": 0, "claim": 0, "phase": "row", "index": 0, "via": 1}  # a frame of one row
    assert (reported.iteration, reported.element) == (0, {"id": 1, "n": 1})
    assert payload["outcome"]["status"] == "ok" and payload["outcome"]["data"] == {"id": 1, "square": 1}
    assert reported.outcome_key() == message.outcome_key()
    [next_claim] = orchestrator.handle_event(url, payload)
    assert next_claim.message["slot"]["phase"] == "claim" and next_claim.message["slot"]["index"] == 1
    assert worker.already_done(url, message)  # a redelivered claim job replays, never claims again
    [again] = orchestrator.handle_event(url, payload)  # a redelivered outcome: its decision sent again
    assert again.message["slot"] == next_claim.message["slot"] and again.message["replay"] is True
    with transaction(url) as conn:
        assert repo.get_loop(conn, message.run_id)["done"] == 1  # counted once
    [item] = [e for e in drain_rows(url, execution_id) if e["event_type"] == "cursor.item.done"]
    assert item["event_id"] == message.outcome_key() and item["meta"]["claimed"] == {"attempt": 1, "rows": 1}


def test_a_claim_whose_job_died_is_tried_again_and_takes_its_slots_row_back(url, tmp_path):
    execution_id, claim = _first_claim(url, tmp_path)
    attempt(url, claim)  # the claim committed and the row ran, but its job died before it reported
    lost = lost_outcome(claim.message, ErrorKind.WORKER_LOST, "the worker's process died", "test")
    [retry] = orchestrator.handle_event(url, lost)
    assert retry.countdown > 0 and retry.message["attempt"] == 2 and retry.message["slot"]["run"] is True
    payload = attempt(url, retry)
    reported = TaskMessage.from_dict(payload["task"])
    assert reported.element == {"id": 1, "n": 1} and reported.slot["via"] == 2  # the slot's own row, back
    orchestrator.handle_event(url, payload)
    kinds = Counter(e["event_type"] for e in drain_rows(url, execution_id))
    assert kinds["cursor.claim.failed"] == 1 and kinds["cursor.item.done"] == 1


def test_a_claim_runs_its_row_only_when_the_first_task_is_a_workers(tmp_path):
    text = DEMO.read_text()
    worker_task = compile_playbook(DEMO).steps["drain"]
    routing = tmp_path / "routing.yaml"
    tool = text[
        text.index("    tool:\n      kind: python\n      args: {id:") : text.index(
            "    next:\n      arcs:\n        - step: report"
        )
    ]
    routing.write_text(text.replace(tool, "    tool: {kind: noop}\n"))
    assert cursor_loop.runs_with_claim(worker_task)
    assert not cursor_loop.runs_with_claim(compile_playbook(routing).steps["drain"])
