"""The workload and root ctx an execution starts with, as NoETL's execution payload gives them.

Decides: which `--set` (or a parent's `input:`) overrides reach the root `ctx:` (a key the root
ctx defines, or everything under `ctx.`), and how workload values that are themselves templates
(`user_id: "{{ payload.user_id }}"`) are rendered once, at compile time, from the workload.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core.errors import TemplateError
from noetl_celery.templates.render import TEMPLATE_MARKERS, plain, render_value

CTX_KEY = "ctx"  # `--set ctx.x=1`: root ctx values by name
WORKLOAD_RENDER_PASSES = 3  # a template naming another workload template is resolved this deep


def ctx_with_overrides(
    variables: dict[str, Any], overrides: dict[str, Any], merge: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(root ctx, workload overrides): an override whose key the root ctx defines replaces the
    ctx value too (it still reaches the workload, which NoETL's payload also is); `ctx: {...}`
    overrides only the root ctx."""
    given = dict(overrides)
    ctx_values = given.pop(CTX_KEY, None)
    result = dict(variables)
    for key, value in given.items():
        if key in result:
            result[key] = merge({key: result[key]}, {key: value})[key]
    if isinstance(ctx_values, dict):
        result = merge(result, ctx_values)
    elif ctx_values is not None:
        given[CTX_KEY] = ctx_values
    return result, given


def _has_template(value: Any) -> bool:
    if isinstance(value, str):
        return any(marker in value for marker in TEMPLATE_MARKERS)
    if isinstance(value, dict):
        return any(_has_template(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_template(v) for v in value)
    return False


def render_workload(workload: dict[str, Any], variables: dict[str, Any]) -> dict[str, Any]:
    """The workload with each top-level value that is a template rendered from the workload (bare
    names or `workload.x`) and the root ctx, as NoETL renders its payload. A value whose render
    fails (a name only an execution knows, such as `execution_id`) is kept as written."""
    rendered = dict(workload)
    for _ in range(WORKLOAD_RENDER_PASSES):
        pending = [key for key, value in rendered.items() if _has_template(value)]
        if not pending:
            break
        changed = False
        for key in pending:
            scope = {**rendered, **variables, "workload": rendered, CTX_KEY: variables}
            try:
                value = plain(render_value(rendered[key], scope))
            except TemplateError:
                continue
            if value != rendered[key]:
                rendered[key], changed = value, True
        if not changed:
            break
    return rendered
