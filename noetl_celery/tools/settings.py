"""Typed tool settings: how a tool's pydantic model checks a task's configuration.

Decides: which values are checked when (at validate only the literal values a playbook wrote; a
value that is a template string is checked after rendering, in the worker), and how a pydantic
error is worded (the same words at validate and at run time: "headers: must be a mapping, not a
list"). A tool without a model (`settings=None`) is free-form: nothing is checked here.

Models are lenient about keys (the validator's field list decides which keys exist) and every
field is optional (the tool's `required` groups decide what must be present).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from noetl_celery.tools.base import ToolSpec

TEMPLATE_MARKERS = ("{{", "{%")


class ToolSettings(BaseModel):
    """Base of every tool's settings model: unknown keys pass (they are checked elsewhere)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and any(marker in value for marker in TEMPLATE_MARKERS)


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (dict, "a mapping"), (list, "a list"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "a number" if isinstance(value, (int, float)) else type(value).__name__


_EXPECTED = {
    "dict_type": "a mapping",
    "list_type": "a list",
    "string_type": "a string",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _message(error: dict[str, Any]) -> str:
    kind, value = error["type"], error.get("input")
    if kind in _EXPECTED:
        return f"must be {_EXPECTED[kind]}, not {type_name(value)}"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"must be one of {expected}, not {value!r}"
    if kind == "value_error":
        return str(error.get("ctx", {}).get("error") or error["msg"])
    if kind in ("greater_than_equal", "greater_than"):
        return f"must be a number {error['msg'].split(' ', 3)[-1]}, not {value!r}"
    return str(error["msg"])


def _where(loc: tuple[Any, ...], values: Any) -> str:
    """The dotted path of an error's location, keeping only the parts that are keys or indexes of
    the input (pydantic adds the member type of a union, "dict[str,any]", to the location)."""
    out, current = "", values
    for part in loc:
        in_mapping = isinstance(current, dict) and part in current
        in_list = isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        if not (in_mapping or in_list):
            continue
        current = current[part]
        out = f"{out}[{part}]" if isinstance(part, int) else (f"{out}.{part}" if out else str(part))
    return out


def problems(spec: ToolSpec, config: dict[str, Any], *, literal_only: bool) -> list[tuple[str, str]]:
    """(dotted field path, message) for each setting of `config` that the tool's model refuses.

    literal_only: leave out top-level values that are template strings (validate time); the
    worker calls this with the rendered values and literal_only=False; a required setting written
    as a template counts as present. The errors of a union's members are joined ("must be a
    mapping or a list, not a number").
    """
    if spec.settings is None:
        return []
    values = {k: v for k, v in config.items() if not (literal_only and _is_template(v))}
    try:
        spec.settings.model_validate(values)
    except ValidationError as exc:
        grouped: dict[str, list[dict[str, Any]]] = {}
        for error in exc.errors():
            loc = tuple(error["loc"])
            if error["type"] == "missing" and len(loc) == 1 and _said_elsewhere(spec, config, str(loc[0])):
                continue
            where = _where(loc, values) if error["type"] != "missing" else ".".join(map(str, loc))
            grouped.setdefault(where, []).append(dict(error))
        found = []
        for where, errors in grouped.items():
            typed = [e for e in errors if e["type"] in _EXPECTED]
            if len(typed) > 1 and len(typed) == len(errors):
                expected = list(dict.fromkeys(_EXPECTED[e["type"]] for e in typed))
                found.append((where, f"must be {' or '.join(expected)}, not {type_name(typed[0].get('input'))}"))
            else:
                found.append((where, _message(next((e for e in errors if e["type"] not in _EXPECTED), errors[0]))))
        return found
    return []


def _said_elsewhere(spec: ToolSpec, config: dict[str, Any], name: str) -> bool:
    """A missing required setting that is no problem here: written as a template (it is there,
    and checked once rendered), or one of the tool's `required` groups (which names it)."""
    return _is_template(config.get(name)) or any(name in group for group in spec.required)


def check_rendered(spec: ToolSpec, config: dict[str, Any]) -> str | None:
    """The worker's check of the rendered settings: None, or one message naming every problem."""
    found = problems(spec, config, literal_only=False)
    if not found:
        return None
    return f"{spec.kind}: " + "; ".join(f"{where}: {message}" for where, message in found)
