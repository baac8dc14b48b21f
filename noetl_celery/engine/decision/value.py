"""The decision as a value: what one event decided, before it is written.

The Decider's role classes (core.py, outcomes.py, tasks.py, steps.py) fill one `Decision` while
they decide an event; the write (write.py) reads it to reach the event store in one round trip.
Its rows are append-only (rows.py): each is built once, with its final content.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noetl_celery.engine.decision.rows import OpenRow, Row, RowRecorded, recorded, writable
from noetl_celery.engine.messages import Dispatch


@dataclass
class Decision:
    """What one event decided: event rows (the causing row first), the messages to publish, the
    variable writes, the change of the execution's pending units, and the end of the execution
    (a failure; its completion is decided by the write, when no unit is pending any more)."""

    rows: list[Row] = field(default_factory=list)  # in order; the causing row first (rows.py)
    dispatches: list[Dispatch] = field(default_factory=list)
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: int = 0  # the change of the execution's pending units
    failure: dict[str, Any] | None = None  # {"step", "error"}: the execution fails
    later_causes: list[str] = field(default_factory=list)  # a batch: the other outcomes' row keys
    # tool-call times of the iterations of `batch: auto` loops this event reports, per loop run
    durations_ms: dict[str, list[float]] = field(default_factory=dict)
    settles: str | None = None  # the key of the decision row whose lease the causing outcome answers

    def record(self, columns: dict[str, Any]) -> None:
        """Add a row, complete: read-only from now on. The decision's first row is its cause,
        held open for the dispatch list the write builds it with (`seal_cause`)."""
        if not self.rows:
            self.open(columns).close()
        else:
            self.rows.append(recorded(columns))

    def open(self, columns: dict[str, Any]) -> OpenRow:
        """Add a row whose content is still being decided (an attempt's outcome row): it takes its
        place now and is built when it is decided (`settle`)."""
        row = OpenRow(columns, len(self.rows))
        self.rows.append(row)
        return row

    def settle(self, row: OpenRow) -> None:
        """The open row's content is decided: built now, or, the causing row, by the write."""
        row.close()
        if row.index is not None and row.index > 0:
            self._place(row, row.build())

    def seal_cause(self, dispatch: list[dict[str, Any]] | None, deadline_at: Any) -> None:
        """The write builds the causing row with the decision's dispatch list and deadline."""
        cause = self.rows[0]
        if not isinstance(cause, OpenRow):
            raise RowRecorded(f"the causing row {cause['event_id']!r} was built before its dispatch list")
        self._place(cause, cause.build(dispatch=dispatch, deadline_at=deadline_at))

    def writable_rows(self) -> list[dict[str, Any]]:
        """The rows as the store inserts them; refuses a row never built (rows.RowOpen)."""
        return [writable(row) for row in self.rows]

    def _place(self, row: OpenRow, built: Row) -> None:
        assert row.index is not None and self.rows[row.index] is row
        self.rows[row.index] = built
