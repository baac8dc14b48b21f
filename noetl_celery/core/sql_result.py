"""The result of a SQL tool (postgres, duckdb): the rows stored once, both NoETL forms read.

NoETL has given a SQL text's result in two forms. Its older Python workers number the
statements: `command_0`, `command_1`, ... each `{rows, row_count, columns, ...}`. Its latest
Python server and its Rust tool give the result flat: the last statement's `rows`, `row_count`,
`columns` (and `status: success`, `statement_count`; the Rust tool's `affected_rows` for a
statement without rows) at the top. A playbook written for either reads what it expects here,
while the stored result holds each row once:

* one statement: stored flat, `{status, rows, row_count, columns, statusmessage,
  [affected_rows], statement_count: 1}`; `command_0` reads those statement fields.
* several statements: stored numbered, `{status, statement_count, command_0, ..., command_N}`;
  the statement fields at the top (`rows`, `row_count`, `columns`, ...) read the last one's.

`both_forms(value)` is the result with the form it was not stored in added beside its own keys
(sharing their values, so nothing is copied): the view templates read (templates.render.as_step_result)
and, through it, what a whole step result passed on as data holds. `alias(value, name)` is one
name of that view. Only a mapping with `statement_count` (what the SQL tools store) has a second
form; one cut when stored (limits.cap) or stored by reference (until read) has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STATEMENT_PREFIX = "command_"
STATEMENT_KEYS = ("rows", "row_count", "columns", "statusmessage", "affected_rows")
STATEMENT_COUNT = "statement_count"
STATUS = "status"
STATUS_OK = "success"
_TRUNCATED = "__truncated__"  # limits.TRUNCATED (this module sits below limits)
_MAX_STATEMENTS_SCANNED = 100_000


def stored(statements: list[dict[str, Any]]) -> dict[str, Any]:
    """The stored result of a text whose statements gave `statements` (each its statement
    fields), in order: flat for one statement, numbered for several."""
    if len(statements) == 1:
        return {STATUS: STATUS_OK, **statements[0], STATEMENT_COUNT: 1}
    numbered = {f"{STATEMENT_PREFIX}{index}": statement for index, statement in enumerate(statements)}
    return {STATUS: STATUS_OK, STATEMENT_COUNT: len(statements), **numbered}


def is_flat(value: Any) -> bool:
    """A one-statement result stored flat (rows at the top, no `command_0`)."""
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("rows"), list)
        and isinstance(value.get("columns"), list)
        and "row_count" in value
        and f"{STATEMENT_PREFIX}0" not in value
        and value.get(_TRUNCATED) is not True
    )


def last_statement(value: Any) -> Mapping[str, Any] | None:
    """The last statement's fields of a numbered result without the flat fields at the top."""
    if not isinstance(value, Mapping) or value.get(_TRUNCATED) is True or "rows" in value:
        return None
    count = value.get(STATEMENT_COUNT)
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        last = value.get(f"{STATEMENT_PREFIX}{count - 1}")
        return last if isinstance(last, Mapping) else None
    index = -1
    while index < _MAX_STATEMENTS_SCANNED and isinstance(value.get(f"{STATEMENT_PREFIX}{index + 1}"), Mapping):
        index += 1
    return value[f"{STATEMENT_PREFIX}{index}"] if index >= 0 else None


def alias(value: Any, name: str) -> Any:
    """What SQL result `value` answers for `name`, a key it does not hold; KeyError if nothing."""
    if name == f"{STATEMENT_PREFIX}0" and is_flat(value):
        return {key: value[key] for key in STATEMENT_KEYS if key in value}
    if name in STATEMENT_KEYS:
        last = last_statement(value)
        if last is not None and name in last:
            return last[name]
    raise KeyError(name)


def is_sql_result(value: Any) -> bool:
    """A result a SQL tool stored (it carries `statement_count`), flat or numbered."""
    return (
        isinstance(value, Mapping)
        and STATEMENT_COUNT in value
        and (is_flat(value) or last_statement(value) is not None)
    )


def both_forms(value: Mapping[str, Any]) -> dict[str, Any]:
    """`value` with the form it was not stored in added (its own keys unchanged); a value that
    is not a SQL result (`is_sql_result`) as a plain copy of its top level."""
    if not is_sql_result(value):
        return dict(value)
    if is_flat(value):
        return {**value, f"{STATEMENT_PREFIX}0": alias(value, f"{STATEMENT_PREFIX}0")}
    last = last_statement(value)
    if last is None:
        return dict(value)
    return {**{key: last[key] for key in STATEMENT_KEYS if key in last}, **value}
