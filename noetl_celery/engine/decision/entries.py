"""The writes a strategy asks for while it decides: one frozen value per kind of write.

A strategy (loops.py, cursor_loop.py, steps.py, subplaybooks.py) never touches the store: it
hands one of these values to `DecisionPort.apply`, and write.py (`apply_entry`) is the one place
that turns it into a statement. What the strategy needs back (a stored value's reference, a
loop's counters, a join's count) is `apply`'s return value. A guarded entry the store refuses
(`CountIteration` on a head that moved on) raises write.Redecide, and the event is decided again.

Each entry is plain data: a test hands a strategy a port that records the entries it applies and
answers them from memory (tests/test_decision_entries.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PutValue:
    """Keep `value` for the execution; inline below the row cap, else by reference
    (store/blobs.py). Returns what a row stores in its place. A `Streamed` value is kept
    without holding its items at once: see there."""

    value: Any


@dataclass(frozen=True)
class PutCollection:
    """Keep a loop's collection for the execution: inline below the row cap, else in pages kept
    by reference (store/blobs.py `collection_form`), so that no process holds the whole list to
    dispatch an iteration. Returns what the loop row stores. With `source` (the reference of a
    list stored by reference: the loop's `in:` names it alone; `items` is empty), the pages are
    made as that list is read, and it is never decoded whole (loops.py `stored_source`)."""

    items: list[Any]
    source: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Streamed:
    """A mapping whose one member `key` is a list given item by item: `parts` in their order,
    the member `key` being every item `items()` yields (each call yields them again from the
    first; the value `parts` holds for `key` is not read). PutValue of it encodes the items one
    at a time and answers what PutValue of the whole mapping would when that is stored by
    reference; None when it is not (its JSON is at most the row cap, or above
    NOETL_MAX_STORED_BYTES): the caller then builds the value and keeps it as before."""

    parts: dict[str, Any]
    key: str
    items: Callable[[], Iterable[Any]]


@dataclass(frozen=True)
class CreateLoop:
    """A loop run's row: its counters start at zero. Returns None."""

    run_id: str
    step: str
    mode: str
    total: int
    max_in_flight: int
    collection: Any
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClaimIndexes:
    """The first `count` indexes of a collection loop are in flight. Returns None."""

    run_id: str
    count: int


@dataclass(frozen=True)
class CountIteration:
    """Count one finished loop iteration (guarded: in a deferred decision the statement checks
    the execution head, and a moved head raises Redecide). `unless_last`: the loop's (max_in_flight, total)
    as this process knows them; a strict deferred decision leaves the count to its last write.
    Returns the loop's counters (`done` None when the count was left to the last write)."""

    run_id: str
    ok: bool
    tolerated: bool
    unless_last: tuple[int, int] | None = None


@dataclass(frozen=True)
class CompleteLoop:
    """Mark a loop complete, once: returns True for the one decision that completed it (False:
    another decision did, and this one does not finish the loop)."""

    run_id: str


@dataclass(frozen=True)
class EndCursorSlot:
    """One slot of a cursor loop is over. Returns the loop's counters after it."""

    run_id: str


@dataclass(frozen=True)
class OpenJoin:
    """A fork of `width` branches that meet at `join_step`, keyed by the forking row. Returns None."""

    fork_id: str
    join_step: str
    width: int


@dataclass(frozen=True)
class SettleJoin:
    """One branch of a fork settled (arrived at the join, or ended before it). Returns
    (settled, arrived, width)."""

    fork_id: str
    arrived: bool


@dataclass(frozen=True)
class CreateChildExecution:
    """A sub-playbook's execution row, linked to the parent's task. Returns None."""

    execution_id: int
    plan: dict[str, Any]
    workload: Any
    parent_event_id: str | None
    parent_task: dict[str, Any]
    depth: int
    timeout: float | None


Entry = (
    PutValue
    | PutCollection
    | CreateLoop
    | ClaimIndexes
    | CountIteration
    | CompleteLoop
    | EndCursorSlot
    | OpenJoin
    | SettleJoin
    | CreateChildExecution
)
