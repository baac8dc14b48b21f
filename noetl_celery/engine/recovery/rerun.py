"""Rerun: a NEW execution made from an old one, recorded as such (resume, by contrast, continues
the same execution: engine/recovery/resume.py).

Decides what a rerun from a step keeps and where it starts:
- the steps of the old execution that completed before the last run of STEP started keep their
  results: each is copied into the new execution (its result and pipeline task results) and
  recorded there as a `step.completed` row with `meta.seeded_from` (the old execution's id), and
  no attempt of them runs again;
- the old execution's ctx and vars, as it left them, are the new one's;
- STEP starts with the arguments of its old run (its `step.started` context) and reads the step
  whose arc started it as `result`, as it did; what follows is decided as in any execution.
The new execution's `execution.started` row carries `meta.rerun_of`, `meta.from_step` (null for a
whole rerun), `meta.plan` ("stored": the old execution's plan; "catalog": the playbook registered
at its path when the rerun was made, with `meta.registered_at`) and `meta.seeded` (the steps kept).

Refused (RerunRefused, which names the request's field when one is wrong): a STEP the plan has
not, a STEP that never started in the old execution, a rerun from a step of an execution that is
still running, and a STEP whose arguments were too large to be recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, and_, select

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import ExecutionNotFound, NoetlError
from noetl_celery.dsl.plan import Plan
from noetl_celery.engine.context import ExecutionState
from noetl_celery.engine.decision.orchestrator import Decider
from noetl_celery.engine.messages import Dispatch, sanitize
from noetl_celery.store import repo

SEEDED_FROM = "seeded_from"  # meta key of a step.completed row copied from the old execution
STEP_ROWS = (ev.STEP_STARTED, ev.STEP_COMPLETED)


class RerunRefused(NoetlError):
    """The rerun cannot be made as asked (says why; `field`: the request's field that is wrong)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class Rerun:
    """What a rerun starts from: the old execution, the step it starts at (None: the entry step)
    and, from a step, what it keeps of the old execution."""

    rerun_of: int
    from_step: str | None = None
    plan_source: str = "stored"  # or "catalog" (--latest)
    registered_at: str | None = None  # the catalog entry's registration time (--latest)
    results: dict[str, Any] = field(default_factory=dict)  # step -> result
    task_results: dict[str, Any] = field(default_factory=dict)  # step -> {label: result}
    ctx: dict[str, Any] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    seeded_runs: dict[str, str] = field(default_factory=dict)  # step -> the old run id of its result
    args: dict[str, Any] = field(default_factory=dict)  # STEP's arguments in its old run
    came_from: str | None = None  # the step whose arc started STEP's old run

    def meta(self, plan: Plan) -> dict[str, Any]:
        return {
            "playbook": plan.name,
            "entry_step": plan.entry_step,
            "rerun_of": self.rerun_of,
            "from_step": self.from_step,
            "plan": self.plan_source,
            **({"registered_at": self.registered_at} if self.registered_at else {}),
            "seeded": sorted(self.results),
        }


def old_execution(conn: Connection, execution_id: int) -> dict[str, Any]:
    row = repo.get_execution(conn, execution_id)
    if row is None:
        raise ExecutionNotFound(f"no execution {execution_id}")
    return row


def seed(conn: Connection, old: dict[str, Any], plan: Plan, rerun: Rerun) -> None:
    """Fill `rerun` (its from_step set) with what it keeps of the old execution `old`."""
    step = rerun.from_step
    assert step is not None
    old_id = int(old["execution_id"])
    if step not in plan.steps:
        raise RerunRefused(f"from_step: the playbook has no step {step!r}", "from_step")
    if old["status"] == "running":
        raise RerunRefused(f"execution {old_id} is still running: rerun from a step once it has ended (or cancel it)")
    rows = _step_rows(conn, old_id)
    starts = [r for r in rows if r["event_type"] == ev.STEP_STARTED and r["step"] == step]
    if not starts:
        raise RerunRefused(f"from_step: step {step!r} never started in execution {old_id}", "from_step")
    cutoff = starts[-1]
    args = (cutoff.get("context") or {}).get("args") or {}
    if isinstance(args, dict) and args.get("truncated") is True:
        raise RerunRefused(
            f"from_step: the arguments of step {step!r}'s run were too large to be recorded; rerun the whole "
            "playbook instead",
            "from_step",
        )
    rerun.args = args if isinstance(args, dict) else {}
    completed = {r["event_id"]: r for r in rows if r["event_type"] == ev.STEP_COMPLETED}
    parent = completed.get(cutoff.get("parent_event_id") or "")
    rerun.came_from = parent["step"] if parent is not None and parent["step"] in plan.steps else None
    before = {r["step"]: r["run_id"] for r in rows if r["event_type"] == ev.STEP_COMPLETED and r["id"] < cutoff["id"]}
    variables = repo.load_variables(conn, old_id)
    stored = variables.get("result", {})
    tasks = variables.get("tasks", {})
    for name, run_id in before.items():
        if name == step or name not in plan.steps or name not in stored:
            continue
        rerun.results[name] = stored[name]
        rerun.seeded_runs[name] = run_id
        if name in tasks:
            rerun.task_results[name] = tasks[name]
    rerun.ctx = dict(variables.get("ctx", {}))
    rerun.vars = dict(variables.get("vars", {}))


def _step_rows(conn: Connection, execution_id: int) -> list[dict[str, Any]]:
    e = repo.EVENTS.c
    query = (
        select(e.id, e.event_id, e.event_type, e.step, e.run_id, e.parent_event_id, e.context)
        .where(and_(e.execution_id == execution_id, e.event_type.in_(STEP_ROWS)))
        .order_by(e.id)
    )
    return [dict(r) for r in conn.execute(query).mappings()]


def start(conn: Connection, state: ExecutionState, create_row: Any, rerun: Rerun) -> list[Dispatch]:
    """Decide the start of the rerun created in this same transaction (as orchestrator.start_new
    decides a new execution's): the start row, the seeded steps' rows and variables, then the
    first step run. Returns what to publish once it commits."""
    decider = Decider(connection=conn, state=state, running=True, version=state.version, create_row=create_row)
    plan = state.plan
    decider.record(
        ev.EXECUTION_STARTED,
        ev.START_KEY,
        status="running",
        context=sanitize({"workload": state.workload}),
        meta=rerun.meta(plan),
    )
    for name in sorted(rerun.results, key=list(plan.steps).index):
        run_id = rerun.seeded_runs[name]
        decider.record(
            ev.STEP_COMPLETED,
            f"{run_id}.step.done",
            status="completed",
            step=name,
            run_id=run_id,
            result=rerun.results[name],
            parent_event_id=ev.START_KEY,
            meta={SEEDED_FROM: rerun.rerun_of},
        )
    decider.set_variables("result", rerun.results)
    decider.set_variables("tasks", rerun.task_results)
    decider.set_variables("ctx", rerun.ctx)
    decider.set_variables("vars", rerun.vars)
    if rerun.from_step is None:
        decider.enter_step(plan.entry_step, ev.START_KEY, frames=[], args={})
    else:
        decider.enter_step(rerun.from_step, ev.START_KEY, frames=[], args=rerun.args, came_from=rerun.came_from)
    return decider.flush(last=True)
