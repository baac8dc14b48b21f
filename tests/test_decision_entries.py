"""The writes a strategy decides are entries of its decision (engine/decision/entries.py).

A strategy is handed a port that records the entries it applies and answers them from memory,
and reads held in memory: no database. The entries it yields are the writes it decided; write.py
(`apply_entry`) alone turns them into statements, and a guarded entry refused there makes the
event be decided again (Redecide).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from noetl_celery.config import limits
from noetl_celery.core import vocabulary as ev
from noetl_celery.dsl.plan import Loop, Step
from noetl_celery.engine.decision import cursor_loop, loops, write
from noetl_celery.engine.decision import entries as en
from noetl_celery.engine.decision.inputs import Bound, Bounds, DecisionInputs
from noetl_celery.engine.decision.rows import Row, recorded
from noetl_celery.engine.decision.sql_store import SqlDecisionStore
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.decision.value import Decision
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.store import repo
from tests.support.reads import ReadsInMemory

EXECUTION = 7


@dataclass
class EntriesPort:
    """A `DecisionPort` that keeps what a strategy decided: rows, messages, entries, step ends.
    `answers`: what an applied entry gives back, by entry type."""

    reads: ReadsInMemory = field(default_factory=ReadsInMemory)
    answers: dict[type, Callable[[Any], Any]] = field(default_factory=dict)
    entries: list[en.Entry] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    sent: list[TaskMessage] = field(default_factory=list)
    ended: list[tuple[str, UnitEnd]] = field(default_factory=list)
    inputs: DecisionInputs = field(
        default_factory=lambda: DecisionInputs(given_bounds=Bounds(Bound(100, "STEPS"), Bound(100, "ITEMS")))
    )
    execution_id: int = EXECUTION
    plan: Any = None
    state: Any = None

    def apply(self, entry: en.Entry) -> Any:
        self.entries.append(entry)
        answer = self.answers.get(type(entry))
        return answer(entry) if answer is not None else None

    def can_dispatch(self) -> bool:
        return True

    def record(self, event_type: str, key: str, **fields: Any) -> str:
        self.rows.append(recorded({"event_type": event_type, "event_id": key, **fields}))
        return key

    def decided(self) -> Sequence[Row]:
        return self.rows

    def last_row(self) -> Row:
        return self.rows[-1]

    def send(self, dispatch: Any) -> None:
        raise AssertionError("no dispatch expected")

    def drop_unit(self) -> None:
        pass

    def fail_step(self, step: str, run_id: str, error: Any, parent: str | None) -> None:
        raise AssertionError(f"the step failed: {error}")

    def step_done(self, step: Step, run: RunRef, end: UnitEnd, via: str = "call") -> None:
        self.ended.append((run.run_id, end))

    def dispatch_task(
        self, step: Step, message: TaskMessage, countdown: float = 0.0, record_start: bool = True
    ) -> None:
        self.sent.append(message)

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
        raise AssertionError("no outcome expected")

    def scope_of(self, message: TaskMessage, step: Step) -> Any:
        raise AssertionError("no scope expected")

    def attempt_fields(self, step: Step, task: Any, message: TaskMessage, **overrides: Any) -> dict[str, Any]:
        return {"step": step.name, **overrides}


def _loop_step() -> Step:
    return Step(name="each", loop=Loop(collection="{{ xs }}", mode="parallel", max_in_flight=2))


def test_a_loop_s_start_yields_its_collection_its_row_and_its_first_claim():
    port = EntriesPort(answers={en.PutCollection: lambda e: {"stored": len(e.items)}})
    loops.start_loop(port, _loop_step(), RunRef("r1", [], {"a": 1}), "p", {"xs": [10, 20, 30]})
    assert port.entries == [
        en.PutCollection([10, 20, 30]),
        en.CreateLoop(
            run_id="r1",
            step="each",
            mode="parallel",
            total=3,
            max_in_flight=2,
            collection={"stored": 3},  # what the write answered for the collection
            context={"frames": [], "args": {"a": 1}, "parent": "p"},
        ),
        en.ClaimIndexes("r1", 2),
    ]
    assert [m.iteration for m in port.sent] == [0, 1]
    assert [r["event_type"] for r in port.rows] == [ev.ITERATOR_STARTED]


def test_an_empty_loop_claims_nothing_and_ends_its_step():
    port = EntriesPort()
    loops.start_loop(port, _loop_step(), RunRef("r1", [], {}), "p", {"xs": []})
    assert [type(e) for e in port.entries] == [en.PutCollection, en.CreateLoop]
    assert port.sent == [] and [run for run, _ in port.ended] == ["r1"]


def _last_iteration(port: EntriesPort, *, completes: bool) -> None:
    counters = {"done": 2, "total": 2, "max_in_flight": 2, "succeeded": 2, "failed": 0, "tolerated": 0, "context": None}
    port.answers.update({en.CountIteration: lambda e: counters, en.CompleteLoop: lambda e: completes})
    port.reads.loops["r1"] = {"collection": [1, 2], "context": {"frames": [], "args": {}}}
    message = TaskMessage(execution_id=EXECUTION, run_id="r1", step="each", iteration=1, element=2)
    loops.iteration_done(port, _loop_step(), message, ok=True, data="b", row=recorded({"event_id": "x"}))


def test_the_last_iteration_yields_its_count_then_the_loop_s_completion():
    port = EntriesPort()
    _last_iteration(port, completes=True)
    assert port.entries == [
        en.CountIteration("r1", ok=True, tolerated=False, unless_last=(2, 2)),
        en.CompleteLoop("r1"),
    ]
    ((run, end),) = port.ended
    assert run == "r1" and end.ok and end.data["stats"] == {"total": 2, "success": 2, "failed": 0}


def test_a_loop_another_decision_completed_is_not_finished_twice():
    port = EntriesPort()
    _last_iteration(port, completes=False)
    assert [type(e) for e in port.entries] == [en.CountIteration, en.CompleteLoop]
    assert port.ended == [] and port.rows == []


def test_a_cursor_slot_s_end_yields_the_slot_then_the_loop_s_completion_with_the_last():
    step = Step(name="drain", loop=Loop(mode="cursor", cursor={"kind": "redis_stream"}, max_in_flight=2))
    counters = {"slots_ended": 2, "max_in_flight": 2, "done": 5, "failed": 1, "tolerated": 1}
    port = EntriesPort(answers={en.EndCursorSlot: lambda e: counters, en.CompleteLoop: lambda e: True})
    cursor_loop._slot_ended(port, step, "r2", "claim")
    assert port.entries == [en.EndCursorSlot("r2"), en.CompleteLoop("r2")]
    ((run, end),) = port.ended
    assert run == "r2" and end.ok and end.data == {"stats": {"processed": 5, "failed": 1, "slots": 2}}

    port = EntriesPort(answers={en.EndCursorSlot: lambda e: {**counters, "slots_ended": 1}})
    cursor_loop._slot_ended(port, step, "r2", "claim")
    assert port.entries == [en.EndCursorSlot("r2")] and port.ended == []


@dataclass
class Deferred:
    """What write.py reads of a decision made on a cached head (write.Decided), without a store."""

    store: Any = field(default_factory=lambda: SqlDecisionStore(None))  # type: ignore[arg-type]  # repo's, faked
    state: Any = None
    running: bool = True
    decision: Decision = field(default_factory=Decision)
    version: int = 4
    deferred: bool = True
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    written_version: int | None = None
    written_pending: int | None = None
    create_row: Any = None
    strict: bool = False
    later_count: Any = None
    inputs: DecisionInputs = field(default_factory=DecisionInputs)
    execution_id: int = EXECUTION
    plan: Any = None

    def record(self, event_type: str, key: str, **fields: Any) -> str:
        return key


def test_a_strict_deferred_count_is_left_to_the_decision_s_last_write():
    d = Deferred(strict=True)
    counters = write.apply_entry(d, en.CountIteration("r1", ok=True, tolerated=False, unless_last=(2, 5)))
    assert counters == {"done": None, "max_in_flight": 2, "total": 5, "context": None}
    assert d.later_count == repo.IterationCount("r1", True, False, 2, 5) and d.deferred


def test_a_refused_guarded_entry_decides_the_event_again(monkeypatch):
    """The count of a deferred decision reads the head in its statement: the head moved on, the
    entry is refused (Redecide), the cached state is forgotten and the event decided the classic
    way, which counts the iteration again."""
    counted: list[str] = []

    def checked_count(conn: Any, execution_id: int, run_id: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        counted.append("checked")
        return {"done": 1, "total": 2, "max_in_flight": 2, "context": None}, {"status": "running", "state_version": 5}

    def count(conn: Any, run_id: str, **kw: Any) -> dict[str, Any]:
        counted.append("classic")
        return {"done": 1, "total": 2, "max_in_flight": 2, "context": None}

    monkeypatch.setattr(repo, "loop_iteration_done_checked", checked_count)
    monkeypatch.setattr(repo, "loop_iteration_done", count)
    forgotten: list[bool] = []

    def decide(strict: bool) -> list[en.Entry]:
        d = Deferred(deferred=strict)  # the classic decision read the head first
        port = EntriesPort(answers={en.CountIteration: lambda e: write.apply_entry(d, e)})
        port.reads.loops["r1"] = {"collection": [1, 2], "context": {}}
        message = TaskMessage(execution_id=EXECUTION, run_id="r1", step="each", iteration=0, element=1)
        loops.iteration_done(port, _loop_step(), message, ok=True, data="a", row=recorded({"event_id": "x"}))
        return port.entries

    decided = write.decide_until_current(decide, forget=lambda: forgotten.append(True))
    assert counted == ["checked", "classic"] and forgotten == [True]
    assert decided == [en.CountIteration("r1", ok=True, tolerated=False, unless_last=(2, 2))]


def test_a_head_that_moved_refuses_any_entry_of_a_deferred_decision(monkeypatch):
    monkeypatch.setattr(repo, "execution_head", lambda *a, **k: {"status": "cancelled", "state_version": 4})
    with pytest.raises(write.Redecide):
        write.apply_entry(Deferred(), en.OpenJoin("fork", "join", 2))


def test_every_entry_has_its_write():
    kinds = {
        en.PutValue,
        en.PutCollection,
        en.CreateLoop,
        en.ClaimIndexes,
        en.CountIteration,
        en.CompleteLoop,
        en.EndCursorSlot,
        en.OpenJoin,
        en.SettleJoin,
        en.CreateChildExecution,
    }
    assert set(write._APPLY) == kinds


def test_a_child_s_end_is_decided_from_its_link_as_read():
    from noetl_celery.engine.decision.subplaybooks import child_end

    assert child_end(None, 9, "completed", {}, None) is None  # a top-level execution: no parent
    message = TaskMessage(execution_id=EXECUTION, run_id="r", step="call", task_index=0)
    link = {"parent_execution_id": EXECUTION, "parent_task": {"message": message.to_dict(), "path": "child"}}
    end = child_end(link, 9, "completed", {"done": 1}, None)
    assert end is not None and end.label == "child.done"
    assert end.message["execution_id"] == EXECUTION
    assert end.message["outcome"] == {
        "status": "ok",
        "data": {"done": 1},
        "meta": {"child": {"execution_id": 9, "path": "child", "status": "completed"}},
    }


class _FailedPort(EntriesPort):
    """An EntriesPort that keeps the error a step failed with instead of raising it."""

    failures: list[Any]

    def fail_step(self, step: str, run_id: str, error: Any, parent: str | None) -> None:
        self.failures.append(error)


def test_a_loop_over_a_stored_list_alone_asks_for_its_pages_from_the_source_and_fails_its_step_if_it_is_gone():
    ref = {"__stored__": True, "execution_id": EXECUTION, "sha256": "ab" * 32, "size": 2_000_000, "type": "list"}
    page = {"__stored__": True, "execution_id": EXECUTION, "sha256": "cd" * 32, "size": 12}
    paged = {limits.PAGED: True, "length": 3, "per": 3, "size": 2_000_000, "pages": [page]}
    port = EntriesPort(answers={en.PutCollection: lambda e: paged})
    port.reads.stored["cd" * 32] = [10, 20, 30]  # the page; the source ("ab...") is not there to read
    loops.start_loop(port, _loop_step(), RunRef("r1", [], {}), "p", {"xs": {**ref, "length": 3}})
    assert port.entries[0] == en.PutCollection([], {**ref, "length": 3})  # the list itself is never read
    assert port.entries[1].total == 3 and port.entries[1].collection == paged
    assert [(m.iteration, m.element) for m in port.sent] == [(0, 10), (1, 20)]  # read from the page

    def gone(entry: en.PutCollection) -> Any:
        raise LookupError("the value stored by reference abab is gone")

    failed = _FailedPort(answers={en.PutCollection: gone})
    failed.failures = []
    loops.start_loop(failed, _loop_step(), RunRef("r2", [], {}), "p", {"xs": {**ref, "length": 3}})
    (error,) = failed.failures
    assert error["kind"] == "loop" and "step 'each' cannot be read" in error["message"] and "gone" in error["message"]
    assert [type(e) for e in failed.entries] == [en.PutCollection] and failed.sent == []
