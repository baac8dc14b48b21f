"""Rows on their way from source to target: a chunk is a column list and a list of tuples.

Decides how rows that arrive as JSON objects (http, JSONL) become tuples (the columns of the
first chunk fix the columns of the copy), and how `target.mapping` ({target_column:
source_field}, a dotted field reaching into a nested object) turns source rows into target rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from noetl_celery.tools.transfer.plan import PlanError

Row = tuple[Any, ...]


@dataclass
class Chunk:
    columns: list[str]
    rows: list[Row]


def chunks_of_objects(objects: Iterable[Any], size: int, where: str, strict: bool = True) -> Iterator[Chunk]:
    """Chunks of `size` rows from JSON objects. The first chunk's keys (in the order they appear)
    are the columns; a later row with a key outside them is an error when `strict` (no mapping
    chooses the fields), and a row that is not an object is always one."""
    columns: list[str] | None = None
    pending: list[dict[str, Any]] = []
    index = 0
    for index, item in enumerate(objects):  # noqa: B007 - the index names a bad row
        if not isinstance(item, dict):
            raise PlanError(f"{where}: row {index} is {type(item).__name__}, not an object")
        pending.append(item)
        if len(pending) >= size:
            columns = columns or _keys(pending)
            yield Chunk(columns, _tuples(pending, columns, where, strict))
            pending = []
    if pending:
        columns = columns or _keys(pending)
        yield Chunk(columns, _tuples(pending, columns, where, strict))


def _keys(objects: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for item in objects:
        for key in item:
            seen.setdefault(str(key), None)
    return list(seen)


def _tuples(objects: list[dict[str, Any]], columns: list[str], where: str, strict: bool) -> list[Row]:
    if strict:
        known = set(columns)
        for item in objects:
            extra = [k for k in item if k not in known]
            if extra:
                raise PlanError(
                    f"{where}: a row has field {extra[0]!r}, which the first chunk's rows do not have "
                    f"(columns: {', '.join(columns)}); give target.mapping to choose the fields"
                )
    return [tuple(item.get(c) for c in columns) for item in objects]


def projection(columns: list[str], mapping: dict[str, str] | None) -> tuple[list[str], Callable[[Row], Row] | None]:
    """The target columns and the function that makes a target row of a source row (None: the
    rows pass as they are)."""
    if not mapping:
        return columns, None
    index = {name: i for i, name in enumerate(columns)}
    getters = [_getter(target, path, index, columns) for target, path in mapping.items()]
    return list(mapping), lambda row: tuple(get(row) for get in getters)


def _getter(target: str, path: str, index: dict[str, int], columns: list[str]) -> Callable[[Row], Any]:
    if path in index:  # a column whose name holds a dot is taken whole
        position = index[path]
        return lambda row: row[position]
    head, *rest = path.split(".")
    if head not in index:
        raise PlanError(
            f"target.mapping: column {target!r} takes source field {path!r}, which the source does not have "
            f"(its columns: {', '.join(columns)})"
        )
    position = index[head]

    def dig(row: Row) -> Any:
        value = row[position]
        for part in rest:
            value = value.get(part) if isinstance(value, dict) else None
        return value

    return dig
