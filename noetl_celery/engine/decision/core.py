"""The Decider's core: the decision in progress, its bounds, its reads of the store, its records.

`DecisionCore` holds one event's `Decision` (value.py) and what its write needs (write.py): the
store it is written to (store_port.py), the head it assumes (`deferred`, `version`, `strict`),
and what the write left. The role classes build on it: outcomes.py (an attempt's outcome:
policy, retry, pages), tasks.py (dispatch, routing-only tasks, the end of a unit), steps.py
(step start and end, routing, joins); orchestrator.py composes them into the Decider.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.dsl.plan import Step, Task
from noetl_celery.engine.context import ExecutionState, Scope, message_scope
from noetl_celery.engine.decision import cursor_loop, loops, write
from noetl_celery.engine.decision.entries import Entry
from noetl_celery.engine.decision.inputs import DecisionInputs
from noetl_celery.engine.decision.reads import Reads
from noetl_celery.engine.decision.rows import OpenRow, Row
from noetl_celery.engine.decision.sql_store import SqlDecisionStore
from noetl_celery.engine.decision.store_port import DecisionStore
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.decision.value import Decision
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.templates.render import strict_rendering

# step runs and inline loop iterations without work (routing-only: no tool, noop, end, router) one
# decision may chain: beyond it the execution fails (a cycle of steps without work never ends)
MAX_INLINE_DEPTH = 1000


def loop_strategy(step: Step) -> loops.LoopStrategy:
    """The strategy of a loop step: a cursor loop's slots, or a collection's iterations."""
    assert step.loop is not None
    return cursor_loop.CURSOR_LOOP if step.loop.mode == "cursor" else loops.COLLECTION_LOOP


@dataclass
class DecisionCore:
    """Accumulates one event's decisions in `decision`; `flush` writes them in order.

    `deferred`: the decision started without reading the execution head (an attempt's outcome,
    with the state cached at the version the message asks for), assuming the execution runs at
    `version`. The head is then read by the first statement of the transaction: a loop counter's
    update carries it, locked FOR KEY SHARE (write.count_iteration); the execution counters' update
    in `flush` returns it, the row locked by the update itself; any other statement reads it
    first (write.checked). A head that does not match raises Redecide.

    `store`: where the decision reads its head and rows and writes (store_port.py); by default
    the event store through `connection`, the decision transaction's."""

    connection: Connection | None
    state: ExecutionState
    running: bool
    decision: Decision = field(default_factory=Decision)
    inputs: DecisionInputs = field(default_factory=DecisionInputs.load)  # clock, draws, bounds
    version: int = 0
    depth: int = 0
    deferred: bool = False
    written: dict[str, dict[str, Any]] = field(default_factory=dict)  # variables as flush stored them
    written_version: int | None = None  # the state version flush moved the execution to
    written_pending: int | None = None  # the pending count flush left (None: unknown)
    # a new execution (start_new): flush inserts its row with its counters instead of updating them
    create_row: Callable[[int, int], None] | None = None
    # the decision's last write commits it and refuses rows that exist (see `flush`); an iteration
    # may then be counted by that write (write.count_iteration, `later_count`)
    strict: bool = False
    later_count: write.IterationCount | None = None
    # step starts and routing-only tasks decided inline wait here while one runs (see `inline`)
    inline_queue: deque[Callable[[], None]] | None = None
    steps_run: int | None = None  # step runs recorded before this decision, once counted (`_too_many_steps`)
    # per step run: what lenient renders of its routing-only tasks hid, for its step.completed row
    hidden_notes: dict[str, list[str]] = field(default_factory=dict)
    store: DecisionStore = None  # type: ignore[assignment]  # set in __post_init__ when not given

    def __post_init__(self) -> None:
        if self.store is None:
            assert self.connection is not None, "a decision is written to a store or through a connection"
            self.store = SqlDecisionStore(self.connection)

    def inline_bound(self) -> int:
        """Steps (or loop iterations) without work one decision may chain (MAX_INLINE_DEPTH)."""
        return MAX_INLINE_DEPTH

    def inline(self, work: Callable[[], None]) -> None:
        """Run `work` (a step start, a routing-only task) now, or after the one running, in order.

        A chain of steps without work is decided in one decision; run one inside the other, each
        step would nest a few Python frames deeper than the last, and a chain of 150 `noop` steps
        ended in RecursionError. Queued, the chain runs in a loop, and `depth` counts its steps."""
        if self.inline_queue is not None:
            self.inline_queue.append(work)
            return
        self.inline_queue = deque([work])
        try:
            while self.inline_queue:
                self.inline_queue.popleft()()
        finally:
            self.inline_queue = None

    def _too_deep(self) -> bool:
        """Count one step run (or inline loop iteration) without work; True past the bound, when
        the decision stops starting more (the caller fails the execution)."""
        self.depth += 1
        if self.depth <= self.inline_bound():
            return False
        if self.inline_queue is not None:
            self.inline_queue.clear()
        return True

    def _too_many_steps(self) -> str | None:
        """The error when this step run is past NOETL_MAX_STEPS (an arc cycle without an end, no
        playbook `timeout:`), else None.

        Free until the execution's state version (one per decision that stores a step's result or
        variables) reaches the bound: then the step runs are counted (their `step.started` rows),
        once per decision. So an execution fails at the first step start after both its step runs
        and its state version passed the bound (a cycle deciding k steps per turn: at about k
        times the bound)."""
        bound = self.inputs.bounds.max_steps.value
        if self.version + self.depth < bound:
            return None
        if self.steps_run is None:
            self.steps_run = self.reads.count_events(ev.STEP_STARTED)
        started = self.steps_run + sum(1 for row in self.decision.rows if row["event_type"] == ev.STEP_STARTED)
        if started <= bound:
            return None
        return (
            f"the execution started more than {bound} step runs ({self.inputs.bounds.max_steps.env}): an arc cycle "
            "without an end? Give the playbook a `timeout:` or raise the bound"
        )

    @property
    def reads(self) -> Reads:
        """The execution's recorded rows, read in this decision's transaction (reads.py)."""
        return self.store.reads(self.execution_id, lambda: self.conn)

    @property
    def conn(self) -> Connection:
        """The transaction's connection; the head is checked before any statement uses it
        (write.checked). Strategies write through `apply`, never through it."""
        return write.checked(self).connection

    def apply(self, entry: Entry) -> Any:
        """Write one entry a strategy decided (entries.py) through write.py; returns its answer."""
        return write.apply_entry(self, entry)

    @property
    def plan(self):  # type: ignore[no-untyped-def]
        return self.state.plan

    @property
    def execution_id(self) -> int:
        return self.state.execution_id

    @property
    def strict_templates(self) -> bool:
        """Undefined names fail where NoETL renders leniently (the playbook or NOETL_STRICT_TEMPLATES)."""
        return strict_rendering(self.plan.strict_templates)

    # --- recording -------------------------------------------------------------------------

    def can_dispatch(self) -> bool:
        return self.running and self.decision.failure is None

    def decided(self) -> list[Row]:
        return self.decision.rows

    def last_row(self) -> Row:
        return self.decision.rows[-1]

    def send(self, dispatch: Dispatch) -> None:
        self.decision.dispatches.append(dispatch)

    def drop_unit(self) -> None:
        self.decision.pending -= 1

    def record(self, event_type: str, key: str, **fields: Any) -> str:
        """Add a complete event row (read-only from now on: rows.py); returns its key."""
        self.decision.record(self._columns(event_type, key, fields))
        return key

    def open_row(self, event_type: str, key: str, **fields: Any) -> OpenRow:
        """Add an attempt's outcome row whose content the decision about it completes
        (`Decision.settle` builds it)."""
        return self.decision.open(self._columns(event_type, key, fields))

    def _columns(self, event_type: str, key: str, fields: dict[str, Any]) -> dict[str, Any]:
        row = {"execution_id": self.execution_id, "event_id": key, "event_type": event_type, **fields}
        if self.state.parent_execution_id is not None:
            row.setdefault("parent_execution_id", self.state.parent_execution_id)
        return row

    def set_variables(self, scope: str, values: dict[str, Any]) -> None:
        if not values:
            return
        self.decision.variables.setdefault(scope, {}).update(values)
        target = {
            "ctx": self.state.ctx,
            "vars": self.state.vars,
            "result": self.state.results,
            "tasks": self.state.task_results,
        }[scope]
        target.update(values)  # later decisions of this same event see the new values

    def fail_step(self, step: str, run_id: str, error: Any, parent: str | None) -> None:
        """The step run failed: its `step.failed` row, then the execution's failure."""
        done_key = f"{run_id}.step.done"
        self.record(
            ev.STEP_FAILED, done_key, status="failed", step=step, run_id=run_id, error=error, parent_event_id=parent
        )
        self.fail_execution(step, error, done_key)

    def fail_execution(self, step: str | None, error: Any, parent: str) -> None:
        if self.decision.failure is None:
            self.decision.failure = {"step": step, "error": error}
            self.record(
                ev.EXECUTION_FAILED,
                ev.EXECUTION_FAILED,
                status="failed",
                step=step,
                error=error,
                parent_event_id=parent,
            )

    @staticmethod
    def attempt_fields(step: Step, task: Task, message: TaskMessage, **overrides: Any) -> dict[str, Any]:
        """The columns every row about one attempt carries (step, task, run, attempt, iteration, page)."""
        fields = {
            "step": step.name,
            "task": task.label,
            "run_id": message.run_id,
            "attempt": message.attempt,
            "iteration": message.iteration,
            "page": message.page,
        }
        return {**fields, **overrides}

    def scope_of(self, message: TaskMessage, step: Step) -> Scope:
        return message_scope(message, step)

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
        raise NotImplementedError  # outcomes.OutcomeRules

    # --- the parts the role classes provide (composed in orchestrator.Decider) ----------------

    def handle_outcome(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], row: OpenRow
    ) -> None:
        raise NotImplementedError  # outcomes.OutcomeRules

    def dispatch_task(
        self, step: Step, message: TaskMessage, countdown: float = 0.0, record_start: bool = True
    ) -> None:
        raise NotImplementedError  # tasks.TaskFlow

    def unit_done(self, step: Step, message: TaskMessage, end: UnitEnd, row: OpenRow) -> None:
        raise NotImplementedError  # tasks.TaskFlow

    def step_done(self, step: Step, run: RunRef, end: UnitEnd, via: str = "call") -> None:
        raise NotImplementedError  # steps.StepFlow

    # --- writing ---------------------------------------------------------------------------

    def flush(self, *, last: bool = False) -> list[Dispatch]:
        """Write everything decided (engine/decision/write.py); raises DuplicateEvent (and rolls
        back) on a redelivery, Redecide when the head moved on."""
        return write.flush(self, last=last)

    def keep_state(self, url: str) -> None:
        write.keep_state(self, url)
