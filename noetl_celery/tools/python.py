"""The `python` tool: run a playbook's inline Python code and return what it produced.

Two styles, both found in real playbooks:

* `def main(...)` / `async def main(...)`: after the code ran, a callable global `main` is
  called with keyword arguments from `args` (alias `input`). A parameter named `context` that
  `args` does not provide receives the render context (legacy loops read
  `context.get('item')`); a parameter named `input_data` that `args` does not provide receives
  the whole args dict; any other parameter `args` does not provide is filled from the render
  context by its name, as NoETL does (inside a loop `main(num)` receives the element `num`, a
  workload key or a step's result by its name); `**kwargs` receives the remaining args; args main
  does not declare are ignored. The value returned (awaited if a coroutine) is the outcome's data.
* script style (no `main`): the code runs with every arg bound as a global, plus
  `input_data` (the args dict) and `context` (the render context); the outcome's data is the
  global `result` afterwards (None when unset). Top-level `await` is allowed. A top-level
  `return value` (NoETL runs such code as a function body) ends the code: the value is the data.

`libs:` ({alias: module}, {alias: {from: module, import: name}}, or a list NoETL ignores: see
import_libs) binds imported names in the code's namespace; `script:`
(see tools/script.py) gives the code from an inline source, a file or a URL instead of `code:`.

The data is returned unchanged (a `{status, data}` dict is NOT unwrapped), made
JSON-serialisable by `to_jsonable`. What the code writes to stdout and stderr is captured into
`Outcome.meta["stdout"]` / `["stderr"]` (truncated; it never reaches the worker's own streams),
and the logging records it emits (at the level its loggers let through) into `meta["log"]` (the
first LOG_RECORDS_LIMIT lines; they still reach the worker's log). Compiled code is cached per
source text.

The code runs with the credential variables (NOETL_AUTH_*, NOETL_CREDENTIALS_FILE) and the
store/broker URLs sealed out of os.environ (secret_registry.seal_environment); whatever it
returns, prints or raises is masked by the worker, and what it (or a subprocess it starts) writes
to file descriptors 1 and 2 directly is masked on its way to the worker's log (fd_masking.py).

This module does not sandbox the code (playbook authors are trusted, as in NoETL), does not
enforce the timeout (Celery's time limits do: their exception is let through, never reported as
the code's own) and does no I/O of its own. The SystemExit with which billiard ends a pool
process on SIGTERM is let through too: the attempt was interrupted, it did not fail.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import concurrent.futures
import contextlib
import hashlib
import importlib
import inspect
import io
import linecache
import logging
import re
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from types import CodeType, TracebackType
from typing import Any

from pydantic import Field

from noetl_celery.config import secret_registry
from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.observe.fd_masking import masking_file_descriptors
from noetl_celery.templates.render import Deferred, materialise
from noetl_celery.tools import script as scripts
from noetl_celery.tools.base import ERROR_TEXT_LIMIT, Outcome, ToolCall, refuse_unstorable, register
from noetl_celery.tools.pool import SoftTimeLimitExceeded, pool_terminating
from noetl_celery.tools.settings import ToolSettings

__all__ = ["run_python", "to_jsonable"]

STDOUT_LIMIT = 4000  # characters of captured print() output kept in Outcome.meta["stdout"]
STDERR_LIMIT = 4000  # characters of captured stderr output kept in Outcome.meta["stderr"]
LOG_RECORDS_LIMIT = 100  # logging records kept in Outcome.meta["log"] (the first ones)
LOG_RECORD_CHARS = 1000  # characters of one record's line
LIBS_IGNORED_NOTE = "INFO libs: not imported (a list of libs is ignored, as in NoETL): "


class _ThreadStream(io.TextIOBase):
    """Installed once as sys.stdout (and once as sys.stderr): a thread that is capturing writes to
    its own buffer, every other thread to the stream that was there before.
    (contextlib.redirect_stdout swaps the process-wide sys.stdout, which concurrent tasks on a
    thread pool restore out of order.)"""

    def __init__(self, real: Any):
        super().__init__()
        self.real = real
        self.local = threading.local()

    def _target(self) -> Any:
        return getattr(self.local, "buffer", None) or self.real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _ThreadLogHandler(logging.Handler):
    """Installed once on the root logger: the records a capturing thread emits (at the level its
    loggers let through) are kept, as `LEVEL logger: message` lines, in that thread's list. The
    other handlers (the worker's log) still get them."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.local = threading.local()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        records = getattr(self.local, "records", None)
        if records is None:
            return
        if len(records) >= LOG_RECORDS_LIMIT:
            self.local.dropped = getattr(self.local, "dropped", 0) + 1
            return
        try:
            records.append(self.format(record)[:LOG_RECORD_CHARS])
        except Exception:  # a record whose message cannot be formatted: as logging itself does
            self.handleError(record)


_install_lock = threading.Lock()
_log_handler = _ThreadLogHandler()


def _stream(name: str) -> _ThreadStream:
    with _install_lock:
        current = getattr(sys, name)
        if not isinstance(current, _ThreadStream):
            current = _ThreadStream(current)
            setattr(sys, name, current)
        return current


@contextlib.contextmanager
def _capture_stream(name: str, buffer: io.StringIO) -> Iterator[None]:
    proxy = _stream(name)
    previous = getattr(proxy.local, "buffer", None)
    proxy.local.buffer = buffer
    try:
        yield
    finally:
        proxy.local.buffer = previous


@dataclass
class Captured:
    """What one run of the code wrote: stdout, stderr and its logging records."""

    stdout: io.StringIO = field(default_factory=io.StringIO)
    stderr: io.StringIO = field(default_factory=io.StringIO)
    log: list[str] = field(default_factory=list)
    log_dropped: int = 0

    def into(self, meta: dict[str, Any]) -> None:
        """Into an outcome's meta: `stdout`, `stderr` (bounded text) and `log` (a list of lines)."""
        if printed := self.stdout.getvalue():
            meta["stdout"] = printed[:STDOUT_LIMIT]
        if errors := self.stderr.getvalue():
            meta["stderr"] = errors[:STDERR_LIMIT]
        if self.log:
            more = [f"... {self.log_dropped} more records not kept"] if self.log_dropped else []
            meta["log"] = self.log + more


@contextlib.contextmanager
def capture_output(captured: Captured) -> Iterator[None]:
    """This thread's stdout, stderr and logging records go to `captured` while the block runs
    (they no longer reach the worker's own stdout/stderr; log records still reach its log)."""
    with _install_lock:
        root = logging.getLogger()
        if _log_handler not in root.handlers:
            root.addHandler(_log_handler)
    previous_records = getattr(_log_handler.local, "records", None)
    previous_dropped = getattr(_log_handler.local, "dropped", 0)
    _log_handler.local.records, _log_handler.local.dropped = captured.log, 0
    try:
        with _capture_stream("stdout", captured.stdout), _capture_stream("stderr", captured.stderr):
            yield
    finally:
        captured.log_dropped = _log_handler.local.dropped
        _log_handler.local.records, _log_handler.local.dropped = previous_records, previous_dropped


class _ScriptReturn(BaseException):  # noqa: N818 - control flow, not an error; BaseException so `except Exception` in user code lets it through
    """Raised by a top-level `return value` of script-style code: the value is the data."""

    def __init__(self, value: Any):
        super().__init__()
        self.value = value


class _TopLevelReturns(ast.NodeTransformer):
    """`return x` outside any function -> `raise __noetl_return__(x)` (NoETL runs such code as a
    function body). Function, class and lambda bodies are left alone."""

    found = False

    def visit_Return(self, node: ast.Return) -> ast.AST:  # noqa: N802 - ast visitor name
        self.found = True
        call = ast.Call(ast.Name(RETURN_NAME, ast.Load()), [node.value or ast.Constant(None)], [])
        return ast.copy_location(ast.Raise(exc=call, cause=None), node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:  # noqa: N802
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:  # noqa: N802
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:  # noqa: N802
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:  # noqa: N802
        return node


RETURN_NAME = "__noetl_return__"


@lru_cache(maxsize=256)
def _compile(code: str) -> tuple[CodeType, str]:
    """Compile `code` once per distinct source; returns (code object, its pseudo file name)."""
    filename = f"<playbook code {hashlib.sha1(code.encode()).hexdigest()[:10]}>"
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        compiled = compile(code, filename, "exec", flags=flags, dont_inherit=True)
    except SyntaxError as exc:
        if "'return' outside function" not in str(exc.msg):
            raise
        tree = ast.parse(code, filename)
        tree = ast.fix_missing_locations(_TopLevelReturns().visit(tree))
        compiled = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
    # Let tracebacks show the source lines of the user's code.
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    return compiled, filename


def _run_coroutine(awaitable: Any) -> Any:
    """Run a coroutine to completion, also when this thread already runs an event loop."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None:
        return asyncio.run(awaitable)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, awaitable).result()


@lru_cache(maxsize=256)
def _names_context(code: CodeType) -> bool:
    """Whether the code names `context` anywhere (its body, a function's parameter or body)."""
    found = "context" in code.co_names or "context" in code.co_varnames
    return found or any(_names_context(c) for c in code.co_consts if isinstance(c, CodeType))


def _as_read(context: dict[str, Any]) -> dict[str, Any]:
    """The render context as the code reads it: a long list result the render context holds
    wrapped only when used (templates.render.Deferred) is its step result view, as every other
    result is. A value stored by reference stays a placeholder (read by name: `_call_main`)."""
    if not any(type(v) is Deferred for v in context.values()):
        return context
    return {k: v.resolve() if type(v) is Deferred else v for k, v in context.items()}


def _call_main(main: Any, args: dict[str, Any], context: dict[str, Any]) -> Any:
    """Call main with the arguments its signature asks for; _MissingArguments names missing ones."""
    sig = inspect.signature(main)
    positional: list[Any] = []
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    takes_var_kw = False
    for name, param in sig.parameters.items():
        if param.kind is param.VAR_POSITIONAL:
            continue
        if param.kind is param.VAR_KEYWORD:
            takes_var_kw = True
            continue
        if name in args:
            value = args[name]
        elif name == "context":
            value = context
        elif name == "input_data":
            value = args
        elif name in context:
            value = materialise(context[name])  # a placeholder of the render context: its value
        elif param.default is not param.empty:
            continue
        else:
            missing.append(name)
            continue
        if param.kind is param.POSITIONAL_ONLY:
            positional.append(value)
        else:
            kwargs[name] = value
    if missing:
        raise _MissingArguments(missing, sorted(args))
    if takes_var_kw:
        for name, value in args.items():
            kwargs.setdefault(name, value)
    value = main(*positional, **kwargs)
    if inspect.isawaitable(value):
        value = _run_coroutine(value)
    return value


class _MissingArguments(Exception):
    def __init__(self, missing: list[str], given: list[str]):
        self.missing, self.given = missing, given
        super().__init__(
            f"main() is missing required argument(s) {', '.join(missing)}; "
            f"args given: {', '.join(given) if given else '(none)'}"
        )


def _user_traceback(exc: BaseException, filename: str) -> tuple[str, int | None]:
    """The traceback text starting at the user's code, and the line of the last user frame."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    frames = traceback.extract_tb(tb if tb is not None else exc.__traceback__)
    user_lines = [f.lineno for f in frames if f.filename == filename]
    text = "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__))
    return text.replace(filename, "<code>"), (user_lines[-1] if user_lines else None)


class LibImport(ToolSettings):
    """`{Name: {from: module, import: Name}}`: `from module import Name as <alias>`."""

    from_: str = Field(alias="from")
    import_: str = Field(alias="import")


VARS_CACHE_MODULE = "noetl.worker.vars_cache"
VARS_CACHE_REFUSAL = (
    f"{VARS_CACHE_MODULE} (NoETL's internal variable cache) is not available in this engine: "
    "set variables with the step's `vars:` (or `set: {vars.x: ...}`) and read them as {{ vars.x }}"
)
_IMPORTS_VARS_CACHE = re.compile(r"\bnoetl\.worker\.vars_cache\b")


class PythonSettings(ToolSettings):
    code: str | None = None
    script: scripts.Script | None = None
    args: dict[str, Any] | None = None
    input: dict[str, Any] | None = None
    libs: dict[str, str | LibImport] | list[Any] | None = None


def noetl_module_refusal(exc: ImportError, code: str) -> str | None:
    """The message for code that failed importing one of NoETL's own modules (`noetl.*`), None
    otherwise (a playbook importing `noetl.worker.vars_cache` validates, as it does in NoETL, and
    is refused here when the import runs)."""
    name = exc.name or ""
    if name in ("noetl", "noetl.worker", VARS_CACHE_MODULE) and _IMPORTS_VARS_CACHE.search(code):
        return VARS_CACHE_REFUSAL
    if name == "noetl" or name.startswith("noetl."):
        return f"{name} is a module of NoETL itself, which this engine does not provide"
    return None


def import_libs(libs: Any) -> tuple[dict[str, Any], list[str]]:
    """`libs:` as names bound in the code's namespace, and the list entries left unimported.

    A mapping is read as NoETL reads it: `{np: numpy}` binds `np` to the module (`import numpy as
    np`), `{Decimal: {from: decimal, import: Decimal}}` binds `Decimal` (`from decimal import
    Decimal`); ImportError names the module that failed. A list is what NoETL ignores (its
    entries are often pip names such as `psycopg2-binary`): an entry that imports as a module
    is bound by its top name (`[os.path]` binds `os`, as `import os.path` does), any other entry
    is left alone and returned, never an error.
    """
    bound: dict[str, Any] = {}
    ignored: list[str] = []
    if isinstance(libs, dict):
        for alias, target in libs.items():
            if isinstance(target, dict):
                bound[str(alias)] = _import_from(str(target.get("from")), str(target.get("import")))
            else:
                bound[str(alias)] = importlib.import_module(str(target))
        return bound, ignored
    for entry in libs or ():
        name = str(entry)
        if not _MODULE_NAME.fullmatch(name):
            ignored.append(name)
            continue
        try:
            importlib.import_module(name)
            top = name.split(".", 1)[0]
            bound[top] = importlib.import_module(top)
        except ImportError:
            ignored.append(name)
    return bound, ignored


_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _import_from(module: str, name: str) -> Any:
    """`from module import name`: an attribute of the module, else its submodule `module.name`."""
    imported = importlib.import_module(module)
    try:
        return getattr(imported, name)
    except AttributeError:
        try:
            return importlib.import_module(f"{module}.{name}")
        except ImportError:
            raise ImportError(f"cannot import name '{name}' from '{module}'", name=f"{module}.{name}") from None


@register(
    "python",
    fields={"code", "args", "input", "libs", "script"},
    required=({"code", "script"},),
    raw_fields={"code"},
    settings=PythonSettings,
)
@masking_file_descriptors  # what the code writes to fd 1/2 itself (os.write, subprocesses) is masked
def run_python(call: ToolCall) -> Outcome:
    """Run the call's code (see the module docstring) and return its value as the data."""
    code = call.config.get("code")
    if code is None and call.config.get("script") is not None:
        try:
            code = scripts.load(call.config["script"], call.source_file)
        except scripts.ScriptError as exc:
            return Outcome.fail(ToolErrorKind.SCRIPT, f"python: {exc}")
    if not isinstance(code, str) or not code.strip():
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "python: `code` must be a non-empty string")
    secret_registry.seal_environment()  # neither the code nor its libs read NOETL_AUTH_* or the store's URL
    try:
        libs, libs_ignored = import_libs(call.config.get("libs"))
    except ImportError as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"python: libs: cannot import {exc.name or exc}: {exc}")
    raw_args = call.config.get("args")
    if raw_args is None:
        raw_args = call.config.get("input")
    if raw_args is None:
        raw_args = {}
    if not isinstance(raw_args, dict):
        return Outcome.fail(
            ToolErrorKind.INVALID_ARGS, f"python: `args` must be a mapping, got {type(raw_args).__name__}"
        )
    args: dict[str, Any] = dict(raw_args)
    context = call.context if call.context is not None else {}

    try:
        compiled, filename = _compile(code)
        if _names_context(compiled):
            context = _as_read(context)
    except SyntaxError as exc:
        return Outcome.fail(ToolErrorKind.EXCEPTION, f"SyntaxError: {exc.msg} (line {exc.lineno} of the code)")

    namespace: dict[str, Any] = {
        "__name__": "__noetl_code__",
        "__builtins__": builtins,
        RETURN_NAME: _ScriptReturn,
        "input_data": args,
        "context": context,
        **libs,
        **args,
    }
    captured = Captured()
    try:
        with capture_output(captured):
            try:
                pending = eval(compiled, namespace)  # noqa: S307 - running the playbook's code is the job
                if inspect.isawaitable(pending):  # top-level await
                    _run_coroutine(pending)
            except _ScriptReturn as returned:
                data = returned.value
            else:
                main = namespace.get("main")
                if callable(main):
                    data = _call_main(main, args, context)
                else:
                    data = namespace.get("result")
    except _MissingArguments as exc:
        outcome = Outcome.fail(ToolErrorKind.INVALID_ARGS, f"python: {exc}", missing=exc.missing)
    except SoftTimeLimitExceeded:
        raise  # the attempt's time limit: run_tool reports it as a timeout
    except (Exception, SystemExit) as exc:  # sys.exit() in user code must not stop the worker
        if pool_terminating():
            # the pool process is being ended (billiard's SIGTERM handler raised SystemExit, or
            # the code's cleanup failed while it unwound): not the code's error. Let it through:
            # the attempt ends as interrupted (engine/transport/worker_loss.py) and is delivered again.
            raise
        text, line = _user_traceback(exc, filename)
        where = f" (line {line} of the code)" if line is not None else ""
        refused = noetl_module_refusal(exc, code) if isinstance(exc, ImportError) else None
        outcome = Outcome.fail(
            ToolErrorKind.EXCEPTION,
            f"python: {refused}{where}" if refused else f"{type(exc).__name__}: {exc}{where}",
            traceback=text[-ERROR_TEXT_LIMIT:],
            line=line,
        )
    else:  # checked first: to_jsonable recurses, and the store refuses NaN, NUL, lone surrogates
        outcome = refuse_unstorable("python", data) or Outcome.ok(to_jsonable(data))
    if libs_ignored:  # NoETL ignores a list of libs: these entries were not imported (a line of meta.log)
        captured.log.insert(0, f"{LIBS_IGNORED_NOTE}{', '.join(libs_ignored)}"[:LOG_RECORD_CHARS])
    captured.into(outcome.meta)
    return outcome
