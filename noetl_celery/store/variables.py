"""The variables' table (ctx, vars, step results) and an execution's state as a decision reads it."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.engine import Dialect

from noetl_celery.config import limits, secret_registry
from noetl_celery.store import kernel
from noetl_celery.store.kernel import EXECUTIONS, VARIABLES, utcnow

# --- variables (ctx, vars, step results) --------------------------------------------------


PG_VARIABLES = "json_agg(json_build_array(v.scope, v.name, v.value))"  # variables v as [scope, name, value]


def put_variables(conn: Connection, execution_id: int, scope: str, values: dict[str, Any]) -> dict[str, Any]:
    """Set variables of one scope (insert or overwrite), in one statement on the DBAPI cursor.
    Returns them as stored (masked, capped, through the column's JSON), as a read would give them."""
    if not values:
        return {}
    dialect = conn.dialect
    count, params = variable_rows(dialect, execution_id, {scope: values})
    cursor = kernel.run(conn, variables_upsert_sql(dialect, count, "name, value"), params)
    return {name: kernel.read(dialect, VARIABLES, "value", value) for name, value in cursor.fetchall()}


def variables_upsert_sql(dialect: Dialect, rows: int, returning: str) -> str:
    row = f"({kernel.placeholders(dialect, 5)})"
    return (
        f"INSERT INTO noetl_variable (execution_id, scope, name, value, updated_at) VALUES "
        f"{', '.join([row] * rows)} ON CONFLICT (execution_id, scope, name) "
        f"DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at RETURNING {returning}"
    )


def variable_rows(dialect: Dialect, execution_id: int, variables: dict[str, dict[str, Any]]) -> tuple[int, list[Any]]:
    """The upsert's parameters for `variables` (by scope): each value masked, capped and bound."""
    now = kernel.bound(dialect, VARIABLES, "updated_at", utcnow())
    params: list[Any] = []
    count = 0
    for scope, values in variables.items():
        for name, value in values.items():
            stored = kernel.bound(dialect, VARIABLES, "value", limits.cap(secret_registry.mask(value)))
            params += [execution_id, scope, name, stored, now]
            count += 1
    return count, params


def read_state(conn: Connection, execution_id: int, *, full: bool) -> dict[str, Any] | None:
    """An execution's state version, pending count and variables by scope (`variables`), and with
    `full` its plan, workload and parent too: one statement, so one snapshot and one round trip
    (None: no such execution)."""
    dialect = conn.dialect
    if dialect.name == "postgresql":
        agg = PG_VARIABLES
    else:  # SQLite stores JSON as text: json() reads it back as JSON inside the array
        agg = "json_group_array(json_array(v.scope, v.name, json(v.value)))"
    columns = "e.plan, e.workload, e.parent_execution_id" if full else "NULL, NULL, NULL"
    sql = kernel.sql(
        dialect,
        "state.full" if full else "state",
        f"SELECT e.state_version, e.pending, {columns}, (SELECT {agg} FROM noetl_variable v "
        "WHERE v.execution_id = e.execution_id) FROM noetl_execution e WHERE e.execution_id = ?",
    )
    row = kernel.run(conn, sql, (execution_id,)).fetchone()
    if row is None:
        return None
    version, pending, plan, workload, parent, triples = row
    if isinstance(triples, str):  # SQLite: the aggregate is JSON text
        triples = json.loads(triples)
    scopes: dict[str, dict[str, Any]] = {}
    for scope, name, value in triples or ():
        scopes.setdefault(scope, {})[name] = value
    state: dict[str, Any] = {"state_version": version, "pending": pending, "variables": scopes}
    if full:
        state["plan"] = kernel.read(dialect, EXECUTIONS, "plan", plan)
        state["workload"] = kernel.read(dialect, EXECUTIONS, "workload", workload)
        state["parent_execution_id"] = parent
    return state


def load_variables(conn: Connection, execution_id: int) -> dict[str, dict[str, Any]]:
    c = VARIABLES.c
    scopes: dict[str, dict[str, Any]] = {}
    for scope, name, value in conn.execute(select(c.scope, c.name, c.value).where(c.execution_id == execution_id)):
        scopes.setdefault(scope, {})[name] = value
    return scopes
