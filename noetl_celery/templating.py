"""The one Jinja2 environment (sandboxed, strict) and how playbook values are rendered.

Rules:
- A string that is exactly one expression (`"{{ expr }}"`) renders to the expression's native
  value (a list stays a list, `{{ n + 1 }}` is an int). Any other string renders to text.
- Undefined names are errors (StrictUndefined), reported with the template text.
- `a.b` on a mapping looks up the key first, so `iter.items` is the key `items`, never the dict
  method. A step's result also answers the legacy aliases `.result` and `.data` when it has no
  such key (legacy playbooks write `step.result.data.x` and `result.data.x` for the same value).
- Only playbook text is rendered. Values that come from data (HTTP bodies, rows, step results)
  are inserted as values and never rendered again.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError, UndefinedError
from jinja2.runtime import Undefined
from jinja2.sandbox import SandboxedEnvironment

from noetl_celery.errors import TemplateError

TEMPLATE_MARKERS = ("{{", "{%")
_SINGLE_EXPRESSION = re.compile(r"^\s*\{\{(?P<expr>.*?)\}\}\s*$", re.DOTALL)
LEGACY_ALIASES = ("result", "data")


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


def as_step_result(value: Any, task_results: Mapping[str, Any] | None = None) -> Any:
    """Wrap a step's result for the render context (non-mappings are returned as they are)."""
    if isinstance(value, Mapping) and not isinstance(value, StepResult):
        return StepResult(value, task_results)
    return value


class PlaybookEnvironment(SandboxedEnvironment):
    """Sandboxed, strict, key-first attribute lookup on mappings."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, Mapping):
            if attribute in obj:
                return obj[attribute]
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
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        if isinstance(obj, (StepResult, ResponseView)) and isinstance(argument, str) and argument not in obj:
            try:
                return obj.alias(argument) if isinstance(obj, StepResult) else obj.fallback(argument)
            except KeyError:
                pass
        return super().getitem(obj, argument)


def _b64encode(value: Any) -> str:
    raw = value if isinstance(value, bytes) else str(value).encode()
    return base64.b64encode(raw).decode()


def _b64decode(value: Any) -> str:
    return base64.b64decode(str(value)).decode()


def _build_environment() -> PlaybookEnvironment:
    env = PlaybookEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)
    env.filters.update(
        fromjson=json.loads,
        from_json=json.loads,
        to_json=lambda v: json.dumps(v, default=str),
        b64encode=_b64encode,
        b64decode=_b64decode,
    )
    env.globals.update(now=lambda: __import__("datetime").datetime.now().isoformat())
    return env


ENV = _build_environment()


def is_template(value: Any) -> bool:
    return isinstance(value, str) and any(m in value for m in TEMPLATE_MARKERS)


@lru_cache(maxsize=4096)
def _compile_expression(expression: str):  # type: ignore[no-untyped-def]
    return ENV.compile_expression(expression, undefined_to_none=False)


@lru_cache(maxsize=4096)
def _compile_template(text: str):  # type: ignore[no-untyped-def]
    return ENV.from_string(text)


def _single_expression(text: str) -> str | None:
    match = _SINGLE_EXPRESSION.match(text)
    if not match:
        return None
    expr = match.group("expr")
    if "{{" in expr or "}}" in expr or "{%" in text:
        return None
    return expr.strip()


def _defined(value: Any) -> Any:
    """A native value with no Undefined inside (a filter such as map() can yield them lazily)."""
    if isinstance(value, Undefined):
        value._fail_with_undefined_error()
    if isinstance(value, (list, tuple)) or type(value).__name__ == "generator":
        return [_defined(v) for v in value]
    if isinstance(value, Mapping) and not isinstance(value, (StepResult, ResponseView)):
        for v in value.values():
            _defined(v)
    return value


def render_string(text: str, context: Mapping[str, Any]) -> Any:
    """Render one playbook string: native value for a lone expression, else text."""
    if not is_template(text):
        return text
    try:
        expression = _single_expression(text)
        if expression is not None:
            return _defined(_compile_expression(expression)(**context))
        return _compile_template(text).render(**context)
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
    """None when `text` parses as a template, else the syntax error message."""
    try:
        ENV.parse(text)
    except TemplateSyntaxError as exc:
        return exc.message or "syntax error"
    return None


def plain(value: Any) -> Any:
    """A deep copy with StepResult mappings turned back into plain dicts (for JSON/messages)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
