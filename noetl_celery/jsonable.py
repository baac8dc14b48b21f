"""Turn values into plain JSON-like data.

`to_jsonable`: values produced by user code or database drivers, made JSON-serialisable (used by
the python and postgres tools on the way out of a call). It converts, it never raises and it
does no I/O: an object it does not know becomes its `str()`.

`plain`: the one deep copy into plain containers, for the DSL (line-numbered YAML mappings) and
the engine (step-result views), before a value goes into a plan, a message or an event row.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import math
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
    dataclass instance -> dict; anything else -> str(value).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, Mapping):
        return {_key(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
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
