"""Execution state as the engine and the workers read it, and the template render context.

The plan and workload of an execution never change, so each process caches them. ctx, vars and
step results change; the execution row carries a `state_version` that grows with every change,
and messages carry the version they were decided at, so a process reloads only when it is behind.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from noetl_celery.dsl.plan import Plan
from noetl_celery.store import repo
from noetl_celery.store.db import transaction
from noetl_celery.templating import as_step_result

CACHED_EXECUTIONS = 256  # executions whose plan and state one process keeps in memory


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

    def load_variables(self, scopes: dict[str, dict[str, Any]], version: int) -> None:
        self.ctx = {**self.plan.ctx, **scopes.get("ctx", {})}
        self.vars = dict(scopes.get("vars", {}))
        self.results = dict(scopes.get("result", {}))
        self.task_results = dict(scopes.get("tasks", {}))
        self.version = version


class StateCache:
    """Per-process cache of ExecutionState, reloaded when a caller needs a newer version."""

    def __init__(self, size: int = CACHED_EXECUTIONS):
        self._size = size
        self._states: OrderedDict[tuple[str, int], ExecutionState] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, url: str, execution_id: int, min_version: int = 0,
            conn: Connection | None = None) -> ExecutionState:
        """The state at `min_version` or newer; loads through `conn` when given (a caller inside a
        transaction must pass its connection: SQLite would block a second writer)."""
        key = (url, execution_id)
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
        if state is not None and state.version >= min_version:
            return state
        with _reuse(conn) if conn is not None else transaction(url) as conn:
            if state is None:
                row = repo.get_execution(conn, execution_id)
                if row is None:
                    raise LookupError(f"execution {execution_id} not found")
                state = ExecutionState(
                    execution_id=execution_id,
                    plan=Plan.model_validate(row["plan"]),
                    workload=row["workload"],
                    parent_execution_id=row["parent_execution_id"],
                )
                version = row["state_version"]
            else:
                head = repo.execution_head(conn, execution_id)
                version = head["state_version"] if head else min_version
            fresh = ExecutionState(state.execution_id, state.plan, state.workload, state.parent_execution_id)
            fresh.load_variables(repo.load_variables(conn, execution_id), version)
        with self._lock:
            self._states[key] = fresh
            self._states.move_to_end(key)
            while len(self._states) > self._size:
                self._states.popitem(last=False)
        return fresh

    def forget(self, url: str, execution_id: int) -> None:
        with self._lock:
            self._states.pop((url, execution_id), None)


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
    attempt: int = 1
    step: str | None = None
    task_results: dict[str, Any] = field(default_factory=dict)


def render_context(state: ExecutionState, scope: Scope, **extra: Any) -> dict[str, Any]:
    """The names a template can use (see docs/dsl.md, Template context)."""
    context: dict[str, Any] = dict(state.workload)
    for name, value in state.results.items():
        context[name] = as_step_result(value, state.task_results.get(name))
    if scope.step and scope.task_results:
        # Inside a pipeline, `step.label` reads an earlier task's result of this very run.
        current = context.get(scope.step)
        base = current if isinstance(current, dict) else {}
        context[scope.step] = as_step_result({**base, **scope.task_results}, scope.task_results)
    context.update(
        workload=state.workload,
        ctx=state.ctx,
        vars=state.vars,
        execution_id=state.execution_id,
        parent_execution_id=state.parent_execution_id,
        args=scope.args,
        _prev=scope.prev,
        _attempt=scope.attempt,
    )
    if scope.iterator is not None:
        iter_scope = {scope.iterator: scope.element, "index": scope.iteration, **scope.iter_vars}
        context["iter"] = iter_scope
        context[scope.iterator] = scope.element
    elif scope.iter_vars:
        context["iter"] = dict(scope.iter_vars)
    context.update(extra)
    return context
