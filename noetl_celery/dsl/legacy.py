"""The legacy (noetl.io/v1) step: `tool: <kind>` with the tool's fields inline on the step.

Decides: which keys of a legacy step are step keys and which are tool fields, how a step (or a
legacy workbook entry) becomes one Task, how `tool: workbook` + `name:` resolves at compile
time, when a step is routing-only (no task), and what a legacy `next:` list means as arcs
(every entry whose `when` holds fires; `then`/`else` branches become negated twins; `args`
written beside `then`/`else` go with each of their arcs).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from noetl_celery.dsl.plan import Arc, Task
from noetl_celery.dsl.policy_forms import task_policy
from noetl_celery.dsl.timeouts import normalise_timeouts
from noetl_celery.dsl.validate import (
    TASK_META_KEYS,
    WORKBOOK_KIND,
    ArcRef,
    Context,
    check_fields,
    check_keys,
    check_required,
    check_settings,
    condition,
    expect_list,
    expect_mapping,
    expect_str,
    join,
    suggest,
    tool_spec,
    unknown_key,
)
from noetl_celery.dsl.yaml_lines import LDict, line_of, plain

# Keys a step may carry in any dialect (tool fields aside).
STEP_KEYS = frozenset(
    {
        "step",
        "desc",
        "tool",
        "loop",
        "retry",
        "sink",
        "next",
        "vars",
        "set_ctx",
        "set",
        "args",
        "spec",
        "case",
        "when",
        "result",
        "output",
        "tags",
    }
)
LEGACY_STEP_KEYS = STEP_KEYS | {"auth", "name"}
LEGACY_WORKBOOK_KEYS = frozenset({"name", "desc", "tool", "assert", "args", "auth"})
NEXT_ENTRY_KEYS = frozenset({"step", "when", "then", "else", "args"})
BRANCH_KEYS = frozenset({"step", "args"})

WORKBOOK_NEEDS_NAME = "a workbook call needs task: <workbook entry> (or name:)"
WORKBOOK_TASK_KEY = "task"  # NoETL's key naming the workbook entry a call runs; `name:` is accepted too
WORKBOOK_WITH_KEY = "with"  # NoETL's older key of a workbook call's arguments; `args:` is accepted too
TASK_RESULT_HINTS = ("output", "output_select", "result")  # a task's result hints NoETL reads
Workbook = dict[str, Task | None]  # entry name -> its task (None when the entry itself is broken)


def legacy_tasks(ctx: Context, step: LDict, label: str, path: str, workbook: Workbook) -> list[Task]:
    """The tasks of a legacy-shaped step: none (routing-only) or one."""
    tool = step.get("tool")
    if tool == WORKBOOK_KIND:
        check_workbook_call_keys(ctx, step, LEGACY_STEP_KEYS, path)
        return _workbook_call(ctx, step, label, path, workbook)
    if "name" in step:
        ctx.problem(
            line_of(step, "name"),
            join(path, "name"),
            "name: refers to a workbook entry; it needs tool: workbook",
        )
    if tool is None:
        check_keys(ctx, step, LEGACY_STEP_KEYS, path)
        if "auth" in step:
            ctx.problem(line_of(step, "auth"), join(path, "auth"), "auth: needs a tool on the step")
        if "args" not in step:
            return []
        args = expect_mapping(ctx, step["args"], line_of(step, "args"), join(path, "args"))
        return [Task(label=label, kind="noop", config={"args": plain(args or {})}, line=step.line)]
    task = inline_task(ctx, step, LEGACY_STEP_KEYS, label, path)
    return [task] if task is not None else []


def inline_task(ctx: Context, mapping: LDict, reserved: frozenset[str], label: str, path: str) -> Task | None:
    """`tool: <kind>` plus the tool's fields among the keys of `mapping` (keys in `reserved` aside)."""
    tool_line, tool_path = line_of(mapping, "tool"), join(path, "tool")
    spec = tool_spec(ctx, mapping.get("tool"), tool_line, tool_path)
    if spec is None:
        return None
    field_keys = [key for key in mapping if key not in reserved]
    # NoETL reads a task's result hints (`result:`, `output:`, `output_select:`); kept, not tool fields
    hints = {key: plain(mapping[key]) for key in TASK_RESULT_HINTS if key in field_keys}
    field_keys = [key for key in field_keys if key not in TASK_RESULT_HINTS]
    for key in field_keys:
        if key in TASK_META_KEYS - {"policy"}:
            unknown_key(ctx, mapping, key, path, reserved | spec.fields - TASK_META_KEYS)
    field_keys = [key for key in field_keys if key not in TASK_META_KEYS - {"policy"}]
    check_fields(ctx, spec, mapping, field_keys, path, also=reserved)
    config = {key: plain(mapping[key]) for key in field_keys if key in spec.fields and key != "policy"}
    if "args" in mapping:
        args = expect_mapping(ctx, mapping["args"], line_of(mapping, "args"), join(path, "args"))
        config["args"] = plain(args or {})
    policy = None
    if "policy" in mapping:
        policy = task_policy(ctx, mapping["policy"], line_of(mapping, "policy"), join(path, "policy"))
    if spec.routing_only and not config and policy is None and "sink" not in mapping:
        return None  # `tool: end` and friends with nothing to do: a routing-only step
    normalise_timeouts(ctx, spec, config, line_of(mapping, "timeout"), path)
    check_required(ctx, spec, config, tool_line, tool_path, [mapping])
    check_settings(ctx, spec, config, mapping, path)
    auth = plain(mapping.get("auth"))
    return Task(label=label, kind=spec.kind, config=config, auth=auth, policy=policy, line=tool_line, hints=hints)


def check_workbook_call_keys(ctx: Context, mapping: LDict, allowed: frozenset[str], path: str) -> None:
    """Unknown keys of a workbook call. `task:` and `name:` both name the entry, `with:` and
    `args:` both give its arguments (NoETL's eras spell them so), never both of a pair at once."""
    for ours, noetls in (("name", WORKBOOK_TASK_KEY), ("args", WORKBOOK_WITH_KEY)):
        if ours in mapping and noetls in mapping:
            message = f"give {noetls}: or {ours}:, not both"
            ctx.problem(line_of(mapping, noetls), join(path, noetls), message)
    for key in mapping:
        if key not in allowed and key not in (WORKBOOK_TASK_KEY, WORKBOOK_WITH_KEY):
            unknown_key(ctx, mapping, key, path, allowed)


def workbook_entry_name(mapping: LDict) -> tuple[Any, str]:
    """The entry a workbook call names (`task:`, NoETL's key, or `name:`) and the key naming it."""
    key = WORKBOOK_TASK_KEY if WORKBOOK_TASK_KEY in mapping else "name"
    return mapping.get(key), key


def workbook_call_args(mapping: LDict) -> Any:
    """The arguments of a workbook call: `args:`, or NoETL's older `with:`."""
    return mapping.get("args") if "args" in mapping else mapping.get(WORKBOOK_WITH_KEY)


def _workbook_call(ctx: Context, step: LDict, label: str, path: str, workbook: Workbook) -> list[Task]:
    name, key = workbook_entry_name(step)
    if name is None:
        ctx.problem(line_of(step, "tool"), join(path, "tool"), WORKBOOK_NEEDS_NAME)
        return []
    args = workbook_call_args(step)
    task = resolve_workbook(ctx, workbook, name, args, step.get("auth"), label, line_of(step, key), path, key)
    return [task] if task is not None else []


def resolve_workbook(
    ctx: Context,
    workbook: Workbook,
    name: Any,
    args: Any,
    auth: Any,
    label: str,
    line: int | None,
    path: str,
    key: str = "name",
) -> Task | None:
    """A copy of workbook entry `name` as the step's task, the step's args merged over the entry's."""
    name_path = join(path, key)
    if name is None:
        ctx.problem(line, path, WORKBOOK_NEEDS_NAME)
        return None
    if not isinstance(name, str) or name not in workbook:
        hint = suggest(str(name), workbook) if isinstance(name, str) else ""
        ctx.problem(line, name_path, f"no workbook entry named '{name}'{hint}")
        return None
    entry = workbook[name]
    if entry is None:
        return None  # the entry's own problems are already reported
    config = deepcopy(entry.config)
    if args is not None:
        step_args: dict[str, Any] = expect_mapping(ctx, args, line, join(path, "args")) or {}
        entry_args = config.get("args")  # not a mapping: a problem of the entry, reported there
        config["args"] = {**(entry_args if isinstance(entry_args, dict) else {}), **plain(step_args)}
    auth = plain(auth) if auth is not None else entry.auth
    return entry.model_copy(update={"label": label, "config": config, "auth": auth, "line": line}, deep=True)


def workbook_entry_task(ctx: Context, entry: LDict, name: str, path: str) -> Task | None:
    """A legacy workbook entry: `{name, tool: <kind>, <fields>...}`."""
    if entry.get("tool") == WORKBOOK_KIND:
        ctx.problem(line_of(entry, "tool"), join(path, "tool"), "a workbook entry cannot call the workbook")
        return None
    return inline_task(ctx, entry, LEGACY_WORKBOOK_KEYS, name, path)


# ---------------------------------------------------------------------------------------------
# next:


def legacy_arcs(ctx: Context, value: Any, line: int | None, path: str) -> list[Arc]:
    """`next: a`, `next: {step: a}` or `next: [{step, when?, args?} | {when, then: [...], else: [...]}]`."""
    if isinstance(value, str):
        ctx.arc_refs.append(ArcRef(value, line, path))
        return [Arc(step=value, line=line)]
    if isinstance(value, dict):
        return _entry(ctx, expect_mapping(ctx, value, line, path) or LDict(), line, path)
    entries = expect_list(ctx, value, line, path) or []
    arcs: list[Arc] = []
    for index, entry in enumerate(entries):
        entry_path, entry_line = join(path, index), line_of(entries, index)
        if isinstance(entry, str):
            ctx.arc_refs.append(ArcRef(entry, entry_line, entry_path))
            arcs.append(Arc(step=entry, line=entry_line))
            continue
        mapping = expect_mapping(ctx, entry, entry_line, entry_path)
        if mapping is not None:
            arcs.extend(_entry(ctx, mapping, entry_line, entry_path))
    return arcs


def _entry(ctx: Context, entry: LDict, line: int | None, path: str) -> list[Arc]:
    check_keys(ctx, entry, NEXT_ENTRY_KEYS, path)
    when = condition(ctx, entry, "when", path)
    if "then" in entry or "else" in entry:
        if "step" in entry:
            ctx.problem(line_of(entry, "step"), join(path, "step"), "give either step or then/else, not both")
        if when is None:
            ctx.problem(line, path, "then/else needs a when")
        arcs = _branch(ctx, entry, "then", when, False, path)
        arcs += _branch(ctx, entry, "else", when, True, path)
        if "args" in entry:  # args beside then/else go with every branch (a branch's own win)
            shared = expect_mapping(ctx, entry["args"], line_of(entry, "args"), join(path, "args"))
            for made in arcs:
                made.args = {**plain(shared or {}), **made.args}
        return arcs
    return [a for a in [arc(ctx, entry, when, False, line, path)] if a is not None]


def _branch(ctx: Context, entry: LDict, key: str, when: Any, negate: bool, path: str) -> list[Arc]:
    if key not in entry:
        return []
    branch_path = join(path, key)
    items = entry[key]
    items = [items] if isinstance(items, (dict, str)) else expect_list(ctx, items, line_of(entry, key), branch_path)
    arcs: list[Arc] = []
    for index, item in enumerate(items or []):
        item_path = join(branch_path, index)
        item_line = line_of(items, index) if isinstance(items, list) else line_of(entry, key)
        if isinstance(item, str):
            item = LDict({"step": item})
            item.line = item_line
        mapping = expect_mapping(ctx, item, item_line, item_path)
        if mapping is None:
            continue
        check_keys(ctx, mapping, BRANCH_KEYS, item_path)
        made = arc(ctx, mapping, when, negate, item_line, item_path)
        arcs.extend([made] if made is not None else [])
    return arcs


def arc(ctx: Context, entry: LDict, when: Any, negate: bool, line: int | None, path: str) -> Arc | None:
    """`{step, args?}` under condition `when` -> Arc (its target is checked later)."""
    if "step" not in entry:
        ctx.missing(entry, line, path, "a next entry needs step: <name>")
        return None
    target = expect_str(ctx, entry["step"], line_of(entry, "step"), join(path, "step"))
    if target is None:
        return None
    ctx.arc_refs.append(ArcRef(target, line_of(entry, "step"), join(path, "step")))
    args = expect_mapping(ctx, entry["args"], line_of(entry, "args"), join(path, "args")) if "args" in entry else None
    return Arc(step=target, when=when, negate=negate, args=plain(args or {}), line=line)
