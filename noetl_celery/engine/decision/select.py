"""Step-level result hints: the part of a step's result the step keeps.

`result: {output_select: data.items}` (or `output: {select: ...}`) keeps only that part of the
step's result: a dotted path (`data.items`, `rows.0.id`: a number indexes a list) or a template
with `result` in scope (`"{{ result.data | first }}"`). A path that is not in the result is an
error of the step, named with the path and the key that is missing. A result stored by reference
is read whole first; a SQL result's path may name either NoETL form (sql_result.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from noetl_celery.core import sql_result
from noetl_celery.core.errors import TemplateError
from noetl_celery.templates.render import as_step_result, is_template, materialise, plain, render_string


def select_part(data: Any, selector: str, context: Mapping[str, Any]) -> Any:
    if is_template(selector):
        return plain(render_string(selector, {**context, "result": as_step_result(data)}))
    value = materialise(data)
    if sql_result.is_sql_result(value):  # `command_0.rows` of a flat result, `rows` of a numbered one
        value = sql_result.both_forms(value)
    walked: list[str] = []
    for part in selector.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            where = ".".join(walked) or "the result"
            raise TemplateError(f"output_select {selector!r}: {where} has no {part!r}")
        walked.append(part)
    return value
