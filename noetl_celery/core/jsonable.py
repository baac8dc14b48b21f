"""Turn values into plain JSON-like data.

`to_jsonable`: values produced by user code or database drivers, made JSON-serialisable (used by
the python and postgres tools on the way out of a call). It converts, it never raises and it
does no I/O: an object it does not know becomes its `str()`.

`plain`: the one deep copy into plain containers, for the DSL (line-numbered YAML mappings) and
the engine (step-result views), before a value goes into a plan, a message or an event row.

`unstorable` / `storable`: what strict JSON and the event store cannot hold (NaN and Infinity,
a NUL character, a lone surrogate, an integer too long for JSON text, nesting past a depth): the
first found, named with its path, so the worker can fail an attempt whose result holds one
(kind `invalid_result`) instead of handing the store a value it refuses; and a copy with such
values spelled out as text, for the engine's own fields (error messages, meta).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import json
import math
import re
import sys
import uuid
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

JSONValue = None | bool | int | float | str | list[Any] | dict[str, Any]


def to_jsonable(value: Any) -> JSONValue:
    """Return `value` as JSON-serialisable data.

    dict/Mapping -> dict with string keys; list/tuple/set/frozenset -> list (sets sorted when
    their items are comparable); Decimal -> int when integral, else float (NaN/Infinity -> str);
    datetime/date/time -> ISO 8601 text; timedelta -> seconds (float); UUID -> str;
    bytes/bytearray/memoryview -> UTF-8 text when it decodes, else base64 text; Enum -> its value;
    dataclass instance -> dict; anything else -> str(value). A list none of whose elements
    change is returned as it is, not copied (a tool's result of a million elements is held once).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, Mapping):
        return {_key(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        for index, item in enumerate(value):
            converted = to_jsonable(item)
            if converted is not item:  # copied from the first element that changes
                return [*value[:index], converted, *(to_jsonable(v) for v in value[index + 1 :])]
        return value
    if isinstance(value, tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [to_jsonable(v) for v in value]
        try:
            return sorted(items)  # type: ignore[type-var]
        except TypeError:
            return items
    if isinstance(value, Decimal):
        if not value.is_finite():
            return str(value)
        if value == value.to_integral_value():
            return int(value)
        as_float = float(value)
        return as_float if math.isfinite(as_float) else str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    return str(value)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    converted = to_jsonable(key)
    return converted if isinstance(converted, str) else str(converted)


def plain(value: Any, *, str_keys: bool = False) -> Any:
    """A deep copy in plain containers: every Mapping (a line-numbered YAML mapping, a step
    result view) becomes a dict and every list or tuple a list; other values are kept as they
    are. `str_keys` turns keys into text (YAML keys may be numbers; plans are keyed by text)."""
    if isinstance(value, Mapping):
        return {(str(k) if str_keys else k): plain(v, str_keys=str_keys) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, str_keys=str_keys) for v in value]
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINERS = (list, tuple, set, frozenset)
PATH_PARTS_SHOWN = 12  # steps of a reported path shown (the first and last halves of a longer one)
_FLOAT_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_Node = tuple[Any, Any] | None  # (parent node, key or index): a path, built only when reported


def _max_int_bits() -> float:
    digits = sys.get_int_max_str_digits()  # Python refuses longer int-to-text conversions
    return math.inf if digits == 0 else digits * math.log2(10)


def _text_problem(text: str) -> str | None:
    nul = text.find("\x00")
    if nul >= 0:
        return f"a NUL character (\\u0000) at index {nul}"
    surrogate = _SURROGATE.search(text)
    if surrogate is not None:
        return f"a lone surrogate ({ascii(surrogate.group())[1:-1]}) at index {surrogate.start()}"
    return None


def _path(node: _Node, root: str) -> str:
    parts: list[str] = []
    while node is not None:
        node, key = node
        if isinstance(key, int) and not isinstance(key, bool):
            parts.append(f"[{key}]")
        elif isinstance(key, str) and key.isidentifier():
            parts.append(f".{key}")
        else:
            parts.append(f"[{ascii(key) if isinstance(key, str) else repr(key)}]")
    parts.reverse()
    if len(parts) > PATH_PARTS_SHOWN:
        half = PATH_PARTS_SHOWN // 2
        parts = [*parts[:half], f"...({len(parts) - 2 * half} levels)...", *parts[-half:]]
    return root + "".join(parts)


def unstorable(value: Any, max_depth: int, root: str = "result") -> str | None:
    """The first thing in `value` that strict JSON or the event store cannot hold, with its path
    from `root` (`NaN at result.rows[2].price`), or None. Containers nested more than `max_depth`
    levels are refused too. A fast screen (the depth of containers only, then strict JSON
    encoding at C speed) clears most values; the walk that names the path runs only when the
    screen finds something."""
    if _depth_within(value, max_depth) and _encodes_strictly(value):
        return None
    return _first_unstorable(value, max_depth, root)


_PLAIN_CONTAINERS = (dict, list, tuple, set, frozenset)
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _is_container(value: Any) -> bool:
    return isinstance(value, (*_PLAIN_CONTAINERS, Mapping))


def _depth_within(value: Any, max_depth: int) -> bool:
    level = [value] if isinstance(value, (*_PLAIN_CONTAINERS, Mapping)) else []
    depth = 0
    while level:
        if depth >= max_depth:
            return False
        depth += 1
        children: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, Mapping) else container
            children.extend(v for v in items if type(v) not in _SCALARS and _is_container(v))
        level = children
    return True


STRICT_SLICE = 10_000  # elements of a long list encoded at a time by the screen


def _encodes_strictly(value: Any) -> bool:
    """Strict JSON (no NaN/Infinity) encodes it, as UTF-8 (no lone surrogate), with no NUL. A
    long list is encoded a slice at a time: its whole text is never held."""
    if isinstance(value, list) and len(value) > STRICT_SLICE:
        return all(
            _encodes_strictly(value[start : start + STRICT_SLICE]) for start in range(0, len(value), STRICT_SLICE)
        )
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, default=to_jsonable)
        text.encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False
    return "\\u0000" not in text


def _first_unstorable(value: Any, max_depth: int, root: str) -> str | None:
    int_bits = _max_int_bits()
    stack: list[tuple[Any, _Node, int]] = [(value, None, 0)]
    while stack:
        item, node, depth = stack.pop()
        problem: str | None = None
        if isinstance(item, float):
            if not math.isfinite(item):
                problem = f"{_FLOAT_NAMES.get(repr(item), repr(item))} (JSON has no NaN or Infinity)"
        elif isinstance(item, str):
            problem = _text_problem(item)
            if problem is not None:
                problem += " of a text"
        elif isinstance(item, (bytes, bytearray)):
            if b"\x00" in item:
                problem = f"a NUL byte at index {bytes(item).index(0)} of bytes"
        elif isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > int_bits:
                digits = int(item.bit_length() / math.log2(10))
                problem = f"an integer of about {digits} digits (longer than JSON text may hold)"
        elif isinstance(item, (Mapping, *_CONTAINERS)):
            if depth >= max_depth:
                problem = f"nesting deeper than {max_depth} levels (NOETL_MAX_RESULT_DEPTH)"
            elif isinstance(item, Mapping):
                children = list(item.items())
                for key, _ in children:
                    key_problem = _text_problem(key) if isinstance(key, str) else None
                    if key_problem is not None:
                        return f"{key_problem} of the key {ascii(key)[:80]} at {_path(node, root)}"
                stack.extend((v, (node, k), depth + 1) for k, v in reversed(children))
            else:
                stack.extend((v, (node, i), depth + 1) for i, v in reversed(list(enumerate(item))))
        if problem is not None:
            return f"{problem} at {_path(node, root)}"
    return None


def storable(value: Any, max_depth: int, depth: int = 0) -> Any:
    """JSON data (`to_jsonable`'s) with what the store refuses spelled out as text: NaN and
    Infinity as their names, a NUL as `\\u0000`, a lone surrogate as its escape, an over-long
    integer as text, containers past `max_depth` as a note."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _FLOAT_NAMES.get(repr(value), repr(value))
    if isinstance(value, str):
        return _spelled(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value.bit_length() <= _max_int_bits() else f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, (dict, list)) and depth >= max_depth:
        return f"<nested deeper than {max_depth} levels>"
    if isinstance(value, dict):
        return {_spelled(str(k)): storable(v, max_depth, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v, max_depth, depth + 1) for v in value]
    return value


def _spelled(text: str) -> str:
    if _text_problem(text) is None:
        return text
    return _SURROGATE.sub(lambda m: ascii(m.group())[1:-1], text.replace("\x00", "\\u0000"))
