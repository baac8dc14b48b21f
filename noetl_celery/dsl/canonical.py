"""The canonical (noetl.io/v2, v10) step: `tool: {kind, ...}` or a pipeline of labelled tasks.

Decides: how a tool mapping becomes a Task (fields beside `kind` or under `spec`, with
`spec.policy` as the task's policy), how a pipeline list is read (`- label: {kind}` or
`- name: label, kind:`), that a tool field written at step level is a mistake, how step `args`
(or `input`, its renames-era name) reach every task, what `next: {spec: {mode}, arcs}` means,
and how every loop form (legacy collection/element, canonical in/iterator/spec, cursor) becomes
one Loop.
"""

from __future__ import annotations

from typing import Any, Literal

from noetl_celery import cursors
from noetl_celery.dsl.legacy import (
    STEP_KEYS,
    TASK_RESULT_HINTS,
    Workbook,
    arc,
    check_workbook_call_keys,
    legacy_arcs,
    resolve_workbook,
    workbook_call_args,
    workbook_entry_name,
)
from noetl_celery.dsl.plan import DEFAULT_MAX_IN_FLIGHT, Action, Loop, Routing, Task
from noetl_celery.dsl.policy_forms import BACKOFF_KEYS, SET_SCOPES, retry_action, task_policy, with_task_sets
from noetl_celery.dsl.timeouts import normalise_timeouts
from noetl_celery.dsl.validate import (
    TASK_META_KEYS,
    WORKBOOK_KIND,
    Context,
    TemplatedMaxInFlight,
    assignments,
    boolean,
    build_sink,
    check_fields,
    check_keys,
    check_required,
    check_settings,
    condition,
    expect_list,
    expect_mapping,
    expect_str,
    join,
    missing_required,
    number,
    one_of,
    suggest,
    tool_only_fields,
    tool_spec,
    unknown_key,
)
from noetl_celery.dsl.yaml_lines import LDict, line_of, plain
from noetl_celery.templates.render import is_template
from noetl_celery.tools.base import get_tool

WORKBOOK_CALL_KEYS = frozenset({"kind", "name", "args", "auth"})
TASK_SET_KEY = "set"  # a task's own `set:` (NoETL reads it): ctx/vars/iter written when the task succeeds
STEP_INPUT_KEY = "input"  # renames era: a step's `input:` is its `args:`
ROUTE_MODES: dict[str, Literal["exclusive", "inclusive"]] = {
    "exclusive": "exclusive",
    "inclusive": "inclusive",
    "parallel": "inclusive",
}
NO_MATCH_ACTIONS = (None, "quiet", "error")
# task-level result hints NoETL reads when it externalises a result (advisory here: Task.hints)
ARC_KEYS = frozenset({"step", "when", "args", "set"})
# `next.arcs[].set` (NoETL's Arc.set): assigned when the arc is taken; a bare key is a ctx variable
ARC_SET_SCOPES = {"ctx": "set_ctx", "vars": "set_vars"}
LEGACY_LOOP_KEYS = frozenset({"collection", "element", "concurrency", "chunk_size", "enumerate", "where", "limit"})
LOOP_KEYS = LEGACY_LOOP_KEYS | {"in", "iterator", "mode", "max_in_flight", "cursor", "spec", "aggregate", "batch"}
LOOP_SPEC_KEYS = frozenset({"mode", "max_in_flight", "chunk_size", "policy", "frame", "batch"})
MAX_BATCH = 1000  # iterations one message may carry (loop.spec.batch)
LOOP_POLICY_KEYS = frozenset({"exec"})  # accepted for compatibility; every loop runs on the workers
LOOP_MODES = {
    "sequential": "sequential",
    "async": "parallel",
    "parallel": "parallel",
    "chunked": "chunked",
    "cursor": "cursor",
}
CURSOR_KEYS = frozenset({"kind", "auth", "claim", "retry"})
FRAME_KEYS = frozenset(
    {
        "max_rows",
        "max_seconds",
        "max_bytes",
        "lease_seconds",
        "heartbeat_seconds",
        "row_concurrency",
        "process",
    }
)


def canonical_tasks(ctx: Context, step: LDict, label: str, path: str, workbook: Workbook) -> list[Task]:
    """The tasks of a step whose `tool` is a mapping (one task) or a list (a pipeline)."""
    tool, tool_line, tool_path = step["tool"], line_of(step, "tool"), join(path, "tool")
    if isinstance(tool, list):
        tasks = _pipeline(ctx, tool, tool_path, workbook)
    else:
        task = task_from_mapping(ctx, tool, label, tool_line, tool_path, workbook)
        tasks = [task] if task is not None else []
    _check_step_keys(ctx, step, tasks, path)
    if "args" in step and STEP_INPUT_KEY in step:
        ctx.problem(line_of(step, STEP_INPUT_KEY), join(path, STEP_INPUT_KEY), "give args or input, not both")
    key = "args" if "args" in step else STEP_INPUT_KEY
    if key in step:
        args = plain(expect_mapping(ctx, step[key], line_of(step, key), join(path, key)) or {})
        for task in tasks:
            task.config["args"] = {**args, **task.config.get("args", {})}
    _check_jumps(ctx, tasks, tool_path)
    return tasks


def _check_step_keys(ctx: Context, step: LDict, tasks: list[Task], path: str) -> None:
    """A tool field written at step level is a problem when its tool lacks a field it needs
    (most likely that one, misplaced), else, as any other unknown step key, a warning."""
    owners: dict[str, list[str]] = {}
    incomplete: set[str] = set()
    for task in tasks:
        spec = get_tool(task.kind)
        for key in tool_only_fields(spec) if spec else ():
            owners.setdefault(key, []).append(task.kind)
        for group in missing_required(spec, task.config) if spec else ():
            incomplete |= group
    for key in step:
        if key in STEP_KEYS or key == STEP_INPUT_KEY:
            continue
        if key in owners:
            kinds = " / ".join(dict.fromkeys(owners[key]))
            message = f"'{key}' is a field of the {kinds} tool; put it under tool"
            if key in incomplete:
                ctx.problem(line_of(step, key), join(path, key), message)
            else:
                ctx.unknown_key(step, line_of(step, key), join(path, key), message)
        else:
            unknown_key(ctx, step, key, path, STEP_KEYS)


def task_from_mapping(
    ctx: Context, value: Any, label: str, line: int | None, path: str, workbook: Workbook, label_key: str = ""
) -> Task | None:
    """`{kind, <fields>, auth?, sink?, spec: {<fields>, policy}}` -> Task."""
    tool = expect_mapping(ctx, value, line, path)
    if tool is None:
        return None
    if "kind" not in tool:
        ctx.problem(line, path, "a tool needs kind: <tool kind>")
        return None
    if tool["kind"] == WORKBOOK_KIND and not label_key:
        check_workbook_call_keys(ctx, tool, WORKBOOK_CALL_KEYS, path)
        name, key = workbook_entry_name(tool)
        return resolve_workbook(
            ctx,
            workbook,
            name,
            workbook_call_args(tool),
            tool.get("auth"),
            label,
            line_of(tool, key) or line,
            path,
            key,
        )
    if tool["kind"] == WORKBOOK_KIND:
        ctx.problem(
            line_of(tool, "kind"),
            join(path, "kind"),
            "call a workbook entry as `- label: {kind: workbook, name: ...}`",
        )
        return None
    spec = tool_spec(ctx, tool["kind"], line_of(tool, "kind"), join(path, "kind"))
    if spec is None:
        return None
    fields = _fields(ctx, tool, path, label_key)
    hints = {key: plain(fields.pop(key)[0][key]) for key in TASK_RESULT_HINTS if key in fields}
    task_sets = None
    if TASK_SET_KEY in fields and TASK_SET_KEY not in spec.fields:  # NoETL's task-level `set:`
        set_holder, set_path = fields.pop(TASK_SET_KEY)
        task_sets = (assignments(ctx, set_holder, set_path, SET_SCOPES, bare="ctx"), join(set_path, TASK_SET_KEY))
    for key, (holder, holder_path) in fields.items():
        check_fields(ctx, spec, holder, [key], holder_path)

    def read(key: str) -> tuple[Any, int | None, str]:
        holder, holder_path = fields[key]
        return holder[key], line_of(holder, key), join(holder_path, key)

    config = {key: plain(read(key)[0]) for key in fields if key not in TASK_META_KEYS and key in spec.fields}
    policy = task_policy(ctx, *read("policy")) if "policy" in fields else None
    if task_sets is not None:
        policy = with_task_sets(policy, *task_sets)
    sink = None
    if "sink" in fields and isinstance(read("sink")[0], bool):
        hints["sink"] = read("sink")[0]  # NoETL's `sink: true` marks the task as a write: advisory
    elif "sink" in fields:
        sink = build_sink(ctx, *read("sink"))
    auth = plain(read("auth")[0]) if "auth" in fields else None
    timeout_line = line_of(fields["timeout"][0], "timeout") if "timeout" in fields else line
    normalise_timeouts(ctx, spec, config, timeout_line, path)
    check_required(ctx, spec, config, line, path, {id(holder): holder for holder, _ in fields.values()}.values())
    check_settings(ctx, spec, config, tool, path, fields)
    return Task(label=label, kind=spec.kind, config=config, auth=auth, policy=policy, sink=sink, line=line, hints=hints)


def _fields(ctx: Context, tool: LDict, path: str, label_key: str) -> dict[str, tuple[LDict, str]]:
    """Every key of the task beside `kind`, with the mapping (tool or tool.spec) that holds it."""
    fields = {key: (tool, path) for key in tool if key not in ("kind", "spec", label_key)}
    if "name" in fields and not label_key:
        message = "name: on a tool only goes with kind: workbook"
        ctx.problem(line_of(tool, "name"), join(path, "name"), message)
        fields.pop("name")
    if "spec" in tool:
        spec_path = join(path, "spec")
        lifted = expect_mapping(ctx, tool["spec"], line_of(tool, "spec"), spec_path) or LDict()
        for key in lifted:
            if key in fields:
                message = f"'{key}' is given both on the tool and in spec"
                ctx.problem(line_of(lifted, key), join(spec_path, key), message)
            else:
                fields[key] = (lifted, spec_path)
    return fields


def _pipeline(ctx: Context, items: list[Any], path: str, workbook: Workbook) -> list[Task]:
    tasks: list[Task] = []
    seen: dict[str, int | None] = {}
    if not items:
        ctx.problem(line_of(items, 0), path, "a pipeline needs at least one task")
    for index, raw in enumerate(items):
        item_path, item_line = join(path, index), line_of(items, index)
        item = expect_mapping(ctx, raw, item_line, item_path)
        if item is None:
            continue
        if "kind" in item:  # - name: label, kind: ...
            label = expect_str(ctx, item.get("name"), item_line, join(item_path, "name"))
            body, body_path, label_key = item, item_path, "name"
        elif len(item) == 1 and isinstance(next(iter(item.values())), dict):  # - label: {kind: ...}
            label = next(iter(item))
            body, body_path, label_key = item[label], join(item_path, label), ""
        else:
            ctx.problem(
                item_line,
                item_path,
                "a pipeline task is `- label: {kind: ...}` or `- name: label, kind: ...`",
            )
            continue
        if label is None:
            continue
        if label in seen:
            ctx.problem(item_line, item_path, f"task label '{label}' is already used at line {seen[label]}")
        seen[label] = item_line
        task = task_from_mapping(ctx, body, label, item_line, body_path, workbook, label_key)
        if task is not None:
            tasks.append(task)
    return tasks


def _check_jumps(ctx: Context, tasks: list[Task], path: str) -> None:
    labels = [task.label for task in tasks]
    for task in tasks:
        for rule in task.policy.rules if task.policy else ():
            target = rule.then.to
            if rule.then.do == "jump" and target is not None and target not in labels:
                ctx.problem(task.line, rule.source, f"jump to unknown task '{target}'{suggest(target, labels)}")


# ---------------------------------------------------------------------------------------------
# next:


def routing(ctx: Context, value: Any, line: int | None, path: str) -> Routing:
    """`next: {spec: {mode}, arcs: [...]}` (default exclusive) or a legacy list (inclusive)."""
    if value is None:
        return Routing()
    if not (isinstance(value, dict) and ({"arcs", "spec"} & value.keys())):
        return Routing(mode="inclusive", arcs=legacy_arcs(ctx, value, line, path))
    nxt = expect_mapping(ctx, value, line, path) or LDict()
    check_keys(ctx, nxt, {"spec", "arcs"}, path)
    mode: Literal["exclusive", "inclusive"] = "exclusive"
    on_no_match = None
    if "spec" in nxt:
        spec_path = join(path, "spec")
        spec = expect_mapping(ctx, nxt["spec"], line_of(nxt, "spec"), spec_path) or LDict()
        check_keys(ctx, spec, {"mode", "on_no_match"}, spec_path)
        written = spec.get("mode", "exclusive")
        if not one_of(written, ROUTE_MODES):
            hint = suggest(str(written), ROUTE_MODES)
            ctx.problem(line_of(spec, "mode"), join(spec_path, "mode"), f"unknown routing mode '{written}'{hint}")
        mode = ROUTE_MODES[written] if one_of(written, ROUTE_MODES) else "exclusive"
        on_no_match = spec.get("on_no_match")
        if not one_of(on_no_match, NO_MATCH_ACTIONS):
            hint = suggest(str(on_no_match), ("quiet", "error"))
            ctx.problem(
                line_of(spec, "on_no_match"),
                join(spec_path, "on_no_match"),
                f"on_no_match must be quiet or error, not {on_no_match!r}{hint}",
            )
            on_no_match = None
    arcs_path = join(path, "arcs")
    items = expect_list(ctx, nxt.get("arcs", []), line_of(nxt, "arcs"), arcs_path) or []
    arcs = []
    for index, raw in enumerate(items):
        item_path, item_line = join(arcs_path, index), line_of(items, index)
        item = expect_mapping(ctx, raw, item_line, item_path)
        if item is None:
            continue
        check_keys(ctx, item, ARC_KEYS, item_path)
        made = arc(ctx, item, condition(ctx, item, "when", item_path), False, item_line, item_path)
        if made is not None and "set" in item:
            sets = assignments(ctx, item, item_path, ARC_SET_SCOPES, bare="ctx")
            made.set_ctx, made.set_vars = sets["set_ctx"], sets["set_vars"]
        arcs.extend([made] if made is not None else [])
    return Routing(mode=mode, arcs=arcs, on_no_match=on_no_match)


# ---------------------------------------------------------------------------------------------
# loop:


def build_loop(ctx: Context, value: Any, line: int | None, path: str) -> Loop | None:
    loop = expect_mapping(ctx, value, line, path)
    if loop is None:
        return None
    check_keys(ctx, loop, LOOP_KEYS, path)
    spec_path = join(path, "spec")
    spec = expect_mapping(ctx, loop.get("spec", LDict()), line_of(loop, "spec"), spec_path) or LDict()
    check_keys(ctx, spec, LOOP_SPEC_KEYS, spec_path)
    _check_loop_policy(ctx, spec, spec_path)
    collection = _one_of(ctx, loop, ("in", "collection"), path)
    iterator = _one_of(ctx, loop, ("iterator", "element"), path) or "item"
    if not isinstance(iterator, str) or not iterator.isidentifier():
        ctx.problem(line_of(loop, "iterator"), join(path, "iterator"), f"iterator must be a name, not {iterator!r}")
        iterator = "item"
    cursor = _cursor(ctx, loop, path) if "cursor" in loop else None
    if (collection is None) == (cursor is None):
        ctx.problem(line, path, "a loop needs exactly one of in (or collection) and cursor")
    elif collection is not None and not isinstance(collection, (str, list)):
        ctx.problem(
            line_of(loop, "in") or line_of(loop, "collection"),
            path,
            "in: must be a template string or a list",
        )
    mode = _mode(ctx, loop, spec, path, cursor is not None)
    max_in_flight = _max_in_flight(ctx, loop, spec, path)
    templated = max_in_flight if isinstance(max_in_flight, str) and mode != "sequential" else None
    if isinstance(max_in_flight, str):
        max_in_flight = None
    if mode == "sequential":
        max_in_flight = 1
    elif max_in_flight is None:
        max_in_flight = DEFAULT_MAX_IN_FLIGHT if mode == "parallel" else 1
    chunk_size = number(ctx, spec, "chunk_size", spec_path, integer=True) or number(
        ctx, loop, "chunk_size", path, integer=True
    )
    if (mode == "chunked") != (chunk_size is not None):
        ctx.problem(line, path, "chunk_size goes with mode: chunked (and chunked needs a chunk_size)")
    frame = None
    if "frame" in spec:
        frame_path = join(spec_path, "frame")
        frame = expect_mapping(ctx, spec["frame"], line_of(spec, "frame"), frame_path)
        if frame is not None:
            check_keys(ctx, frame, FRAME_KEYS, frame_path)
            if mode != "cursor":
                ctx.problem(line_of(spec, "frame"), frame_path, "frame: only applies to a cursor loop")
    batch = _batch(ctx, loop, spec, path, mode)
    aggregate = bool(boolean(ctx, loop, "aggregate", path))
    if aggregate and mode != "cursor":
        ctx.problem(
            line_of(loop, "aggregate"),
            join(path, "aggregate"),
            "aggregate: only applies to a cursor loop (a collection loop's result always has its results)",
        )
    made = Loop(
        collection=plain(collection),
        cursor=cursor,
        iterator=iterator,
        mode=mode,
        max_in_flight=max(max_in_flight, 1),
        chunk_size=chunk_size,
        batch=batch,
        enumerate=bool(boolean(ctx, loop, "enumerate", path)),
        where=condition(ctx, loop, "where", path),
        limit=number(ctx, loop, "limit", path, integer=True),
        line=line,
        frame=plain(frame),
        aggregate=aggregate,
        claim_retry=claim_retry(ctx, loop, path) if cursor is not None else None,
    )
    if templated is not None:  # rendered from the workload and ctx when the plan is made
        holder, key, where = (
            (spec, "max_in_flight", spec_path) if "max_in_flight" in spec else (loop, _max_in_flight_key(loop), path)
        )
        ctx.templated_max_in_flight.append(
            TemplatedMaxInFlight(made, templated, line_of(holder, key), join(where, key))
        )
    return made


def _one_of(ctx: Context, loop: LDict, keys: tuple[str, str], path: str) -> Any:
    present = [key for key in keys if key in loop]
    if len(present) > 1:
        ctx.problem(line_of(loop, keys[1]), join(path, keys[1]), f"give {keys[0]} or {keys[1]}, not both")
    return loop[present[0]] if present else None


def _mode(ctx: Context, loop: LDict, spec: LDict, path: str, is_cursor: bool) -> Any:
    if "mode" in loop and "mode" in spec and loop["mode"] != spec["mode"]:
        ctx.problem(line_of(spec, "mode"), join(path, "spec.mode"), "mode is given twice with different values")
    holder, hpath = (spec, join(path, "spec")) if "mode" in spec else (loop, path)
    written = holder.get("mode", "cursor" if is_cursor else "sequential")
    if not one_of(written, LOOP_MODES):
        hint = suggest(str(written), LOOP_MODES)
        ctx.problem(line_of(holder, "mode"), join(hpath, "mode"), f"unknown loop mode '{written}'{hint}")
        return "cursor" if is_cursor else "sequential"
    if (written == "cursor") != is_cursor:
        ctx.problem(line_of(holder, "mode"), join(hpath, "mode"), "mode: cursor goes with cursor: (and only there)")
    return LOOP_MODES[written]


def _batch(ctx: Context, loop: LDict, spec: LDict, path: str, mode: str) -> int | Literal["auto"]:
    """`batch: N | auto` (in spec, or beside it): iterations sent together in one message."""
    if "batch" in loop and "batch" in spec:
        ctx.problem(line_of(spec, "batch"), join(path, "spec.batch"), "batch is given twice: keep spec.batch")
    holder, hpath = (spec, join(path, "spec")) if "batch" in spec else (loop, path)
    if "batch" not in holder:
        return 1
    where, line = join(hpath, "batch"), line_of(holder, "batch")
    value = holder["batch"]
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH):
        ctx.problem(line, where, f"batch must be a whole number from 1 to {MAX_BATCH}, or auto; got {value!r}")
        return 1
    if mode in ("sequential", "cursor"):
        why = (
            "a sequential loop runs one iteration at a time"
            if mode == "sequential"
            else "a cursor loop's frame (max_rows) sets how many rows a claim takes"
        )
        ctx.problem(line, where, f"batch only applies to a parallel or chunked loop: {why}")
        return 1
    return "auto" if value == "auto" else int(value)


def _max_in_flight(ctx: Context, loop: LDict, spec: LDict, path: str) -> int | str | None:
    """The loop's max_in_flight: a number, or a template (NoETL renders `max_in_flight: "{{ n }}"`).
    Written `spec.max_in_flight`, `max_in_flight` or, as an alias, `concurrency` on the loop
    itself (the legacy loop form); the first of them given counts."""
    found = []
    for holder, key, hpath in (
        (spec, "max_in_flight", join(path, "spec")),
        (loop, "max_in_flight", path),
        (loop, "concurrency", path),  # an alias of max_in_flight
    ):
        if is_template(holder.get(key)):
            found.append(holder[key])
        elif (value := number(ctx, holder, key, hpath, integer=True)) is not None:
            found.append(value)
    return found[0] if found else None


def _max_in_flight_key(loop: LDict) -> str:
    return "max_in_flight" if "max_in_flight" in loop else "concurrency"


def _check_loop_policy(ctx: Context, spec: LDict, spec_path: str) -> None:
    if "policy" in spec:
        policy_path = join(spec_path, "policy")
        policy = expect_mapping(ctx, spec["policy"], line_of(spec, "policy"), policy_path)
        if policy is not None:
            check_keys(ctx, policy, LOOP_POLICY_KEYS, policy_path)


def _cursor(ctx: Context, loop: LDict, path: str) -> dict[str, Any] | None:
    cursor_path = join(path, "cursor")
    cursor = expect_mapping(ctx, loop["cursor"], line_of(loop, "cursor"), cursor_path)
    if cursor is None:
        return None
    kind = cursor.get("kind")
    known = cursors.known_kinds()
    check_keys(ctx, cursor, CURSOR_KEYS | cursors.driver_keys(str(kind)), cursor_path)
    if not one_of(kind, known):
        hint = suggest(str(kind), known)
        ctx.problem(
            line_of(cursor, "kind"),
            join(cursor_path, "kind"),
            f"cursor kind '{kind}' is not supported (known: {', '.join(known)}){hint}",
        )
    elif (missing := cursors.missing_extra(str(kind))) is not None:
        ctx.problem(line_of(cursor, "kind"), join(cursor_path, "kind"), missing)
    if cursors.needs_claim(str(kind)) or "claim" in cursor:
        expect_str(ctx, cursor.get("claim"), line_of(cursor, "claim"), join(cursor_path, "claim"))
    return plain(cursor)


def claim_retry(ctx: Context, loop: LDict, path: str) -> Action | None:
    """`cursor.retry`: how an erroring claim is tried again, in a task retry's words
    (max_attempts, initial_delay, backoff_multiplier, backoff, max_delay, jitter)."""
    cursor = loop.get("cursor")
    if not isinstance(cursor, dict) or "retry" not in cursor:
        return None
    retry_path = join(join(path, "cursor"), "retry")
    retry = expect_mapping(ctx, cursor["retry"], line_of(cursor, "retry"), retry_path)
    if retry is None:
        return None
    check_keys(ctx, retry, BACKOFF_KEYS, retry_path)
    return retry_action(ctx, retry, retry_path)
