"""Workload overrides written as `key=value` (`--set`, and the dashboard's rerun and launch forms):
values read as YAML scalars (numbers, booleans, lists), a dotted key naming a nested value."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from noetl_celery.config import limits, settings
from noetl_celery.dsl import nest_dotted
from noetl_celery.dsl.yaml_lines import load_yaml, plain


def parse_assignments(items: Iterable[str]) -> dict[str, Any]:
    """`["a.b=1"]` -> {"a": {"b": 1}}; raises ValueError naming the item that is not key=value."""
    flat: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        flat[key] = scalar(raw)
    return nest_dotted(flat)


def scalar(raw: str) -> Any:
    """A value as `--set` reads it: YAML ("3" is 3, "true" is True, "[1, 2]" a list), text when it
    does not parse, and a number with a leading zero ("01234", a code) kept as text."""
    if not raw:
        return ""
    value, problems = load_yaml(raw, "--set")
    if problems:
        if any(settings.MAX_INPUT_DEPTH_ENV in problem.message for problem in problems):
            raise ValueError(
                f"{raw[:40]!r}...: nested more than {limits.max_input_depth()} levels (the input depth limit)"
            )
        return raw
    if isinstance(value, int) and raw.strip().lstrip("+-").startswith("0") and len(raw.strip()) > 1:
        return raw  # "01234" is a code with a leading zero, not YAML 1.1's octal
    return plain(value)
