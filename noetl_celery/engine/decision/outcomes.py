"""An attempt's outcome: its row, the task's policy, retries and pages (the Decider's first role).

`OutcomeRules.on_outcome` opens the row of an attempt's outcome; `handle_outcome` applies the
task's policy: `set` and `result`, then the first of the named rules in `OUTCOME_RULES` that
applies to the action's `do` (next page, retry, next task, jump, end of the unit, fail), as a
policy is an ordered list of named rules. `retry` schedules the same task again: a retry with its
backoff, or the next page. What they decide about the outcome's row (the rule that matched, a
page's type, the unit's end) completes it before it is built (rows.py), once, when the outcome is
decided.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import TemplateError
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Action, Step, Task
from noetl_celery.engine.context import render_context
from noetl_celery.engine.decision import cursor_loop, pagination, policy_eval
from noetl_celery.engine.decision.core import DecisionCore
from noetl_celery.engine.decision.rows import OpenRow
from noetl_celery.engine.decision.units import UnitEnd
from noetl_celery.engine.ids import attempt_key
from noetl_celery.engine.messages import TaskMessage, sanitize
from noetl_celery.templates.render import HIDDEN_META, lenient, plain, render_value

# the outcome's meta: what the worker reported under these names (in this order), when set
_OUTCOME_META = ("http", "pg")
_TOOL_META = ("sink", "input", "stdout", "stderr", "log", "child", HIDDEN_META)


@dataclass
class Outcome:
    """One attempt's outcome as the rules see it, once its policy matched and `set` rendered."""

    step: Step
    task: Task
    message: TaskMessage
    outcome: dict[str, Any]
    row: OpenRow
    verdict: policy_eval.Verdict
    context: dict[str, Any]
    iter_vars: dict[str, Any]
    data: Any
    task_results: dict[str, Any]
    do: str

    @property
    def ok(self) -> bool:
        return bool(self.outcome["status"] == "ok")

    @property
    def action(self) -> Action:
        return self.verdict.action

    def next_message(self) -> TaskMessage:
        """The message of the task this outcome sends on to (a pipeline's next task, a jump)."""
        return self.message.evolve(
            iter_vars=self.iter_vars,
            task_results=self.task_results,
            prev=self.data,
            parent_event_id=self.row["event_id"],
            attempt=1,
            page=1,
            call={},
        )


@dataclass(frozen=True)
class OutcomeRule:
    """A named rule of an outcome: `applies` to it, then `apply` decides it (False: not decided,
    the next rule that applies decides it)."""

    name: str
    applies: Callable[[Outcome], bool]
    apply: Callable[[OutcomeRules, Outcome], bool]


class OutcomeRules(DecisionCore):
    """The Decider's part deciding on an attempt's outcome."""

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
        if message.is_claim:
            cursor_loop.claim_done(self, message, outcome, report)
            return
        step = self.plan.steps[message.step]
        task = step.tasks[message.task_index]
        key = message.outcome_key()
        ok = outcome["status"] == "ok"
        causing = {
            "status": "completed" if ok else "failed",
            **self.attempt_fields(step, task, message),
            "parent_event_id": _attempt_parent(message),
            "queue_id": report.get("queue_id"),
            "worker": report.get("worker"),
            "started_at": _timestamp(report.get("started_at")),
            "duration_ms": report.get("duration_ms"),
            "result": outcome.get("data"),
            "error": outcome.get("error"),
            "meta": _outcome_meta(message, outcome, report, ignored=not self.running),
        }
        if self.decision.rows:  # a later iteration of a batch: its outcome row must be new as well
            self.decision.later_causes.append(key)
        self._keep_duration(step, message, report.get("duration_ms"))
        row = self.open_row(ev.ACTION_COMPLETED if ok else ev.ACTION_FAILED, key, **causing)
        if message.ran_with_claim:
            _note_claim(row, message)
        self._record_sink(step, task, message, outcome, key)
        if self.running:
            self.handle_outcome(step, task, message, outcome, row)
        self.decision.settle(row)

    def _keep_duration(self, step: Step, message: TaskMessage, duration: Any) -> None:
        """An iteration's duration, which sizes an `auto` batch of its loop."""
        if step.loop is not None and step.loop.batch == "auto" and isinstance(duration, (int, float)):
            self.decision.durations_ms.setdefault(message.run_id, []).append(float(duration))

    def _record_sink(self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], key: str) -> None:
        """A sink into the event log: its own row, after the outcome's."""
        sink = outcome.get("meta", {}).get("sink") or {}
        if sink.get("kind") not in ("event_log", "log") or sink.get("status") != "ok":
            return
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

    # --- tasks -----------------------------------------------------------------------------

    def handle_outcome(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], row: OpenRow
    ) -> None:
        """Apply the task's policy to an attempt's outcome: the first named rule that applies."""
        decided = self._policy(step, task, message, outcome, row)
        if decided is None:
            return
        for rule in OUTCOME_RULES:
            if rule.applies(decided) and rule.apply(self, decided):
                return

    def _policy(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], row: OpenRow
    ) -> Outcome | None:
        """The outcome with its policy's verdict and `set`/`result` rendered (None: a template
        failed, and the unit with it)."""
        ok = outcome["status"] == "ok"
        verdict, context = self._verdict(step, task, message, outcome)
        action = verdict.action
        if verdict.rule is not None or verdict.skipped_conditions:
            row.note(policy={"rule": verdict.rule, "do": action.do, "skipped": verdict.skipped_conditions or None})
        try:
            iter_vars, data = self._apply_sets(action, message, outcome, context, row)
        except TemplateError as exc:
            self._template_failed(step, message, row, exc)
            return None
        task_results = dict(message.task_results)
        if len(step.tasks) > 1:
            task_results[task.label] = data
        return Outcome(
            step, task, message, outcome, row, verdict, context, iter_vars, data, task_results, _do(verdict, ok)
        )

    def _verdict(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any]
    ) -> tuple[policy_eval.Verdict, dict[str, Any]]:
        """The policy's verdict on the outcome, and the context its templates render in."""
        if task.policy is None or not task.policy.rules:
            default = policy_eval.DEFAULT_OK if outcome["status"] == "ok" else policy_eval.DEFAULT_ERROR
            return policy_eval.Verdict(default, None, []), {}  # nothing to render: the common, fast path
        base = render_context(self.state, self.scope_of(message, step))
        context = {**base, **policy_eval.outcome_scope(outcome, message.attempt)}
        return policy_eval.decide(task.policy, outcome, context), context

    def _apply_sets(
        self, action: Action, message: TaskMessage, outcome: dict[str, Any], context: dict[str, Any], row: OpenRow
    ) -> tuple[dict[str, Any], Any]:
        """The action's `set` (iteration, ctx, vars) and `result`: the iteration's variables and
        the data the outcome carries on."""
        iter_vars = message.iter_vars
        with lenient(self.strict_templates) as hidden:  # `set` renders as NoETL renders it
            if action.set_iter:
                iter_vars = {**message.iter_vars, **plain(render_value(action.set_iter, context))}
            self.set_variables("ctx", plain(render_value(action.set_ctx, context)))
            self.set_variables("vars", plain(render_value(action.set_vars, context)))
        data = plain(render_value(action.result, context)) if action.sets_result else outcome.get("data")
        if hidden:
            row.note(**{HIDDEN_META: [*(row.get("meta") or {}).get(HIDDEN_META, []), *hidden]})
        return iter_vars, data

    # --- the named rules (OUTCOME_RULES) ---------------------------------------------------

    def _rule_retry(self, o: Outcome) -> bool:
        """`retry`: the next page of an ok outcome, or the attempt again after an error; when the
        limit is reached, the outcome continues (ok) or fails."""
        if self.retry(o.step, o.task, o.message, o.outcome, o.action, o.context, o.iter_vars, o.row):
            return True
        o.do = "continue" if o.ok else "fail"
        return False

    def _rule_next_task(self, o: Outcome) -> bool:
        """`continue` in a pipeline: its next task, whose start is this outcome's row."""
        nxt = o.next_message().evolve(task_index=o.message.task_index + 1, seq=o.message.seq + 1)
        self.dispatch_task(o.step, nxt, record_start=False)
        return True

    def _rule_jump(self, o: Outcome) -> bool:
        """`jump`: the pipeline's task named by `to` (the unit fails when there is none)."""
        target = next((i for i, t in enumerate(o.step.tasks) if t.label == o.action.to), None)
        if target is None:
            error = {"kind": ErrorKind.POLICY, "message": f"jump target {o.action.to!r} is not a task"}
            self.unit_done(o.step, o.message, UnitEnd(ok=False, parent=o.row["event_id"], error=error), o.row)
            return True
        nxt = o.next_message().evolve(task_index=target, seq=o.message.seq + 1)
        self.dispatch_task(o.step, nxt, record_start=False)
        return True

    def _rule_end(self, o: Outcome) -> bool:
        """`continue` after a pipeline's last task, or `break`: the unit ends ok (an error it
        tolerated kept)."""
        end = UnitEnd(
            ok=True,
            parent=o.row["event_id"],
            data=self.collected_or(o.data, o.step, o.task, o.message),
            task_results=o.task_results,
            iter_vars=o.iter_vars,
            tolerated=None if o.ok else o.outcome.get("error"),
            response=o.data,
        )
        self.unit_done(o.step, o.message, end, o.row)
        return True

    def _rule_fail(self, o: Outcome) -> bool:
        """`fail` (or any other action): the unit fails with the outcome's error."""
        error = o.outcome.get("error") or {"kind": ErrorKind.POLICY, "message": "failed by policy rule"}
        self.unit_done(o.step, o.message, UnitEnd(ok=False, parent=o.row["event_id"], data=o.data, error=error), o.row)
        return True

    def retry(
        self,
        step: Step,
        task: Task,
        message: TaskMessage,
        outcome: dict[str, Any],
        action: Action,
        context: dict[str, Any],
        iter_vars: dict[str, Any],
        row: OpenRow,
    ) -> bool:
        """Schedule the same task again (a retry on error, or the next page); False if exhausted."""
        ok = outcome["status"] == "ok"
        limit = action.attempts or (policy_eval.DEFAULT_PAGES if ok else policy_eval.DEFAULT_ATTEMPTS)
        if (message.page if ok else message.attempt) >= limit:
            self._exhausted(step, task, message, row, limit, ok)
            return False
        if ok:
            self._next_page(step, message, action, context, iter_vars, row)
        else:
            self._retry_later(step, task, message, outcome, action, iter_vars, row, limit)
        return True

    def _exhausted(self, step: Step, task: Task, message: TaskMessage, row: OpenRow, limit: int, ok: bool) -> None:
        base_key = attempt_key(message.run_id, message.iteration, message.seq, message.attempt)
        self.record(
            ev.RETRY_EXHAUSTED,
            base_key + ".exhausted",
            status="exhausted",
            parent_event_id=row["event_id"],
            **self.attempt_fields(step, task, message),
            meta={"limit": limit, "kind": "pages" if ok else "attempts"},
        )

    def _next_page(
        self,
        step: Step,
        message: TaskMessage,
        action: Action,
        context: dict[str, Any],
        iter_vars: dict[str, Any],
        row: OpenRow,
    ) -> None:
        """The next page: the same task with the action's `next_call` (this row a page's)."""
        try:
            call = plain(render_value(action.next_call or {}, context))
        except TemplateError as exc:
            self._template_failed(step, message, row, exc)
            return
        row.retype(ev.PAGE_COMPLETED)
        row.note(collect=action.collect.model_dump() if action.collect else None)
        nxt = message.evolve(
            seq=message.seq + 1,
            page=message.page + 1,
            attempt=1,
            call=call,
            iter_vars=iter_vars,
            parent_event_id=row["event_id"],
        )
        self.dispatch_task(step, nxt)

    def _retry_later(
        self,
        step: Step,
        task: Task,
        message: TaskMessage,
        outcome: dict[str, Any],
        action: Action,
        iter_vars: dict[str, Any],
        row: OpenRow,
        limit: int,
    ) -> None:
        """The attempt again after its backoff (its retry.scheduled row is its start)."""
        error = outcome.get("error") or {}
        delay = policy_eval.next_backoff(action, message.attempt, error.get("retry_after"))
        key = self.record(
            ev.RETRY_SCHEDULED,
            attempt_key(message.run_id, message.iteration, message.seq, message.attempt) + ".retry",
            status="scheduled",
            parent_event_id=row["event_id"],
            **self.attempt_fields(step, task, message, attempt=message.attempt + 1),
            meta={
                "delay": delay,
                "reason": error.get("message"),
                "rule": (row.get("meta") or {}).get("policy", {}).get("rule"),
                "limit": limit,
            },
        )
        nxt = message.evolve(attempt=message.attempt + 1, iter_vars=iter_vars, parent_event_id=key)
        self.dispatch_task(step, nxt, countdown=delay, record_start=False)

    def _template_failed(self, step: Step, message: TaskMessage, row: OpenRow, exc: TemplateError) -> None:
        """A template of the outcome's action could not render: the unit fails with kind `template`."""
        error = {"kind": ErrorKind.TEMPLATE, "message": str(exc)}
        self.unit_done(step, message, UnitEnd(ok=False, parent=row["event_id"], error=error), row)

    def collected_or(self, data: Any, step: Step, task: Task, message: TaskMessage) -> Any:
        """The step's data after a task's last page: the collected pages when it paginated."""
        if message.page <= 1 and not _collects(task):
            return data
        collected = pagination.collect_pages(self.reads, message, task, data)
        into = pagination.collect_spec(task).into
        if into and message.iteration is None:
            self.set_variables("vars", {into: collected})
        return collected


# A policy's actions as an ordered list of named rules: the first that applies and decides wins.
OUTCOME_RULES: tuple[OutcomeRule, ...] = (
    OutcomeRule("retry", lambda o: o.do == "retry", OutcomeRules._rule_retry),
    OutcomeRule(
        "next_task",
        lambda o: o.do == "continue" and o.message.task_index + 1 < len(o.step.tasks),
        OutcomeRules._rule_next_task,
    ),
    OutcomeRule("jump", lambda o: o.do == "jump", OutcomeRules._rule_jump),
    OutcomeRule("end", lambda o: o.do in ("continue", "break"), OutcomeRules._rule_end),
    OutcomeRule("fail", lambda o: True, OutcomeRules._rule_fail),
)


def _do(verdict: policy_eval.Verdict, ok: bool) -> str:
    """The action's `do` the rules read: `stop` ends the unit as the outcome went, and an error
    no rule matched does not continue."""
    do = verdict.action.do
    if do == "stop":
        return "continue" if ok else "fail"
    if do == "continue" and not ok and verdict.rule is None:
        return "fail"
    return do


def _attempt_parent(message: TaskMessage) -> str | None:
    """Every attempt links to the first one (a retry's own start is its retry.scheduled row); a
    later task of a pipeline has no start row: it links to what sent it (the previous task's
    outcome, or its retry.scheduled row)."""
    if message.seq > 0 and message.slot is None:
        return message.parent_event_id
    return attempt_key(message.run_id, message.iteration, message.seq, 1) + ".start"


def _outcome_meta(message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any], ignored: bool) -> dict:
    """The outcome row's meta: what the worker reported that is set."""
    tool_meta = outcome.get("meta", {})
    pairs = [
        *((name, outcome.get(name)) for name in _OUTCOME_META),
        ("retry_of", message.parent_event_id if message.attempt > 1 else None),
        *((name, tool_meta.get(name)) for name in _TOOL_META),
        ("pid", report.get("pid")),
        ("ignored", ignored),  # recorded, not acted on: a resume decides it
    ]
    return {k: v for k, v in pairs if v}


def _note_claim(row: OpenRow, message: TaskMessage) -> None:
    """The claim that took this row ran it: its frame's size, its row."""
    assert message.slot is not None
    rest = list(message.slot.get("rows") or [])
    row.note(
        claimed={"attempt": message.slot["via"], "rows": 1 + len(rest)},
        **({"frame": [message.element, *rest]} if rest else {}),  # kept once: the frame's rows name it
        **(sanitize({"row": message.element}) or {}),
    )


def _timestamp(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _collects(task: Task) -> bool:
    return bool(task.policy and any(rule.then.collect for rule in task.policy.rules))
