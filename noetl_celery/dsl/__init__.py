"""Playbook front end: load a playbook of any dialect, validate it, normalise it into one Plan.

Decides: the top-level shape (apiVersion, kind, metadata, workload, ctx, executor, workbook,
workflow), the dialect of each step (tool a string or absent: legacy; tool a mapping or list:
canonical; `case:`: v2 case), the step-level keys every dialect shares (loop, retry, sink,
vars, set_ctx/set, admission), the graph checks (unique step names, arc targets, entry and
final steps) and `Plan.dialect`. Every problem is collected; `load_plan` raises once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from noetl_celery.config import credentials, limits
from noetl_celery.core.errors import PlaybookError, Problem, TemplateError
from noetl_celery.dsl.bounded import InputError, check_value_depth
from noetl_celery.dsl.canonical import build_loop, canonical_tasks, routing, task_from_mapping
from noetl_celery.dsl.case import compile_case
from noetl_celery.dsl.legacy import Workbook, legacy_tasks, workbook_entry_task
from noetl_celery.dsl.names import check_names
from noetl_celery.dsl.plan import Plan, Policy, Routing, Rule, Sink, Step, Task
from noetl_celery.dsl.policy_forms import admit_rules, legacy_retry, when_admit
from noetl_celery.dsl.validate import (
    Context,
    assignments,
    boolean,
    build_sink,
    check_keys,
    check_templates,
    condition,
    expect_list,
    expect_mapping,
    expect_str,
    join,
    step_path,
    suggest,
    tags,
)
from noetl_celery.dsl.workload import ctx_with_overrides, render_workload
from noetl_celery.dsl.yaml_lines import LDict, line_of, load_yaml, plain
from noetl_celery.templates.render import BUILTIN_NAMES, render_string, strict_rendering

__all__ = ["PlaybookError", "load_plan"]

API_VERSIONS = ("noetl.io/v1", "noetl.io/v2", "noetl.io/v10")
LEGACY_API_VERSION = "noetl.io/v1"
TOP_KEYS = frozenset(
    {"apiVersion", "kind", "metadata", "workload", "ctx", "keychain", "executor", "workbook", "workflow", "timeout"}
    | {"auth"}  # NoETL's playbook-level auth: accepted; each task names its own credential here
)
METADATA_KEYS = frozenset({"name", "path", "description", "version", "labels", "tags"}) | {
    # NoETL's catalog and gui read these; they change nothing in a run
    "agent",
    "exposed_in_ui",
    "exposes_as_mcp",
    "capabilities",
    "terminal",
}
EXECUTOR_KEYS = frozenset({"profile", "version", "requires", "spec", "kind"})  # kind: NoETL ignores it
EXECUTOR_SPEC_KEYS = frozenset(
    {"entry_step", "final_step", "no_next_is_error", "policy", "timeout", "strict_templates", "webhook", "pool"}
)  # pool: NoETL's worker pool name, which NoETL ignores too
CANONICAL_WORKBOOK_KEYS = frozenset({"name", "desc", "tool", "assert"})
DEFAULT_ENTRY_STEP = "start"
SET_TARGETS = {"ctx": "set_ctx", "vars": "vars"}  # step-level `set: {ctx.x: ..., vars.y: ...}`
RESULT_HINT_KEYS = ("result", "output")  # step-level result hints (NoETL: selection and storage)
RESULT_SELECTORS = frozenset({"output_select", "select"})  # hints that keep part of the result
SET_BARE_SCOPE = "ctx"  # step-level `set: {x: ...}` (renames era): a bare key is an execution variable


def load_plan(
    source: str | Path,
    *,
    text: str | None = None,
    overrides: dict[str, Any] | None = None,
    warnings: list[Problem] | None = None,
) -> Plan:
    """Read the playbook at `source` (or `text`, named `source` in problems) and return its Plan.

    `overrides` is deep-merged over the playbook's workload. Raises PlaybookError carrying every
    problem found (file, line, key path, message). A `{{ name }}` the playbook never gives
    (dsl/names.py) is a problem where templates render strictly (the playbook's
    `executor.spec.strict_templates` or NOETL_STRICT_TEMPLATES), else a warning appended to
    `warnings` (templates render leniently: the name reads as empty and is noted at run time).
    """
    file = str(source)
    try:
        check_value_depth(overrides, "workload")
    except InputError as exc:
        raise PlaybookError([Problem(file, None, "", str(exc))]) from None
    if text is None:
        text = read_playbook_text(Path(source), file)
    elif len(text) > limits.max_playbook_bytes():
        raise PlaybookError([_too_big(file, len(text.encode("utf-8")))])
    document, problems = load_yaml(text, file)
    ctx = Context(file=file, problems=problems)
    # a document that loads to null (`~`) is refused by _plan as "must be a mapping"
    plan = _plan(ctx, document, overrides or {}) if document is not None or not problems else None
    if document is not None:
        check_templates(ctx, document)
        names = Context(file=file, problems=[])
        check_names(names, document, list(overrides or {}))
        advisories = sorted([problem for _, problem in ctx.unknown] + names.problems, key=_where)
        if plan is not None and strict_rendering(plan.strict_templates):
            ctx.problems.extend(advisories)
        elif warnings is not None:
            warnings.extend(advisories)
    if ctx.problems or plan is None:
        raise PlaybookError(sorted(ctx.problems, key=_where))
    return plan


def _where(problem: Problem) -> tuple[int, str]:
    return problem.line or 0, problem.path


def _too_big(file: str, size: int) -> Problem:
    limit = limits.max_playbook_bytes()
    return Problem(
        file, None, "", f"the playbook is {size} bytes, more than the limit of {limit} bytes (NOETL_MAX_PLAYBOOK_BYTES)"
    )


def read_playbook_text(path: Path, file: str) -> str:
    """The playbook's text: at most NOETL_MAX_PLAYBOOK_BYTES of UTF-8, else one problem."""
    limit = limits.max_playbook_bytes()
    try:
        with path.open("rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as exc:
        raise PlaybookError([Problem(file, None, "", f"cannot read the playbook: {exc.strerror or exc}")]) from None
    if len(raw) > limit:
        raise PlaybookError([_too_big(file, path.stat().st_size)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        byte = raw[exc.start]
        raise PlaybookError(
            [
                Problem(
                    file,
                    line,
                    "",
                    f"the playbook is not UTF-8 text: byte 0x{byte:02x} at column {column}; save it as UTF-8",
                )
            ]
        ) from None


def _plan(ctx: Context, document: Any, overrides: dict[str, Any]) -> Plan | None:
    top = expect_mapping(ctx, document, 1, "")
    if top is None:
        return None
    check_keys(ctx, top, TOP_KEYS, "")
    api_version = _api_version(ctx, top)
    if top.get("kind") != "Playbook":
        ctx.problem(line_of(top, "kind"), "kind", f"kind must be Playbook, not {top.get('kind')!r}")
    for key, shape in (("metadata", "{name: ...}"), ("workflow", "[steps]")):
        if key not in top:
            ctx.problem(top.line, "", f"a playbook needs {key}: {shape}")
    metadata = expect_mapping(ctx, top.get("metadata", LDict()), line_of(top, "metadata"), "metadata") or LDict()
    check_keys(ctx, metadata, METADATA_KEYS, "metadata")
    name = None
    if "name" in metadata:
        name = expect_str(ctx, metadata["name"], line_of(metadata, "name"), "metadata.name")
    elif "metadata" in top:
        ctx.problem(line_of(top, "metadata"), "metadata", "metadata needs name: <playbook name>")
    workload = expect_mapping(ctx, top.get("workload") or LDict(), line_of(top, "workload"), "workload")
    variables = expect_mapping(ctx, top.get("ctx") or LDict(), line_of(top, "ctx"), "ctx")
    executor = _executor(ctx, top)
    workbook = _workbook(ctx, top.get("workbook"), line_of(top, "workbook"))
    steps, shapes = _workflow(ctx, top, workbook)
    if not steps:
        return None
    entry = _entry_and_final(ctx, executor, steps)
    final = executor.get("final_step")
    root_ctx, overrides = ctx_with_overrides(plain(variables or {}), overrides, _deep_merge)
    merged_workload = render_workload(_deep_merge(plain(workload or {}), overrides), root_ctx)
    _resolve_max_in_flight(ctx, merged_workload, root_ctx)
    _refuse_secret_managers(ctx, steps)
    return Plan(
        name=name or "",
        path=_optional_str(ctx, metadata, "path"),
        api_version=api_version or "",
        dialect=_dialect(shapes, api_version),
        description=_optional_str(ctx, metadata, "description"),
        workload=merged_workload,
        ctx=root_ctx,
        entry_step=entry,
        final_step=final if isinstance(final, str) else None,
        no_next_is_error=bool(executor.get("no_next_is_error")),
        strict_templates=bool(executor.get("strict_templates")),
        **_webhook_fields(executor),
        steps=steps,
        source_file=source_path(ctx.file),
        timeout=_playbook_timeout(ctx, top, executor),
        tags=tags(ctx, metadata, "metadata"),
    )


def _refuse_secret_managers(ctx: Context, steps: dict[str, Step]) -> None:
    """An `auth:` (of a task or its sink) that asks a cloud secret manager is refused by name."""
    for index, (name, step) in enumerate(steps.items()):
        for task in step.tasks:
            for where, auth, line in (("tool", task.auth, task.line), ("sink", *_sink_auth(task))):
                refused = credentials.secret_manager_refusal(auth)
                if refused is not None:
                    path = f"workflow[{index}]({name}).{where}.auth"
                    ctx.problem(line if line is not None else step.line, path, refused)


def _sink_auth(task: Task) -> tuple[Any, int | None]:
    return (task.sink.auth, task.sink.line) if task.sink is not None else (None, None)


def _resolve_max_in_flight(ctx: Context, workload: dict[str, Any], variables: dict[str, Any]) -> None:
    """A loop's templated `max_in_flight` (`"{{ n }}"`), rendered once from the workload (with
    `--set` overrides) and the root ctx, as bare names or `workload.x`/`ctx.x`: it must give a
    whole number, else it is a problem at its line."""
    scope = {**workload, **variables, "workload": workload, "ctx": variables}
    for templated in ctx.templated_max_in_flight:
        try:
            value = render_string(templated.template, scope)
            count = int(str(value).strip()) if not isinstance(value, bool) else -1
        except (TemplateError, ValueError) as exc:
            reason = exc if isinstance(exc, TemplateError) else f"rendered to {value!r}"
            ctx.problem(
                templated.line,
                templated.path,
                f"max_in_flight {templated.template!r} must render to a whole number "
                f"from the workload or root ctx: {reason}",
            )
            continue
        if count < 0:
            ctx.problem(
                templated.line,
                templated.path,
                f"max_in_flight {templated.template!r} rendered to {value!r}, not a whole number",
            )
            continue
        templated.loop.max_in_flight = max(count, 1)


def source_path(file: str) -> str:
    """The playbook's file as the plan keeps it: absolute when it names a file here, so that a
    worker in another working directory finds what the playbook names relative to its file
    (sub-playbooks beside it, `script: {source: {type: file}}`); any other name (`catalog:<path>`,
    a name given to text) unchanged. Symbolic links are kept, as the submitter named them."""
    if file.startswith("catalog:") or os.path.isabs(file):
        return file
    return os.path.abspath(file) if os.path.isfile(file) else file


def _playbook_timeout(ctx: Context, top: LDict, executor: dict[str, Any]) -> float | None:
    """`timeout:` (top level, or executor.spec.timeout): seconds the whole execution may take."""
    for mapping, path in ((top, "timeout"), (executor, "executor.spec.timeout")):
        if "timeout" not in mapping:
            continue
        value = mapping["timeout"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            ctx.problem(line_of(mapping, "timeout"), path, f"must be a positive number of seconds, not {value!r}")
            return None
        return float(value)
    return None


def _dialect(shapes: set[str], api_version: str | None) -> Literal["legacy", "v2case", "canonical"]:
    """v2case if any step uses case:, legacy if a v1 playbook has a legacy-shaped step, else canonical."""
    if "case" in shapes:
        return "v2case"
    if "legacy" in shapes and api_version == LEGACY_API_VERSION:
        return "legacy"
    return "canonical"


def _optional_str(ctx: Context, metadata: LDict, key: str) -> str | None:
    if key not in metadata:
        return None
    return expect_str(ctx, metadata[key], line_of(metadata, key), f"metadata.{key}")


def _api_version(ctx: Context, top: LDict) -> str | None:
    value = top.get("apiVersion")
    if value not in API_VERSIONS:
        line = line_of(top, "apiVersion")
        ctx.problem(line, "apiVersion", f"apiVersion must be one of {', '.join(API_VERSIONS)}, not {value!r}")
        return None
    return value


def _executor(ctx: Context, top: LDict) -> dict[str, Any]:
    executor = expect_mapping(ctx, top.get("executor") or LDict(), line_of(top, "executor"), "executor") or LDict()
    check_keys(ctx, executor, EXECUTOR_KEYS, "executor")
    spec = expect_mapping(ctx, executor.get("spec") or LDict(), line_of(executor, "spec"), "executor.spec") or LDict()
    check_keys(ctx, spec, EXECUTOR_SPEC_KEYS, "executor.spec")
    for key in ("entry_step", "final_step"):
        if key in spec:
            expect_str(ctx, spec[key], line_of(spec, key), f"executor.spec.{key}")
    if "webhook" in spec:
        _check_webhook(ctx, spec["webhook"], line_of(spec, "webhook"))
    boolean(ctx, spec, "no_next_is_error", "executor.spec")
    boolean(ctx, spec, "strict_templates", "executor.spec")
    return spec


WEBHOOK_KEYS = frozenset({"url", "events", "secret"})
WEBHOOK_EVENTS = ("failed", "cancelled", "completed")


def _check_webhook(ctx: Context, value: Any, line: int | None) -> None:
    """`executor.spec.webhook`: a URL, or {url, events: [failed|cancelled|completed], secret: a
    credential name} (noetl_celery/observe/webhooks.py)."""
    path = "executor.spec.webhook"
    if not isinstance(value, dict):
        expect_str(ctx, value, line, path)
        return
    hook = expect_mapping(ctx, value, line, path) or LDict()
    check_keys(ctx, hook, WEBHOOK_KEYS, path)
    expect_str(ctx, hook.get("url"), line_of(hook, "url") or line, f"{path}.url")
    if "secret" in hook:
        expect_str(ctx, hook["secret"], line_of(hook, "secret"), f"{path}.secret")
    events = hook.get("events")
    if events is not None and (
        not isinstance(events, list) or not events or any(e not in WEBHOOK_EVENTS for e in events)
    ):
        ctx.problem(
            line_of(hook, "events"), f"{path}.events", f"must be a list of {', '.join(WEBHOOK_EVENTS)}, got {events!r}"
        )


def _webhook_fields(executor: dict[str, Any]) -> dict[str, Any]:
    """The plan's webhook fields of a checked `executor.spec.webhook`."""
    hook = executor.get("webhook")
    if isinstance(hook, str):
        return {"webhook": hook}
    if isinstance(hook, dict) and isinstance(hook.get("url"), str):
        events = hook.get("events")
        return {
            "webhook": hook["url"],
            "webhook_events": [str(e) for e in events] if isinstance(events, list) else None,
            "webhook_secret": hook.get("secret") if isinstance(hook.get("secret"), str) else None,
        }
    return {}


def _entry_and_final(ctx: Context, executor: dict[str, Any], steps: dict[str, Step]) -> str:
    for key in ("entry_step", "final_step"):
        name = executor.get(key)
        if isinstance(name, str) and name not in steps:
            line = line_of(executor, key)
            ctx.problem(line, f"executor.spec.{key}", f"no step named '{name}'{suggest(name, steps)}")
    entry = executor.get("entry_step")
    if isinstance(entry, str) and entry in steps:
        return entry
    return DEFAULT_ENTRY_STEP if DEFAULT_ENTRY_STEP in steps else next(iter(steps))


def nest_dotted(values: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}: a workload override's dotted key names a nested value
    (`--set a.b=1`, and the `workload` of the REST API's execute)."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        target = nested
        *parents, leaf = key.split(".")
        for part in parents:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{key}: {part!r} is set both as a value and as a mapping")
            target = child
        target[leaf] = value
    return nested


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in: mappings key by key, anything else replaced."""
    return _deep_merge(base, overrides)


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _workbook(ctx: Context, value: Any, line: int | None) -> Workbook:
    workbook: Workbook = {}
    entries = expect_list(ctx, value, line, "workbook") if value is not None else []
    for index, raw in enumerate(entries or []):
        path, item_line = f"workbook[{index}]", line_of(value, index)
        entry = expect_mapping(ctx, raw, item_line, path)
        if entry is None:
            continue
        name = expect_str(ctx, entry.get("name"), line_of(entry, "name"), join(path, "name"))
        if name is None:
            continue
        path = f"{path}({name})"
        if name in workbook:
            ctx.problem(line_of(entry, "name"), join(path, "name"), f"workbook entry '{name}' is defined twice")
        tool = entry.get("tool")
        if "tool" not in entry:
            ctx.problem(item_line, path, "a workbook entry needs tool: <kind> (or tool: {kind: ...})")
            task = None
        elif isinstance(tool, dict):
            check_keys(ctx, entry, CANONICAL_WORKBOOK_KEYS, path)
            task = task_from_mapping(ctx, tool, name, line_of(entry, "tool"), join(path, "tool"), {})
        else:
            task = workbook_entry_task(ctx, entry, name, path)
        workbook[name] = task
    return workbook


# Built-in names that only a policy condition sees (the attempt's outcome): a step may be named so,
# as NoETL allows; its result reads by that name everywhere else (args, sinks, arcs, set).
POLICY_ONLY_NAMES = frozenset({"success", "error"})


def _workflow(ctx: Context, top: LDict, workbook: Workbook) -> tuple[dict[str, Step], set[str]]:
    if "workflow" not in top:
        return {}, set()
    items = expect_list(ctx, top["workflow"], line_of(top, "workflow"), "workflow")
    if items is None:
        return {}, set()
    if not items:
        ctx.problem(line_of(top, "workflow"), "workflow", "the workflow has no steps")
    steps: dict[str, Step] = {}
    shapes: set[str] = set()
    for index, raw in enumerate(items):
        path, line = step_path(index, raw), line_of(items, index)
        step = expect_mapping(ctx, raw, line, path)
        if step is None:
            continue
        built = _step(ctx, step, line, path, workbook)
        if built is None:
            continue
        if built.name in BUILTIN_NAMES - POLICY_ONLY_NAMES:
            ctx.problem(
                line_of(step, "step"),
                join(path, "step"),
                f"step name '{built.name}' is a built-in template name: its result would be hidden "
                f"behind `{{{{ {built.name} }}}}`; rename the step, e.g. '{built.name}_step'",
            )
            continue
        if built.name in steps:
            ctx.problem(
                line,
                join(path, "step"),
                f"step '{built.name}' is already defined at line {steps[built.name].line}",
            )
            continue
        steps[built.name] = built
        shapes.add(_shape(step))
    for ref in ctx.arc_refs:
        if ref.target not in steps and steps:
            ctx.problem(ref.line, ref.path, f"no step named '{ref.target}'{suggest(ref.target, steps)}")
    return steps, shapes


def _shape(step: LDict) -> str:
    """case: v2 case form; tool a mapping or a list: canonical; tool a string or absent: legacy."""
    if "case" in step:
        return "case"
    return "canonical" if isinstance(step.get("tool"), (dict, list)) else "legacy"


def _step(ctx: Context, step: LDict, line: int | None, path: str, workbook: Workbook) -> Step | None:
    name = expect_str(ctx, step.get("step"), line_of(step, "step"), join(path, "step"))
    if name is None:
        return None
    if isinstance(step.get("tool"), (dict, list)):
        tasks = canonical_tasks(ctx, step, name, path, workbook)
    else:
        tasks = legacy_tasks(ctx, step, name, path, workbook)
    next_routing = routing(ctx, step.get("next"), line_of(step, "next"), join(path, "next"))
    if "case" in step:
        next_routing = _case(ctx, step, tasks, next_routing, path)
    if "retry" in step:
        policy, page_sink = legacy_retry(ctx, step["retry"], line_of(step, "retry"), join(path, "retry"))
        _attach_policy(ctx, tasks, policy, step, "retry", path)
        _attach_sink(ctx, tasks, page_sink, name, step, "retry", path)
    if "sink" in step and not isinstance(step["sink"], bool):  # `sink: true`: a hint (below)
        sink = build_sink(ctx, step["sink"], line_of(step, "sink"), join(path, "sink"))
        _attach_sink(ctx, tasks, sink, name, step, "sink", path)
    variables, set_ctx = _assignments(ctx, step, path)
    loop = build_loop(ctx, step["loop"], line_of(step, "loop"), join(path, "loop")) if "loop" in step else None
    desc = expect_str(ctx, step["desc"], line_of(step, "desc"), join(path, "desc")) if "desc" in step else None
    select, hints = _result_hints(ctx, step, path)
    if isinstance(step.get("sink"), bool):
        hints["sink"] = step["sink"]  # NoETL's `sink: true` marks the step as a write: advisory here
    return Step(
        name=name,
        desc=desc,
        admit=_admission(ctx, step, path),
        tasks=tasks,
        loop=loop,
        vars=variables,
        set_ctx=set_ctx,
        next=next_routing,
        result_select=select,
        result_hints=hints,
        line=line,
        tags=tags(ctx, step, path),
    )


def _result_hints(ctx: Context, step: LDict, path: str) -> tuple[str | None, dict[str, Any]]:
    """Step-level `result:` / `output:` hints: a selector (`output_select`, `select`) is honoured,
    every other hint (storage and the like) is kept as written and is advisory."""
    select: str | None = None
    hints: dict[str, Any] = {}
    for key in RESULT_HINT_KEYS:
        if key not in step:
            continue
        block = expect_mapping(ctx, step[key], line_of(step, key), join(path, key))
        for name, value in (block or {}).items():
            where = join(join(path, key), name)
            if name not in RESULT_SELECTORS or isinstance(value, list):
                # a list of paths (`output_select: [status, count]`) is what NoETL keeps of a result
                # it externalises; it never trims a result kept inline: advisory here
                hints[f"{key}.{name}"] = plain(value)
            elif select is not None:
                ctx.problem(line_of(block, name), where, "the result is selected twice; give one selector")
            else:
                select = expect_str(ctx, value, line_of(block, name), where)
    return select, hints


def _case(ctx: Context, step: LDict, tasks: list[Task], next_routing: Routing, path: str) -> Routing:
    """case: entries with next are the step's arcs (a structural next: routes when none of them
    fires), the rest its task's policy."""
    result = compile_case(ctx, step["case"], line_of(step, "case"), join(path, "case"))
    if result.rules:
        _attach_policy(ctx, tasks, Policy(rules=result.rules), step, "case", path)
    if not result.arcs:
        return next_routing
    # as in NoETL, a structural next: is the fallback when no case entry routes
    fallback = [arc.model_copy(update={"fallback": True}) for arc in next_routing.arcs]
    return Routing(mode="inclusive", arcs=[*result.arcs, *fallback], fallback_mode=next_routing.mode)


def _attach_policy(ctx: Context, tasks: list[Task], policy: Policy | None, step: LDict, key: str, path: str) -> None:
    """A step-level policy (retry:, case:) belongs to the step's single task."""
    if policy is None:
        return
    line = line_of(step, key)
    if len(tasks) != 1:
        what = "a step without a tool" if not tasks else "a pipeline (put spec.policy on a task)"
        ctx.problem(line, join(path, key), f"{key}: needs exactly one task; this is {what}")
        return
    if tasks[0].policy is not None:
        ctx.problem(line, join(path, key), f"the task already has a policy; give {key}: or spec.policy, not both")
        return
    tasks[0].policy = policy


def _attach_sink(
    ctx: Context, tasks: list[Task], sink: Sink | None, name: str, step: LDict, key: str, path: str
) -> None:
    """A step's sink runs after its last task; a step with no task gets a noop one to carry it."""
    if sink is None:
        return
    if not tasks:
        tasks.append(Task(label=name, kind="noop", line=step.line))
    if tasks[-1].sink is not None:
        ctx.problem(line_of(step, key), join(path, key), "the step's last task already has a sink")
        return
    tasks[-1].sink = sink


def _assignments(ctx: Context, step: LDict, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`vars:`, `set_ctx:` and `set: {ctx.x: ..., vars.y: ..., z: ...}` -> (vars, set_ctx), unrendered.
    A bare key of `set:` is a ctx variable, as NoETL reads it (`set: {page: 2}` -> `ctx.page`)."""
    targets = assignments(ctx, step, path, SET_TARGETS, bare=SET_BARE_SCOPE)
    return targets["vars"], targets["set_ctx"]


def _admission(ctx: Context, step: LDict, path: str) -> list[Rule] | None:
    """`spec.policy.admit` (canonical) or a step-level `when:` -> admission rules."""
    admit: list[Rule] | None = None
    if "spec" in step:
        spec_path = join(path, "spec")
        spec = expect_mapping(ctx, step["spec"], line_of(step, "spec"), spec_path) or LDict()
        check_keys(ctx, spec, {"policy"}, spec_path)
        if "policy" in spec:
            policy_path = join(spec_path, "policy")
            policy = expect_mapping(ctx, spec["policy"], line_of(spec, "policy"), policy_path) or LDict()
            check_keys(ctx, policy, {"admit"}, policy_path)
            if "admit" in policy:
                admit = admit_rules(ctx, policy["admit"], line_of(policy, "admit"), join(policy_path, "admit"))
    if "when" in step:
        if admit is not None:
            ctx.problem(line_of(step, "when"), join(path, "when"), "give when: or spec.policy.admit, not both")
        else:
            admit = when_admit(condition(ctx, step, "when", path), join(path, "when"))
    return admit
