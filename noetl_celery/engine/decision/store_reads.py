"""`Reads` (reads.py) from the store, in the decision's transaction.

Every read goes through `connection()`, the decision's `conn`: a deferred decision checks the
execution head before its first statement (write.checked).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.store import blobs, repo


@dataclass(frozen=True)
class StoreReads:
    """The execution's rows, read from the store through the decision's connection."""

    connection: Callable[[], Connection]
    execution_id: int

    def count_events(self, event_type: str) -> int:
        return repo.count_events(self.connection(), self.execution_id, event_type)

    def event(self, event_id: str) -> dict[str, Any] | None:
        return repo.find_event(self.connection(), self.execution_id, event_id)

    def event_meta(self, event_id: str) -> dict[str, Any]:
        return repo.event_meta(self.connection(), self.execution_id, event_id)

    def run_events(self, run_id: str, event_type: str, columns: Sequence[str]) -> list[dict[str, Any]]:
        return repo.run_events(self.connection(), self.execution_id, run_id, event_type, columns=tuple(columns))

    def iteration_ends(self, run_id: str) -> Iterator[tuple[int, bool, Any]]:
        return repo.iteration_ends(
            self.connection(), self.execution_id, run_id, ev.ITERATION_COMPLETED, ev.ITERATION_FAILED
        )

    def run_results(self, run_id: str, event_type: str) -> list[Any]:
        return repo.run_results(self.connection(), self.execution_id, run_id, event_type)

    def loop(self, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
        return repo.get_loop(self.connection(), run_id, with_collection=with_collection)

    def value(self, reference: Mapping[str, Any]) -> Any:
        return blobs.fetch(self.connection(), reference)

    def read_once(self, reference: Mapping[str, Any]) -> Any:
        return blobs.fetch(self.connection(), reference, keep=False)

    def execution_link(self) -> dict[str, Any] | None:
        return repo.execution_link(self.connection(), self.execution_id)

    def playbook(self, path: str) -> dict[str, Any] | None:
        return repo.find_playbook(self.connection(), path)

    def store_key(self) -> str:
        return str(self.connection().engine.url)
