"""The store a decision reads its head and state from and writes to: the `DecisionStore` port.

write.py and orchestrator.py reach the store through this port only: the execution head, its
counters and end, the state a decision starts from, its one-statement write (`record_decision`),
the strategies' entries (entries.py: loops, joins, values kept by reference, a child execution),
the execution's link to its parent, and its recorded rows (reads.Reads).

Two implementations: sql_store.SqlDecisionStore, the event store in the decision's transaction
(every call one of `store.repo`'s, as the hot path always made it), and memory_store.MemoryStore,
one execution held in memory, on which `noetl-celery replay` decides a recorded execution again
without a database. Each call answers as `store.repo`'s function of the same name does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from noetl_celery.engine.context import ExecutionState
from noetl_celery.engine.decision.reads import Reads


class Recorded(Protocol):
    """What `record_decision` wrote (store.decisions.Recorded)."""

    @property
    def new(self) -> bool: ...

    @property
    def stored(self) -> dict[str, dict[str, Any]]: ...

    @property
    def pending(self) -> int | None: ...


class DecisionStore(Protocol):
    """The store side of one decision, inside its transaction."""

    @property
    def connection(self) -> Any:
        """The SQL transaction's connection (None: a store held in memory)."""

    def last_write_commits(self) -> bool:
        """The decision's last write may commit its transaction (db.commit_suffix)."""

    def execution_head(self, execution_id: int, *, deciding: bool = False) -> dict[str, Any] | None:
        """Status, pending and state version (locked for the decision with `deciding`)."""

    def state(self, execution_id: int, min_version: int) -> ExecutionState:
        """The execution's state at `min_version` or newer (its plan, workload and variables)."""

    def reads(self, execution_id: int, connection: Callable[[], Any]) -> Reads:
        """The execution's recorded rows (`connection`: the decision's, its head checked first)."""

    def value_reader(self) -> Callable[[Mapping[str, Any]], Any]:
        """What templates read values stored by reference with (templates.render.reading)."""

    def bump_execution(self, execution_id: int, *, pending: int = 0, version: int = 0) -> tuple[int, int, str]:
        """Add to the pending count and the state version: (pending, version, status) after."""

    def finish_execution(
        self, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
    ) -> bool:
        """End a running execution; False when it had ended already."""

    def execution_link(self, execution_id: int) -> dict[str, Any] | None:
        """The execution's parent execution, parent event, parent task and depth."""

    def record_decision(
        self,
        rows: list[dict[str, Any]],
        variables: dict[str, dict[str, Any]],
        *,
        new_keys: Sequence[str] = (),
        last: bool = False,
        head_version: int | None = None,
        count: Any = None,
        bump: Any = None,
        settles: str | None = None,
    ) -> Recorded:
        """A decision's rows and variables (store.decisions.record_decision); a guarded write
        refused raises store.decisions.Conflict."""

    def put_value(self, execution_id: int, value: Any) -> Any:
        """`value` as a row may hold it: itself, or a reference to it kept once (store/blobs.py); of
        an `entries.Streamed`, the reference, or None when the caller is to build it whole."""

    def put_collection(self, execution_id: int, items: list[Any], source: Mapping[str, Any] | None = None) -> Any:
        """A loop's collection as its row holds it: the list, or its pages' references, each page
        kept once (store/blobs.py `collection_form`); with `source`, the pages of the list stored
        by reference as `source`, read as they are made (`stored_collection_form`)."""

    def create_loop(self, values: dict[str, Any]) -> None: ...

    def claim_loop_indexes(self, run_id: str, count: int) -> int: ...

    def loop_iteration_done(self, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]: ...

    def loop_iteration_done_checked(
        self, execution_id: int, run_id: str, *, ok: bool, tolerated: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]: ...

    def complete_loop(self, run_id: str) -> bool: ...

    def end_loop_slot(self, run_id: str) -> dict[str, Any]: ...

    def open_join(self, execution_id: int, fork_id: str, join_step: str, width: int) -> None: ...

    def settle_join(self, execution_id: int, fork_id: str, *, arrived: bool) -> tuple[int, int, int]: ...

    def create_execution(
        self,
        *,
        execution_id: int,
        plan: dict[str, Any],
        workload: dict[str, Any],
        parent_execution_id: int | None = None,
        parent_event_id: str | None = None,
        parent_task: dict[str, Any] | None = None,
        depth: int = 0,
        timeout: float | None = None,
    ) -> None:
        """A child execution's row (store.executions.create_execution)."""


class HeldStore(DecisionStore, Protocol):
    """A `DecisionStore` held in memory, whose transactions the decision opens itself
    (orchestrator.decide_in)."""

    def transaction(self) -> AbstractContextManager[None]:
        """What is written inside it is undone when it exits on an exception."""
