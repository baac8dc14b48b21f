"""Execution state as the engine and the workers read it, and the template render context.

The plan and workload of an execution never change, so each process caches them. ctx, vars and
step results change; the execution row carries a `state_version` that grows with every change,
and messages carry the version they were decided at, so a process reloads only when it is behind.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from noetl_celery.config import limits
from noetl_celery.dsl.plan import Plan, Step
from noetl_celery.store import variables as variable_rows
from noetl_celery.store.db import single_read
from noetl_celery.templates.render import (
    BUILTIN_NAMES,
    Deferred,
    Lenient,
    LoopResult,
    Stored,
    as_step_result,
    rows_result,
    stored_or,
)

if TYPE_CHECKING:
    from noetl_celery.engine.messages import TaskMessage

CACHED_EXECUTIONS = 256  # executions whose plan and state one process keeps in memory
CACHED_PLANS = 64  # plans (with their workload) one process keeps by digest, for seeded messages
DUCKDB_KIND = "duckdb"  # a one-task step of this kind reads as its list of rows (templates.render.RowsResult)
LOOP_RESULTS = "loop_results"  # a run entered from a loop step's arc reads its iteration results by this name
# a list result longer than this is wrapped in its step result view (a copy) only when a template
# reads it (templates.render.Deferred): an iteration's render of a loop over a long inline list
# does not copy the list each time
DEFERRED_LIST_ITEMS = 1_000
JOB_UUID_NAMESPACE = uuid.UUID("5d3c7c1e-6b0f-4f43-9d55-2f7e0c1a9b21")  # job.uuid = uuid5(this, execution id)


@dataclass
class ExecutionState:
    execution_id: int
    plan: Plan
    workload: dict[str, Any]
    parent_execution_id: int | None
    version: int = -1
    ctx: dict[str, Any] = field(default_factory=dict)
    vars: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    task_results: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the pending count as last seen at `version` (None: unknown). Decisions without variables
    # change it without a new version, so it is a guess: a strict write checks it (Decider.flush)
    pending: int | None = None
    digest: str | None = None  # the plan's digest (plan_digest), where it is known

    def load_variables(self, scopes: dict[str, dict[str, Any]], version: int) -> None:
        self.ctx = {**self.plan.ctx, **scopes.get("ctx", {})}
        self.vars = dict(scopes.get("vars", {}))
        self.results = dict(scopes.get("result", {}))
        self.task_results = dict(scopes.get("tasks", {}))
        self.version = version


def plan_digest(plan: dict[str, Any]) -> str:
    """The digest of a plan in its stored (JSON) form, workload included: the same for the dict
    a submit writes and for the one a load reads back."""
    text = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def new_state(plan: Plan, execution_id: int, stored: dict[str, Any] | None = None) -> ExecutionState:
    """The state of an execution of `plan` that is being created: as a load of it would read
    (the workload as stored, in its JSON form). `stored`: the plan as it is written (its
    JSON form), which also gives the state its `digest`."""
    workload = (stored or plan.model_dump(mode="json", include={"workload"}))["workload"]
    state = ExecutionState(execution_id=execution_id, plan=plan, workload=workload, parent_execution_id=None)
    state.load_variables({}, 0)
    if stored is not None:
        state.digest = plan_digest(stored)
    return state


def seed_of(state: ExecutionState, version: int | None, pending: int | None) -> dict[str, Any] | None:
    """The seed of a new execution's first messages (TaskMessage.seed), whose start wrote no
    variables: the plan's digest, the state version and the pending count the start wrote.
    None when the plan's digest or the version is not known."""
    if state.digest is None or version is None:
        return None
    return {"plan": state.digest, "version": version, "pending": pending}


class StateCache:
    """Per-process cache of ExecutionState, reloaded when a caller needs a newer version."""

    def __init__(self, size: int = CACHED_EXECUTIONS, plans: int = CACHED_PLANS):
        self._size = size
        self._states: OrderedDict[tuple[str, int], ExecutionState] = OrderedDict()
        self._plans_size = plans
        # plan digest -> the plan and its workload as stored (a top-level execution's, read whole)
        self._plans: OrderedDict[str, tuple[Plan, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self,
        url: str,
        execution_id: int,
        min_version: int = 0,
        conn: Connection | None = None,
        seed: dict[str, Any] | None = None,
    ) -> ExecutionState:
        """The state at `min_version` or newer; loads through `conn` when given (a caller inside a
        transaction must pass its connection: SQLite would block a second writer). `seed`: a new
        execution's first message's (seed_of); when this process holds its plan by digest, the
        state is built from it and nothing is read."""
        key = (url, execution_id)
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
            held = self._plans.get(seed["plan"]) if state is None and seed else None
        if state is not None and state.version >= min_version:
            return state
        if held is not None and seed is not None and seed.get("version") == min_version:
            seeded = ExecutionState(execution_id, held[0], held[1], None, digest=seed["plan"])
            seeded.load_variables({}, min_version)
            seeded.pending = seed.get("pending")
            self._keep(url, seeded)
            return seeded
        with _reuse(conn) if conn is not None else single_read(url) as conn:
            loaded = variable_rows.read_state(conn, execution_id, full=state is None)
        if state is None:
            if loaded is None:
                raise LookupError(f"execution {execution_id} not found")
            state = ExecutionState(
                execution_id=execution_id,
                plan=Plan.model_validate(loaded["plan"]),
                workload=loaded["workload"],
                parent_execution_id=loaded["parent_execution_id"],
            )
            if state.parent_execution_id is None:  # a later execution of this plan may be seeded
                state.digest = plan_digest(loaded["plan"])
                self._hold(state.digest, state.plan, state.workload)
        fresh = ExecutionState(
            state.execution_id, state.plan, state.workload, state.parent_execution_id, digest=state.digest
        )
        if loaded is None:  # removed meanwhile (a submit whose broker was down): nothing is left
            fresh.load_variables({}, min_version)
        else:
            fresh.load_variables(loaded["variables"], loaded["state_version"])
            fresh.pending = loaded["pending"]
        self._keep(url, fresh)
        return fresh

    def advance(
        self,
        url: str,
        state: ExecutionState,
        version: int,
        written: dict[str, dict[str, Any]],
        pending: int | None = None,
    ) -> None:
        """Keep the state a decision of this process committed: `state` as it read it, with the
        variables it `written` (as stored), at `version`, the one version after `state`'s, with
        the `pending` count the decision left (None: unknown)."""
        fresh = ExecutionState(
            state.execution_id, state.plan, state.workload, state.parent_execution_id, digest=state.digest
        )
        fresh.ctx = {**state.ctx, **written.get("ctx", {})}
        fresh.vars = {**state.vars, **written.get("vars", {})}
        fresh.results = {**state.results, **written.get("result", {})}
        fresh.task_results = {**state.task_results, **written.get("tasks", {})}
        fresh.version = version
        fresh.pending = pending
        self._keep(url, fresh)

    def _hold(self, digest: str, plan: Plan, workload: dict[str, Any]) -> None:
        with self._lock:
            self._plans[digest] = (plan, workload)
            self._plans.move_to_end(digest)
            while len(self._plans) > self._plans_size:
                self._plans.popitem(last=False)

    def _keep(self, url: str, state: ExecutionState) -> None:
        key = (url, state.execution_id)
        with self._lock:
            self._states[key] = state
            self._states.move_to_end(key)
            while len(self._states) > self._size:
                self._states.popitem(last=False)

    def peek(self, url: str, execution_id: int, min_version: int = 0) -> ExecutionState | None:
        """The cached state if it is at `min_version` or newer (None otherwise: nothing is read)."""
        with self._lock:
            state = self._states.get((url, execution_id))
        return state if state is not None and state.version >= min_version else None

    def forget(self, url: str, execution_id: int) -> None:
        with self._lock:
            self._states.pop((url, execution_id), None)

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._plans.clear()


STATE = StateCache()


@contextmanager
def _reuse(conn: Connection) -> Iterator[Connection]:
    yield conn


@dataclass
class Scope:
    """What one task attempt (or one decision) sees besides the execution state."""

    iteration: int | None = None
    element: Any = None
    iterator: str | None = None
    iter_vars: dict[str, Any] = field(default_factory=dict)
    prev: Any = None
    args: dict[str, Any] = field(default_factory=dict)
    from_step: str | None = None  # the step whose arc started this run
    attempt: int = 1
    step: str | None = None
    task_results: dict[str, Any] = field(default_factory=dict)


def job_of(state: ExecutionState) -> dict[str, Any]:
    """`job`: the execution as NoETL playbooks name it (`job.uuid` is stable for the execution;
    its ids are strings, as `execution_id` is)."""
    parent = state.parent_execution_id
    return {
        "uuid": str(uuid.uuid5(JOB_UUID_NAMESPACE, str(state.execution_id))),
        "id": str(state.execution_id),
        "execution_id": str(state.execution_id),
        "parent_execution_id": None if parent is None else str(parent),
        "name": state.plan.name,
        "path": state.plan.path,
    }


def message_scope(message: TaskMessage, step: Step) -> Scope:
    """What one attempt of `step` carried by `message` sees besides the execution state."""
    return Scope(
        iteration=message.iteration,
        element=message.element,
        iterator=step.loop.iterator if step.loop else None,
        iter_vars=message.iter_vars,
        prev=message.prev,
        args=message.args,
        attempt=message.attempt,
        from_step=message.from_step,
        step=step.name,
        task_results=message.task_results,
    )


def _with_loop_results(state: ExecutionState, scope: Scope) -> tuple[dict[str, Any], dict[str, Any]]:
    """`args` and `ctx` of a run; entered from a loop step's arc, both also answer `loop_results`
    (the loop's per-iteration results, in collection order) unless they hold that name, as NoETL
    passes a loop's results on. Read from the stored result, never carried in messages."""
    step = state.plan.steps.get(scope.from_step) if scope.from_step else None
    done = state.results.get(scope.from_step) if scope.from_step else None
    if step is not None and step.loop is not None and limits.is_reference(done):
        # a loop's result stored by reference: its results are read when a template uses them
        results: Any = stored_or(done, lambda v: as_step_result(v.get("results") if isinstance(v, dict) else None))
        args = scope.args if LOOP_RESULTS in scope.args else {**scope.args, LOOP_RESULTS: results}
        ctx = state.ctx if LOOP_RESULTS in state.ctx else {**state.ctx, LOOP_RESULTS: results}
        return args, ctx
    if step is None or step.loop is None or not isinstance(done, dict) or not isinstance(done.get("results"), list):
        return scope.args, state.ctx
    results = done["results"]
    args = scope.args if LOOP_RESULTS in scope.args else {**scope.args, LOOP_RESULTS: results}
    ctx = state.ctx if LOOP_RESULTS in state.ctx else {**state.ctx, LOOP_RESULTS: results}
    return args, ctx


def previous_output(prev: Any) -> Lenient:
    """`output` inside a pipeline task: the previous task's outcome (a task only runs after the
    one before it continued, so its status is ok; `data` and `result` are its data)."""
    return Lenient(status="ok", data=prev, result=as_step_result(prev), error=None, http=Lenient(), pg=Lenient())


def render_context(state: ExecutionState, scope: Scope, **extra: Any) -> dict[str, Any]:
    """The names a template can use (see docs/dsl.md, Template context)."""
    context: dict[str, Any] = dict(state.workload)
    context.update(state.ctx)  # ctx variables are bare names too (`{{ api_url }}`), as in NoETL
    for name, value in state.results.items():
        step = state.plan.steps.get(name)
        # a result stored by reference (limits.reference) is read only when a template uses it
        if step is not None and step.loop is not None and isinstance(value, dict):
            context[name] = stored_or(value, LoopResult)
        elif step is not None and len(step.tasks) == 1 and step.tasks[0].kind == DUCKDB_KIND:
            context[name] = stored_or(value, rows_result)
        else:
            tasks = state.task_results.get(name)
            wrap = partial(as_step_result, task_results=tasks)
            if limits.is_reference(value):
                context[name] = Stored(value, wrap)
            elif isinstance(value, list) and len(value) > DEFERRED_LIST_ITEMS:  # wrapped (copied) when read
                context[name] = Deferred(value, wrap)
            else:
                context[name] = as_step_result(value, tasks)
    if scope.step and scope.task_results:
        # Inside a pipeline, `step.label` reads an earlier task's result of this very run, and so
        # does the bare label, as in NoETL (`{{ build.id }}`; it wins over a step or workload name,
        # not over the engine's own names or the current step's)
        current = context.get(scope.step)
        base = current if isinstance(current, dict) else {}
        for label, value in scope.task_results.items():
            if label not in BUILTIN_NAMES and label != scope.step:
                context[label] = as_step_result(value)
        context[scope.step] = as_step_result({**base, **scope.task_results}, scope.task_results)
        # `output`: the previous task's outcome as a policy reads it ({{ output.data }})
        context["output"] = previous_output(scope.prev)
    if scope.from_step in state.results and "result" not in context:
        # As in NoETL, a step's tool reads the step that routed to it as `result` (conditions and
        # sinks bind their own `result` through `extra`).
        context["result"] = context[scope.from_step]
    args, ctx = _with_loop_results(state, scope)
    context.update(
        workload=state.workload,
        ctx=ctx,
        vars=state.vars,
        # strings, as NoETL passes them (`execution_id[:8]`); SQL text renders the same digits
        execution_id=str(state.execution_id),
        parent_execution_id=None if state.parent_execution_id is None else str(state.parent_execution_id),
        args=args,
        _prev=scope.prev,
        _attempt=scope.attempt,
        job=job_of(state),
    )
    if scope.iteration is not None:
        context["loop_index"] = scope.iteration
    if scope.iterator is not None:
        iter_scope = {scope.iterator: scope.element, "index": scope.iteration, **scope.iter_vars}
        context["iter"] = iter_scope
        context[scope.iterator] = scope.element
    elif scope.iter_vars:
        context["iter"] = dict(scope.iter_vars)
    context.update(extra)
    return context
