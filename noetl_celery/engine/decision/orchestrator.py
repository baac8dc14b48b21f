"""on_event: the only place that decides what runs next, and records every decision.

One call handles one event in one database transaction:
  1. decide (counters of loops and joins are updated atomically as the decision needs them),
  2. record the causing event row with the messages to dispatch (its key is deterministic: a
     redelivered event conflicts on the unique key and the whole transaction rolls back),
  3. record the decision rows, variables and the execution's counters,
  4. after commit, publish the messages. A redelivered event whose row exists re-publishes the
     stored messages (flagged `replay`), so a crash between commit and publish loses nothing.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection

from noetl_celery import limits, settings
from noetl_celery import vocabulary as ev
from noetl_celery.compiler.names import shadow_label
from noetl_celery.dsl.plan import Action, Step, Task
from noetl_celery.engine import deadlines
from noetl_celery.engine.arc_args import merge_arc_args
from noetl_celery.engine.context import STATE, ExecutionState, Scope, message_scope, render_context
from noetl_celery.engine.decision import (
    cursor_loop,
    loops,
    pagination,
    policy_eval,
    routing,
    subplaybooks,
    write,
)
from noetl_celery.engine.decision.select import select_part
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.decision.write import DuplicateEvent, Redecide
from noetl_celery.engine.ids import attempt_key, run_id_for
from noetl_celery.engine.messages import BATCH_EVENT, Dispatch, OutcomeEvent, TaskMessage, sanitize
from noetl_celery.errors import TemplateError
from noetl_celery.store import blobs, repo
from noetl_celery.store.db import commit_suffix, decision_transaction, transaction
from noetl_celery.templating import (
    HIDDEN_META,
    as_step_result,
    lenient,
    plain,
    reading,
    render_value,
    response_view,
    strict_rendering,
)
from noetl_celery.tools.base import get_tool
from noetl_celery.vocabulary import DispatchKind, ErrorKind, PayloadKind

log = logging.getLogger(__name__)

# step runs and inline loop iterations without work (routing-only: no tool, noop, end, router) one
# decision may chain: beyond it the execution fails (a cycle of steps without work never ends)
MAX_INLINE_DEPTH = 1000
START_KEY = ev.START_KEY


def loop_strategy(step: Step) -> loops.LoopStrategy:
    """The strategy of a loop step: a cursor loop's slots, or a collection's iterations."""
    assert step.loop is not None
    return cursor_loop.CURSOR_LOOP if step.loop.mode == "cursor" else loops.COLLECTION_LOOP


@dataclass
class Decider:
    """Accumulates one event's decisions; `flush` writes them in order.

    `deferred`: the decision started without reading the execution head (an attempt's outcome,
    with the state cached at the version the message asks for), assuming the execution runs at
    `version`. The head is then read by the first statement of the transaction: a loop counter's
    update carries it, locked FOR KEY SHARE (`count_iteration`); the execution counters' update
    in `flush` returns it, the row locked by the update itself; any other statement reads it
    first (`conn`). A head that does not match raises Redecide."""

    connection: Connection
    state: ExecutionState
    running: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 0
    pending: int = 0
    failure: dict[str, Any] | None = None
    depth: int = 0
    deferred: bool = False
    later_causes: list[str] = field(default_factory=list)  # a batch: the other outcomes' row keys
    written: dict[str, dict[str, Any]] = field(default_factory=dict)  # variables as flush stored them
    written_version: int | None = None  # the state version flush moved the execution to
    written_pending: int | None = None  # the pending count flush left (None: unknown)
    # a new execution (start_new): flush inserts its row with its counters instead of updating them
    create_row: Callable[[int, int], None] | None = None
    # tool-call times of the iterations of `batch: auto` loops this event reports, per loop run
    durations_ms: dict[str, list[float]] = field(default_factory=dict)
    # the decision's last write commits it and refuses rows that exist (see `flush`); an iteration
    # may then be counted by that write (`count_iteration`, `later_count`)
    strict: bool = False
    later_count: repo.IterationCount | None = None
    # step starts and routing-only tasks decided inline wait here while one runs (see `inline`)
    inline_queue: deque[Callable[[], None]] | None = None
    steps_run: int | None = None  # step runs recorded before this decision, once counted (`_too_many_steps`)
    # per step run: what lenient renders of its routing-only tasks hid, for its step.completed row
    hidden_notes: dict[str, list[str]] = field(default_factory=dict)

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
        if self.depth <= MAX_INLINE_DEPTH:
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
        bound = limits.max_steps()
        if self.version + self.depth < bound:
            return None
        if self.steps_run is None:
            self.steps_run = repo.count_events(self.conn, self.execution_id, ev.STEP_STARTED)
        started = self.steps_run + sum(1 for row in self.rows if row["event_type"] == ev.STEP_STARTED)
        if started <= bound:
            return None
        return (
            f"the execution started more than {bound} step runs ({settings.MAX_STEPS_ENV}): an arc cycle "
            "without an end? Give the playbook a `timeout:` or raise the bound"
        )

    @property
    def conn(self) -> Connection:
        """The transaction's connection; the head is checked before any statement uses it."""
        if self.deferred:
            self.deferred = False
            self._check_head(repo.execution_head(self.connection, self.execution_id, deciding=True))
        return self.connection

    def _check_head(self, head: dict[str, Any] | None) -> None:
        if not repo.running_at(head, self.version):
            raise Redecide()

    def count_iteration(
        self, run_id: str, *, ok: bool, tolerated: bool, unless_last: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        """Count one finished loop iteration (`repo.loop_iteration_done`); in a deferred decision
        the same statement reads and locks the execution head.

        `unless_last`: the loop's (cap, total) as this process knows them. A strict deferred
        decision then leaves the count to its last write, which refuses it when the iteration is
        the loop's last (Redecide: the classic decision finishes the loop); the counters returned
        have `done` None, and the caller goes on as for an iteration that is not the last."""
        if unless_last is not None and self.strict and self.deferred and self.later_count is None:
            cap, total = unless_last
            self.later_count = repo.IterationCount(run_id, ok, tolerated, cap, total)
            return {"done": None, "cap": cap, "total": total, "context": None}
        if not self.deferred:
            return repo.loop_iteration_done(self.conn, run_id, ok=ok, tolerated=tolerated)
        self.deferred = False
        counters, head = repo.loop_iteration_done_checked(
            self.connection, self.execution_id, run_id, ok=ok, tolerated=tolerated
        )
        self._check_head(head)
        assert counters is not None
        return counters

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
        return self.running and self.failure is None

    def decided(self) -> list[dict[str, Any]]:
        return self.rows

    def last_row(self) -> dict[str, Any]:
        return self.rows[-1]

    def send(self, dispatch: Dispatch) -> None:
        self.dispatches.append(dispatch)

    def drop_unit(self) -> None:
        self.pending -= 1

    def record(self, event_type: str, key: str, **fields: Any) -> str:
        row = {"execution_id": self.execution_id, "event_id": key, "event_type": event_type, **fields}
        if self.state.parent_execution_id is not None:
            row.setdefault("parent_execution_id", self.state.parent_execution_id)
        self.rows.append(row)
        return key

    def set_variables(self, scope: str, values: dict[str, Any]) -> None:
        if not values:
            return
        self.variables.setdefault(scope, {}).update(values)
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
        if self.failure is None:
            self.failure = {"step": step, "error": error}
            self.record(
                ev.EXECUTION_FAILED,
                ev.EXECUTION_FAILED,
                status="failed",
                step=step,
                error=error,
                parent_event_id=parent,
            )

    # --- entry points ----------------------------------------------------------------------

    def start_execution(self) -> None:
        self.record(
            ev.EXECUTION_STARTED,
            START_KEY,
            status="running",
            context=sanitize({"workload": self.state.workload}),
            meta={"playbook": self.plan.name, "entry_step": self.plan.entry_step},
        )
        self.enter_step(self.plan.entry_step, START_KEY, frames=[], args={})

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
        if message.is_claim:
            cursor_loop.claim_done(self, message, outcome, report)
            return
        step = self.plan.steps[message.step]
        task = step.tasks[message.task_index]
        key = message.outcome_key()
        # every attempt links to the first one (a retry's own start is its retry.scheduled row)
        first_attempt = attempt_key(message.run_id, message.iteration, message.seq, 1) + ".start"
        ok = outcome["status"] == "ok"
        causing = {
            "event_type": ev.ACTION_COMPLETED if ok else ev.ACTION_FAILED,
            "status": "completed" if ok else "failed",
            **self.attempt_fields(step, task, message),
            "parent_event_id": first_attempt,
            "queue_id": report.get("queue_id"),
            "worker": report.get("worker"),
            "started_at": _timestamp(report.get("started_at")),
            "duration_ms": report.get("duration_ms"),
            "result": outcome.get("data"),
            "error": outcome.get("error"),
            "meta": {
                k: v
                for k, v in (
                    ("http", outcome.get("http")),
                    ("pg", outcome.get("pg")),
                    ("retry_of", message.parent_event_id if message.attempt > 1 else None),
                    ("sink", outcome.get("meta", {}).get("sink")),
                    ("input", outcome.get("meta", {}).get("input")),
                    ("stdout", outcome.get("meta", {}).get("stdout")),
                    ("stderr", outcome.get("meta", {}).get("stderr")),
                    ("log", outcome.get("meta", {}).get("log")),
                    ("child", outcome.get("meta", {}).get("child")),
                    (HIDDEN_META, outcome.get("meta", {}).get(HIDDEN_META)),
                    ("pid", report.get("pid")),
                )
                if v
            },
        }
        if not self.running:
            causing["meta"]["ignored"] = True  # recorded, not acted on: a resume decides it
        if self.rows:  # a later iteration of a batch: its outcome row must be new as well
            self.later_causes.append(key)
        duration = report.get("duration_ms")
        if step.loop is not None and step.loop.batch == "auto" and isinstance(duration, (int, float)):
            self.durations_ms.setdefault(message.run_id, []).append(float(duration))
        self.record(key=key, **causing)
        causing_row = self.rows[-1]
        sink = outcome.get("meta", {}).get("sink") or {}
        if sink.get("kind") in ("event_log", "log") and sink.get("status") == "ok":
            self.record(
                ev.SINK_EVENT_LOG,
                key + ".sink",
                status="recorded",
                step=step.name,
                task=task.label,
                run_id=message.run_id,
                iteration=message.iteration,
                parent_event_id=key,
                result=(sink.get("data") or {}).get("event_log"),
            )
        if self.running:
            self.handle_outcome(step, task, message, outcome, causing_row)

    # --- tasks -----------------------------------------------------------------------------

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

    def handle_outcome(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], row: dict[str, Any]
    ) -> None:
        ok = outcome["status"] == "ok"
        if task.policy is None or not task.policy.rules:
            verdict = policy_eval.Verdict(policy_eval.DEFAULT_OK if ok else policy_eval.DEFAULT_ERROR, None, [])
            context: dict[str, Any] = {}  # nothing to render: the common, fast path
        else:
            base = render_context(self.state, self.scope_of(message, step))
            context = {**base, **policy_eval.outcome_scope(outcome, message.attempt)}
            verdict = policy_eval.decide(task.policy, outcome, context)
        action = verdict.action
        if verdict.rule is not None or verdict.skipped_conditions:
            row.setdefault("meta", {})["policy"] = {
                "rule": verdict.rule,
                "do": action.do,
                "skipped": verdict.skipped_conditions or None,
            }
        iter_vars = message.iter_vars
        try:
            with lenient(self.strict_templates) as hidden:  # `set` renders as NoETL renders it
                if action.set_iter:
                    iter_vars = {**message.iter_vars, **plain(render_value(action.set_iter, context))}
                self.set_variables("ctx", plain(render_value(action.set_ctx, context)))
                self.set_variables("vars", plain(render_value(action.set_vars, context)))
            data = plain(render_value(action.result, context)) if action.sets_result else outcome.get("data")
            if hidden:
                row.setdefault("meta", {})[HIDDEN_META] = [*row.get("meta", {}).get(HIDDEN_META, []), *hidden]
        except TemplateError as exc:
            self.unit_done(
                step,
                message,
                UnitEnd(ok=False, parent=row["event_id"], error={"kind": ErrorKind.TEMPLATE, "message": str(exc)}),
                row,
            )
            return
        task_results = dict(message.task_results)
        if len(step.tasks) > 1:
            task_results[task.label] = data
        do = action.do
        if do == "stop":
            do = "continue" if ok else "fail"
        if do == "retry":
            if self.retry(step, task, message, outcome, action, context, iter_vars, row):
                return
            do = "continue" if ok else "fail"
        if do == "continue" and not ok and verdict.rule is None:
            do = "fail"
        nxt = message.evolve(
            iter_vars=iter_vars,
            task_results=task_results,
            prev=data,
            parent_event_id=row["event_id"],
            attempt=1,
            page=1,
            call={},
        )
        if do == "continue" and message.task_index + 1 < len(step.tasks):
            self.dispatch_task(step, nxt.evolve(task_index=message.task_index + 1, seq=message.seq + 1))
        elif do == "jump":
            target = next((i for i, t in enumerate(step.tasks) if t.label == action.to), None)
            if target is None:
                self.unit_done(
                    step,
                    message,
                    UnitEnd(
                        ok=False,
                        parent=row["event_id"],
                        error={"kind": ErrorKind.POLICY, "message": f"jump target {action.to!r} is not a task"},
                    ),
                    row,
                )
                return
            self.dispatch_task(step, nxt.evolve(task_index=target, seq=message.seq + 1))
        elif do in ("continue", "break"):
            end = UnitEnd(
                ok=True,
                parent=row["event_id"],
                data=self.collected_or(data, step, task, message),
                task_results=task_results,
                iter_vars=iter_vars,
                tolerated=None if ok else outcome.get("error"),
                response=data,
            )
            self.unit_done(step, message, end, row)
        else:
            self.unit_done(
                step,
                message,
                UnitEnd(
                    ok=False,
                    parent=row["event_id"],
                    data=data,
                    error=(outcome.get("error") or {"kind": ErrorKind.POLICY, "message": "failed by policy rule"}),
                ),
                row,
            )

    def retry(
        self,
        step: Step,
        task: Task,
        message: TaskMessage,
        outcome: dict[str, Any],
        action: Action,
        context: dict[str, Any],
        iter_vars: dict[str, Any],
        row: dict[str, Any],
    ) -> bool:
        """Schedule the same task again (a retry on error, or the next page); False if exhausted."""
        ok = outcome["status"] == "ok"
        limit = action.attempts or (policy_eval.DEFAULT_PAGES if ok else policy_eval.DEFAULT_ATTEMPTS)
        used = message.page if ok else message.attempt
        base_key = attempt_key(message.run_id, message.iteration, message.seq, message.attempt)
        if used >= limit:
            self.record(
                ev.RETRY_EXHAUSTED,
                base_key + ".exhausted",
                status="exhausted",
                parent_event_id=row["event_id"],
                **self.attempt_fields(step, task, message),
                meta={"limit": limit, "kind": "pages" if ok else "attempts"},
            )
            return False
        if ok:
            try:
                call = plain(render_value(action.next_call or {}, context))
            except TemplateError as exc:
                self.unit_done(
                    step,
                    message,
                    UnitEnd(ok=False, parent=row["event_id"], error={"kind": ErrorKind.TEMPLATE, "message": str(exc)}),
                    row,
                )
                return True
            row["event_type"] = ev.PAGE_COMPLETED
            row.setdefault("meta", {})["collect"] = action.collect.model_dump() if action.collect else None
            nxt = message.evolve(
                seq=message.seq + 1,
                page=message.page + 1,
                attempt=1,
                call=call,
                iter_vars=iter_vars,
                parent_event_id=row["event_id"],
            )
            self.dispatch_task(step, nxt)
            return True
        retry_after = (outcome.get("error") or {}).get("retry_after")
        delay = policy_eval.next_backoff(action, message.attempt, retry_after)
        key = self.record(
            ev.RETRY_SCHEDULED,
            base_key + ".retry",
            status="scheduled",
            parent_event_id=row["event_id"],
            **self.attempt_fields(step, task, message, attempt=message.attempt + 1),
            meta={
                "delay": delay,
                "reason": (outcome.get("error") or {}).get("message"),
                "rule": row.get("meta", {}).get("policy", {}).get("rule"),
                "limit": limit,
            },
        )
        nxt = message.evolve(attempt=message.attempt + 1, iter_vars=iter_vars, parent_event_id=key)
        self.dispatch_task(step, nxt, countdown=delay, record_start=False)  # the retry row is its start
        return True

    def collected_or(self, data: Any, step: Step, task: Task, message: TaskMessage) -> Any:
        """The step's data after a task's last page: the collected pages when it paginated."""
        if message.page <= 1 and not _collects(task):
            return data
        collected = pagination.collect_pages(self.conn, self.execution_id, message, task, data)
        into = pagination.collect_spec(task).into
        if into and message.iteration is None:
            self.set_variables("vars", {into: collected})
        return collected

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
        timeout = deadlines.timeout_of(task.kind, task.config)
        if message.slot is not None and "timeout" not in task.config:  # a cursor row: the frame's lease
            timeout = cursor_loop.lease_seconds(step) or timeout
        label = shadow_label(step, task, self.plan.name)
        self.dispatches.append(Dispatch.task(message, countdown=countdown, label=label, timeout=timeout))

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
                        "message": f"more than {MAX_INLINE_DEPTH} steps or loop iterations without "
                        "work in a row (routing-only: no tool, noop, end, router): a cycle of steps "
                        "without work?",
                    },
                ),
                {"event_id": message.parent_event_id},
            )
            return
        context = render_context(self.state, self.scope_of(message, step))
        row: dict[str, Any] = {"event_id": message.parent_event_id}  # no row of its own is recorded
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

    def unit_done(self, step: Step, message: TaskMessage, end: UnitEnd, row: dict[str, Any]) -> None:
        """A step run, or one loop element, is over: its loop strategy counts it, or the step ends."""
        if message.iteration is not None:
            loop_strategy(step).unit_done(self, step, message, end, row)
            return
        self.step_done(step, RunRef(message.run_id, message.frames, message.args), end)

    def step_done(self, step: Step, run: RunRef, end: UnitEnd, via: str = "call") -> None:
        """A step run is over: record it, store its result, apply vars/set_ctx, route.
        `end.routing_response` is the last call's result (the last page), which routing reads."""
        self.pending -= 1
        run_id, data, parent = run.run_id, end.data, end.parent
        done_key = f"{run_id}.step.done"
        if end.ok and step.result_select is not None:
            try:
                data = select_part(
                    data, step.result_select, render_context(self.state, Scope(args=run.args, step=step.name))
                )
            except TemplateError as exc:
                end = end.evolve(ok=False, error={"kind": ErrorKind.TEMPLATE, "message": str(exc)})
        if not end.ok:
            self.fail_step(step.name, run_id, end.error, parent)
            return
        self.set_variables("result", {step.name: data})
        if len(step.tasks) > 1 and end.task_results:
            self.set_variables("tasks", {step.name: end.task_results})
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
        try:
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
        no_match_fails = step.next.on_no_match == "error" or (
            step.next.on_no_match is None and self.plan.no_next_is_error
        )
        if not targets and step.next.arcs and no_match_fails and step.name != self.plan.final_step:
            err = {"kind": ErrorKind.ROUTING, "message": f"no arc of step {step.name!r} matched"}
            self.fail_execution(step.name, err, done_key)
            return
        self.route(step, targets, run.frames, done_key)

    # --- routing and joins -----------------------------------------------------------------

    def route(
        self, step: Step, targets: list[tuple[str, dict[str, Any]]], frames: list[list[str]], parent: str
    ) -> None:
        if not targets:
            self.branch_ended(frames, parent)
            return
        child_frames = frames
        if len(targets) > 1 and step.join:
            repo.open_join(self.conn, self.execution_id, parent, step.join, len(targets))
            child_frames = [*frames, [parent, step.join]]
        for target, args in targets:
            self.enter_step(target, parent, child_frames, args, came_from=step.name)

    def enter_step(
        self, name: str, parent: str, frames: list[list[str]], args: dict[str, Any], came_from: str | None = None
    ) -> None:
        if frames and frames[-1][1] == name:
            fork_id = frames[-1][0]
            settled, arrived, width = repo.settle_join(self.conn, self.execution_id, fork_id, arrived=True)
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
        settled, arrived, width = repo.settle_join(self.conn, self.execution_id, fork_id, arrived=False)
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
                "message": f"more than {MAX_INLINE_DEPTH} steps without work in a row (routing-only: no "
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
        self.pending += 1
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

    # --- writing ---------------------------------------------------------------------------

    def flush(self, *, last: bool = False) -> list[Dispatch]:
        """Write everything decided (engine/decision/write.py); raises DuplicateEvent (and rolls
        back) on a redelivery, Redecide when the head moved on."""
        return write.flush(self, last=last)

    def keep_state(self, url: str) -> None:
        write.keep_state(self, url)


def _timestamp(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _collects(task: Task) -> bool:
    return bool(task.policy and any(rule.then.collect for rule in task.policy.rules))


def _deferred_state(url: str, execution_id: int, message: TaskMessage) -> ExecutionState | None:
    """The cached state an attempt's outcome can be decided on without reading the head first
    (None: decide the classic way). The message says which state version its decision saw; the
    head read later in the transaction must confirm the cached version is the newest."""
    state = STATE.peek(url, execution_id, min_version=message.version)
    if state is None or message.step not in state.plan.steps:
        return None
    return state


Outcome = tuple[TaskMessage, dict[str, Any], dict[str, Any]]  # an attempt's message, outcome, report


def outcomes_of(payload: dict[str, Any]) -> list[Outcome]:
    """The attempt outcomes an event reports, in order: one, or a batch's (engine/batching.py).
    A batch message that ended without reporting (lost, worker_lost, timeout) gives its one
    outcome to each of its iterations."""
    if payload["kind"] == BATCH_EVENT:
        return [(TaskMessage.from_dict(e["task"]), e["outcome"], e["report"]) for e in payload["events"]]
    event = OutcomeEvent.from_dict(payload)
    message = TaskMessage.from_dict(event.task)
    return [(member, event.outcome, event.report) for member in message.members()]


def handle_event(url: str, payload: dict[str, Any]) -> list[Dispatch]:
    """Decide on one event; returns what to publish (already recorded)."""
    execution_id = int(payload["execution_id"])
    kind = payload["kind"]
    outcomes = outcomes_of(payload) if kind in (PayloadKind.OUTCOME, PayloadKind.BATCH) else []
    deferred = _deferred_state(url, execution_id, outcomes[0][0]) if outcomes else None
    try:
        try:
            decided = _decide(url, payload, outcomes, deferred, strict=True)
        except Redecide:
            STATE.forget(url, execution_id)
            decided = _decide(url, payload, outcomes, None, strict=False)
        if decided is None:
            return []
        decider, dispatches = decided
    except DuplicateEvent as dup:
        STATE.forget(url, execution_id)
        ran_by = (payload.get("report") or {}).get("queue_id")  # a redelivered message's Celery task id
        return replay(url, execution_id, str(dup), ran_by=ran_by)
    except Exception:
        STATE.forget(url, execution_id)  # the in-memory state saw writes that were rolled back
        raise
    decider.keep_state(url)
    return dispatches


def _decide(
    url: str, payload: dict[str, Any], outcomes: list[Outcome], state: ExecutionState | None, *, strict: bool
) -> tuple[Decider, list[Dispatch]] | None:
    """One transaction deciding one event. With `state`, a deferred decision (see Decider).
    `strict`: its last write may commit it, and refuses rows that exist (Redecide): the first
    try of every event. The second, after a Redecide, tells a redelivery (DuplicateEvent) from
    rows that may exist."""
    execution_id = int(payload["execution_id"])
    kind = payload["kind"]
    with decision_transaction(url) as conn, reading(blobs.reader(conn)):  # results stored by reference
        if state is not None:
            decider = Decider(
                connection=conn,
                state=state,
                running=True,
                version=state.version,
                deferred=True,
                strict=strict and len(outcomes) == 1 and commit_suffix(conn) is not None,
            )
        else:
            head = repo.execution_head(conn, execution_id, deciding=True)
            if head is None:
                log.warning("event for unknown execution %s dropped", execution_id)
                return None
            state = STATE.get(url, execution_id, min_version=head["state_version"], conn=conn)
            decider = Decider(
                connection=conn, state=state, running=head["status"] == "running", version=head["state_version"]
            )
        if kind == PayloadKind.START:
            decider.start_execution()
        elif kind in (PayloadKind.OUTCOME, PayloadKind.BATCH):
            for message, outcome, report in outcomes:
                decider.depth = 0
                decider.on_outcome(message, outcome, report)
        else:
            raise ValueError(f"unknown event kind {kind!r}")
        dispatches = decider.flush(last=strict)
        if decider.deferred:  # nothing was written: impossible, flush inserts the causing row
            raise Redecide()
    return decider, dispatches


def start_new(conn: Connection, state: ExecutionState, create_row: Callable[[int, int], None]) -> list[Dispatch]:
    """Decide the start of an execution that is created in this same transaction
    (runner.submit): `create_row(pending, state_version)` inserts its row when the decision is
    written, with the counters the start leaves. Returns what to publish once it commits.
    In a `db.decision_transaction` the start's rows are the last write, which commits."""
    decider = Decider(connection=conn, state=state, running=True, version=state.version, create_row=create_row)
    decider.start_execution()
    return decider.flush(last=True)


def fail_internally(url: str, payload: dict[str, Any], reason: str, *, kind: str = ErrorKind.INTERNAL) -> None:
    """An event could not be decided (a defect, a lasting outage, a value the store refuses):
    fail the execution, recorded, rather than leave it running forever."""
    execution_id = int(payload["execution_id"])
    error = {"kind": kind, "message": reason[:2000]}
    events: list[dict[str, Any]] = payload.get("events") or [{}]
    task = payload.get("task") or events[0].get("task") or {}
    step = task.get("step")
    try:
        with transaction(url) as conn:
            if repo.finish_execution(conn, execution_id, "failed", error=error, failed_step=step):
                repo.insert_events(
                    conn,
                    [
                        {
                            "execution_id": execution_id,
                            "event_id": ev.EXECUTION_FAILED,
                            "event_type": ev.EXECUTION_FAILED,
                            "status": "failed",
                            "step": step,
                            "error": error,
                        }
                    ],
                )
    except Exception:  # the store itself is gone: nothing more can be recorded
        log.exception("could not record the failure of execution %s", execution_id)
    STATE.forget(url, execution_id)


def replay(url: str, execution_id: int, key: str, *, ran_by: str | None = None) -> list[Dispatch]:
    """A redelivered event: publish again what its first delivery decided (receivers dedupe). A
    message decided with a countdown keeps what is left of it: a retry's backoff still holds.
    `ran_by`: the Celery task id of a redelivered message, which may have run attempts of its own
    decisions itself (engine/eager.py): an attempt recorded with that id as its queue_id is not
    sent again; its decision is replayed in its place, and so on to the attempts not recorded."""
    replayed = []
    followed: set[str] = set()
    with transaction(url) as conn:
        rows = [repo.find_event(conn, execution_id, key)]
        while rows:
            row = rows.pop()
            elapsed = _since(row)
            for stored in ((row or {}).get("meta") or {}).get("dispatch") or []:
                dispatch = Dispatch.from_dict(stored)
                if ran_by is not None and dispatch.kind == DispatchKind.RUN:
                    attempt = dispatch.attempt_key()
                    if attempt in followed:
                        continue
                    outcome = repo.find_event(conn, execution_id, attempt + ".done")
                    if outcome is not None and outcome.get("queue_id") == ran_by:
                        followed.add(attempt)
                        rows.append(outcome)
                        continue
                replayed.append(dispatch.as_replay(countdown=max(dispatch.countdown - elapsed, 0.0)))
    return replayed


def _since(row: dict[str, Any] | None) -> float:
    """Seconds since an event row was decided (infinite when unknown)."""
    decided = (row or {}).get("created_at")
    if not isinstance(decided, datetime):
        return math.inf
    decided = decided if decided.tzinfo is not None else decided.replace(tzinfo=UTC)  # SQLite: naive UTC
    return (repo.utcnow() - decided).total_seconds()


def start_payload(execution_id: int) -> dict[str, Any]:
    return {"kind": PayloadKind.START, "execution_id": execution_id}
