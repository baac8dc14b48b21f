"""Event rows as a decision records them: append-only, each built once with its final content.

A decision adds rows to its `Decision` (value.py) in order; the write (write.py) inserts them in
that order. A row is built once and never amended: `recorded` makes it read-only (its `meta`
too), so a late change raises TypeError instead of slipping into the log.

Two rows of a decision cannot be complete when they take their place, so they are held open
(`OpenRow`) until their content is decided, and built then:
- an attempt's outcome row, whose type, result and meta depend on the decision about it (the
  policy rule that matched, a page of a paginated task, the end of a loop iteration or cursor
  item): the outcome rules decide them through the named calls of `OpenRow`, and the row is
  built when the outcome is decided (`Decision.settle`);
- the decision's causing row (its first), whose dispatch list and deadline are the decision's
  last part: the write builds it with them (`Decision.seal_cause`).
The write refuses a row still open (RowOpen): every row it inserts was built once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from noetl_celery.engine.decision.units import REPORTED_META

Row = Mapping[str, Any]  # an event row of a decision: read-only, recorded or open


class RowRecorded(Exception):
    """A change to an event row after its content was decided: the row stays as it was decided."""


class RowOpen(Exception):
    """The write met a row whose content was never completed (a defect of the decision)."""


def recorded(columns: dict[str, Any]) -> Row:
    """A row as recorded: a read-only view of `columns` (taken over, not copied), its meta a
    read-only copy."""
    meta = columns.get("meta")
    if isinstance(meta, dict):
        columns["meta"] = MappingProxyType(meta.copy())
    return MappingProxyType(columns)


def writable(row: Row) -> dict[str, Any]:
    """A recorded row as the store inserts it (plain dicts); refuses a row never built."""
    if not isinstance(row, MappingProxyType):  # an OpenRow, or a row that bypassed `recorded`
        raise RowOpen(f"event row {row['event_id']!r} was never built: its decision did not complete it")
    columns = row.copy()
    meta = columns.get("meta")
    if isinstance(meta, MappingProxyType):
        columns["meta"] = meta.copy()
    return columns


class OpenRow(Mapping[str, Any]):
    """An event row whose place is taken and whose content is still being decided.

    Reading it shows the row as decided so far. It changes only through `note` (meta keys: the
    policy rule, the collect spec, what lenient renders hid, a cursor item's slot), `retype` (a
    page of a paginated task) and `end_unit` (the row becomes the iteration's or cursor item's
    row), until `close`; `build` makes the recorded row, once, adding the dispatch list and the
    deadline of a causing row. A change after `close` raises RowRecorded.

    `index`: its place among the decision's rows (None: a row of no decision's list, such as
    the outcome row a resume decides again, or the parent event of a task decided inline,
    which has no row of its own: what is noted on it is dropped)."""

    def __init__(self, columns: dict[str, Any], index: int | None = None) -> None:
        self._columns = columns
        self.index = index
        self.closed = False
        self._built = False

    def __getitem__(self, name: str) -> Any:
        value = self._columns[name]
        return MappingProxyType(value) if name == "meta" and isinstance(value, dict) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def _change(self) -> dict[str, Any]:
        if self.closed:
            raise RowRecorded(f"event row {self._columns.get('event_id')!r} was already decided: it cannot change")
        return self._columns

    def note(self, **meta: Any) -> None:
        """Add (or replace) keys of the row's meta."""
        columns = self._change()
        columns["meta"] = {**(columns.get("meta") or {}), **meta}

    def retype(self, event_type: str) -> None:
        columns = self._change()
        columns["event_type"] = event_type

    def end_unit(self, **columns: Any) -> None:
        """The attempt's outcome row becomes the row of the unit it ends (a loop iteration, a
        cursor item): `columns` replace its event_type, result, status or error. Of the status,
        result and error the attempt reported, those this changes are kept in `meta.reported`,
        so that the outcome can still be read from the row (`noetl-celery replay` decides it
        again from there)."""
        row = self._change()
        reported = {
            name: row.get(name)
            for name in ("status", "result", "error")
            if name in columns and row.get(name) is not columns[name] and row.get(name) != columns[name]
        }
        row.update(columns)
        if reported:
            self.note(**{REPORTED_META: reported})

    def close(self) -> None:
        """Its content is decided: nothing but `build` follows."""
        self.closed = True

    def build(self, *, dispatch: list[dict[str, Any]] | None = None, deadline_at: Any = None) -> Row:
        """The recorded row, built once: with a causing row's `dispatch` list and deadline."""
        if self._built:
            raise RowRecorded(f"event row {self._columns.get('event_id')!r} was built already")
        self._built = self.closed = True
        columns = self._columns.copy()
        if dispatch:
            columns["meta"] = {**(columns.get("meta") or {}), "dispatch": dispatch}
            columns["deadline_at"] = deadline_at
        return recorded(columns)
