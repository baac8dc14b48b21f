"""The contract between the engine and a tool: a rendered call in, an Outcome out.

A tool knows nothing of Celery, the engine or the event store. It gets its configuration already
rendered (except the fields it declares raw, such as python's `code`), the resolved credential,
and the render context; it returns an Outcome and never raises for a failure of the work itself
(a raised exception is turned into an error Outcome by `run_tool`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

ERROR_TEXT_LIMIT = 4000  # characters of an error message or traceback kept in an outcome


@dataclass
class ToolCall:
    """Everything a tool may use to do one call."""

    kind: str
    config: dict[str, Any]  # rendered fields (raw fields as written in the playbook)
    credential: Any = None  # resolved `auth` (a dict or a DSN string); never logged or returned
    context: dict[str, Any] = field(default_factory=dict)  # the render context (read-only)
    execution_id: int | None = None
    timeout: float | None = None  # seconds


@dataclass
class Outcome:
    """The result of one attempt.

    status: "ok" or "error".
    data: the tool's result (python: the returned value; http: {status_code, headers, url,
          elapsed, data: body}; postgres: {rows, row_count, columns, statusmessage}).
    error: {"kind", "message", "retryable", "status"?, "code"?} when status is "error".
    http: {"status", "headers"} for http calls; pg: {"code"} (SQLSTATE) for postgres errors.
    """

    status: Literal["ok", "error"]
    data: Any = None
    error: dict[str, Any] | None = None
    http: dict[str, Any] | None = None
    pg: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def ok(cls, data: Any = None, **extra: Any) -> Outcome:
        return cls(status="ok", data=data, **extra)

    @classmethod
    def fail(cls, kind: str, message: str, retryable: bool = False, **error: Any) -> Outcome:
        extra = {k: error.pop(k) for k in ("data", "http", "pg") if k in error}
        body = {"kind": kind, "message": message[:ERROR_TEXT_LIMIT], "retryable": retryable, **error}
        return cls(status="error", error=body, **extra)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "data": self.data,
            "error": self.error,
            "http": self.http,
            "pg": self.pg,
            "meta": self.meta,
        }


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool kind.

    fields: the configuration keys the tool accepts (the validator rejects others, with a
            suggestion); required: groups of keys of which at least one must be present;
    raw_fields: keys that are never rendered as templates (code).
    routing_only: the kind does no work (noop, end, router); on_event runs it inline.
    """

    kind: str
    run: Callable[[ToolCall], Outcome]
    fields: frozenset[str]
    required: tuple[frozenset[str], ...] = ()
    raw_fields: frozenset[str] = frozenset()
    routing_only: bool = False


_REGISTRY: dict[str, ToolSpec] = {}

# Keys every task may carry whatever its kind (handled by the engine, not by the tool).
COMMON_FIELDS = frozenset({"kind", "auth", "spec", "policy", "desc", "timeout", "args", "input", "sink", "name"})


def register(
    kind: str,
    *,
    fields: set[str] | frozenset[str],
    required: tuple[set[str], ...] = (),
    raw_fields: set[str] | frozenset[str] = frozenset(),
    routing_only: bool = False,
    aliases: tuple[str, ...] = (),
) -> Callable[[Callable[[ToolCall], Outcome]], Callable[[ToolCall], Outcome]]:
    """Decorator: register `run` as the implementation of tool `kind` (and its aliases)."""

    def decorate(run: Callable[[ToolCall], Outcome]) -> Callable[[ToolCall], Outcome]:
        spec = ToolSpec(
            kind=kind,
            run=run,
            fields=frozenset(fields) | COMMON_FIELDS,
            required=tuple(frozenset(r) for r in required),
            raw_fields=frozenset(raw_fields),
            routing_only=routing_only,
        )
        for name in (kind, *aliases):
            _REGISTRY[name] = spec
        return run

    return decorate


def _load_builtin_tools() -> None:
    # Importing the modules registers them.
    from noetl_celery.tools import event_log, http, noop, postgres, python  # noqa: F401


def get_tool(kind: str) -> ToolSpec | None:
    if not _REGISTRY:
        _load_builtin_tools()
    return _REGISTRY.get(kind)


def known_kinds() -> list[str]:
    if not _REGISTRY:
        _load_builtin_tools()
    return sorted(_REGISTRY)


def run_tool(call: ToolCall) -> Outcome:
    """Run one call; an exception escaping the tool becomes an error Outcome."""
    spec = get_tool(call.kind)
    if spec is None:
        return Outcome.fail("unknown_tool", f"no tool of kind {call.kind!r}; known: {', '.join(known_kinds())}")
    try:
        return spec.run(call)
    except Exception as exc:  # the tool's failure is the attempt's outcome, not a crash
        text = "".join(traceback.format_exception(exc))
        return Outcome.fail("exception", f"{type(exc).__name__}: {exc}", traceback=text[-ERROR_TEXT_LIMIT:])
