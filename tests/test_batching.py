"""Micro-batching of loop iterations (`loop.spec.batch`): the playbook form, how dispatches are
grouped, and batches driven by hand through the worker and on_event on SQLite and PostgreSQL:
per-iteration rows and results, a redelivered batch counted once, a failing iteration retried
alone, a lost batch giving each iteration its outcome, and an old reader refusing the format."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import pytest

from noetl_celery.compiler import compile_playbook
from noetl_celery.dsl import load_plan
from noetl_celery.dsl.plan import Loop
from noetl_celery.engine.attempt import worker
from noetl_celery.engine.decision import batching, orchestrator
from noetl_celery.engine.messages import (
    BATCH_VERSION,
    MESSAGE_VERSION,
    READ_VERSION,
    VERSION_FIELD,
    Dispatch,
    MessageTooNew,
    TaskMessage,
    wire,
)
from noetl_celery.engine.recovery.sweeper import lost_outcome
from noetl_celery.runner import create_execution
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from tests.test_dsl import V10, compile_text, texts

BATCHED = Path(__file__).resolve().parent / "playbooks" / "loop_batched.yaml"  # cap 50, batch 8


def one_loop(loop: str) -> str:
    """A playbook body whose one step loops as `loop` (a flow mapping); the loop is on line 8."""
    return f"workflow:\n  - step: start\n    tool: {{kind: noop}}\n    loop: {loop}\n"


def loop_of(loop: str) -> Loop:
    found = compile_text(V10, one_loop(loop)).steps["start"].loop
    assert found is not None
    return found


def refused(loop: str) -> list[str]:
    return texts(V10, one_loop(loop))


# ---------------------------------------------------------------------------------------------
# The playbook form


def test_batch_is_read_from_spec_or_beside_it_and_defaults_to_one() -> None:
    assert loop_of("{in: [1], mode: parallel}").batch == 1
    assert loop_of("{in: [1], spec: {mode: parallel, batch: 16}}").batch == 16
    assert loop_of("{in: [1], mode: parallel, batch: auto}").batch == "auto"
    assert loop_of("{in: [1], spec: {mode: chunked, chunk_size: 10, batch: 4}}").batch == 4


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        ("{in: [1], spec: {mode: parallel, batch: 0}}", "batch must be a whole number from 1 to 1000, or auto; got 0"),
        ("{in: [1], spec: {mode: parallel, batch: many}}", "got 'many'"),
        ("{in: [1], spec: {mode: parallel, batch: 2.5}}", "got 2.5"),
        ("{in: [1], spec: {mode: parallel, batch: true}}", "got True"),
        ("{in: [1], spec: {mode: sequential, batch: 4}}", "a sequential loop runs one iteration at a time"),
        ("{in: [1], mode: parallel, batch: 2, spec: {batch: 4}}", "batch is given twice"),
    ],
)
def test_a_bad_batch_is_refused_with_its_line_and_path(loop: str, message: str) -> None:
    [problem] = refused(loop)
    assert problem.startswith("pb.yaml:8: workflow[0](start).loop")
    assert ".batch: " in problem and message in problem


def test_a_cursor_loop_refuses_batch() -> None:
    body = """\
    workflow:
      - step: start
        tool: {kind: noop}
        loop:
          cursor: {kind: postgres, auth: pg, claim: "SELECT 1"}
          spec: {max_in_flight: 4, batch: 8}
    """
    assert texts(V10, body) == [
        "pb.yaml:10: workflow[0](start).loop.spec.batch: batch only applies to a parallel or chunked loop: "
        "a cursor loop's frame (max_rows) sets how many rows a claim takes"
    ]


# ---------------------------------------------------------------------------------------------
# Grouping


def test_auto_spreads_the_cap_over_eight_messages_and_shrinks_for_slow_iterations() -> None:
    auto = loop_of("{in: [1], spec: {mode: parallel, max_in_flight: 100, batch: auto}}")
    assert batching.batch_size(auto, []) == 12  # 100 // 8
    assert batching.batch_size(auto, [0.5, 0.7]) == 12  # fast iterations: as many as the cap allows
    assert batching.batch_size(auto, [20.0]) == 5  # 100 ms of tool time per batch
    assert batching.batch_size(auto, [500.0]) == 1  # slow: one per message again
    wide = loop_of("{in: [1], spec: {mode: parallel, max_in_flight: 1000, batch: auto}}")
    assert batching.batch_size(wide, []) == batching.AUTO_MAX
    assert batching.batch_size(loop_of("{in: [1], spec: {mode: parallel, batch: 7}}"), [500.0]) == 7


def _plan_and_dispatches(n: int = 20):  # type: ignore[no-untyped-def]
    plan = compile_playbook(BATCHED, overrides={"n": n})

    def iteration(i: int, **changes: object) -> Dispatch:
        message = TaskMessage(
            execution_id=1, run_id="r", step="work", iteration=i, element=i, parent_event_id=f"r#{i}.start"
        )
        return Dispatch.task(message.evolve(**changes), label="loop_batched:work", timeout=30.0)

    return plan, iteration


def test_first_attempts_of_a_loop_are_grouped_and_everything_else_travels_alone() -> None:
    plan, iteration = _plan_and_dispatches()
    other = Dispatch.task(TaskMessage(execution_id=1, run_id="s", step="start"), label="x")
    retry = iteration(100, attempt=2)
    delayed = Dispatch.task(TaskMessage(execution_id=1, run_id="r", step="work", iteration=101), countdown=5)
    page = iteration(102, page=2)
    dispatches = [other, *(iteration(i) for i in range(10)), retry, delayed, page]
    grouped = batching.group(plan, dispatches, {})
    assert grouped[0] is other and grouped[-3:] == [retry, delayed, page]
    first, second = grouped[1:3]
    assert len(grouped) == 6
    assert first.message["iteration"] == 0 and [m["iteration"] for m in first.message["batch"]] == list(range(1, 8))
    assert second.message["iteration"] == 8 and [m["iteration"] for m in second.message["batch"]] == [9]
    # each further iteration carries only what differs from the first
    assert first.message["batch"][0] == {"iteration": 1, "element": 1, "parent_event_id": "r#1.start"}
    assert (first.timeout, second.timeout) == (8 * 30.0, 2 * 30.0)
    assert first.message[VERSION_FIELD] == BATCH_VERSION and other.message[VERSION_FIELD] == MESSAGE_VERSION


def test_auto_measures_the_loops_own_iterations_not_the_step_before_it() -> None:
    text = BATCHED.read_text().replace("batch: 8", "batch: auto")
    plan = load_plan("auto.yaml", text=text)
    _, iteration = _plan_and_dispatches()
    dispatches = [iteration(i) for i in range(12)]
    assert [len(d.message.get("batch") or []) + 1 for d in batching.group(plan, dispatches, {})] == [6, 6]  # 50 // 8
    slow_elsewhere = {"another-run": [900.0]}  # e.g. the step that built the collection
    assert len(batching.group(plan, dispatches, slow_elsewhere)) == 2
    assert len(batching.group(plan, dispatches, {"r": [900.0]})) == 12  # this loop's are slow: one each


def test_a_batch_message_unfolds_into_its_iterations_and_travels_in_the_batch_format() -> None:
    plan, iteration = _plan_and_dispatches()
    [batch] = batching.group(plan, [iteration(i) for i in range(3)], {})
    message = TaskMessage.from_dict(wire(batch.as_replay().message))
    members = message.members()
    assert [(m.iteration, m.element, m.parent_event_id, m.batch, m.replay) for m in members] == [
        (i, i, f"r#{i}.start", None, False) for i in range(3)
    ]
    assert wire(batch.message)[VERSION_FIELD] == BATCH_VERSION
    assert "batch of 3 (to iteration 2)" in message.describe()
    assert TaskMessage(execution_id=1, run_id="r", step="s").members()[0].batch is None


def test_a_reader_of_an_older_format_refuses_a_batch_instead_of_running_its_first_iteration(monkeypatch) -> None:
    from noetl_celery.engine import messages

    plan, iteration = _plan_and_dispatches()
    [batch] = batching.group(plan, [iteration(i) for i in range(3)], {})
    monkeypatch.setattr(messages, "READ_VERSION", MESSAGE_VERSION)  # a worker from before batches
    with pytest.raises(MessageTooNew, match="message format 2, newer than this worker reads"):
        TaskMessage.from_dict(wire(batch.message))
    TaskMessage.from_dict(wire(iteration(5).message))  # ordinary messages still read
    assert READ_VERSION >= BATCH_VERSION  # this code reads batches (and the cursor frames of format 3)


# ---------------------------------------------------------------------------------------------
# Batches through the worker and on_event, driven by hand


@pytest.fixture
def url(either_store: str) -> str:
    return either_store


def run(url: str, dispatch: Dispatch) -> dict:
    message = TaskMessage.from_dict(dispatch.message)
    payload = (worker.execute_batch if message.batch else worker.execute)(url, message, queue_id="test")
    assert payload is not None
    return payload


def loop_started(url: str, n: int, playbook: Path = BATCHED, **overrides: object) -> tuple[int, list[Dispatch]]:
    plan = compile_playbook(playbook, overrides={"n": n, **overrides})
    execution_id = create_execution(plan, url)
    [start] = orchestrator.handle_event(url, orchestrator.start_payload(execution_id))
    return execution_id, orchestrator.handle_event(url, run(url, start))


def events(url: str, execution_id: int) -> list[dict]:
    with transaction(url) as conn:
        return repo.list_events(conn, execution_id)


def drain(url: str, pending: list[Dispatch]) -> None:
    while pending:
        pending += orchestrator.handle_event(url, run(url, pending.pop(0)))


def test_a_batched_loop_keeps_two_rows_and_a_result_per_iteration(url):
    execution_id, first = loop_started(url, 60)  # cap 50 in batches of 8: 6 of 8 and one of 2
    assert [len(d.message.get("batch") or []) + 1 for d in first] == [8, 8, 8, 8, 8, 8, 2]
    payload = run(url, first[0])
    assert payload["kind"] == "batch" and [e["task"]["iteration"] for e in payload["events"]] == list(range(8))
    [refill] = orchestrator.handle_event(url, payload)  # 8 done: the next 8 indexes, in one message
    assert [refill.message["iteration"], *(m["iteration"] for m in refill.message["batch"])] == list(range(50, 58))
    drain(url, [*first[1:], refill])
    rows = events(url, execution_id)
    work = [r for r in rows if r["step"] == "work"]
    per_kind = Counter(r["event_type"] for r in work)
    assert per_kind["iteration.started"] == per_kind["iteration.completed"] == 60
    assert len(work) == 2 * 60 + 4  # step and loop start and end rows
    assert Counter(r["iteration"] for r in work if r["event_type"] == "iteration.completed") == Counter(range(60))
    with transaction(url) as conn:
        head = repo.execution_head(conn, execution_id)
        result = repo.run_results(conn, execution_id, work[0]["run_id"], "step.completed")
    assert head["status"] == "completed"
    assert result == [{"results": [2 * i for i in range(60)], "stats": {"total": 60, "success": 60, "failed": 0}}]


def test_a_redelivered_batch_is_counted_once_and_replays_its_decision(url):
    execution_id, first = loop_started(url, 60)
    payload = run(url, first[0])
    decided = orchestrator.handle_event(url, payload)
    again = orchestrator.handle_event(url, payload)  # the same outcomes delivered again
    assert [d.message["iteration"] for d in again] == [d.message["iteration"] for d in decided] == [50]
    assert all(d.message["replay"] for d in again)
    with transaction(url) as conn:
        loop = repo.get_loop(conn, first[0].message["run_id"])
    assert (loop["done"], loop["succeeded"]) == (8, 8)
    # a re-published copy of the batch finds its outcomes recorded and runs nothing
    assert worker.execute_batch(url, TaskMessage.from_dict(first[0].as_replay().message)) is None
    # the worker ran the batch again before it could ack (a crash after the commit): a no-op too
    assert orchestrator.handle_event(url, run(url, first[0])) != []
    with transaction(url) as conn:
        assert repo.get_loop(conn, first[0].message["run_id"])["done"] == 8


def test_a_batch_whose_later_outcome_exists_is_refused_whole(url):
    # a batch's outcomes are recorded together or not at all: one already there means a redelivery
    execution_id, first = loop_started(url, 60)
    payload = run(url, first[0])
    single = {
        "kind": "outcome",
        "execution_id": execution_id,
        **{k: payload["events"][3][k] for k in ("task", "outcome", "report")},
    }
    orchestrator.handle_event(url, single)
    orchestrator.handle_event(url, payload)
    with transaction(url) as conn:
        assert repo.get_loop(conn, first[0].message["run_id"])["done"] == 1  # the single one only


def test_a_failing_iteration_of_a_batch_is_retried_alone(url, tmp_path):
    playbook = tmp_path / "flaky.yaml"
    playbook.write_text(
        textwrap.dedent(
            """\
            apiVersion: noetl.io/v10
            kind: Playbook
            metadata: {name: flaky}
            workload: {n: 6}
            workflow:
              - step: start
                tool: {kind: python, args: {n: "{{ n }}"}, code: "result = list(range(n))"}
                next:
                  arcs: [{step: work}]
              - step: work
                loop: {in: "{{ start }}", iterator: x, spec: {mode: parallel, max_in_flight: 10, batch: 6}}
                tool:
                  kind: python
                  args: {x: "{{ iter.x }}", attempt: "{{ _attempt }}"}
                  code: |
                    if x == 2 and attempt < 3:
                        raise RuntimeError("flaky " + str(attempt))
                    result = x
                  spec:
                    policy:
                      rules:
                        - when: "{{ outcome.status == 'error' }}"
                          then: {do: retry, attempts: 3, backoff: fixed, delay: 0}
            """
        )
    )
    execution_id, [batch] = loop_started(url, 6, playbook=playbook)
    assert len(batch.message["batch"]) == 5
    retries = orchestrator.handle_event(url, run(url, batch))
    assert [(d.message["iteration"], d.message["attempt"], d.message.get("batch")) for d in retries] == [(2, 2, None)]
    drain(url, retries)
    rows = events(url, execution_id)
    assert Counter(r["event_type"] for r in rows if r["iteration"] == 2) == Counter(
        {"iteration.started": 1, "action.failed": 2, "retry.scheduled": 2, "iteration.completed": 1}
    )
    assert all(
        Counter(r["event_type"] for r in rows if r["iteration"] == i)["iteration.completed"] == 1 for i in range(6)
    )
    with transaction(url) as conn:
        assert repo.execution_head(conn, execution_id)["status"] == "completed"


def test_a_lost_batch_gives_each_of_its_iterations_the_outcome(url):
    execution_id, first = loop_started(url, 8)  # one batch of 8
    [batch] = first
    orchestrator.handle_event(url, lost_outcome(batch.message, "lost", "no outcome after 3 re-publishes", "sweeper"))
    rows = events(url, execution_id)
    failed = [r for r in rows if r["event_type"] == "iteration.failed"]
    assert sorted(r["iteration"] for r in failed) == list(range(8))
    assert {r["error"]["kind"] for r in failed} == {"lost"}
    with transaction(url) as conn:
        head = repo.execution_head(conn, execution_id)
    assert head["status"] == "failed"


RESUMABLE = Path(__file__).resolve().parent / "playbooks" / "loop_resume.yaml"


def test_a_failed_batched_loop_resumes_only_its_failed_iterations_each_alone(url, tmp_path):
    from noetl_celery.engine.recovery.resume import resume
    from noetl_celery.runner import execution_status

    playbook = tmp_path / "batched_resume.yaml"
    playbook.write_text(RESUMABLE.read_text().replace("max_in_flight: 3}", "max_in_flight: 6, batch: 3}"))
    gate = tmp_path / "gate"
    execution_id, first = loop_started(url, 12, playbook=playbook, gate=str(gate))
    assert [len(d.message["batch"]) + 1 for d in first] == [3, 3]
    drain(url, first)
    status = execution_status(url, execution_id)
    assert status["status"] == "failed" and status["failed_step"] == "work", status
    gate.write_text("open")
    _, again = resume(url, execution_id)
    assert [(d.message["iteration"], d.message["attempt"], d.message.get("batch")) for d in again] == [
        (1, 2, None),
        (4, 2, None),
        (7, 2, None),
        (10, 2, None),
    ]
    drain(url, again)
    status = execution_status(url, execution_id)
    assert status["status"] == "completed", status
    assert status["results"]["work"]["results"] == [10 * x for x in range(12)]
    rows = events(url, execution_id)
    failed = Counter(r["iteration"] for r in rows if r["event_type"] == "iteration.failed")
    completed = Counter(r["iteration"] for r in rows if r["event_type"] == "iteration.completed")
    assert failed == Counter([1, 4, 7, 10]) and completed == Counter(range(12))  # nothing that completed ran again


def test_a_batch_finishing_after_a_cancel_is_recorded_and_dispatches_nothing(url):
    from noetl_celery.engine.recovery.lifecycle import end_tree

    execution_id, first = loop_started(url, 60)
    payload = run(url, first[0])
    with transaction(url) as conn:
        end_tree(conn, execution_id, "cancelled", "execution.cancelled", {"kind": "cancelled", "message": "x"})
    assert orchestrator.handle_event(url, payload) == []  # no refill after the cancel
    rows = {r["event_id"]: r for r in events(url, execution_id)}
    outcomes = [rows[TaskMessage.from_dict(e["task"]).outcome_key()] for e in payload["events"]]
    assert len(outcomes) == 8 and all(r["meta"].get("ignored") for r in outcomes)  # kept for a resume
    with transaction(url) as conn:
        assert repo.get_loop(conn, first[0].message["run_id"])["done"] == 0


def test_nothing_is_batched_while_a_rolling_upgrades_older_workers_read_no_batch(monkeypatch) -> None:
    """NOETL_MESSAGE_FORMAT=1 (the newest format the release being replaced reads): every
    iteration travels alone, in format 1."""
    plan, iteration = _plan_and_dispatches()
    dispatches = [iteration(i) for i in range(10)]
    assert len(batching.group(plan, dispatches, {})) < len(dispatches)
    monkeypatch.setenv("NOETL_MESSAGE_FORMAT", "1")
    grouped = batching.group(plan, dispatches, {})
    assert grouped == dispatches and all(wire(d.message)[VERSION_FIELD] == MESSAGE_VERSION for d in grouped)
