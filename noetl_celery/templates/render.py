"""The one Jinja2 environment (sandboxed, strict) and how playbook values are rendered.

Rules:
- A string that is exactly one expression (`"{{ expr }}"`) renders to the expression's native
  value (a list stays a list, `{{ n + 1 }}` is an int); when that expression ends in `| tojson`
  the value is the structure itself (NoETL playbooks pass mappings as `{{ x | tojson }}`). Any
  other string renders to text.
- Undefined names are errors (strict), reported with the template text, unless the caller
  renders inside `lenient()` (tool args, sinks, `set`/`vars`, arcs; as NoETL renders them): there
  an undefined name or attribute is a falsy empty value (None as a whole value, "" in text), and
  each one used is noted in the list `lenient()` yields, so that the caller can record it.
- `a.b` on a mapping looks up the key first, so `iter.items` is the key `items`, never the dict
  method. A step's result also answers the legacy aliases `.result` and `.data` when it has no
  such key (legacy playbooks write `step.result.data.x` and `result.data.x` for the same value);
  so does a list or scalar result (`{{ step.result }}` of a step that returned a list is the list).
- Only playbook text is rendered. Values that come from data (HTTP bodies, rows, step results)
  are inserted as values and never rendered again.
- A value stored by reference (limits.reference: a result above NOETL_MAX_RESULT_BYTES, stored
  outside its row by store/blobs.py) is read whole when a template uses it: by name (the
  environment's context class), as an attribute or item, or held by a `Stored` placeholder that
  knows how to wrap it. The reading function is the caller's (`reading`); a reference itself is
  never rendered as if it were the value. A long list result is held by a `Deferred` placeholder
  the same way: wrapped in its step result view (a copy) only when a template uses it.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, cast

from jinja2 import TemplateAssertionError, TemplateSyntaxError, UndefinedError, pass_environment
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.nodes import Concat
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import SandboxedEnvironment, SandboxedFormatter
from markupsafe import Markup

from noetl_celery.config import limits, settings
from noetl_celery.core import sql_result
from noetl_celery.core.errors import TemplateError
from noetl_celery.core.jsonable import plain as plain  # re-exported: the engine renders, then makes plain
from noetl_celery.templates import budget as template_budget

TEMPLATE_MARKERS = ("{{", "{%")
# Names every template sees (engine/context.py render_context, engine/decision/policy_eval.py outcome_scope, the
# sink and routing scopes, Jinja's globals). A step of the same name would be hidden by them.
BUILTIN_NAMES = frozenset(
    {
        "workload",
        "ctx",
        "vars",
        "iter",
        "args",
        "execution_id",
        "parent_execution_id",
        "_prev",
        "_attempt",
        "job",
        "result",
        "response",
        "data",
        "outcome",
        "output",
        "error",
        "status_code",
        "success",
        "attempt",
        "event",
        "loop",
        "range",
        "lipsum",
        "dict",
        "cycler",
        "joiner",
        "namespace",
        "now",
        "loop_index",
        "this",
    }
)
_SINGLE_EXPRESSION = re.compile(r"^\s*\{\{(?P<expr>.*?)\}\}\s*$", re.DOTALL)
# a Go template action ({{.ID}}, {{ .Repository }}:{{.Tag}}, as docker, podman and kubectl take
# in --format) is no Jinja expression: it stays in the text as written, as NoETL's runtime leaves
# what it does not substitute
_GO_TEMPLATE_ACTION = re.compile(r"\{\{-?\s*\.[A-Za-z_][^{}]*\}\}")
_ENDS_IN_JSON = re.compile(r"\|\s*(tojson|to_json)\s*(\(\s*\))?\s*$")
LEGACY_ALIASES = ("result", "data")
# Filters that take a width or a count, and the positions of those arguments (the value is 0;
# a filter that receives the environment first counts it too).
BOUNDED_FILTERS = {"center": (1,), "indent": (1,), "wordwrap": (2,), "batch": (1,), "slice": (2,)}


# The notes of the `lenient()` block being rendered in (None: strict rendering).
_HIDDEN: ContextVar[list[str] | None] = ContextVar("noetl_lenient_notes", default=None)
HIDDEN_META = "template_warnings"  # the meta key of an event row: what its lenient renders hid
MAX_NOTES = 20  # hidden undefined names one lenient block keeps (the first ones)


@contextmanager
def lenient(strict: bool = False) -> Iterator[list[str]]:
    """Render leniently inside the block (unless `strict`): an undefined name or attribute is a
    falsy empty value instead of an error. Yields the list of what a render hid (each undefined
    name used, with its template), for the caller to record."""
    notes: list[str] = []
    if strict:
        yield notes
        return
    token = _HIDDEN.set(notes)
    try:
        yield notes
    finally:
        _HIDDEN.reset(token)


def lenient_active() -> bool:
    return _HIDDEN.get() is not None


def note(message: str) -> None:
    """Record `message` in the enclosing `lenient()` block's notes (kept once, at most MAX_NOTES)."""
    notes = _HIDDEN.get()
    if notes is not None and message not in notes and len(notes) < MAX_NOTES:
        notes.append(message)


def strict_rendering(playbook_strict: bool = False) -> bool:
    """Strict everywhere: the playbook asks for it (`executor.spec.strict_templates: true`) or
    the deployment does (NOETL_STRICT_TEMPLATES=1)."""
    return playbook_strict or settings.strict_templates()


class PlaybookUndefined(Undefined):
    """An undefined name or attribute: an error (as StrictUndefined), except inside `lenient()`,
    where it chains (`high.c` of an undefined `high`), reads as false, empty text, an empty
    sequence, and is noted when used. Comparisons and arithmetic still raise, as in NoETL."""

    __slots__ = ()

    def _hidden(self) -> bool:
        notes = _HIDDEN.get()
        if notes is None:
            return False
        message = self._undefined_message
        if message not in notes and len(notes) < MAX_NOTES:
            notes.append(message)
        return True

    def __getattr__(self, name: str) -> Any:
        if name[:2] == "__":
            raise AttributeError(name)
        if _HIDDEN.get() is not None:
            return self
        return self._fail_with_undefined_error()

    __getitem__ = __getattr__  # type: ignore[assignment]

    def __str__(self) -> str:
        return "" if self._hidden() else self._fail_with_undefined_error()

    def __bool__(self) -> bool:
        return False if self._hidden() else self._fail_with_undefined_error()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return iter(()) if self._hidden() else self._fail_with_undefined_error()

    def __len__(self) -> int:
        return 0 if self._hidden() else self._fail_with_undefined_error()

    def __contains__(self, item: Any) -> bool:
        return False if self._hidden() else self._fail_with_undefined_error()

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) if self._hidden() else self._fail_with_undefined_error()

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return id(type(self)) if _HIDDEN.get() is not None else self._fail_with_undefined_error()


class Lenient(dict):
    """A mapping whose missing keys read as None in templates (`outcome.error.kind` on success)."""


class StepResult(dict):
    """A mapping result of a step, with the legacy aliases and, for a pipeline, its task results."""

    __slots__ = ("task_results",)

    def __init__(self, value: Mapping[str, Any], task_results: Mapping[str, Any] | None = None):
        super().__init__(value)
        self.task_results = dict(task_results or {})

    def alias(self, name: str) -> Any:
        if name in LEGACY_ALIASES:
            return self
        if name == "results" and self.task_results:
            return self.task_results
        if name in self.task_results:
            return self.task_results[name]
        raise KeyError(name)


class TruncatedResult(StepResult):
    """A step result stored as its truncation marker (limits.cap): its own keys (`size`,
    `sha256`, `preview`) read as usual, but iterating it (`{% for %}`, `| list`, a loop's
    collection) is an error, not a walk over the marker's keys."""

    __slots__ = ()

    def __iter__(self) -> Any:
        _refuse_truncated(self, None)
        return super().__iter__()


class LoopResult(StepResult):
    """A loop step's result ({results: [...], stats: {...}}): the legacy aliases `.data` and
    `.result` answer the per-iteration results, as NoETL's aggregated iterator result does, and
    that list also answers `.results` and `.stats` (the seed design's `iterator_completed` data:
    `{{ step.data.results }}`)."""

    __slots__ = ()

    def alias(self, name: str) -> Any:
        if name in LEGACY_ALIASES:
            results = self.get("results")
            return IterationResults(results, self) if isinstance(results, list) else as_step_result(results)
        return super().alias(name)


class ResponseView(dict):
    """`response` in conditions: an HTTP result ({status_code, headers, url, elapsed, data}) whose
    missing keys read from the body. Legacy playbooks write `response.paging` (the body), v2 case
    playbooks `response.data.paging` (the result): both work."""

    __slots__ = ("body",)

    def __init__(self, result: Mapping[str, Any], body: Any):
        super().__init__(result)
        self.body = body

    def fallback(self, name: str) -> Any:
        if isinstance(self.body, Mapping) and name in self.body:
            return self.body[name]
        raise KeyError(name)


def response_view(data: Any) -> Any:
    """The `response` name for a tool result: a ResponseView for HTTP results, else the data."""
    if isinstance(data, Mapping) and "status_code" in data and "data" in data:
        return ResponseView(data, data["data"])
    return data


class _Aliased:
    """A list or scalar step result: `.result` and `.data` answer the value itself."""

    __slots__ = ()

    def alias(self, name: str) -> Any:
        if name in LEGACY_ALIASES:
            return self
        raise KeyError(name)


class StepList(_Aliased, list):  # type: ignore[type-arg]
    __slots__ = ()


class StepStr(_Aliased, str):
    __slots__ = ()


class StepInt(_Aliased, int):
    __slots__ = ()


class StepFloat(_Aliased, float):
    __slots__ = ()


class RowsResult(StepList):
    """A duckdb step's result as NoETL gives it: the list of row mappings of the last statement.
    The stored result's fields (`rows`, `row_count`, `columns`, `database`) and NoETL's numbered
    form (`command_0`, sql_result.both_forms) still answer by name, so `{{ step.rows }}` and
    `{{ step.command_0.rows }}` keep working."""

    __slots__ = ("fields",)

    def __init__(self, result: Mapping[str, Any]):
        super().__init__(result.get("rows") or [])
        self.fields = sql_result.both_forms(result)

    def alias(self, name: str) -> Any:
        if name in self.fields:
            return self.fields[name]
        return super().alias(name)


class IterationResults(StepList):
    """A loop step's per-iteration results (`step.data`): a list that also answers the loop
    result's own keys by name (`step.data.results`, `step.data.stats`)."""

    __slots__ = ("fields",)

    def __init__(self, results: list[Any], fields: Mapping[str, Any]):
        super().__init__(results)
        self.fields = dict(fields)

    def alias(self, name: str) -> Any:
        if name in self.fields:
            return as_step_result(self.fields[name])
        return super().alias(name)


def rows_result(value: Any) -> Any:
    """A duckdb step's stored result ({rows, row_count, columns, ...}) as a RowsResult; any other
    value (a failed or truncated result) as_step_result wraps it."""
    if isinstance(value, Mapping) and isinstance(value.get("rows"), list) and not value.get(limits.TRUNCATED):
        return RowsResult(value)
    return as_step_result(value)


_SCALAR_WRAPPERS: tuple[tuple[type, type], ...] = ((str, StepStr), (int, StepInt), (float, StepFloat))
for _base, _wrapper in ((list, StepList), (list, RowsResult), (list, IterationResults), *_SCALAR_WRAPPERS):
    _wrapper.__module__ = "builtins"  # error messages name the plain type: "'list object' has no ..."
    _wrapper.__name__ = _wrapper.__qualname__ = _base.__name__


def as_step_result(value: Any, task_results: Mapping[str, Any] | None = None) -> Any:
    """Wrap a step's result for the render context: a mapping, a list, a string or a number answers
    the legacy aliases (booleans and None are returned as they are)."""
    if isinstance(value, (StepResult, _Aliased, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        if value.get(limits.TRUNCATED) is True:
            return TruncatedResult(value, task_results)
        if sql_result.is_sql_result(value):  # a SQL result answers both NoETL forms
            return StepResult(sql_result.both_forms(value), task_results)
        return StepResult(value, task_results)
    if isinstance(value, list):
        return StepList(value)
    for base, wrapper in _SCALAR_WRAPPERS:
        if isinstance(value, base):
            return wrapper(value)
    return value


def _unwrap(value: Any) -> Any:
    """A wrapped list or scalar result back as its plain type."""
    if isinstance(value, StepList):
        return list(value)
    for base, wrapper in _SCALAR_WRAPPERS:
        if isinstance(value, wrapper):
            return base(value)
    return value


# How the render being made reads a value stored by reference (None: it cannot; see `reading`).
_READER: ContextVar[Callable[[Mapping[str, Any]], Any] | None] = ContextVar("noetl_stored_reader", default=None)


@contextmanager
def reading(reader: Callable[[Mapping[str, Any]], Any]) -> Iterator[None]:
    """Renders inside the block read values stored by reference with `reader` (a reference ->
    the whole value: store/blobs.py `reader` or `url_reader`)."""
    token = _READER.set(reader)
    try:
        yield
    finally:
        _READER.reset(token)


def read_stored(ref: Mapping[str, Any]) -> Any:
    """The whole value a reference stands for (a TemplateError when it cannot be read here)."""
    reader = _READER.get()
    if reader is None:
        raise TemplateError(
            f"a value of {ref.get('size')} bytes stored by reference cannot be read here (no store to read it from)"
        )
    try:
        return reader(ref)
    except LookupError as exc:
        raise TemplateError(str(exc)) from None


class Deferred:
    """A name whose value is wrapped (by `wrap`: a step result view) only when a template uses
    it: a long list result is not copied into its view by every render that never reads it."""

    __slots__ = ("value", "wrap")

    def __init__(self, value: Any, wrap: Callable[[Any], Any]):
        self.value = value
        self.wrap = wrap

    def resolve(self) -> Any:
        return self.wrap(self.value)

    def __repr__(self) -> str:
        return f"Deferred({type(self.value).__name__})"


class Stored(Deferred):
    """A name whose value is stored by reference, read (and wrapped by `wrap`: a step result
    view) only when a template uses it."""

    __slots__ = ()

    @property
    def ref(self) -> Mapping[str, Any]:
        return cast(Mapping[str, Any], self.value)

    def resolve(self) -> Any:
        return self.wrap(read_stored(self.ref))

    def __repr__(self) -> str:
        return f"Stored({self.ref.get('size')} bytes, sha256 {str(self.ref.get('sha256'))[:12]})"


def stored_or(value: Any, wrap: Callable[[Any], Any]) -> Any:
    """`wrap(value)`, or a `Stored` placeholder that wraps it once read when it is a reference."""
    if limits.is_reference(value):
        return Stored(value, wrap)
    return wrap(value)


def materialise(value: Any) -> Any:
    """A placeholder (`Deferred`, `Stored`) or a reference as the whole value it stands for (a
    reference in a step result view keeps that view's task results); any other value as it is."""
    if isinstance(value, Deferred):
        return value.resolve()
    if limits.is_reference(value):
        task_results = value.task_results if isinstance(value, StepResult) else None
        return as_step_result(read_stored(value), task_results)
    return value


class PlaybookContext(Context):
    """Jinja's context, reading a name whose value is stored by reference whole (`materialise`)."""

    def resolve_or_missing(self, key: str) -> Any:
        return materialise(super().resolve_or_missing(key))


def _refuse_truncated(obj: Mapping[str, Any], name: Any) -> None:
    """A clear error for reading into (or, `name` None, iterating) a value that was stored
    truncated (limits.cap)."""
    if obj.get(limits.TRUNCATED) is True:
        what = "iterate over it" if name is None else f"read {name!r}"
        raise TemplateError(
            f"cannot {what}: the value was truncated when stored ({obj.get('size')} bytes, limit "
            f"{obj.get('limit')} bytes, NOETL_MAX_RESULT_BYTES); move big data through a sink and pass a "
            "reference instead"
        )


def _guard_truncated(value: Any) -> Any:
    """A truncation marker found inside a value (an HTTP body, a field) answers as the result of
    a truncated step does: its fields read, iterating it is an error. A reference found there is
    read whole (`materialise`)."""
    if type(value) is dict and value.get(limits.TRUNCATED) is True:
        return TruncatedResult(value)
    if isinstance(value, Deferred) or (type(value) is dict and value.get(limits.STORED) is True):
        return materialise(value)
    return value


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to the environment's bounded concatenation (Jinja's own `str_join` is
    a plain function no sandbox hook sees)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:  # noqa: N802 - Jinja's visitor name
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class PlaybookEnvironment(SandboxedEnvironment):
    """Sandboxed, strict, key-first attribute lookup on mappings, within the template budget."""

    code_generator_class = _BoundedCodeGenerator
    context_class = PlaybookContext

    def bounded_concat(self, values: tuple[Any, ...]) -> str:
        pieces = [str(v) for v in values]
        template_budget.check_total("concatenating with ~", sum(len(p) for p in pieces))
        return "".join(pieces)

    intercepted_binops = frozenset({"**", "*", "%", "+", "//", "/"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        template_budget.check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(__obj, "__name__", None) in template_budget.WIDTH_METHODS and isinstance(
            getattr(__obj, "__self__", None), (str, bytes)
        ):
            for value in (*args, *kwargs.values()):
                template_budget.check_width(f"str.{__obj.__name__}", value)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None or not isinstance(getattr(value, "__self__", None), str):
            return wrapped
        text: str = value.__self__
        template_budget.check_format_widths(text)
        is_format_map = value.__name__ == "format_map"
        checker = _SpecChecker(self)

        def bounded(*args: Any, **kwargs: Any) -> Any:
            # a dry run fills in every field, nested widths (`{0:>{1}}`) included, and checks each
            # spec before the real call pads anything
            if not is_format_map:
                checker.vformat(text, args, kwargs)
            elif len(args) == 1 and not kwargs:
                checker.vformat(text, (), args[0])
            return wrapped(*args, **kwargs)

        return bounded

    def getattr(self, obj: Any, attribute: str) -> Any:
        obj = materialise(obj)
        if isinstance(obj, Mapping):
            if attribute in obj:
                return _guard_truncated(obj[attribute])
            _refuse_truncated(obj, attribute)
            if sql_result.is_sql_result(obj):  # one found inside a value (a loop's results)
                try:
                    return _guard_truncated(sql_result.alias(obj, attribute))
                except KeyError:
                    pass
            if isinstance(obj, StepResult):
                try:
                    return obj.alias(attribute)
                except KeyError:
                    pass
            if isinstance(obj, ResponseView):
                try:
                    return obj.fallback(attribute)
                except KeyError:
                    pass
            if isinstance(obj, Lenient):
                return None
            return self.undefined(obj=obj, name=attribute)
        if isinstance(obj, (RowsResult, IterationResults)) and attribute in obj.fields:
            return obj.alias(attribute)
        if isinstance(obj, _Aliased) and attribute in LEGACY_ALIASES:
            return obj
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        obj = materialise(obj)
        if isinstance(obj, (RowsResult, IterationResults)) and isinstance(argument, str) and argument in obj.fields:
            return obj.alias(argument)
        if isinstance(obj, _Aliased) and argument in LEGACY_ALIASES:
            return obj
        if isinstance(obj, Mapping) and argument not in obj:
            _refuse_truncated(obj, argument)
            if isinstance(argument, str) and sql_result.is_sql_result(obj):
                try:
                    return _guard_truncated(sql_result.alias(obj, argument))
                except KeyError:
                    pass
        if isinstance(obj, Mapping) and not isinstance(obj, StepResult) and argument in obj:
            return _guard_truncated(obj[argument])
        if isinstance(obj, (StepResult, ResponseView)) and isinstance(argument, str) and argument not in obj:
            try:
                return obj.alias(argument) if isinstance(obj, StepResult) else obj.fallback(argument)
            except KeyError:
                pass
        return super().getitem(obj, argument)


class _SpecChecker(SandboxedFormatter):
    """Formats as the sandbox does, checking each filled-in spec against the size budget before
    the field is padded (a nested field, `{1}` in `{0:>{1}}`, is formatted first)."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        template_budget.check_format_spec(format_spec)
        return super().format_field(value, format_spec)


def _b64encode(value: Any) -> str:
    raw = value if isinstance(value, bytes) else str(value).encode()
    return base64.b64encode(raw).decode()


def _b64decode(value: Any) -> str:
    return base64.b64decode(str(value)).decode()


def _build_environment() -> PlaybookEnvironment:
    env = PlaybookEnvironment(undefined=PlaybookUndefined, autoescape=False, keep_trailing_newline=True)
    env.filters.update(
        fromjson=json.loads,
        from_json=json.loads,
        to_json=lambda v: json.dumps(v, default=str),
        b64encode=_b64encode,
        b64decode=_b64decode,
    )
    env.globals.update(now=lambda: __import__("datetime").datetime.now().isoformat())
    env.globals["lipsum"] = template_budget.bounded_lipsum(env.globals["lipsum"])  # type: ignore[arg-type]
    for name, positions in BOUNDED_FILTERS.items():
        env.filters[name] = template_budget.bounded_filter(name, env.filters[name], *positions)
    env.filters["format"] = _bounded_format(env.filters["format"])
    env.filters["join"] = _bounded_join
    env.filters["sum"] = _bounded_sum(env.filters["sum"])
    return env


@pass_environment
def _bounded_join(environment: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """Jinja's join (no autoescape here), refused before joining past NOETL_TEMPLATE_MAX_BYTES."""
    if attribute is not None:
        value = map(make_attrgetter(environment, attribute), value)
    pieces = [str(v) for v in value]
    separator = str(d)
    template_budget.check_total(
        "the filter join", sum(len(p) for p in pieces) + len(separator) * max(len(pieces) - 1, 0)
    )
    return separator.join(pieces)


def _bounded_sum(run: Any) -> Any:
    """Jinja's sum; summing sequences (`start=[]`) is refused past NOETL_TEMPLATE_MAX_BYTES before
    it starts (each `+` copies all that came before)."""

    @pass_environment
    def sum_filter(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if not isinstance(start, (str, bytes, list, tuple)):
            return run(environment, iterable, attribute, start)
        values = list(iterable if attribute is None else map(make_attrgetter(environment, attribute), iterable))
        size = template_budget.sequence_bytes(start) + sum(template_budget.sequence_bytes(v) for v in values)
        template_budget.check_total("the filter sum", size)
        return run(environment, values, None, start)

    return sum_filter


def _bounded_format(run: Any) -> Any:
    def format_filter(value: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(value, str):
            template_budget.check_percent_format(value, kwargs or args)
        return run(value, *args, **kwargs)

    return format_filter


ENV = _build_environment()


def is_template(value: Any) -> bool:
    return isinstance(value, str) and any(m in value for m in TEMPLATE_MARKERS)


@lru_cache(maxsize=4096)
def _compile_expression(expression: str):  # type: ignore[no-untyped-def]
    return ENV.compile_expression(expression, undefined_to_none=False)


@lru_cache(maxsize=4096)
def _compile_template(text: str):  # type: ignore[no-untyped-def]
    return ENV.from_string(jinja_source(text))


def jinja_source(text: str) -> str:
    """`text` as Jinja parses it: each Go template action kept verbatim (a raw block)."""
    if "{{" not in text or not _GO_TEMPLATE_ACTION.search(text):
        return text
    return _GO_TEMPLATE_ACTION.sub(lambda m: "{% raw %}" + m.group(0) + "{% endraw %}", text)


def _single_expression(text: str) -> str | None:
    if _GO_TEMPLATE_ACTION.search(text):
        return None
    match = _SINGLE_EXPRESSION.match(text)
    if not match:
        return None
    expr = match.group("expr")
    if "{{" in expr or "}}" in expr or "{%" in text:
        return None
    return expr.strip()


def _defined(value: Any) -> Any:
    """A native value with no Undefined inside (a filter such as map() can yield them lazily);
    rendering leniently, an Undefined is None (noted)."""
    if isinstance(value, Undefined):
        if isinstance(value, PlaybookUndefined) and value._hidden():
            return None
        value._fail_with_undefined_error()
    if isinstance(value, Deferred):  # a placeholder inside a rendered value (`{{ ctx }}`): read whole
        return _defined(materialise(value))
    if isinstance(value, (list, tuple)) or type(value).__name__ == "generator":
        return [_defined(v) for v in value]
    if type(value) is dict:
        return {k: _defined(v) for k, v in value.items()}
    if isinstance(value, Mapping) and not isinstance(value, (StepResult, ResponseView)):
        for v in value.values():
            _defined(v)
    return _unwrap(value)


def _render_text(template: Any, context: Mapping[str, Any]) -> str:
    """A template's text, refused as soon as it grows past NOETL_TEMPLATE_MAX_BYTES."""
    chunks: list[str] = []
    size = 0
    for chunk in template.generate(**context):
        size += len(chunk)
        template_budget.check_output(size)
        chunks.append(chunk)
    return "".join(chunks)


def render_string(text: str, context: Mapping[str, Any]) -> Any:
    """Render one playbook string: native value for a lone expression, else text."""
    if not is_template(text):
        return text
    notes = _HIDDEN.get()
    seen = len(notes) if notes is not None else 0
    try:
        return _render(text, context)
    finally:
        if notes is not None:  # name the template of what this render hid
            notes[seen:] = [f"{n} in template {text.strip()[:200]!r}" for n in notes[seen:]]


def _render(text: str, context: Mapping[str, Any]) -> Any:
    try:
        expression = _single_expression(text)
        if expression is not None:  # no loop in an expression: its size checks bound it
            value = _defined(_compile_expression(expression)(**context))
            if _ENDS_IN_JSON.search(expression) and isinstance(value, str):
                return json.loads(value)  # `{{ x | tojson }}` passes the structure x, as in NoETL
            return str(value) if isinstance(value, Markup) else value
        with template_budget.budget():  # statements can loop: the clock is watched too
            return _render_text(_compile_template(text), context)
    except template_budget.BudgetExceeded as exc:  # still told apart: a when past its budget fails
        raise template_budget.BudgetExceeded(f"{exc} in template {text.strip()[:200]!r}") from None
    except UndefinedError as exc:
        raise TemplateError(f"{exc.message} in template {text.strip()!r}") from None
    except TemplateSyntaxError as exc:
        raise TemplateError(f"template syntax error: {exc.message} in {text.strip()!r}") from None
    except TemplateError:
        raise
    except Exception as exc:  # a filter or an operation failed on the data
        raise TemplateError(f"{type(exc).__name__}: {exc} in template {text.strip()!r}") from None


def render_value(value: Any, context: Mapping[str, Any], raw_keys: frozenset[str] = frozenset()) -> Any:
    """Render a playbook value recursively (dict keys are not rendered; `raw_keys` are skipped)."""
    if isinstance(value, str):
        return render_string(value, context)
    if isinstance(value, Mapping):
        return {k: (v if k in raw_keys else render_value(v, context)) for k, v in value.items()}
    if isinstance(value, list):
        return [render_value(v, context) for v in value]
    return value


def evaluate_condition(condition: Any, context: Mapping[str, Any]) -> bool:
    """A `when`: None (else) is true, a bool is itself, a template is rendered and judged."""
    if condition is None:
        return True
    if isinstance(condition, bool):
        return condition
    value = render_string(condition, context) if isinstance(condition, str) else condition
    if isinstance(value, str):
        lowered = value.strip().lower()
        return lowered not in ("", "false", "0", "none", "null", "no")
    return bool(value)


def check_syntax(text: str) -> str | None:
    """None when `text` compiles in the runtime's environment (so its filters and tests exist),
    else what is wrong, with the line inside the template."""
    try:
        ENV.compile(jinja_source(text))
    except TemplateAssertionError as exc:  # parsed, but names a filter or test that does not exist
        return f"template uses what does not exist (its line {exc.lineno}): {exc.message}"
    except TemplateSyntaxError as exc:
        return f"template does not parse (its line {exc.lineno}): {exc.message or 'syntax error'}"
    return None
