"""An attempt's outcome: its row, the task's policy, retries and pages (the Decider's first role).

`OutcomeRules.on_outcome` opens the row of an attempt's outcome; `handle_outcome` applies the
task's policy (`set`, `result`, then continue, jump, break, retry or fail), and `retry` schedules
the same task again: a retry with its backoff, or the next page. What they decide about the
outcome's row (the rule that matched, a page's type, the unit's end) completes it before it is
built (rows.py), once, when the outcome is decided.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from noetl_celery import vocabulary as ev
from noetl_celery.dsl.plan import Action, Step, Task
from noetl_celery.engine.context import render_context
from noetl_celery.engine.decision import cursor_loop, pagination, policy_eval
from noetl_celery.engine.decision.core import DecisionCore
from noetl_celery.engine.decision.rows import OpenRow
from noetl_celery.engine.decision.units import UnitEnd
from noetl_celery.engine.ids import attempt_key
from noetl_celery.engine.messages import TaskMessage, sanitize
from noetl_celery.errors import TemplateError
from noetl_celery.templating import HIDDEN_META, lenient, plain, render_value
from noetl_celery.vocabulary import ErrorKind


class OutcomeRules(DecisionCore):
    """The Decider's part deciding on an attempt's outcome."""

    def on_outcome(self, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
        if message.is_claim:
            cursor_loop.claim_done(self, message, outcome, report)
            return
        step = self.plan.steps[message.step]
        task = step.tasks[message.task_index]
        key = message.outcome_key()
        # every attempt links to the first one (a retry's own start is its retry.scheduled row); a
        # later task of a pipeline has no start row: it links to what sent it (the previous
        # task's outcome, or its retry.scheduled row)
        if message.seq > 0 and message.slot is None:
            parent = message.parent_event_id
        else:
            parent = attempt_key(message.run_id, message.iteration, message.seq, 1) + ".start"
        ok = outcome["status"] == "ok"
        causing = {
            "status": "completed" if ok else "failed",
            **self.attempt_fields(step, task, message),
            "parent_event_id": parent,
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
                    ("ignored", not self.running),  # recorded, not acted on: a resume decides it
                )
                if v
            },
        }
        if self.decision.rows:  # a later iteration of a batch: its outcome row must be new as well
            self.decision.later_causes.append(key)
        duration = report.get("duration_ms")
        if step.loop is not None and step.loop.batch == "auto" and isinstance(duration, (int, float)):
            self.decision.durations_ms.setdefault(message.run_id, []).append(float(duration))
        row = self.open_row(ev.ACTION_COMPLETED if ok else ev.ACTION_FAILED, key, **causing)
        if message.ran_with_claim:  # the claim that took this row ran it: its frame's size, its row
            assert message.slot is not None
            rest = list(message.slot.get("rows") or [])
            row.note(
                claimed={"attempt": message.slot["via"], "rows": 1 + len(rest)},
                **({"frame": [message.element, *rest]} if rest else {}),  # kept once: the frame's rows name it
                **(sanitize({"row": message.element}) or {}),
            )
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
            self.handle_outcome(step, task, message, outcome, row)
        self.decision.settle(row)

    # --- tasks -----------------------------------------------------------------------------

    def handle_outcome(
        self, step: Step, task: Task, message: TaskMessage, outcome: dict[str, Any], row: OpenRow
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
            row.note(
                policy={
                    "rule": verdict.rule,
                    "do": action.do,
                    "skipped": verdict.skipped_conditions or None,
                }
            )
        iter_vars = message.iter_vars
        try:
            with lenient(self.strict_templates) as hidden:  # `set` renders as NoETL renders it
                if action.set_iter:
                    iter_vars = {**message.iter_vars, **plain(render_value(action.set_iter, context))}
                self.set_variables("ctx", plain(render_value(action.set_ctx, context)))
                self.set_variables("vars", plain(render_value(action.set_vars, context)))
            data = plain(render_value(action.result, context)) if action.sets_result else outcome.get("data")
            if hidden:
                row.note(**{HIDDEN_META: [*(row.get("meta") or {}).get(HIDDEN_META, []), *hidden]})
        except TemplateError as exc:
            self._template_failed(step, message, row, exc)
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
        # a pipeline's next task: this outcome row is its start (one row per task, not two)
        if do == "continue" and message.task_index + 1 < len(step.tasks):
            self.dispatch_task(
                step, nxt.evolve(task_index=message.task_index + 1, seq=message.seq + 1), record_start=False
            )
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
            self.dispatch_task(step, nxt.evolve(task_index=target, seq=message.seq + 1), record_start=False)
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
        row: OpenRow,
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
                self._template_failed(step, message, row, exc)
                return True
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
                "rule": (row.get("meta") or {}).get("policy", {}).get("rule"),
                "limit": limit,
            },
        )
        nxt = message.evolve(attempt=message.attempt + 1, iter_vars=iter_vars, parent_event_id=key)
        self.dispatch_task(step, nxt, countdown=delay, record_start=False)  # the retry row is its start
        return True

    def _template_failed(self, step: Step, message: TaskMessage, row: OpenRow, exc: TemplateError) -> None:
        """A template of the outcome's action could not render: the unit fails with kind `template`."""
        error = {"kind": ErrorKind.TEMPLATE, "message": str(exc)}
        self.unit_done(step, message, UnitEnd(ok=False, parent=row["event_id"], error=error), row)

    def collected_or(self, data: Any, step: Step, task: Task, message: TaskMessage) -> Any:
        """The step's data after a task's last page: the collected pages when it paginated."""
        if message.page <= 1 and not _collects(task):
            return data
        collected = pagination.collect_pages(self.conn, self.execution_id, message, task, data)
        into = pagination.collect_spec(task).into
        if into and message.iteration is None:
            self.set_variables("vars", {into: collected})
        return collected


def _timestamp(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _collects(task: Task) -> bool:
    return bool(task.policy and any(rule.then.collect for rule in task.policy.rules))
