"""Bounds on steps, decided in-process (no worker, no broker).

- Steps without work (no tool, noop, end, router) are decided inside one decision: a linear chain
  of 150 `noop` steps failed "more than 200 steps without work in a row" (each step was counted
  twice, and each nested a few Python frames deeper: past about 200 steps, RecursionError). The
  chain now runs in a loop; its bound (MAX_INLINE_DEPTH) counts each step once and still ends a
  cycle of steps without work.
- An arc cycle whose steps do work never ended without a playbook `timeout:`: NOETL_MAX_STEPS
  bounds the step runs of one execution.
"""

from __future__ import annotations

import time

import pytest

from noetl_celery import runner
from noetl_celery.compiler import compile_playbook
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.store.db import migrate

HEAD = "apiVersion: noetl.io/v10\nkind: Playbook\nmetadata: {name: bounds}\nworkflow:\n"


def chain(n: int) -> str:
    """n noop steps, each the next one's only arc."""
    steps = [
        f"  - step: s{i}\n    tool: {{kind: noop}}\n    next: {{arcs: [{{step: s{i + 1}}}]}}\n" for i in range(n - 1)
    ]
    return HEAD + "".join(steps) + f"  - step: s{n - 1}\n    tool: {{kind: noop}}\n"


WORK_CYCLE = HEAD + (
    "  - step: start\n"
    "    tool: {kind: python, code: 'result = 1'}\n"
    "    next: {arcs: [{step: again}]}\n"
    "  - step: again\n"
    "    tool: {kind: noop}\n"
    "    next: {arcs: [{step: start}]}\n"
)
IDLE_CYCLE = HEAD + (
    "  - step: start\n    next: {arcs: [{step: again}]}\n  - step: again\n    tool: {kind: noop}\n"
    "    next: {arcs: [{step: start}]}\n"
)
NOOP_LOOP = HEAD + (
    "  - step: start\n"
    "    loop: {in: '{{ range(600) | list }}', iterator: x, spec: {mode: parallel, max_in_flight: 4}}\n"
    "    tool: {kind: noop, args: {x: '{{ iter.x }}'}}\n"
)


@pytest.fixture
def url(sqlite_url: str) -> str:
    migrate(sqlite_url)
    return sqlite_url


def run(url: str, tmp_path, text: str, max_decisions: int = 200) -> tuple[dict, list[dict]]:
    """Decide the execution to its end here: every task message runs in this process."""
    path = tmp_path / "pb.yaml"
    path.write_text(text)
    execution_id = runner.create_execution(compile_playbook(path), url)
    pending = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    for _ in range(max_decisions):
        if not pending:
            break
        payload = worker.execute(url, TaskMessage.from_dict(pending.pop(0).message), queue_id="test")
        assert payload is not None
        pending += orchestrator.handle_event(url, payload)
    else:
        raise AssertionError(f"still deciding after {max_decisions} decisions")
    return runner.execution_status(url, execution_id), runner.execution_events(url, execution_id)


def started(events: list[dict]) -> int:
    return sum(1 for e in events if e["event_type"] == "step.started")


def test_a_chain_of_150_noop_steps_completes(url, tmp_path):
    began = time.monotonic()
    status, events = run(url, tmp_path, chain(150))
    assert status["status"] == "completed", status.get("error")
    assert started(events) == 150
    assert time.monotonic() - began < 30


def test_the_bound_on_steps_without_work_counts_each_step_once(url, tmp_path, monkeypatch):
    bound = 40
    monkeypatch.setattr(orchestrator, "MAX_INLINE_DEPTH", bound)
    status, _ = run(url, tmp_path, chain(bound))
    assert status["status"] == "completed", status.get("error")
    status, _ = run(url, tmp_path, chain(bound + 1))
    assert status["status"] == "failed"
    assert status["error"]["kind"] == "routing"
    assert f"more than {bound} steps without work in a row" in status["error"]["message"]


def test_a_cycle_of_steps_without_work_fails_in_its_first_decision(url, tmp_path):
    status, events = run(url, tmp_path, IDLE_CYCLE)
    assert status["status"] == "failed" and status["error"]["kind"] == "routing", status
    assert started(events) == orchestrator.MAX_INLINE_DEPTH + 1


def test_a_loop_of_600_noop_iterations_completes(url, tmp_path):
    status, _ = run(url, tmp_path, NOOP_LOOP)
    assert status["status"] == "completed", status.get("error")
    assert len(status["results"]["start"]["results"]) == 600


def test_an_arc_cycle_with_work_ends_at_the_step_bound(url, tmp_path, monkeypatch):
    monkeypatch.setenv("NOETL_MAX_STEPS", "40")
    status, events = run(url, tmp_path, WORK_CYCLE)
    assert status["status"] == "failed", status
    assert status["error"]["kind"] == "limit"
    assert "more than 40 step runs (NOETL_MAX_STEPS)" in status["error"]["message"]
    assert "timeout:" in status["error"]["message"]
    # checked once the state version (one per decision storing a step's result: here one per
    # turn of the cycle, two step runs) passed the bound too
    assert 40 < started(events) <= 2 * 40 + 2
    assert events[-1]["event_type"] == "execution.failed"


def test_the_step_bound_has_a_default_and_refuses_nonsense(monkeypatch):
    from noetl_celery.config import limits
    from noetl_celery.core.errors import ConfigurationError

    monkeypatch.delenv("NOETL_MAX_STEPS", raising=False)
    assert limits.max_steps() == 100_000
    monkeypatch.setenv("NOETL_MAX_STEPS", "0")
    with pytest.raises(ConfigurationError, match="NOETL_MAX_STEPS must be a positive whole number"):
        limits.max_steps()
