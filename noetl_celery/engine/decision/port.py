"""The port through which loop, cursor and sub-playbook strategies talk to the Decider.

The strategies (loops.py, cursor_loop.py, subplaybooks.py) decide a loop's or a child's part of
one event; the Decider (orchestrator.py) accumulates the decision. They meet here, not on the
Decider's fields: a strategy records rows, dispatches, asks for writes (entries.py) and ends units
through these calls, and imports no orchestrator (which imports the strategies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from noetl_celery.dsl.plan import Step, Task
from noetl_celery.engine.context import ExecutionState, Scope
from noetl_celery.engine.decision.entries import Entry
from noetl_celery.engine.decision.inputs import DecisionInputs
from noetl_celery.engine.decision.reads import Reads
from noetl_celery.engine.decision.rows import Row
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.messages import Dispatch, TaskMessage


class DecisionPort(Protocol):
    """What a strategy may ask of the decision in progress."""

    @property
    def execution_id(self) -> int: ...

    @property
    def plan(self) -> Any: ...

    @property
    def reads(self) -> Reads:
        """The execution's recorded rows the decision reads (reads.py)."""

    @property
    def inputs(self) -> DecisionInputs:
        """The decision's clock, random draws and bounds."""

    @property
    def state(self) -> ExecutionState: ...

    def can_dispatch(self) -> bool:
        """The execution still runs and this decision has not failed it: new work may start."""

    def record(self, event_type: str, key: str, **fields: Any) -> str:
        """Add an event row to the decision; returns its key."""

    def decided(self) -> Sequence[Row]:
        """The rows decided in this event so far (not written yet)."""

    def last_row(self) -> Row:
        """The row recorded last."""

    def send(self, dispatch: Dispatch) -> None:
        """Add a message to publish once the decision is written."""

    def drop_unit(self) -> None:
        """A unit counted as pending will not run (a loop that cannot start)."""

    def apply(self, entry: Entry) -> Any:
        """Write one entry of the decision (entries.py, written by write.py) in its transaction;
        returns what the entry gives back. A guarded entry refused raises write.Redecide."""

    def fail_step(self, step: str, run_id: str, error: Any, parent: str | None) -> None: ...

    def step_done(self, step: Step, run: RunRef, end: UnitEnd, via: str = "call") -> None: ...

    def dispatch_task(
        self, step: Step, message: TaskMessage, countdown: float = 0.0, record_start: bool = True
    ) -> None: ...

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None: ...

    def scope_of(self, message: TaskMessage, step: Step) -> Scope: ...

    def attempt_fields(self, step: Step, task: Task, message: TaskMessage, **overrides: Any) -> dict[str, Any]: ...
