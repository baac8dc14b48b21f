"""Checks every dialect shares, and how their problems are worded.

Decides: the wording of a problem (unknown key + "did you mean", wrong type, unsupported tool
kind, missing required tool field), which tool kinds exist (the tool registry is the only
authority), how a condition and a number are read, how a `sink:` is read, and that every
template compiles in the runtime's own sandboxed environment (so unknown filters and tests are
found at validate, not at run time). It collects problems into a `Context`; it never raises and never renders.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from noetl_celery.config import settings as noetl_settings
from noetl_celery.core.errors import Problem
from noetl_celery.dsl.plan import Condition, Sink
from noetl_celery.dsl.yaml_lines import LDict, line_of, plain
from noetl_celery.templates.render import check_syntax
from noetl_celery.tools import settings as tool_settings
from noetl_celery.tools.base import COMMON_FIELDS, ToolSpec, get_tool, known_kinds
from noetl_celery.tools.unavailable import UNAVAILABLE_KINDS

SUGGESTION_CUTOFF = 0.6  # difflib similarity below which no "did you mean" is offered
WORKBOOK_KIND = "workbook"  # resolved at compile time, not a registered tool
NON_TEMPLATE_KEYS = frozenset({"code"})  # python source: braces are Python, not Jinja
# Task keys that are not tool configuration: handled by the plan itself.
TASK_META_KEYS = frozenset({"kind", "auth", "spec", "policy", "desc", "sink", "name"})
SINK_META_KEYS = frozenset({"tool", "kind", "auth"})


@dataclass
class ArcRef:
    """A reference to a step by name, checked once every step is known."""

    target: str
    line: int | None
    path: str


@dataclass
class TemplatedMaxInFlight:
    """A loop's `max_in_flight` written as a template: rendered once the workload is known."""

    loop: Any  # the plan's Loop, whose max_in_flight is set then
    template: str
    line: int | None
    path: str


@dataclass
class Context:
    """What one compilation accumulates: the problems found and the references to check."""

    file: str
    problems: list[Problem] = field(default_factory=list)
    arc_refs: list[ArcRef] = field(default_factory=list)
    templated_max_in_flight: list[TemplatedMaxInFlight] = field(default_factory=list)
    # unknown keys, with the id of the mapping that holds each: warnings unless strict, or unless
    # that mapping lacks a key it needs (the unknown key is then most likely that key misspelt)
    unknown: list[tuple[int, Problem]] = field(default_factory=list)

    def problem(self, line: int | None, path: str, message: str) -> None:
        self.problems.append(Problem(self.file, line, path, message))

    def unknown_key(self, holder: Any, line: int | None, path: str, message: str) -> None:
        self.unknown.append((id(holder), Problem(self.file, line, path, message)))

    def refuse_unknown(self, holder: Any) -> bool:
        """Make the unknown keys of `holder` problems; True when it had any."""
        mine = [problem for owner, problem in self.unknown if owner == id(holder)]
        self.unknown = [(owner, problem) for owner, problem in self.unknown if owner != id(holder)]
        self.problems.extend(mine)
        return bool(mine)

    def missing(self, holder: Any, line: int | None, path: str, message: str) -> None:
        """`holder` lacks a key it needs: its unknown keys are the problem when it has any (a
        misspelt `-step:` is named as such), else `message`."""
        if not self.refuse_unknown(holder):
            self.problem(line, path, message)


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def suggest(word: str, choices: Iterable[str]) -> str:
    """ "; did you mean 'x'?" for the closest choice, or "" when nothing is close."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=SUGGESTION_CUTOFF)
    if not close and word.lstrip("-_ ") != word:
        close = difflib.get_close_matches(word.lstrip("-_ "), sorted(set(choices)), n=1, cutoff=SUGGESTION_CUTOFF)
    return f"; did you mean '{close[0]}'?" if close else ""


def unknown_key(ctx: Context, mapping: Any, key: str, path: str, choices: Iterable[str]) -> None:
    """A key this playbook's reader does not know: a warning with the nearest known key (as NoETL,
    the run ignores it), a problem where the playbook is strict or `mapping` lacks a key it needs."""
    ctx.unknown_key(mapping, line_of(mapping, key), join(path, key), f"unknown key '{key}'{suggest(key, choices)}")


def check_keys(ctx: Context, mapping: LDict, allowed: Iterable[str], path: str) -> None:
    """Note every key of `mapping` not in `allowed` (see `unknown_key`)."""
    allowed = frozenset(allowed)
    for key in mapping:
        if key not in allowed:
            unknown_key(ctx, mapping, key, path, allowed)


def expect_mapping(ctx: Context, value: Any, line: int | None, path: str) -> LDict | None:
    if isinstance(value, dict):
        return value if isinstance(value, LDict) else LDict(value)
    ctx.problem(line, path, f"must be a mapping, not {tool_settings.type_name(value)}")
    return None


def expect_list(ctx: Context, value: Any, line: int | None, path: str) -> list[Any] | None:
    if isinstance(value, list):
        return value
    ctx.problem(line, path, f"must be a list, not {tool_settings.type_name(value)}")
    return None


def expect_str(ctx: Context, value: Any, line: int | None, path: str) -> str | None:
    if isinstance(value, str) and value:
        return value
    ctx.problem(line, path, f"must be a non-empty string, not {tool_settings.type_name(value)}")
    return None


def one_of(value: Any, choices: Collection[Any]) -> bool:
    """Whether `value` is one of `choices`; a list or a mapping (written where a name belongs) is
    none of them, never an error."""
    return isinstance(value, Hashable) and value in choices


def number(ctx: Context, mapping: LDict, key: str, path: str, *, integer: bool = False) -> Any:
    """mapping[key] as an int (or float); None when absent; a problem when not a number."""
    value = mapping.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        ctx.problem(line_of(mapping, key), join(path, key), f"must be {kind}, not {value!r}")
        return None
    return value


def boolean(ctx: Context, mapping: LDict, key: str, path: str) -> bool | None:
    value = mapping.get(key)
    if value is None or isinstance(value, bool):
        return value
    ctx.problem(line_of(mapping, key), join(path, key), f"must be true or false, not {value!r}")
    return None


def condition(ctx: Context, mapping: LDict, key: str, path: str) -> Condition:
    """A `when`-like value: a template string or a literal boolean."""
    value = mapping.get(key)
    if value is None or isinstance(value, (str, bool)):
        return value
    ctx.problem(line_of(mapping, key), join(path, key), f"must be a template string or a boolean, not {value!r}")
    return None


def tags(ctx: Context, owner: Any, path: str) -> list[str]:
    """`tags:` of a playbook's metadata or of a step: a list of names (or one name); metadata only."""
    if not isinstance(owner, dict) or "tags" not in owner:
        return []
    value, line = owner["tags"], line_of(owner, "tags")
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    ctx.problem(line, join(path, "tags"), f"must be a list of names, not {tool_settings.type_name(value)}")
    return []


def step_path(index: int, step: Any) -> str:
    """`workflow[3](fetch_users)`: the path of a step, with its name when it has one."""
    name = step.get("step") if isinstance(step, dict) else None
    return f"workflow[{index}]({name})" if isinstance(name, str) else f"workflow[{index}]"


# ---------------------------------------------------------------------------------------------
# Tools


def known_tool_kinds() -> list[str]:
    return sorted({*known_kinds(), WORKBOOK_KIND})


def tool_spec(ctx: Context, kind: Any, line: int | None, path: str) -> ToolSpec | None:
    """The registered tool of `kind`, or a problem naming the kinds that exist."""
    if not isinstance(kind, str) or not kind:
        ctx.problem(line, path, f"tool kind must be a non-empty string, not {tool_settings.type_name(kind)}")
        return None
    if kind in noetl_settings.disabled_tools():
        ctx.problem(line, path, noetl_settings.disabled_tool_message(kind))
        return None
    spec = get_tool(kind)
    if spec is None and kind in UNAVAILABLE_KINDS:
        ctx.problem(line, path, f"tool kind '{kind}' cannot run here: {UNAVAILABLE_KINDS[kind]}")
    elif spec is None:
        known = known_tool_kinds()
        hint = suggest(kind, known)
        ctx.problem(line, path, f"tool kind '{kind}' is not supported (known: {', '.join(known)}){hint}")
    elif (missing := spec.missing_extra()) is not None:
        ctx.problem(line, path, missing)
    return spec


def tool_only_fields(spec: ToolSpec) -> frozenset[str]:
    """Fields that belong to this tool and could not be meant for the step (plus auth/timeout/input)."""
    return (spec.fields - COMMON_FIELDS) | {"auth", "timeout", "input"}


def check_fields(
    ctx: Context, spec: ToolSpec, mapping: LDict, keys: Iterable[str], path: str, also: Iterable[str] = ()
) -> None:
    """Each of `keys` (taken from `mapping`) must be a field of the tool; `also`: other valid keys
    there (a legacy step's own keys). A key closest to one of `also` is named as a misspelt step key."""
    others = set(also) - spec.fields
    choices = spec.fields - TASK_META_KEYS | others
    for key in keys:
        if key in spec.fields:
            continue
        hint = suggest(key, choices)
        close = difflib.get_close_matches(key, sorted(choices), n=1, cutoff=SUGGESTION_CUTOFF)
        if close and close[0] in others:
            message = f"unknown step key '{key}'{hint}"
        else:
            message = f"unknown key '{key}' for the {spec.kind} tool{hint}"
        ctx.unknown_key(mapping, line_of(mapping, key), join(path, key), message)


def missing_required(spec: ToolSpec, config: dict[str, Any]) -> list[frozenset[str]]:
    """The groups of fields of which the tool needs one and `config` gives none."""
    return [group for group in spec.required if not any(config.get(key) not in (None, "") for key in group)]


def check_required(
    ctx: Context, spec: ToolSpec, config: dict[str, Any], line: int | None, path: str, holders: Iterable[Any] = ()
) -> None:
    """A problem per group of fields the tool needs and lacks; the unknown keys of `holders` (the
    mappings its fields are written in) are problems then too: most likely the field misspelt."""
    missing = missing_required(spec, config)
    for group in missing:
        ctx.problem(line, path, f"{spec.kind} tool needs one of: {', '.join(sorted(group))}")
    for holder in holders if missing else ():
        ctx.refuse_unknown(holder)


def check_settings(
    ctx: Context,
    spec: ToolSpec,
    config: dict[str, Any],
    mapping: Any,
    path: str,
    holders: dict[str, tuple[Any, str]] | None = None,
) -> None:
    """The literal values of `config` against the tool's settings model (see tools/settings.py).

    `mapping` holds the keys as written (for their lines); `holders`: key -> (the mapping that
    holds it, its path) for keys written elsewhere (a canonical tool's `spec:`).
    """
    for where, message in tool_settings.problems(spec, config, literal_only=True):
        key = where.split(".", 1)[0].split("[", 1)[0]
        holder, holder_path = (holders or {}).get(key, (mapping, path))
        ctx.problem(line_of(holder, key), join(holder_path, where), message)
    written = set(holders or ()) | (set(mapping) if isinstance(mapping, dict) else set())
    if "credential" in config and "auth" in written:  # `credential:` is an alias of `auth:`
        holder, holder_path = (holders or {}).get("credential", (mapping, path))
        ctx.problem(
            line_of(holder, "credential"),
            join(holder_path, "credential"),
            "give the credential once: auth or credential",
        )


# ---------------------------------------------------------------------------------------------
# Sinks


def build_sink(ctx: Context, value: Any, line: int | None, path: str) -> Sink | None:
    """`sink: {tool: postgres, auth, table, ...}` (or `kind:`, or `tool: {kind: ...}`) -> Sink."""
    sink = expect_mapping(ctx, value, line, path)
    if sink is None:
        return None
    fields = sink
    tool = sink.get("tool", sink.get("kind"))
    if "tool" in sink and "kind" in sink:
        ctx.problem(line_of(sink, "kind"), join(path, "kind"), "give the sink's kind once: tool or kind")
        return None
    if isinstance(tool, dict):  # sink: {tool: {kind: postgres, ...}}
        fields = expect_mapping(ctx, tool, line_of(sink, "tool"), join(path, "tool")) or LDict()
        check_keys(ctx, sink, {"tool"}, path)
        path, tool = join(path, "tool"), fields.get("kind")
        if "tool" in fields:
            unknown_key(ctx, fields, "tool", path, fields.keys() - {"tool"})
    if tool is None:
        ctx.problem(line, path, "a sink needs a tool kind (tool: postgres, ...)")
        return None
    spec = tool_spec(ctx, tool, line_of(fields, "tool") or line_of(fields, "kind"), path)
    if spec is None:
        return None
    config_keys = [key for key in fields if key not in SINK_META_KEYS]
    check_fields(ctx, spec, fields, config_keys, path)
    config = {key: plain(fields[key]) for key in config_keys if key in spec.fields}
    check_required(ctx, spec, config, line, path, [fields])
    check_settings(ctx, spec, config, fields, path)
    return Sink(kind=spec.kind, config=config, auth=plain(fields.get("auth")), line=line)


# ---------------------------------------------------------------------------------------------
# Templates


def check_templates(ctx: Context, value: Any, path: str = "", line: int | None = None) -> None:
    """Every string that looks like a Jinja template must parse (nothing is rendered)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in NON_TEMPLATE_KEYS:
                check_templates(ctx, item, join(path, key), line_of(value, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            item_path = step_path(index, item) if path == "workflow" else join(path, index)
            check_templates(ctx, item, item_path, line_of(value, index))
    elif isinstance(value, str) and ("{{" in value or "{%" in value):
        failed = check_syntax(value)
        if failed is not None:
            ctx.problem(line, path, failed)


def _named_values(ctx: Context, items: list[Any], path: str, scope: str | None) -> LDict:
    """NoETL's `set: [{name: x, value: ...}]` (v2 examples): each item assigns `vars.x` (or x in
    `scope` where there are no vars), as `set: {vars.x: ...}` does."""
    values = LDict()
    values.line = line_of(items, 0)
    for index, item in enumerate(items):
        item_path, item_line = join(path, index), line_of(items, index)
        entry = expect_mapping(ctx, item, item_line, item_path)
        if entry is None:
            continue
        check_keys(ctx, entry, {"name", "value"}, item_path)
        name = expect_str(ctx, entry.get("name"), line_of(entry, "name"), join(item_path, "name"))
        if name is None:
            continue
        key = f"{scope}.{name}" if scope else name
        if key in values:
            ctx.problem(line_of(entry, "name"), join(item_path, "name"), f"'{name}' is assigned twice")
            continue
        values[key] = entry.get("value")
        values.key_lines[key] = item_line or 0
    return values


def assignments(
    ctx: Context, owner: LDict, path: str, scopes: dict[str, str], bare: str | None = None
) -> dict[str, dict[str, Any]]:
    """Assignments written as separate blocks (`set_ctx:`, `vars:`, ...: the values of `scopes`)
    and as the `set: {ctx.x: ..., iter.y: ...}` alias (its keys' prefixes are the keys of
    `scopes`), merged per block; unrendered. A name assigned twice in `set:` is a problem.
    `bare`: the scope a key without a dot (`set: {page: 2}`) assigns, None to refuse it."""
    targets: dict[str, dict[str, Any]] = {block: {} for block in scopes.values()}
    for block, values in targets.items():
        if block in owner:
            values.update(plain(expect_mapping(ctx, owner[block], line_of(owner, block), join(path, block)) or {}))
    if "set" not in owner:
        return targets
    if isinstance(owner["set"], list):
        values = _named_values(ctx, owner["set"], join(path, "set"), "vars" if "vars" in scopes else bare)
    else:
        values = expect_mapping(ctx, owner["set"], line_of(owner, "set"), join(path, "set")) or LDict()
    names = [f"{scope}.x" for scope in scopes]
    shapes = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
    if bare is not None:
        shapes += f" (a bare x is {bare}.x)"
    for key, value in values.items():
        scope, _, name = key.partition(".")
        where = join(path, f"set.{key}")
        if "." not in key and bare is not None:
            scope, name = bare, key
        if scope not in scopes or not name:
            ctx.problem(line_of(values, key), where, f"set keys look like {shapes}")
        elif name in targets[scopes[scope]]:
            ctx.problem(line_of(values, key), where, f"'{name}' is assigned twice")
        else:
            targets[scopes[scope]][name] = plain(value)
    return targets
