"""A task's dispatch, the routing-only tasks decided inline, and the end of a unit.

`TaskFlow.dispatch_task` records an attempt's start and adds its message (a child playbook
starts its child execution; a routing-only task is decided inline, without a worker round trip);
`unit_done` hands a finished loop element to its loop strategy, a finished step run to its end.
"""

from __future__ import annotations

from noetl_celery.compiler.names import shadow_label
from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import TemplateError
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Step, Task
from noetl_celery.engine import deadlines
from noetl_celery.engine.arc_args import merge_arc_args
from noetl_celery.engine.context import render_context
from noetl_celery.engine.decision import cursor_loop, subplaybooks
from noetl_celery.engine.decision.core import DecisionCore, loop_strategy
from noetl_celery.engine.decision.rows import OpenRow
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.ids import attempt_key
from noetl_celery.engine.messages import Dispatch, TaskMessage, sanitize
from noetl_celery.templates.render import lenient, plain, render_value
from noetl_celery.tools.base import get_tool


class TaskFlow(DecisionCore):
    """The Decider's part running tasks: dispatch, inline routing-only tasks, units' ends."""

    def dispatch_task(
        self, step: Step, message: TaskMessage, countdown: float = 0.0, record_start: bool = True
    ) -> None:
        task = step.tasks[message.task_index]
        spec = get_tool(task.kind)
        if spec is not None and spec.routing_only and task.sink is None and countdown == 0:
            self.run_inline(step, task, message)
            return
        key = attempt_key(message.run_id, message.iteration, message.seq, message.attempt)
        if task.kind == subplaybooks.PLAYBOOK_KIND:  # a child execution, started by this decision
            subplaybooks.start_child(self, step, task, message, key, record_start and message.slot is None, countdown)
            return
        first_of_iteration = message.iteration is not None and message.seq == 0 and message.attempt == 1
        if record_start and message.slot is None:  # cursor rows: the item's row is its only row
            self.record(
                ev.ITERATION_STARTED if first_of_iteration else ev.ACTION_STARTED,
                key + ".start",
                status="started",
                parent_event_id=message.parent_event_id,
                **self.attempt_fields(step, task, message),
                context=sanitize(
                    {"element": message.element, "call": message.call or None, "args": message.args or None}
                ),
            )
            message = message.evolve(parent_event_id=key + ".start")
        if message.slot is not None:  # a cursor row: without its own timeout, the frame's lease
            timeout = cursor_loop.row_timeout(step, message.task_index)
        else:
            timeout = deadlines.timeout_of(task.kind, task.config)
        label = shadow_label(step, task, self.plan.name)
        self.decision.dispatches.append(Dispatch.task(message, countdown=countdown, label=label, timeout=timeout))

    def run_inline(self, step: Step, task: Task, message: TaskMessage) -> None:
        """A routing-only task (noop/end/router) is decided here, without a worker round trip."""
        self.inline(lambda: self._run_inline(step, task, message))

    def _run_inline(self, step: Step, task: Task, message: TaskMessage) -> None:
        # a step's own task was counted with the step's start; a loop's iterations count each
        if message.iteration is not None and self._too_deep():
            self.unit_done(
                step,
                message,
                UnitEnd(
                    ok=False,
                    parent=message.parent_event_id,
                    error={
                        "kind": ErrorKind.ROUTING,
                        "message": f"more than {self.inline_bound()} steps or loop iterations without "
                        "work in a row (routing-only: no tool, noop, end, router): a cycle of steps "
                        "without work?",
                    },
                ),
                OpenRow({"event_id": message.parent_event_id}),  # no row of its own
            )
            return
        context = render_context(self.state, self.scope_of(message, step))
        row = OpenRow({"event_id": message.parent_event_id})  # no row of its own: its notes are dropped
        try:
            with lenient(self.strict_templates) as hidden:  # args render as NoETL renders them
                rendered = {**task.config, "args": plain(render_value(task.config.get("args"), context))}
            args = merge_arc_args(task.kind, rendered, message.args).get("args")
            outcome = {"status": "ok", "data": args}
            if message.iteration is None:  # noted on the step's step.completed row
                self.hidden_notes.setdefault(message.run_id, []).extend(hidden)
        except TemplateError as exc:
            outcome = {"status": "error", "error": {"kind": ErrorKind.TEMPLATE, "message": str(exc)}}
        self.handle_outcome(step, task, message, outcome, row)

    # --- units: a step run, or one element of a loop ----------------------------------------

    def unit_done(self, step: Step, message: TaskMessage, end: UnitEnd, row: OpenRow) -> None:
        """A step run, or one loop element, is over: its loop strategy counts it, or the step ends."""
        if message.iteration is not None:
            loop_strategy(step).unit_done(self, step, message, end, row)
            return
        self.step_done(step, RunRef(message.run_id, message.frames, message.args), end)
