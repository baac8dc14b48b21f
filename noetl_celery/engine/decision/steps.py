"""A step run's start and end, routing and joins (the Decider's part walking the plan's graph).

`StepFlow.start_step` starts a run (bounds, `admit`, a loop, a task, or no task at all);
`step_done` records its end, stores its result, applies `vars`/`set` and routes along the arcs
that fire; `enter_step` and `branch_ended` settle the joins of a fork.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import TemplateError
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Step
from noetl_celery.engine.context import Scope, render_context
from noetl_celery.engine.decision import policy_eval, routing
from noetl_celery.engine.decision.core import DecisionCore, loop_strategy
from noetl_celery.engine.decision.entries import OpenJoin, SettleJoin
from noetl_celery.engine.decision.select import select_part
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.ids import run_id_for
from noetl_celery.engine.messages import TaskMessage, sanitize
from noetl_celery.templates.render import HIDDEN_META, as_step_result, lenient, plain, render_value, response_view

START_KEY = ev.START_KEY


class StepFlow(DecisionCore):
    """The Decider's part starting and ending step runs, routing and joining."""

    def start_execution(self) -> None:
        self.record(
            ev.EXECUTION_STARTED,
            START_KEY,
            status="running",
            context=sanitize({"workload": self.state.workload}),
            meta={"playbook": self.plan.name, "entry_step": self.plan.entry_step},
        )
        self.enter_step(self.plan.entry_step, START_KEY, frames=[], args={})

    def step_done(self, step: Step, run: RunRef, end: UnitEnd, via: str = "call") -> None:
        """A step run is over: record it, store its result, apply vars/set_ctx, route.
        `end.routing_response` is the last call's result (the last page), which routing reads."""
        self.decision.pending -= 1
        run_id, parent = run.run_id, end.parent
        done_key = f"{run_id}.step.done"
        end, data = self._step_result(step, run, end)
        if not end.ok:
            self.fail_step(step.name, run_id, end.error, parent)
            return
        self.set_variables("result", {step.name: data})
        if len(step.tasks) > 1 and end.task_results:
            self.set_variables("tasks", {step.name: end.task_results})
        try:
            targets, hidden = self._step_arcs(step, run, end, data, via)
        except TemplateError as exc:
            self.fail_step(step.name, run_id, {"kind": ErrorKind.TEMPLATE, "message": str(exc)}, parent)
            return
        meta: dict[str, Any] = {}
        if targets:
            meta["next"] = [t for t, _ in targets]
        hidden = [*self.hidden_notes.pop(run_id, []), *hidden]
        if hidden:
            meta[HIDDEN_META] = hidden
        self.record(
            ev.STEP_COMPLETED,
            done_key,
            status="completed",
            step=step.name,
            run_id=run_id,
            result=data,
            parent_event_id=parent,
            meta=meta or None,
        )
        if not targets and self._no_match_fails(step):
            err = {"kind": ErrorKind.ROUTING, "message": f"no arc of step {step.name!r} matched"}
            self.fail_execution(step.name, err, done_key)
            return
        self.route(step, targets, run.frames, done_key)

    def _step_result(self, step: Step, run: RunRef, end: UnitEnd) -> tuple[UnitEnd, Any]:
        """The step's result: the part its `result` selects (a template that fails fails the end)."""
        if not end.ok or step.result_select is None:
            return end, end.data
        try:
            scope = Scope(args=run.args, step=step.name)
            return end, select_part(end.data, step.result_select, render_context(self.state, scope))
        except TemplateError as exc:
            return end.evolve(ok=False, error={"kind": ErrorKind.TEMPLATE, "message": str(exc)}), end.data

    def _step_arcs(
        self, step: Step, run: RunRef, end: UnitEnd, data: Any, via: str
    ) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
        """Apply the step's `vars`/`set` and its arcs' `set`; the arcs that fire (target, args)
        and what lenient rendering hid. Raises TemplateError."""
        scope = Scope(args=run.args, step=step.name)
        # step-level set/vars and arcs read the step's last call as `output`/`outcome`, like policies
        last_call = policy_eval.outcome_scope({"status": "ok", "data": end.routing_response}, 1)
        own = dict(
            output=last_call["output"],
            outcome=last_call["outcome"],
            result=as_step_result(data),
            response=response_view(end.routing_response),
            event={"name": routing.TERMINAL_EVENT_NAMES[via]},
        )
        context = {**render_context(self.state, scope), **own}
        # vars, set and arcs render as NoETL renders them: an undefined name is falsy, an arc
        # whose `when` raises does not fire; what that hid is kept in the row's meta
        with lenient(self.strict_templates) as hidden:
            self.set_variables("vars", plain(render_value(step.vars, context)))
            self.set_variables("ctx", plain(render_value(step.set_ctx, context)))
            if step.vars or step.set_ctx:  # arcs read the new values (also as bare ctx names)
                context = {**render_context(self.state, scope), **own}
            fired = [] if step.name == self.plan.final_step else routing.fired_arcs(step, context)
            targets = [(arc.step, routing.arc_args(arc, context)) for arc in fired]
            for arc in fired:  # v2 case `then: {next, set}`
                self.set_variables("ctx", plain(render_value(arc.set_ctx, context)))
                self.set_variables("vars", plain(render_value(arc.set_vars, context)))
        return targets, list(hidden)

    def _no_match_fails(self, step: Step) -> bool:
        """A step none of whose arcs fired fails the execution (`on_no_match: error`, or the
        playbook's default), unless it is the final step or has no arcs."""
        if not step.next.arcs or step.name == self.plan.final_step:
            return False
        return step.next.on_no_match == "error" or (step.next.on_no_match is None and self.plan.no_next_is_error)

    # --- routing and joins -----------------------------------------------------------------

    def route(
        self, step: Step, targets: list[tuple[str, dict[str, Any]]], frames: list[list[str]], parent: str
    ) -> None:
        if not targets:
            self.branch_ended(frames, parent)
            return
        child_frames = frames
        if len(targets) > 1 and step.join:
            self.apply(OpenJoin(parent, step.join, len(targets)))
            child_frames = [*frames, [parent, step.join]]
        for target, args in targets:
            self.enter_step(target, parent, child_frames, args, came_from=step.name)

    def enter_step(
        self, name: str, parent: str, frames: list[list[str]], args: dict[str, Any], came_from: str | None = None
    ) -> None:
        if frames and frames[-1][1] == name:
            fork_id = frames[-1][0]
            settled, arrived, width = self.apply(SettleJoin(fork_id, arrived=True))
            self.record(
                ev.JOIN_ARRIVED,
                f"{parent}>{name}.arrive",
                status="waiting" if settled < width else "ready",
                step=name,
                parent_event_id=parent,
                meta={"fork": fork_id, "settled": settled, "width": width},
            )
            if settled == width:
                self.start_step(name, f"{fork_id}.join", frames[:-1], args)
            return
        self.start_step(name, parent, frames, args, came_from)

    def branch_ended(self, frames: list[list[str]], parent: str) -> None:
        """A branch inside a fork ended without reaching the join: settle it, maybe release the join."""
        if not frames:
            return
        fork_id, join_step = frames[-1]
        settled, arrived, width = self.apply(SettleJoin(fork_id, arrived=False))
        if settled < width:
            return
        if arrived:
            self.start_step(join_step, f"{fork_id}.join", frames[:-1], {})
        else:
            self.branch_ended(frames[:-1], parent)

    def start_step(
        self, name: str, parent: str, frames: list[list[str]], args: dict[str, Any], came_from: str | None = None
    ) -> None:
        """Start a run of step `name`; `came_from` is the step whose arc chose it (none after a join)."""
        self.inline(lambda: self._start_step(name, parent, frames, args, came_from))

    def _start_step(
        self, name: str, parent: str, frames: list[list[str]], args: dict[str, Any], came_from: str | None
    ) -> None:
        step = self.plan.steps[name]
        run_id = run_id_for(self.execution_id, parent, name)
        start_key = self.record(
            ev.STEP_STARTED,
            f"{run_id}.step.start",
            status="started",
            step=name,
            run_id=run_id,
            parent_event_id=parent,
            context=sanitize({"args": args}) if args else None,
        )
        if self._too_deep():
            err = {
                "kind": ErrorKind.ROUTING,
                "message": f"more than {self.inline_bound()} steps without work in a row (routing-only: no "
                "tool, noop, end, router): a cycle of steps without work?",
            }
            self.fail_execution(name, err, start_key)
            return
        too_many = self._too_many_steps()
        if too_many is not None:
            self.fail_execution(name, {"kind": ErrorKind.LIMIT, "message": too_many}, start_key)
            return
        context = render_context(self.state, Scope(args=args, step=name))
        try:
            allowed = routing.admitted(step.admit, context)
        except TemplateError as exc:
            self.fail_execution(name, {"kind": ErrorKind.TEMPLATE, "message": str(exc)}, start_key)
            return
        if not allowed:
            self.record(
                ev.STEP_SKIPPED,
                f"{run_id}.step.skipped",
                status="skipped",
                step=name,
                run_id=run_id,
                parent_event_id=start_key,
            )
            self.branch_ended(frames, start_key)
            return
        self.decision.pending += 1
        if step.loop is not None:
            loop_strategy(step).start(self, step, RunRef(run_id, frames, args), start_key, context)
            return
        if not step.tasks:
            self.step_done(step, RunRef(run_id, frames, args), UnitEnd(ok=True, parent=start_key, data=args or None))
            return
        message = TaskMessage(
            execution_id=self.execution_id,
            run_id=run_id,
            step=name,
            task_index=0,
            frames=frames,
            args=args,
            from_step=came_from,
            parent_event_id=start_key,
        )
        self.dispatch_task(step, message)
