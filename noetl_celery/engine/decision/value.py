"""The decision as a value: what one event decided, before it is written.

The Decider's role classes (core.py, outcomes.py, tasks.py, steps.py) fill one `Decision` while
they decide an event; the write (write.py) reads it to reach the event store in one round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from noetl_celery.engine.messages import Dispatch


@dataclass
class Decision:
    """What one event decided: event rows (the causing row first), the messages to publish, the
    variable writes, the change of the execution's pending units, and the end of the execution
    (a failure; its completion is decided by the write, when no unit is pending any more)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)
    variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: int = 0  # the change of the execution's pending units
    failure: dict[str, Any] | None = None  # {"step", "error"}: the execution fails
    later_causes: list[str] = field(default_factory=list)  # a batch: the other outcomes' row keys
    # tool-call times of the iterations of `batch: auto` loops this event reports, per loop run
    durations_ms: dict[str, list[float]] = field(default_factory=dict)
