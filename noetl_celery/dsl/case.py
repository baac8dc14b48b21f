"""The v2 `case:` form (Dec 2025): a list of `{when, then: {next | retry | collect}}` entries.

Decides: which case entries are routing (then.next -> arcs carrying the entry's `when`, mode
inclusive) and which are policy (then.retry / then.collect -> rules on the step's single task),
the outcome gate of a policy entry (a `call.error` condition gates on error, `call.done` on ok),
and that a `retry` with params/body/headers/url/args is the next page, not a retry after an
error. The `when` text is kept as written; the engine evaluates it with `event.name` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noetl_celery.dsl.legacy import legacy_arcs
from noetl_celery.dsl.plan import Action, Arc, Condition, OutcomeGate, Rule
from noetl_celery.dsl.policy import (
    BACKOFF_KEYS,
    NEXT_CALL_KEYS,
    collect_of,
    next_call_of,
    pagination_action,
    retry_action,
)
from noetl_celery.dsl.validate import Context, check_keys, condition, expect_list, expect_mapping, join
from noetl_celery.dsl.yaml_lines import LDict, line_of

CASE_ENTRY_KEYS = frozenset({"when", "then"})
CASE_THEN_KEYS = frozenset({"next", "retry", "collect"})
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
        if entry is None or not check_keys(ctx, entry, CASE_ENTRY_KEYS, entry_path):
            continue
        if "when" not in entry or "then" not in entry:
            ctx.problem(entry_line, entry_path, "a case entry needs when and then")
            continue
        when = condition(ctx, entry, "when", entry_path)
        then_path = join(entry_path, "then")
        then = expect_mapping(ctx, entry["then"], line_of(entry, "then"), then_path)
        if then is None or not check_keys(ctx, then, CASE_THEN_KEYS, then_path):
            continue
        if "next" in then:
            result.arcs.extend(_arcs(ctx, then, when, then_path))
        rule = _rule(ctx, then, when, then_path, entry_path)
        if rule is not None:
            result.rules.append(rule)
    if result.rules:
        result.rules.append(Rule(then=Action(do="stop"), source=path))
    return result


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


def _rule(ctx: Context, then: LDict, when: Condition, path: str, source: str) -> Rule | None:
    collect = collect_of(ctx, then, path)
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
            action = pagination_action(ctx, retry, next_call, collect, retry_path)
            return Rule(on=_gate(when, "ok"), when=when, then=action, source=source)
        if collect is not None:
            ctx.problem(
                line_of(then, "collect"),
                join(path, "collect"),
                "collect goes with a successful call, not a retry",
            )
        return Rule(
            on=_gate(when, "error"), when=when, then=retry_action(ctx, retry, retry_path), source=source
        )
    if collect is not None:
        return Rule(
            on=_gate(when, "ok"), when=when, then=Action(do="continue", collect=collect), source=source
        )
    return None
