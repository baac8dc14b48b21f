"""One attempt of one task on a worker: render, run the tool, run its sink, report the outcome.

The worker never decides what runs next: it returns the outcome for on_event. It reads the plan
and the execution state (cached per process) and writes nothing to the event store but a result
above NOETL_MAX_RESULT_BYTES, stored once by reference (store/blobs.py) before it is reported
(the outcome then carries the reference, never the value), and the rows a SQL cursor claim took
before it runs the first of them (cursor_claim.hold).

A cursor claim that says `run` goes on, in the same attempt, to the first claimed row's first
task (TaskMessage.claimed_row): the attempt then reports that row's outcome, not the claim's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Connection

from noetl_celery.config import credentials, limits, secret_registry
from noetl_celery.core.errors import CredentialError, TemplateError
from noetl_celery.core.jsonable import storable, to_jsonable, unstorable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.dsl.plan import Sink, Task
from noetl_celery.engine import deadlines
from noetl_celery.engine import identity as process_identity
from noetl_celery.engine.arc_args import merge_arc_args
from noetl_celery.engine.attempt import cursor_claim
from noetl_celery.engine.context import STATE, message_scope, render_context
from noetl_celery.engine.messages import BatchEvent, OutcomeEvent, TaskMessage
from noetl_celery.observe import log_format, metrics
from noetl_celery.store import blobs, clock, executions, leases, views
from noetl_celery.store.db import single_read, transaction
from noetl_celery.store.events import event_exists
from noetl_celery.templates.render import (
    HIDDEN_META,
    as_step_result,
    lenient,
    plain,
    reading,
    render_value,
    response_view,
    strict_rendering,
)
from noetl_celery.tools import settings as tool_settings
from noetl_celery.tools.base import SECRET_VALUES_META, Outcome, ToolCall, get_tool, refuse_unstorable, run_tool

CALL_OVERRIDES = ("params", "body", "payload", "json", "headers", "args", "data")  # merged by next_call
STORE_KEY_LENGTH = 12  # hex characters of the store URL's digest in ToolCall.store_key
INPUT_META = "input"  # Outcome.meta key of a failed attempt's rendered arguments
INPUT_VALUE_BYTES = 4096  # JSON bytes kept of each rendered argument of a failed attempt

log = logging.getLogger(__name__)


def apply_call(config: dict[str, Any], call: dict[str, Any]) -> dict[str, Any]:
    """A pagination `next_call` applied to a task's configuration (merged, or replaced for url)."""
    if not call:
        return config
    merged = dict(config)
    for key, value in call.items():
        target = "url" if key == "endpoint" else key
        if target in CALL_OVERRIDES and isinstance(value, dict) and isinstance(merged.get(target), dict):
            merged[target] = {**merged[target], **value}
        else:
            merged[target] = value
    return merged


def store_key(url: str | None) -> str | None:
    """A short stable name for the event store (execution ids are unique only within one store)."""
    return hashlib.sha1(url.encode()).hexdigest()[:STORE_KEY_LENGTH] if url else None


def _credential(auth: Any, context: dict[str, Any]) -> Any:
    if auth is None:
        return None
    return credentials.resolve(plain(render_value(auth, context)))


def _call(
    kind: str,
    config: dict[str, Any],
    auth: Any,
    context: dict[str, Any],
    execution_id: int,
    secrets: set[str],
    *,
    task: str | None = None,
    source_file: str | None = None,
    store: str | None = None,
    arc_args: dict[str, Any] | None = None,
    strict: bool = False,
    prerendered: dict[str, Any] | None = None,
) -> Outcome:
    """One tool call: render `config` (`prerendered`: fields already rendered, added as they are),
    resolve the credential, run the tool."""
    spec = get_tool(kind)
    raw = spec.raw_fields if spec else frozenset()
    if auth is None and spec is not None and "credential" in spec.fields and "credential" in config:
        config = dict(config)
        auth = config.pop("credential")  # `credential:` is an alias of `auth:`
    if auth is not None and spec is not None and spec.resolves_auth:
        config, auth = {**config, "auth": auth}, None
    try:
        with lenient(strict) as hidden:  # as NoETL renders a tool's fields: undefined is falsy
            fields = {**plain(render_value(config, context, raw_keys=raw)), **(prerendered or {})}
            rendered = merge_arc_args(kind, fields, arc_args or {})
        credential = _credential(auth, context)
    except TemplateError as exc:
        return Outcome.fail(ToolErrorKind.TEMPLATE, str(exc))
    except CredentialError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, str(exc))
    if credential is not None:
        secrets |= credentials.secret_values(credential)
        secret_registry.register(credential)
    if spec is not None:
        refused = tool_settings.check_rendered(spec, rendered)
        if refused is not None:
            return Outcome.fail(ToolErrorKind.INVALID_ARGS, refused)
    timeout = deadlines.timeout_of(kind, rendered)
    outcome = run_tool(
        ToolCall(
            kind=kind,
            config=rendered,
            credential=credential,
            context=context,
            execution_id=execution_id,
            timeout=timeout,
            task=task,
            source_file=source_file,
            store_key=store_key(store),
            cancelled=cancel_check(store, execution_id),
        )
    )
    found = set(outcome.meta.pop(SECRET_VALUES_META, None) or ())
    for value in found:  # values a tool read at run time (the secrets tool): masked from now on
        secret_registry.register(value)
    secrets |= found
    if outcome.status != "ok":
        outcome.meta[INPUT_META] = shown_input(rendered, raw, secrets)
    if hidden:
        outcome.meta[HIDDEN_META] = hidden
    return outcome


def cancel_check(url: str | None, execution_id: int) -> Callable[[], bool] | None:
    """What a long-running tool polls to learn that its execution has ended (cancelled, or failed
    by another branch): True once it no longer runs. A store that cannot be read says False."""
    if url is None:
        return None

    def cancelled() -> bool:
        try:
            return not still_running(url, execution_id)
        except Exception as exc:  # the store is out of reach: the tool goes on, its outcome waits for it
            log.warning("execution %s: cannot read whether it still runs: %s", execution_id, exc)
            return False

    return cancelled


def shown_input(rendered: dict[str, Any], raw: frozenset[str], secrets: set[str]) -> dict[str, Any]:
    """A failed attempt's rendered arguments as its event row keeps them: the fields the worker
    rendered (not the raw ones, such as python's `code`, which are the playbook's text), with
    secret-named keys, the credential's values and every configured secret masked (before the
    cap, so that a truncated preview cannot cut a secret in two), each capped at INPUT_VALUE_BYTES."""
    kept: Any = to_jsonable({k: v for k, v in rendered.items() if k not in raw})
    if secrets:
        kept = credentials.scrub(kept, secrets)
    masked = cast(dict[str, Any], views.mask(kept))
    return {k: limits.cap(v, INPUT_VALUE_BYTES) for k, v in masked.items()}


def _run_sink(
    sink: Sink,
    outcome: Outcome,
    context: dict[str, Any],
    execution_id: int,
    secrets: set[str],
    source_file: str | None = None,
    store: str | None = None,
    strict: bool = False,
) -> Outcome:
    # `this` is the legacy dialect's name for the result a sink writes
    result = as_step_result(outcome.data)
    scope = {**context, "result": result, "this": result, "response": response_view(outcome.data), "data": outcome.data}
    config, rendered_args = sink.config, None
    if isinstance(config.get("args"), dict):
        # NoETL binds `data` to the sink's rendered args: they render first (with `data` the
        # task's data), the other fields then see them as `data`
        try:
            with lenient(strict) as hidden:
                rendered_args = plain(render_value(config["args"], scope))
        except TemplateError as exc:
            return Outcome.fail(ToolErrorKind.TEMPLATE, str(exc))
        config = {key: value for key, value in config.items() if key != "args"}
        scope["data"] = rendered_args
    outcome = _call(
        sink.kind,
        config,
        sink.auth,
        scope,
        execution_id,
        secrets,
        source_file=source_file,
        store=store,
        strict=strict,
        prerendered={"args": rendered_args} if rendered_args is not None else None,
    )
    if rendered_args is not None and hidden:
        outcome.meta[HIDDEN_META] = [*hidden, *outcome.meta.get(HIDDEN_META, [])]
    return outcome


def bounded(body: dict[str, Any], url: str | None = None, execution_id: int | None = None) -> dict[str, Any]:
    """An outcome whose data, error and meta each fit NOETL_MAX_RESULT_BYTES: data above it is
    stored once by reference (with the store at `url`; see store/blobs.py), the others (and data
    above NOETL_MAX_STORED_BYTES) are replaced by a truncation marker."""
    limit = limits.max_result_bytes()
    capped = dict(body)
    if url is not None and execution_id is not None:
        capped["data"] = blobs.put_new(url, execution_id, body.get("data"), masked=True)
    else:
        capped["data"] = limits.cap(body.get("data"), limit)
    for key in ("error", "meta"):  # field by field: error.kind and meta.sink.status stay readable
        value = body.get(key)
        if isinstance(value, dict):
            capped[key] = {k: limits.cap(v, limit) for k, v in value.items()}
    return capped


def storable_outcome(kind: str, outcome: Outcome) -> dict[str, Any]:
    """The outcome as JSON data the event store accepts. A result holding what it refuses (NaN,
    Infinity, a NUL character, a lone surrogate, nesting past NOETL_MAX_RESULT_DEPTH) fails the
    attempt once, kind `invalid_result`, naming the value and its path: recorded as any failure,
    never taken for a store outage. In the engine's own fields (an error message, meta, an error
    response's body) such values are spelled out as text instead."""
    depth = limits.max_result_depth()
    if outcome.status == "ok":
        refused = refuse_unstorable(kind, outcome.data)
        if refused is not None:
            outcome = Outcome(status="error", error=refused.error, meta=outcome.meta)
    elif unstorable(outcome.data, depth) is not None:
        outcome = dataclasses.replace(outcome, data=None)  # a failure's data is not worth refusing it
    body = cast(dict[str, Any], to_jsonable(outcome.to_dict()))
    return {key: value if key == "data" else storable(value, depth) for key, value in body.items()}


def claimed_rows(outcome: Outcome, secrets: set[str]) -> list[Any] | None:
    """The rows a claim took as its outcome would report them (JSON data, secrets masked): what
    a row's message carries; None when it took none, failed, or took what cannot be stored."""
    if outcome.status != "ok" or not (outcome.data or {}).get("rows"):
        return None
    body = storable_outcome("claim", outcome)
    if body["status"] != "ok":
        return None
    if secrets:
        body = credentials.scrub(body, secrets)
    rows = secret_registry.mask(body)["data"]["rows"]
    return list(rows) if isinstance(rows, list) and rows else None


def already_done(url: str, message: TaskMessage) -> bool:
    key = message.outcome_key()
    with transaction(url) as conn:
        return event_exists(conn, message.execution_id, key)


def taken_late(url: str, message: TaskMessage, lease_seconds: float) -> bool:
    """This message waited in its broker's queue: its decision's lease (the one it answers or the
    one it shares) now runs from here (store/leases.py `taken`), and whether its attempt was
    recorded meanwhile. One statement on PostgreSQL."""
    with single_read(url) as conn:
        return leases.taken(
            conn, message.execution_id, message.lease or message.shares, message.outcome_key(), lease_seconds
        )


def still_wanted(url: str, message: TaskMessage) -> bool:
    """A delayed message that came due: False once its execution has ended, or when its attempt
    was recorded meanwhile (a replay of its decision ran it first). One transaction."""
    with transaction(url) as conn:
        return _running(conn, message.execution_id) and not event_exists(
            conn, message.execution_id, message.outcome_key()
        )


def still_running(url: str, execution_id: int) -> bool:
    """False once the execution has ended (completed, failed, cancelled) or is unknown."""
    with transaction(url) as conn:
        return _running(conn, execution_id)


def _running(conn: Connection, execution_id: int) -> bool:
    head = executions.execution_head(conn, execution_id)
    return head is not None and head["status"] == "running"


def execute(
    url: str, message: TaskMessage, *, queue_id: str | None = None, node: str | None = None
) -> dict[str, Any] | None:
    """Run one attempt; returns the on_event payload (None for a replay of a finished attempt, or
    a delayed message of an execution that ended, or of an attempt recorded, meanwhile: it is
    dropped).
    `node` is the Celery node name of the worker (the task request's hostname)."""
    if message.replay and already_done(url, message):
        return None
    if message.delayed and not still_wanted(url, message):
        return None
    return run_attempt(url, message, queue_id=queue_id, node=node)


def run_attempt(
    url: str, message: TaskMessage, *, queue_id: str | None = None, node: str | None = None
) -> dict[str, Any]:
    """Run one attempt, with no check of whether it should run; its on_event payload."""
    scope = log_format.attempt_scope(
        execution_id=str(message.execution_id),
        step=message.step,
        attempt=message.attempt,
        iteration=message.iteration,
        worker=node,
    )
    with scope, reading(blobs.url_reader(url)):  # templates read results stored by reference whole
        return _run_attempt(url, message, queue_id=queue_id, node=node)


def _run_attempt(url: str, message: TaskMessage, *, queue_id: str | None, node: str | None) -> dict[str, Any]:
    started = time.time()
    state = STATE.get(url, message.execution_id, min_version=message.version, seed=message.seed)
    step = state.plan.steps[message.step]
    task: Task = step.tasks[message.task_index]
    context = render_context(state, message_scope(message, step))
    secrets: set[str] = set()
    source_file = state.plan.source_file
    strict = strict_rendering(state.plan.strict_templates)
    if message.is_claim:
        kept = cursor_claim.held(url, step, message)
        outcome = Outcome.ok({"rows": kept}) if kept else cursor_claim.run_claim(step, message, context, secrets)
        rows = claimed_rows(outcome, secrets) if (message.slot or {}).get("run") else None
        if rows:  # the claim runs its first row's first task now: this attempt reports that row
            assert step.loop is not None
            if not kept:
                cursor_claim.hold(url, step, message, rows)
            message = message.claimed_row(rows, max(step.loop.max_in_flight, 1))
            context = render_context(state, message_scope(message, step))
    if message.is_claim:
        pass  # the claim's own outcome: its rows, none, or its error
    elif message.child is not None:  # a sub-playbook's outcome: only the task's sink is left to run
        outcome = Outcome(
            status=message.child["status"],
            data=message.child.get("data"),
            error=message.child.get("error"),
            meta=dict(message.child.get("meta") or {}),
        )
    else:
        outcome = _call(
            task.kind,
            apply_call(task.config, message.call),
            task.auth,
            context,
            message.execution_id,
            secrets,
            task=task.label,
            source_file=source_file,
            store=url,
            arc_args=message.args,
            strict=strict,
        )
    if outcome.status == "ok" and task.sink is not None and not message.is_claim:
        sink_outcome = _run_sink(task.sink, outcome, context, message.execution_id, secrets, source_file, url, strict)
        outcome.meta["sink"] = {
            "kind": task.sink.kind,
            "status": sink_outcome.status,
            "data": limits.cap(sink_outcome.data),
            "error": sink_outcome.error,
        }
        if sink_outcome.meta.get(HIDDEN_META):
            outcome.meta["sink"][HIDDEN_META] = sink_outcome.meta[HIDDEN_META]
        if sink_outcome.status != "ok":
            error = dict(sink_outcome.error or {})
            error["message"] = f"sink ({task.sink.kind}) failed: {error.get('message', '')}"
            error["kind"] = ToolErrorKind.SINK
            outcome = Outcome(
                status="error", data=outcome.data, error=error, http=outcome.http, pg=sink_outcome.pg, meta=outcome.meta
            )
    body = storable_outcome(task.kind, outcome)
    if secrets:  # masked before it is bounded: a value stored by reference is stored masked
        body = credentials.scrub(body, secrets)
    body = bounded(secret_registry.mask(body), url, message.execution_id)
    took = time.time() - started
    metrics.attempt_ended(task.kind, str(body.get("status")), took)
    report = {
        "queue_id": queue_id,
        **process_identity.identity(node),
        "started_at": datetime.fromtimestamp(started - clock.skew(), UTC).isoformat(),  # the store's clock
        "duration_ms": round(took * 1000, 3),
    }
    return OutcomeEvent(message.execution_id, message.to_wire(), body, report).to_dict()


def execute_batch(
    url: str, message: TaskMessage, *, queue_id: str | None = None, node: str | None = None
) -> dict[str, Any] | None:
    """Run a batch's iterations one after another (engine/decision/batching.py); returns one on_event
    payload with every outcome, in order (None for a replay of a batch already recorded: its
    outcomes are written in one transaction, so the first one tells)."""
    if message.replay and already_done(url, message):
        return None
    events = [run_attempt(url, member, queue_id=queue_id, node=node) for member in message.members()]
    return BatchEvent(message.execution_id, events).to_dict()
