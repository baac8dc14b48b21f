"""Every surface form of retry, pagination and admission -> ordered `Rule`s of one `Policy`.

Decides: what `retry: true`, `retry: 5`, the flat retry mapping, `on_error`/`on_success`,
a retry rule list, canonical `spec.policy.rules` and `spec.policy.admit` each mean as rules
(order, outcome gate, action, defaults). Conditions stay the template text as written: the
engine evaluates them. The v2 `case:` form is read by `case.py` with the helpers here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, get_args

from noetl_celery.dsl.plan import (
    DEFAULT_MAX_DELAY,
    DEFAULT_PAGINATION_MAX,
    DEFAULT_RETRY_ATTEMPTS,
    DEFAULT_RETRY_DELAY,
    Action,
    ActionKind,
    BackoffKind,
    Collect,
    CollectStrategy,
    Condition,
    OutcomeGate,
    Policy,
    Rule,
    Sink,
)
from noetl_celery.dsl.validate import (
    Context,
    assignments,
    boolean,
    build_sink,
    check_keys,
    condition,
    expect_list,
    expect_mapping,
    join,
    number,
    one_of,
    suggest,
)
from noetl_celery.dsl.yaml_lines import LDict, line_of, plain

ACTION_KINDS = frozenset(get_args(ActionKind))
BACKOFF_KINDS = frozenset(get_args(BackoffKind))
COLLECT_STRATEGIES = frozenset(get_args(CollectStrategy))
SET_SCOPES = {"ctx": "set_ctx", "iter": "set_iter", "vars": "set_vars"}  # `set: {ctx.x: ...}`

ACTION_KEYS = frozenset({"do", "attempts", "backoff", "delay", "max_delay", "jitter", "to", "set"}) | set(
    SET_SCOPES.values()
)
BACKOFF_KEYS = frozenset({"max_attempts", "initial_delay", "backoff_multiplier", "max_delay", "jitter", "backoff"})
# `retry_on` (a list of error names): accepted and, as in NoETL, not read: every error is retried
FLAT_RETRY_KEYS = BACKOFF_KEYS - {"backoff"} | {"retry_when", "stop_when", "retry_on"}
ON_ERROR_KEYS = BACKOFF_KEYS | {"when"}
ON_SUCCESS_KEYS = frozenset({"while", "max_attempts", "next_call", "collect", "merge_path", "per_iteration"})
NEXT_CALL_KEYS = frozenset({"params", "body", "headers", "url", "args"})
COLLECT_KEYS = frozenset({"strategy", "path", "into"})
RULE_LIST_THEN_KEYS = BACKOFF_KEYS | {"next_call", "collect", "merge_path"}


def _stop(source: str) -> Rule:
    return Rule(then=Action(do="stop"), source=source)


# ---------------------------------------------------------------------------------------------
# Canonical: spec.policy.rules


def task_policy(ctx: Context, value: Any, line: int | None, path: str) -> Policy | None:
    """A task's `spec.policy` (or `policy`): `{rules: [...]}`."""
    policy = expect_mapping(ctx, value, line, path)
    if policy is None:
        return None
    check_keys(ctx, policy, {"rules"}, path)
    if "rules" not in policy:
        ctx.missing(policy, line, path, "a policy needs rules: [...]")
        return None
    rules = expect_list(ctx, policy.get("rules"), line_of(policy, "rules"), join(path, "rules"))
    if rules is None:
        return None
    return Policy(rules=canonical_rules(ctx, rules, join(path, "rules")))


@dataclass
class _RuleParts:
    """One rule item read for its shape only: `when` (None for else) and where its `then` is."""

    when: Condition
    then: Any
    then_line: int | None
    then_path: str
    source: str


def _rule_parts(ctx: Context, rules: list[Any], path: str) -> Iterator[_RuleParts]:
    """`{when, then}` items and a last `{else: {then: {...}}}` (or `{else: {...}}`) item."""
    for index, raw in enumerate(rules):
        item_path, item_line = join(path, index), line_of(rules, index)
        item = expect_mapping(ctx, raw, item_line, item_path)
        if item is None:
            continue
        if "else" in item:
            if index != len(rules) - 1:
                ctx.problem(item_line, item_path, "an else rule must be the last rule")
            check_keys(ctx, item, {"else"}, item_path)
            else_path = join(item_path, "else")
            body = expect_mapping(ctx, item["else"], line_of(item, "else"), else_path)
            if body is None:
                continue
            if "then" in body:
                check_keys(ctx, body, {"then"}, else_path)
                yield _RuleParts(None, body["then"], line_of(body, "then"), join(else_path, "then"), item_path)
            else:
                yield _RuleParts(None, body, line_of(item, "else"), else_path, item_path)
            continue
        check_keys(ctx, item, {"when", "then"}, item_path)
        if "when" not in item or "then" not in item:
            ctx.missing(item, item_line, item_path, "a rule needs when and then (or else)")
            continue
        when = condition(ctx, item, "when", item_path)
        yield _RuleParts(when, item["then"], line_of(item, "then"), join(item_path, "then"), item_path)


def canonical_rules(ctx: Context, rules: list[Any], path: str) -> list[Rule]:
    return [
        Rule(
            when=part.when,
            then=canonical_action(ctx, part.then, part.then_line, part.then_path),
            source=part.source,
        )
        for part in _rule_parts(ctx, rules, path)
    ]


def canonical_action(ctx: Context, value: Any, line: int | None, path: str) -> Action:
    then = expect_mapping(ctx, value, line, path)
    if then is None:
        return Action()
    check_keys(ctx, then, ACTION_KEYS, path)
    do = then.get("do", "continue")
    if not one_of(do, ACTION_KINDS):
        ctx.problem(line_of(then, "do"), join(path, "do"), f"unknown action '{do}'{suggest(str(do), ACTION_KINDS)}")
        do = "continue"
    if (do == "jump") != ("to" in then):
        ctx.problem(line_of(then, "to" if "to" in then else "do"), path, "`to:` goes with `do: jump` (and only there)")
    attempts = number(ctx, then, "attempts", path, integer=True)
    if do == "retry" and attempts is None:
        attempts = DEFAULT_RETRY_ATTEMPTS
    sets = _sets(ctx, then, path)
    return Action(
        do=do,
        attempts=attempts,
        backoff=backoff_kind(ctx, then, path) or "none",
        delay=number(ctx, then, "delay", path) or 0.0,
        max_delay=number(ctx, then, "max_delay", path) or DEFAULT_MAX_DELAY,
        jitter=bool(boolean(ctx, then, "jitter", path)),
        to=then.get("to") if isinstance(then.get("to"), str) else None,
        **sets,
    )


def _sets(ctx: Context, then: LDict, path: str) -> dict[str, Any]:
    """`set_ctx`/`set_iter`/`set_vars` and the `set: {ctx.x: ..., iter.y: ...}` alias; a bare
    key (`set: {seen: ...}`) is a ctx variable, as NoETL reads it."""
    return assignments(ctx, then, path, SET_SCOPES, bare="ctx")


def with_task_sets(policy: Policy | None, sets: dict[str, dict[str, Any]], source: str) -> Policy:
    """A task's own `set:` as its policy writes it: on success. Each rule of the task's policy
    that continues on an ok outcome writes it too (its own assignments win), and a last rule
    continues every other ok outcome with it; without a policy, an error still fails the task."""
    sets = {block: values for block, values in sets.items() if values}
    rules: list[Rule] = []
    for rule in policy.rules if policy is not None else []:
        then = rule.then
        if rule.on != "error" and then.do == "continue":
            then = then.model_copy(update={block: {**values, **getattr(then, block)} for block, values in sets.items()})
        rules.append(rule.model_copy(update={"then": then}))
    then = Action(do="continue").model_copy(update=sets)
    rules.append(Rule(on="ok", then=then, source=source))
    if policy is None:
        rules.append(Rule(on="error", then=Action(do="fail"), source=source))
    return Policy(rules=rules)


def backoff_kind(ctx: Context, mapping: LDict, path: str) -> BackoffKind | None:
    value = mapping.get("backoff")
    if value is None:
        return None
    if not one_of(value, BACKOFF_KINDS):
        hint = suggest(str(value), BACKOFF_KINDS)
        ctx.problem(line_of(mapping, "backoff"), join(path, "backoff"), f"unknown backoff '{value}'{hint}")
        return None
    return "none" if value == "fixed" else value


# ---------------------------------------------------------------------------------------------
# Admission: spec.policy.admit and step-level `when`


def admit_rules(ctx: Context, value: Any, line: int | None, path: str) -> list[Rule]:
    """`admit: {mode?, rules: [{when, then: {allow}}, {else: {then: {allow}}}]}`."""
    admit = expect_mapping(ctx, value, line, path)
    if admit is None:
        return []
    check_keys(ctx, admit, {"mode", "rules"}, path)
    if admit.get("mode", "exclusive") != "exclusive":
        ctx.problem(line_of(admit, "mode"), join(path, "mode"), "admission is first-match: mode must be exclusive")
    rules = expect_list(ctx, admit.get("rules"), line_of(admit, "rules"), join(path, "rules")) or []
    result: list[Rule] = []
    for part in _rule_parts(ctx, rules, join(path, "rules")):
        then = expect_mapping(ctx, part.then, part.then_line, part.then_path)
        if then is None:
            continue
        check_keys(ctx, then, {"allow"}, part.then_path)
        allow = then.get("allow")
        if not isinstance(allow, bool):
            ctx.problem(line_of(then, "allow"), join(part.then_path, "allow"), f"must be true or false, not {allow!r}")
        action = Action(do="continue" if allow is True else "break")
        result.append(Rule(when=part.when, then=action, source=part.source))
    return result


def when_admit(when: Condition, source: str) -> list[Rule]:
    """A step-level `when:` admits the step when it holds and skips it otherwise."""
    return [
        Rule(when=when, then=Action(do="continue"), source=source),
        Rule(then=Action(do="break"), source=source),
    ]


# ---------------------------------------------------------------------------------------------
# Legacy retry forms


def legacy_retry(ctx: Context, value: Any, line: int | None, path: str) -> tuple[Policy | None, Sink | None]:
    """Any legacy `retry:` value -> (policy, per-iteration sink of on_success)."""
    if value is False or value is None:
        return None, None
    if value is True:
        retry = Action(do="retry", attempts=DEFAULT_RETRY_ATTEMPTS, delay=DEFAULT_RETRY_DELAY, backoff="exponential")
        return Policy(rules=[Rule(on="error", then=retry, source=path), _stop(path)]), None
    if isinstance(value, int):
        if value < 1:
            ctx.problem(line, path, f"retry attempts must be at least 1, not {value}")
            return None, None
        retry = Action(do="retry", attempts=value, delay=DEFAULT_RETRY_DELAY, backoff="exponential")
        return Policy(rules=[Rule(on="error", then=retry, source=path), _stop(path)]), None
    if isinstance(value, list):
        return Policy(rules=_rule_list(ctx, value, path)), None
    block = expect_mapping(ctx, value, line, path)
    if block is None:
        return None, None
    if "on_error" in block or "on_success" in block:
        return _blocks(ctx, block, path)
    return Policy(rules=_flat(ctx, block, path)), None


def _flat(ctx: Context, retry: LDict, path: str) -> list[Rule]:
    check_keys(ctx, retry, FLAT_RETRY_KEYS, path)
    rules: list[Rule] = []
    stop_when = condition(ctx, retry, "stop_when", path)
    if stop_when is not None:
        rules.append(Rule(when=stop_when, then=Action(do="stop"), source=join(path, "stop_when")))
    retry_when = condition(ctx, retry, "retry_when", path)
    gate: OutcomeGate = "any" if retry_when is not None else "error"
    rules.append(Rule(on=gate, when=retry_when, then=retry_action(ctx, retry, path), source=path))
    return [*rules, _stop(path)]


def retry_action(ctx: Context, mapping: LDict, path: str) -> Action:
    """max_attempts/initial_delay/backoff_multiplier/max_delay/jitter/backoff -> a retry Action."""
    multiplier = number(ctx, mapping, "backoff_multiplier", path)
    backoff = backoff_kind(ctx, mapping, path) or ("exponential" if multiplier else "none")
    delay = number(ctx, mapping, "initial_delay", path)
    return Action(
        do="retry",
        attempts=number(ctx, mapping, "max_attempts", path, integer=True) or DEFAULT_RETRY_ATTEMPTS,
        delay=DEFAULT_RETRY_DELAY if delay is None else delay,
        multiplier=multiplier,
        backoff=backoff,
        max_delay=number(ctx, mapping, "max_delay", path) or DEFAULT_MAX_DELAY,
        jitter=bool(boolean(ctx, mapping, "jitter", path)),
    )


def pagination_action(
    ctx: Context, mapping: LDict, next_call: dict[str, Any], collect: Collect | None, path: str
) -> Action:
    attempts = number(ctx, mapping, "max_attempts", path, integer=True) or DEFAULT_PAGINATION_MAX
    return Action(do="retry", next_call=next_call, attempts=attempts, collect=collect)


def next_call_of(ctx: Context, value: Any, line: int | None, path: str) -> dict[str, Any]:
    next_call = expect_mapping(ctx, value, line, path)
    if next_call is None:
        return {}
    check_keys(ctx, next_call, NEXT_CALL_KEYS, path)
    return {key: plain(item) for key, item in next_call.items() if key in NEXT_CALL_KEYS}


def collect_of(ctx: Context, mapping: LDict, path: str) -> Collect | None:
    """`collect: {strategy, path, into}` or `collect: append`, plus the legacy `merge_path`."""
    value, merge_path = mapping.get("collect"), mapping.get("merge_path")
    line, cpath = line_of(mapping, "collect"), join(path, "collect")
    if value is None and merge_path is None:
        return None
    fields: dict[str, Any] = {}
    if isinstance(value, str):
        fields["strategy"] = value
    elif value is not None:
        collect = expect_mapping(ctx, value, line, cpath) or LDict()
        check_keys(ctx, collect, COLLECT_KEYS, cpath)
        fields = {key: collect[key] for key in COLLECT_KEYS if collect.get(key) is not None}
    if merge_path is not None:
        if "path" in fields:
            ctx.problem(
                line_of(mapping, "merge_path"),
                join(path, "merge_path"),
                "give collect.path or merge_path, not both",
            )
        fields["path"] = merge_path
    strategy = fields.get("strategy", "append")
    if not one_of(strategy, COLLECT_STRATEGIES):
        ctx.problem(line, cpath, f"unknown collect strategy '{strategy}'{suggest(str(strategy), COLLECT_STRATEGIES)}")
        fields["strategy"] = "append"
    for key in ("path", "into"):
        if key in fields and not isinstance(fields[key], str):
            ctx.problem(line, join(cpath, key), f"must be a string, not {fields[key]!r}")
            fields.pop(key)
    return Collect(**fields)


def _blocks(ctx: Context, retry: LDict, path: str) -> tuple[Policy, Sink | None]:
    check_keys(ctx, retry, {"on_error", "on_success"}, path)
    rules: list[Rule] = []
    sink: Sink | None = None
    if "on_error" in retry:
        epath = join(path, "on_error")
        on_error = expect_mapping(ctx, retry["on_error"], line_of(retry, "on_error"), epath) or LDict()
        check_keys(ctx, on_error, ON_ERROR_KEYS, epath)
        when = condition(ctx, on_error, "when", epath)
        rules.append(Rule(on="error", when=when, then=retry_action(ctx, on_error, epath), source=epath))
    if "on_success" in retry:
        spath = join(path, "on_success")
        on_success = expect_mapping(ctx, retry["on_success"], line_of(retry, "on_success"), spath) or LDict()
        check_keys(ctx, on_success, ON_SUCCESS_KEYS, spath)
        if "while" not in on_success:
            ctx.problem(on_success.line, spath, "on_success needs while: (when to fetch the next page)")
        next_call = next_call_of(
            ctx,
            on_success.get("next_call", LDict()),
            line_of(on_success, "next_call"),
            join(spath, "next_call"),
        )
        collect = collect_of(ctx, on_success, spath)
        page = pagination_action(ctx, on_success, next_call, collect, spath)
        rules.append(Rule(on="ok", when=condition(ctx, on_success, "while", spath), then=page, source=spath))
        rules.append(Rule(on="ok", then=Action(do="continue", collect=collect), source=spath))
        sink = _per_iteration_sink(ctx, on_success, spath)
    return Policy(rules=[*rules, _stop(path)]), sink


def _per_iteration_sink(ctx: Context, on_success: LDict, path: str) -> Sink | None:
    if "per_iteration" not in on_success:
        return None
    ppath = join(path, "per_iteration")
    per_iteration = expect_mapping(ctx, on_success["per_iteration"], line_of(on_success, "per_iteration"), ppath)
    if per_iteration is None:
        return None
    check_keys(ctx, per_iteration, {"sink"}, ppath)
    if "sink" not in per_iteration:
        ctx.missing(per_iteration, line_of(on_success, "per_iteration"), ppath, "per_iteration needs sink: {...}")
        return None
    return build_sink(ctx, per_iteration["sink"], line_of(per_iteration, "sink"), join(ppath, "sink"))


def _rule_list(ctx: Context, items: list[Any], path: str) -> list[Rule]:
    """`retry: [{when, then: {...}}]`: pagination rules (next_call) gate on ok, the rest retry."""
    rules: list[Rule] = []
    last_collect: Collect | None = None
    for index, raw in enumerate(items):
        item_path, item_line = join(path, index), line_of(items, index)
        item = expect_mapping(ctx, raw, item_line, item_path)
        if item is None:
            continue
        check_keys(ctx, item, {"when", "then"}, item_path)
        if "then" not in item:
            ctx.missing(item, item_line, item_path, "a retry rule needs then: {...}")
            continue
        tpath = join(item_path, "then")
        then = expect_mapping(ctx, item.get("then"), line_of(item, "then"), tpath)
        if then is None:
            continue
        check_keys(ctx, then, RULE_LIST_THEN_KEYS, tpath)
        when = condition(ctx, item, "when", item_path)
        collect = collect_of(ctx, then, tpath)
        if "next_call" in then:
            next_call = next_call_of(ctx, then["next_call"], line_of(then, "next_call"), join(tpath, "next_call"))
            action = pagination_action(ctx, then, next_call, collect, tpath)
            rules.append(Rule(on="ok", when=when, then=action, source=item_path))
            last_collect = collect or last_collect
        elif collect is not None and not (BACKOFF_KEYS & then.keys()):
            rules.append(Rule(on="ok", when=when, then=Action(do="continue", collect=collect), source=item_path))
        else:
            rules.append(Rule(on="any", when=when, then=retry_action(ctx, then, tpath), source=item_path))
    if last_collect is not None:
        rules.append(Rule(on="ok", then=Action(do="continue", collect=last_collect), source=path))
    return [*rules, _stop(path)]
