"""The `DecisionStore` port (store_port.py) over the event store, in the decision's transaction.

Each call is the `store.repo` (or `store.blobs`) function of the same name on the transaction's
connection, looked up when it is made: the statements and round trips of a decision are the
ones it always sent, and a test that replaces a function of `repo` is heard here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from noetl_celery.engine.context import STATE, ExecutionState
from noetl_celery.engine.decision.entries import Streamed
from noetl_celery.engine.decision.store_reads import StoreReads
from noetl_celery.store import blobs, repo
from noetl_celery.store.db import commit_suffix


@dataclass(frozen=True)
class SqlDecisionStore:
    """The event store through the decision transaction's `connection`; `url` names the store
    for the process's state cache (engine.context.STATE; None: the state is not read here)."""

    connection: Connection
    url: str | None = None

    def last_write_commits(self) -> bool:
        return commit_suffix(self.connection) is not None

    def execution_head(self, execution_id: int, *, deciding: bool = False) -> dict[str, Any] | None:
        return repo.execution_head(self.connection, execution_id, deciding=deciding)

    def state(self, execution_id: int, min_version: int) -> ExecutionState:
        assert self.url is not None, "the state is read from a store named by its URL"
        return STATE.get(self.url, execution_id, min_version=min_version, conn=self.connection)

    def reads(self, execution_id: int, connection: Callable[[], Any]) -> StoreReads:
        return StoreReads(connection, execution_id)

    def value_reader(self) -> Callable[[Mapping[str, Any]], Any]:
        return blobs.reader(self.connection)

    def bump_execution(self, execution_id: int, *, pending: int = 0, version: int = 0) -> tuple[int, int, str]:
        return repo.bump_execution(self.connection, execution_id, pending=pending, version=version)

    def finish_execution(
        self, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
    ) -> bool:
        return repo.finish_execution(self.connection, execution_id, status, error=error, failed_step=failed_step)

    def execution_link(self, execution_id: int) -> dict[str, Any] | None:
        return repo.execution_link(self.connection, execution_id)

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
    ) -> repo.Recorded:
        return repo.record_decision(
            self.connection,
            rows,
            variables,
            new_keys=new_keys,
            last=last,
            head_version=head_version,
            count=count,
            bump=bump,
            settles=settles,
        )

    def put_value(self, execution_id: int, value: Any) -> Any:
        if isinstance(value, Streamed):  # a loop's result written item by item (loops.py)
            return blobs.put_streamed(self.connection, execution_id, value.parts, value.key, value.items)
        return blobs.put(self.connection, execution_id, value)

    def put_collection(self, execution_id: int, items: list[Any], source: Mapping[str, Any] | None = None) -> Any:
        return blobs.put_collection(self.connection, execution_id, items, source)

    def create_loop(self, values: dict[str, Any]) -> None:
        repo.create_loop(self.connection, values)

    def claim_loop_indexes(self, run_id: str, count: int) -> int:
        return repo.claim_loop_indexes(self.connection, run_id, count)

    def loop_iteration_done(self, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]:
        return repo.loop_iteration_done(self.connection, run_id, ok=ok, tolerated=tolerated)

    def loop_iteration_done_checked(
        self, execution_id: int, run_id: str, *, ok: bool, tolerated: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return repo.loop_iteration_done_checked(self.connection, execution_id, run_id, ok=ok, tolerated=tolerated)

    def complete_loop(self, run_id: str) -> bool:
        return repo.complete_loop(self.connection, run_id)

    def end_loop_slot(self, run_id: str) -> dict[str, Any]:
        return repo.end_loop_slot(self.connection, run_id)

    def open_join(self, execution_id: int, fork_id: str, join_step: str, width: int) -> None:
        repo.open_join(self.connection, execution_id, fork_id, join_step, width)

    def settle_join(self, execution_id: int, fork_id: str, *, arrived: bool) -> tuple[int, int, int]:
        return repo.settle_join(self.connection, execution_id, fork_id, arrived=arrived)

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
        repo.create_execution(
            self.connection,
            execution_id=execution_id,
            plan=plan,
            workload=workload,
            parent_execution_id=parent_execution_id,
            parent_event_id=parent_event_id,
            parent_task=parent_task,
            depth=depth,
            timeout=timeout,
        )
