"""`Reads` over rows and loop rows held in memory: what a test (or a replay) hands a decision
instead of the store (engine/decision/reads.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from noetl_celery.engine.decision.reads import iteration_ends_in


class ReadsInMemory:
    """`Reads` over rows and loop rows held in memory; `stored`: values stored by reference, by
    their sha256."""

    def __init__(self, rows: list[dict[str, Any]] | None = None, loops: dict[str, dict[str, Any]] | None = None):
        self.rows = rows or []
        self.loops = loops or {}
        self.stored: dict[str, Any] = {}

    def count_events(self, event_type: str) -> int:
        return sum(1 for r in self.rows if r["event_type"] == event_type)

    def event(self, event_id: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["event_id"] == event_id), None)

    def event_meta(self, event_id: str) -> dict[str, Any]:
        return (self.event(event_id) or {}).get("meta") or {}

    def run_events(self, run_id: str, event_type: str, columns: Sequence[str]) -> list[dict[str, Any]]:
        found = [r for r in self.rows if r.get("run_id") == run_id and r["event_type"] == event_type]
        return [{c: r.get(c) for c in columns} for r in found]

    def iteration_ends(self, run_id: str) -> Iterator[tuple[int, bool, Any]]:
        return iteration_ends_in(self.rows, run_id)

    def run_results(self, run_id: str, event_type: str) -> list[Any]:
        return [r["result"] for r in self.run_events(run_id, event_type, ("result",))]

    def loop(self, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
        return self.loops.get(run_id)

    def value(self, reference: Mapping[str, Any]) -> Any:
        if reference["sha256"] not in self.stored:
            raise AssertionError(f"no value {reference['sha256'][:12]} is stored by reference here")
        return self.stored[reference["sha256"]]

    def read_once(self, reference: Mapping[str, Any]) -> Any:
        return self.value(reference)

    def execution_link(self) -> dict[str, Any] | None:
        return None

    def playbook(self, path: str) -> dict[str, Any] | None:
        return None

    def store_key(self) -> str:
        return "memory"
