"""The v2 `case:` form (Dec 2025): a list of `{when, then: {next | retry | collect | set | result}}`.

Decides: which case entries are routing (then.next -> arcs carrying the entry's `when`, mode
inclusive) and which are policy (then.retry / then.collect / then.set / then.result -> rules on
the step's single task), the outcome gate of a policy entry (a `call.error` condition gates on
error, `call.done` on ok), and that a `retry` with params/body/headers/url/args is the next page,
not a retry after an error. `then:` may be a list of actions (`- set: ...`, `- next: ...`): they
are read as one mapping, each action at most once. `then.set` (bare keys and `ctx.x` assign ctx,
`vars.x` vars, `iter.x` the iteration) goes with the entry's arcs when it has `next` (assigned when
an arc fires), else with its rule (assigned when the call's outcome matches). `then.result`
replaces the call's data with its rendered value. The `when` text is kept as written; the engine
evaluates it with `event.name` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noetl_celery.dsl.legacy import legacy_arcs
from noetl_celery.dsl.plan import Action, Arc, Condition, OutcomeGate, Rule
from noetl_celery.dsl.policy_forms import (
    BACKOFF_KEYS,
    NEXT_CALL_KEYS,
    collect_of,
    next_call_of,
    pagination_action,
    retry_action,
)
from noetl_celery.dsl.validate import (
    Context,
    assignments,
    check_keys,
    condition,
    expect_list,
    expect_mapping,
    join,
)
from noetl_celery.dsl.yaml_lines import LDict, line_of, plain

CASE_ENTRY_KEYS = frozenset({"when", "then"})
CASE_ELSE_KEY = "else"  # `- else: {then: ...}`: the last entry, when no other applies
CASE_THEN_KEYS = frozenset({"next", "retry", "collect", "set", "result"})
CASE_SET_SCOPES = {"ctx": "set_ctx", "vars": "set_vars", "iter": "set_iter"}
CASE_SET_BARE = "ctx"  # `then: {set: {page: 2}}` assigns ctx.page
CASE_RETRY_KEYS = BACKOFF_KEYS | NEXT_CALL_KEYS
ERROR_EVENT = "call.error"
DONE_EVENT = "call.done"


@dataclass
class CaseResult:
    """What a `case:` list compiles to: arcs for the step, rules for its single task."""

    arcs: list[Arc] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)


def compile_case(ctx: Context, value: Any, line: int | None, path: str) -> CaseResult:
    result = CaseResult()
    entries = expect_list(ctx, value, line, path) or []
    for index, raw in enumerate(entries):
        entry_path, entry_line = join(path, index), line_of(entries, index)
        entry = expect_mapping(ctx, raw, entry_line, entry_path)
        if entry is None:
            continue
        is_else = CASE_ELSE_KEY in entry
        if is_else:
            entry = _else_entry(ctx, entry, index == len(entries) - 1, entry_line, entry_path)
            if entry is None:
                continue
            entry_path = join(entry_path, CASE_ELSE_KEY)
        check_keys(ctx, entry, CASE_ENTRY_KEYS, entry_path)
        if ("when" not in entry and not is_else) or "then" not in entry:
            ctx.missing(entry, entry_line, entry_path, "a case entry needs when and then")
            continue
        when = None if is_else else condition(ctx, entry, "when", entry_path)
        then_path = join(entry_path, "then")
        then = _then(ctx, entry, then_path)
        if then is None:
            continue
        sets = _sets(ctx, then, then_path)
        if "next" in then:
            arcs = _arcs(ctx, then, when, then_path)
            for made in arcs:
                made.set_ctx, made.set_vars = dict(sets.get("set_ctx", {})), dict(sets.get("set_vars", {}))
                made.fallback = is_else
            if sets.get("set_iter") and not ({"retry", "collect", "result"} & then.keys()):
                message = "iter.x goes with a call's outcome; with next, set ctx.x or vars.x"
                ctx.problem(line_of(then, "set"), join(then_path, "set"), message)
            result.arcs.extend(arcs)
            sets = {"set_iter": sets["set_iter"]} if sets.get("set_iter") else {}
        rule = _rule(ctx, then, when, then_path, entry_path, sets)
        if rule is not None:
            result.rules.append(rule)
    if result.rules:
        result.rules.append(Rule(then=Action(do="stop"), source=path))
    return result


def _else_entry(ctx: Context, entry: LDict, last: bool, line: int | None, path: str) -> LDict | None:
    """`- else: {then: {...}}` (or `- else: {next: ...}`, the actions themselves): the entry that
    applies when no other entry does; it is the last entry. Returned as an entry without `when`."""
    check_keys(ctx, entry, {CASE_ELSE_KEY}, path)
    if not last:
        ctx.problem(line, path, "a case else must be the last entry")
    body = expect_mapping(ctx, entry[CASE_ELSE_KEY], line_of(entry, CASE_ELSE_KEY), join(path, CASE_ELSE_KEY))
    if body is None or "then" in body:
        return body
    wrapped = LDict({"then": body})
    wrapped.line, wrapped.key_lines = body.line, {"then": body.line or 0}
    return wrapped


def _then(ctx: Context, entry: LDict, path: str) -> LDict | None:
    """`then:` as a mapping of actions, or a list of one-action mappings read as one mapping."""
    value, line = entry["then"], line_of(entry, "then")
    if not isinstance(value, list):
        then = expect_mapping(ctx, value, line, path)
        if then is not None:
            check_keys(ctx, then, CASE_THEN_KEYS, path)
        return then
    merged = LDict()
    merged.line = line
    for index, item in enumerate(value):
        item_path, item_line = join(path, index), line_of(value, index)
        action = expect_mapping(ctx, item, item_line, item_path)
        if action is None:
            continue
        check_keys(ctx, action, CASE_THEN_KEYS, item_path)
        for key in action:
            if key in merged:
                message = f"'{key}' is given twice in this then list (first at line {merged.key_lines[key]})"
                ctx.problem(line_of(action, key), join(item_path, key), message)
                continue
            merged[key] = action[key]
            merged.key_lines[key] = line_of(action, key) or item_line or 0
    return merged


def _sets(ctx: Context, then: LDict, path: str) -> dict[str, dict[str, Any]]:
    if "set" not in then:
        return {}
    found = assignments(ctx, then, path, CASE_SET_SCOPES, bare=CASE_SET_BARE)
    return {block: values for block, values in found.items() if values}


def _arcs(ctx: Context, then: LDict, when: Condition, path: str) -> list[Arc]:
    next_path = join(path, "next")
    arcs = legacy_arcs(ctx, then["next"], line_of(then, "next"), next_path)
    for made in arcs:
        if made.when is not None:
            ctx.problem(made.line, next_path, "a next inside case takes its condition from the case's when")
        made.when = when
    return arcs


def _gate(when: Condition, default: OutcomeGate) -> OutcomeGate:
    text = when if isinstance(when, str) else ""
    if ERROR_EVENT in text and DONE_EVENT not in text:
        return "error"
    if DONE_EVENT in text and ERROR_EVENT not in text:
        return "ok"
    return default


def _rule(
    ctx: Context, then: LDict, when: Condition, path: str, source: str, sets: dict[str, dict[str, Any]]
) -> Rule | None:
    collect = collect_of(ctx, then, path)
    extra: dict[str, Any] = dict(sets)
    if "result" in then:
        extra.update(result=plain(then["result"]), sets_result=True)
    if "retry" in then:
        retry_path = join(path, "retry")
        retry = expect_mapping(ctx, then["retry"], line_of(then, "retry"), retry_path)
        if retry is None:
            return None
        check_keys(ctx, retry, CASE_RETRY_KEYS, retry_path)
        page_keys = NEXT_CALL_KEYS & retry.keys()
        if page_keys:
            page = LDict({key: retry[key] for key in page_keys})
            page.line, page.key_lines = retry.line, dict(retry.key_lines)
            next_call = next_call_of(ctx, page, line_of(then, "retry"), retry_path)
            action = pagination_action(ctx, retry, next_call, collect, retry_path).model_copy(update=extra)
            return Rule(on=_gate(when, "ok"), when=when, then=action, source=source)
        if collect is not None:
            ctx.problem(
                line_of(then, "collect"),
                join(path, "collect"),
                "collect goes with a successful call, not a retry",
            )
        action = retry_action(ctx, retry, retry_path).model_copy(update=extra)
        return Rule(on=_gate(when, "error"), when=when, then=action, source=source)
    if collect is not None or extra:
        action = Action(do="continue", collect=collect, **extra)
        return Rule(on=_gate(when, "ok"), when=when, then=action, source=source)
    return None
