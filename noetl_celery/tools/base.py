"""The contract between the engine and a tool: a rendered call in, an Outcome out.

A tool knows nothing of Celery, the engine or the event store. It gets its configuration already
rendered (except the fields it declares raw, such as python's `code`), the resolved credential,
and the render context; it returns an Outcome and never raises for a failure of the work itself
(a raised exception is turned into an error Outcome by `run_tool`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Literal

from pydantic import BaseModel

from noetl_celery.config import limits, settings
from noetl_celery.core.jsonable import unstorable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.pool import SoftTimeLimitExceeded  # raised by the worker pool's time limit

ERROR_TEXT_LIMIT = 4000  # characters of an error message or traceback kept in an outcome
# Outcome.meta key under which a tool hands the worker secret values it read (the secrets tool):
# the worker removes the key and masks those values in everything the outcome writes.
SECRET_VALUES_META = "secret_values"


@dataclass
class ToolCall:
    """Everything a tool may use to do one call."""

    kind: str
    config: dict[str, Any]  # rendered fields (raw fields as written in the playbook)
    credential: Any = None  # resolved `auth` (a dict or a DSN string); never logged or returned
    context: dict[str, Any] = field(default_factory=dict)  # the render context (read-only)
    execution_id: int | None = None
    timeout: float | None = None  # seconds
    task: str | None = None  # the task's label (the secrets tool reads the secret's name from it)
    source_file: str | None = None  # the playbook file (scripts with a relative `file` source)
    store_key: str | None = None  # names the event store: with execution_id, unique to the execution
    # True once the execution has ended (cancelled): a long-running tool (shell) polls it and stops
    cancelled: Callable[[], bool] | None = None


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
    settings: a pydantic model of the tool's settings (see tools/settings.py): literal values are
              checked against it at validate, rendered values in the worker. None: free-form.
    resolves_auth: `auth:` is the tool's own (duckdb: aliases -> credentials): the worker renders
              it into config["auth"] instead of resolving one credential.
    extra: the optional extra of the package that installs what the tool imports
           (`pip install 'noetl_celery[<extra>]'`); modules: the modules it imports when it runs.
           A kind whose modules are missing is refused at validate, naming the extra.
    """

    kind: str
    run: Callable[[ToolCall], Outcome]
    fields: frozenset[str]
    required: tuple[frozenset[str], ...] = ()
    raw_fields: frozenset[str] = frozenset()
    routing_only: bool = False
    settings: type[BaseModel] | None = None
    resolves_auth: bool = False  # the worker renders `auth` into config["auth"]; the tool resolves it
    extra: str | None = None
    modules: tuple[str, ...] = ()

    def missing_extra(self) -> str | None:
        """Why this tool cannot run in this installation (a module of its extra is missing), or None."""
        return missing_extra(f"tool kind '{self.kind}'", self.extra, self.modules)


ENTRY_POINT_GROUP = "noetl_celery.tools"  # third-party tool modules; importing one registers its kinds
_BUILTIN_MODULES = (
    "noetl_celery.tools.event_log",
    "noetl_celery.tools.http",
    "noetl_celery.tools.noop",
    "noetl_celery.tools.postgres",
    "noetl_celery.tools.python",
    "noetl_celery.tools.duckdb",
    "noetl_celery.tools.ducklake",
    "noetl_celery.tools.mcp",
    "noetl_celery.tools.nats",
    "noetl_celery.tools.secrets",
    "noetl_celery.tools.playbook",
    "noetl_celery.tools.transfer",
    "noetl_celery.tools.buckets",
    "noetl_celery.tools.artifact",
    "noetl_celery.tools.shell",
    "noetl_celery.tools.snowflake",
)

_REGISTRY: dict[str, ToolSpec] = {}
_loaded = {"builtins": False, "plugins": False}
# held while the tool modules load: a thread that finds a load under way waits for it (a thread
# pool's first attempts would otherwise find the registry half filled: "no tool of kind ...")
_load_lock = threading.Lock()
_loading = threading.local()  # this thread is loading them (a module that asks for a tool as it loads)
_plugin_errors: dict[str, str] = {}  # entry point name -> why it could not be loaded

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
    settings: type[BaseModel] | None = None,
    resolves_auth: bool = False,
    extra: str | None = None,
    modules: tuple[str, ...] = (),
) -> Callable[[Callable[[ToolCall], Outcome]], Callable[[ToolCall], Outcome]]:
    """Decorator: register `run` as the implementation of tool `kind` (and its aliases).

    A kind already registered by another function is refused (ValueError): a third-party tool
    cannot hide a built-in one. Registering the same function again (a module imported twice)
    is harmless.
    """

    def decorate(run: Callable[[ToolCall], Outcome]) -> Callable[[ToolCall], Outcome]:
        spec = ToolSpec(
            kind=kind,
            run=run,
            fields=frozenset(fields) | COMMON_FIELDS,
            required=tuple(frozenset(r) for r in required),
            raw_fields=frozenset(raw_fields),
            routing_only=routing_only,
            settings=settings,
            resolves_auth=resolves_auth,
            extra=extra,
            modules=tuple(modules),
        )
        for name in (kind, *aliases):
            existing = _REGISTRY.get(name)
            if existing is not None and _identity(existing.run) != _identity(run):
                raise ValueError(
                    f"tool kind {name!r} is already registered by {_identity(existing.run)}; choose another kind name"
                )
        for name in (kind, *aliases):
            _REGISTRY[name] = spec
        return run

    return decorate


def _identity(run: Callable[..., Any]) -> str:
    return f"{getattr(run, '__module__', '?')}.{getattr(run, '__qualname__', repr(run))}"


def _load_once(part: str, load: Callable[[], None]) -> None:
    """Run `load` once per process for `part` ("builtins", "plugins"). A thread that comes while
    another loads waits for it; the flag is set once the load is through (an import that raised
    is tried again by the next call); a module that asks for a tool as it loads gets what is
    registered so far."""
    if _loaded[part] or getattr(_loading, "active", False):
        return
    with _load_lock:
        if _loaded[part]:
            return
        _loading.active = True
        try:
            load()
        finally:
            _loading.active = False
        _loaded[part] = True


def _load_builtin_tools() -> None:
    """Import the built-in tool modules (importing one registers its kinds). Idempotent."""

    def load() -> None:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)

    _load_once("builtins", load)


def _load_plugins() -> None:
    """Import the modules of the `noetl_celery.tools` entry points, once per process.

    A plugin that fails to import is skipped and remembered (see `plugin_errors`): a broken
    third-party package must not stop the built-in kinds from working.
    """

    def load() -> None:
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            try:
                entry.load()
            except Exception as exc:  # a broken plugin is reported, not fatal
                _plugin_errors[entry.name] = f"{type(exc).__name__}: {exc}"

    _load_once("plugins", load)


def _ensure_loaded() -> None:
    _load_builtin_tools()
    _load_plugins()


def plugin_errors() -> dict[str, str]:
    """Entry points of the `noetl_celery.tools` group that could not be loaded, and why."""
    _ensure_loaded()
    return dict(_plugin_errors)


@functools.cache  # an installation does not change under a running process; attempts ask per call
def module_installed(name: str) -> bool:
    """Whether `name` (dotted) can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken module spec
        return False


def missing_extra(what: str, extra: str | None, modules: tuple[str, ...]) -> str | None:
    """The one-line reason `what` (a tool or cursor kind, named) cannot run in this installation, or
    None when its modules are there."""
    missing = [name for name in modules if not module_installed(name)]
    if not missing:
        return None
    install = f"pip install 'noetl_celery[{extra}]'" if extra else f"pip install {' '.join(missing)}"
    return f"{what} needs {', '.join(missing)}, which is not installed: {install}"


def get_tool(kind: str) -> ToolSpec | None:
    _ensure_loaded()
    return _REGISTRY.get(kind)


def known_kinds() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def refuse_unstorable(kind: str, data: Any) -> Outcome | None:
    """An `invalid_result` failure (not retryable) when `data` holds what the event store cannot
    hold (jsonable.unstorable: NaN/Infinity, NUL, a lone surrogate, too deep), naming the value
    and its path; None when it can be stored."""
    problem = unstorable(data, limits.max_result_depth())
    if problem is None:
        return None
    return Outcome.fail(ToolErrorKind.INVALID_RESULT, f"{kind}: the result cannot be stored: {problem}")


def run_tool(call: ToolCall) -> Outcome:
    """Run one call; an exception escaping the tool becomes an error Outcome."""
    if call.kind in settings.disabled_tools():
        return Outcome.fail(ToolErrorKind.DISABLED, settings.disabled_tool_message(call.kind))
    spec = get_tool(call.kind)
    if spec is None:
        return Outcome.fail(
            ToolErrorKind.UNKNOWN_TOOL, f"no tool of kind {call.kind!r}; known: {', '.join(known_kinds())}"
        )
    missing = spec.missing_extra()
    if missing is not None:
        return Outcome.fail(ToolErrorKind.UNKNOWN_TOOL, missing)
    try:
        return spec.run(call)
    except SoftTimeLimitExceeded:
        limit = f" of {call.timeout:g} s" if call.timeout else ""
        return Outcome.fail(ToolErrorKind.TIMEOUT, f"{call.kind} call ran past its timeout{limit}", True)
    except Exception as exc:  # the tool's failure is the attempt's outcome, not a crash
        text = "".join(traceback.format_exception(exc))
        return Outcome.fail(ToolErrorKind.EXCEPTION, f"{type(exc).__name__}: {exc}", traceback=text[-ERROR_TEXT_LIMIT:])
