"""Value objects of the decider: how a unit of work ended, and which step run it belongs to.

A unit is a step run without a loop, or one element of a loop (a collection iteration, a
cursor row). The decider builds one `UnitEnd` when a unit is over and hands it to the step (or
to the step's loop strategy), instead of passing its fields one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RunRef:
    """Where a step run sits in the execution: its id, open forks, and the args it entered with."""

    run_id: str
    frames: list[list[str]] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UnitEnd:
    """A unit of work is over.

    ok: the unit succeeded (a tolerated error counts as ok for routing, as a failure for loops);
    data: the unit's result (the collected pages when it paginated);
    error: why it failed; tolerated: the error a policy rule said to continue past;
    task_results: results by task label of a multi-task pipeline;
    iter_vars: `iter.*` values the pipeline set; response: the last call's result, which
    routing conditions read (None: `data`); parent: the event row that ended the unit.
    """

    ok: bool
    parent: str | None
    data: Any = None
    error: Any = None
    tolerated: Any = None
    task_results: dict[str, Any] = field(default_factory=dict)
    iter_vars: dict[str, Any] = field(default_factory=dict)
    response: Any = None

    @property
    def failed(self) -> bool:
        """For loop counting: failed, or failed and tolerated by a policy rule."""
        return not self.ok or self.tolerated is not None

    @property
    def routing_response(self) -> Any:
        return self.data if self.response is None else self.response

    def evolve(self, **changes: Any) -> UnitEnd:
        return replace(self, **changes)


REPORTED_META = "reported"  # meta key: what the attempt reported, where the unit's row shows otherwise (rows.py)
