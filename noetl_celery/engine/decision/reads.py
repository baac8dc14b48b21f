"""What a decision reads of the recorded execution, beside its state: the `Reads` protocol.

The strategies (loops, cursor loops, pages, step bounds) read rows of the execution through
`DecisionPort.reads`, not the store: the orchestrator hands them `store_reads.StoreReads`, bound
to the decision's transaction; a test or a replay may hand them rows held in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from noetl_celery.core import vocabulary as ev


class Reads(Protocol):
    """The reads of one execution's recorded rows a decision makes."""

    def count_events(self, event_type: str) -> int:
        """How many rows of `event_type` the execution has."""

    def event(self, event_id: str) -> dict[str, Any] | None:
        """The row with key `event_id` (None: there is none)."""

    def event_meta(self, event_id: str) -> dict[str, Any]:
        """The `meta` of the row with key `event_id` ({} when there is no such row or it has none)."""

    def run_events(self, run_id: str, event_type: str, columns: Sequence[str]) -> list[dict[str, Any]]:
        """The `columns` of a run's rows of one type, in recorded order."""

    def iteration_ends(self, run_id: str) -> Iterator[tuple[int, bool, Any]]:
        """A loop run's iterations, each by its last end row (`iteration.completed` or
        `iteration.failed`, the later recorded winning), in iteration order, read as they are
        consumed: (iteration, failed?, its result, or its error when it failed)."""

    def run_results(self, run_id: str, event_type: str) -> list[Any]:
        """The results of a run's rows of one type, in recorded order."""

    def loop(self, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
        """A loop run's row (its counters and context; its collection if asked)."""

    def value(self, reference: Mapping[str, Any]) -> Any:
        """The whole value a stored reference names."""

    def read_once(self, reference: Mapping[str, Any]) -> Any:
        """The whole value a stored reference names, read without keeping it in the process's cache
        of values: a loop's collection as the loop starts, and its pages (engine/decision/loops.py:
        it keeps the few pages it uses)."""

    def execution_link(self) -> dict[str, Any] | None:
        """The execution's link to its parent (parent execution, parent task, depth; None: no row)."""

    def playbook(self, path: str) -> dict[str, Any] | None:
        """The catalog's entry for `path` (its `content` and `source_file`; None: not registered)."""

    def store_key(self) -> str:
        """Names the store read: what a process keeps of rows it read (rows do not change) is
        kept per store."""


def iteration_ends_in(rows: Iterable[dict[str, Any]], run_id: str) -> Iterator[tuple[int, bool, Any]]:
    """`Reads.iteration_ends` over rows held in memory (a test's, a replay's), in recorded order
    (a row's `id`, else its place): the rule the store's statement applies."""
    ends = [
        (r["iteration"], r["id"] if r.get("id") is not None else position, r)
        for position, r in enumerate(rows)
        if r.get("run_id") == run_id
        and r["event_type"] in (ev.ITERATION_COMPLETED, ev.ITERATION_FAILED)
        and r.get("iteration") is not None
    ]
    last: dict[int, dict[str, Any]] = {}
    for iteration, _, r in sorted(ends, key=lambda end: end[:2]):
        last[iteration] = r  # the later recorded end of an iteration wins
    for iteration, r in last.items():
        failed = r["event_type"] == ev.ITERATION_FAILED
        yield iteration, failed, r.get("error" if failed else "result")
