"""Bounded reading of untrusted JSON and of values built from it.

Decides: how deep a JSON document (a REST request body, a workload given as JSON) and a value
built from one may nest (NOETL_MAX_INPUT_DEPTH, the same bound as a playbook's YAML), and the
wording of the refusal. The depth is measured without recursion before anything recursive
(json.loads, merging, templates) sees the input, so no input ends in a RecursionError.
It must not interpret what it reads.
"""

from __future__ import annotations

import json
from typing import Any

from noetl_celery.config import limits

OPENERS = frozenset(b"[{")
CLOSERS = frozenset(b"]}")
MAX_SHOWN_PATH = 60  # characters of a too-deep value's key path shown in the refusal
QUOTE, BACKSLASH = ord('"'), ord("\\")


class InputError(ValueError):
    """Input that cannot be read: the message says what and where (`line N`, a key path)."""


def json_depth(raw: bytes | str) -> tuple[int, int]:
    """(deepest nesting, its line) of JSON text, counted over brackets outside strings."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth = deepest = 0
    line = deepest_line = 1
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == BACKSLASH:
                escaped = True
            elif byte == QUOTE:
                in_string = False
            continue
        if byte == QUOTE:
            in_string = True
        elif byte in OPENERS:
            depth += 1
            if depth > deepest:
                deepest, deepest_line = depth, line
        elif byte in CLOSERS:
            depth -= 1
        elif byte == 0x0A:
            line += 1
    return deepest, deepest_line


def parse_json(raw: bytes | str, what: str = "body") -> Any:
    """The value of JSON text `raw`, refused (InputError naming `what` and the line) when it does
    not parse, is not UTF-8 or nests deeper than NOETL_MAX_INPUT_DEPTH."""
    limit = limits.max_input_depth()
    deepest, line = json_depth(raw)
    if deepest > limit:
        raise InputError(
            f"{what}: line {line}: nested {deepest} levels deep, more than {limit} (NOETL_MAX_INPUT_DEPTH)"
        )
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"{what}: not JSON ({exc})") from None


def value_depth(value: Any, limit: int) -> tuple[int, str]:
    """(depth, key path) of the first place where `value` (dicts and lists) nests deeper than
    `limit`, or (its depth, "") when it does not; iterative."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    deepest = 0
    while stack:
        item, depth, path = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        depth += 1
        if depth > limit:
            return depth, path
        deepest = max(deepest, depth)
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in pairs:
            child_path = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
            stack.append((child, depth, child_path))
    return deepest, ""


def check_value_depth(value: Any, what: str) -> None:
    """InputError when `value` nests deeper than NOETL_MAX_INPUT_DEPTH."""
    limit = limits.max_input_depth()
    depth, path = value_depth(value, limit)
    if depth > limit:
        where = f"{what}.{path}" if path else what
        where = where if len(where) <= MAX_SHOWN_PATH else where[: MAX_SHOWN_PATH - 3] + "..."
        raise InputError(f"{where}: nested more than {limit} levels deep (NOETL_MAX_INPUT_DEPTH)")
