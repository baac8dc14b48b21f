"""One execution held in memory: the store `noetl-celery replay` decides a recorded execution on.

`MemoryStore` is the decision's `DecisionStore` (engine/decision/store_port.py) and its `Reads`
(engine/decision/reads.py) without a database: the execution's row (its head: status, pending,
state version; its plan, workload and link to its parent), its event rows, variables, loops,
joins, values kept by reference, the child executions its decisions create, and the catalog
entries sub-playbooks are found by. Each call answers as the `store.repo` function of the same
name answers on SQLite, where a decision is one writer at a time:

- a row is stored as the event table holds it: its columns only, the content columns masked
  (config/secret_registry.py) and through JSON, a variable capped (limits.cap) too, and a value
  above NOETL_MAX_RESULT_BYTES kept once by reference (store/blobs.py `stored_form`);
- a row whose key exists is not inserted again, and a decision whose causing row exists is told
  so (its `record_decision` is not new: the orchestrator's DuplicateEvent);
- a guarded write on a head that is not running at the version assumed is refused
  (store.decisions.Conflict: the decision is made again);
- the loop, slot and join counters move as their UPDATEs move them, a loop completes once, and an
  execution ends once;
- `transaction()` undoes what a decision wrote when it raises, as a rollback does.

Values stored by reference that the execution's recorded rows name (a worker's result kept by
the worker) are read through `values`, a reader of the recorded store.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from noetl_celery.config import limits, secret_registry
from noetl_celery.dsl.plan import Plan
from noetl_celery.engine.context import ExecutionState, plan_digest
from noetl_celery.engine.decision.entries import Streamed
from noetl_celery.engine.decision.reads import iteration_ends_in
from noetl_celery.store import blobs, clock
from noetl_celery.store.decisions import Conflict, Recorded
from noetl_celery.store.events import EVENT_COLUMNS
from noetl_celery.store.executions import running_at

# the event table's JSON columns: what tools and templates produced (masked, through JSON)
CONTENT_COLUMNS = ("context", "result", "error", "meta")
LOOP_COUNTERS = ("done", "succeeded", "failed", "tolerated", "total", "max_in_flight", "status", "context")
SLOT_COUNTERS = ("slots_ended", "max_in_flight", "done", "succeeded", "failed", "tolerated", "status")
LINK = ("parent_execution_id", "parent_event_id", "parent_task", "depth")


def as_stored(value: Any) -> Any:
    """`value` as a JSON column gives it back (tuples as lists, keys as strings, a copy)."""
    return None if value is None else json.loads(json.dumps(value))


class MemoryStore:
    """One execution's store held in memory; `execution` is its row as the recorded store has it
    (plan, workload, link to its parent). The execution starts running, with no rows."""

    connection = None  # no SQL transaction

    def __init__(
        self,
        execution: Mapping[str, Any],
        *,
        catalog: Sequence[Mapping[str, Any]] = (),
        values: Callable[[Mapping[str, Any]], Any] | None = None,
    ) -> None:
        self.execution_id = int(execution["execution_id"])
        self.executions: dict[int, dict[str, Any]] = {}
        self.create_execution(
            execution_id=self.execution_id,
            plan=execution["plan"],
            workload=execution["workload"] or {},
            parent_execution_id=execution["parent_execution_id"],
            parent_event_id=execution["parent_event_id"],
            parent_task=execution["parent_task"],
            depth=execution["depth"] or 0,
        )
        self.plan = Plan.model_validate(self.executions[self.execution_id]["plan"])
        self.digest = None if execution["parent_execution_id"] is not None else plan_digest(execution["plan"])
        self.events: list[dict[str, Any]] = []
        self.keys: dict[str, dict[str, Any]] = {}  # event key -> its row
        self.variables: dict[str, dict[str, Any]] = {}  # scope -> name -> value as stored
        self.loops: dict[str, dict[str, Any]] = {}
        self.joins: dict[tuple[int, str], dict[str, Any]] = {}
        self.values: dict[tuple[int, str], Any] = {}  # (execution, sha256) -> a value kept by reference
        self.catalog = {str(entry["path"]): dict(entry) for entry in catalog}
        self.recorded_values = values
        self.key = f"memory:{uuid.uuid4().hex}"  # Reads.store_key: unlike any other store's

    # --- transactions ------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """What is written inside is undone when it raises (a rollback)."""
        rows = len(self.events)
        executions = {k: dict(v) for k, v in self.executions.items()}
        variables = {k: dict(v) for k, v in self.variables.items()}
        loops = {k: dict(v) for k, v in self.loops.items()}
        joins = {k: dict(v) for k, v in self.joins.items()}
        values = set(self.values)
        try:
            yield
        except BaseException:
            for row in self.events[rows:]:
                self.keys.pop(row["event_id"], None)
            del self.events[rows:]
            self.executions, self.variables, self.loops, self.joins = executions, variables, loops, joins
            for key in set(self.values) - values:
                del self.values[key]
            raise

    def last_write_commits(self) -> bool:
        return False  # nothing to commit: the last write is a write like the others

    # --- the execution -------------------------------------------------------------------

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
        pending: int = 0,
        state_version: int = 0,
    ) -> None:
        if execution_id in self.executions:
            raise ValueError(f"execution {execution_id} exists")
        self.executions[execution_id] = {
            "execution_id": execution_id,
            "parent_execution_id": parent_execution_id,
            "parent_event_id": parent_event_id,
            "parent_task": as_stored(parent_task),
            "depth": depth,
            "status": "running",
            "plan": as_stored(plan),
            "workload": as_stored(workload),
            "error": None,
            "failed_step": None,
            "pending": pending,
            "state_version": state_version,
            "timeout": timeout,
        }

    def execution(self, execution_id: int | None = None) -> dict[str, Any] | None:
        """An execution's row (the replayed one's by default), a copy."""
        found = self.executions.get(self.execution_id if execution_id is None else execution_id)
        return None if found is None else dict(found)

    def execution_head(self, execution_id: int, *, deciding: bool = False) -> dict[str, Any] | None:
        row = self.executions.get(execution_id)
        return None if row is None else {k: row[k] for k in ("status", "pending", "state_version")}

    def state(self, execution_id: int, min_version: int = 0) -> ExecutionState:
        """The replayed execution's state as its rows and variables hold it now (built afresh: a
        decision's own changes to it are not kept unless written)."""
        if execution_id != self.execution_id:
            raise LookupError(f"execution {execution_id} is not held here")
        row = self.executions[execution_id]
        state = ExecutionState(execution_id, self.plan, row["workload"], row["parent_execution_id"], digest=self.digest)
        state.load_variables(self.variables, row["state_version"])
        state.pending = row["pending"]
        return state

    def bump_execution(self, execution_id: int, *, pending: int = 0, version: int = 0) -> tuple[int, int, str]:
        row = self.executions.get(execution_id)
        if row is None:
            raise LookupError(f"execution {execution_id} not found")
        row["pending"] += pending
        row["state_version"] += version
        return int(row["pending"]), int(row["state_version"]), str(row["status"])

    def finish_execution(
        self, execution_id: int, status: str, *, error: Any = None, failed_step: str | None = None
    ) -> bool:
        row = self.executions.get(execution_id)
        if row is None or row["status"] != "running":
            return False
        row.update(status=status, error=as_stored(secret_registry.mask(error)), failed_step=failed_step)
        return True

    def execution_link(self, execution_id: int) -> dict[str, Any] | None:
        row = self.executions.get(execution_id)
        return None if row is None else {k: copy.deepcopy(row[k]) for k in LINK}

    # --- rows and variables ----------------------------------------------------------------

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
        """store.decisions.record_decision as SQLite makes it (no strict statement: `last` changes
        nothing, and a count or bump left to it is refused). Leases are not kept."""
        execution_id = rows[0]["execution_id"]
        rows, variables = blobs.with_references(rows, variables, lambda value: self.put_value(execution_id, value))
        if count is not None or bump is not None:
            raise Conflict(
                f"execution {execution_id}: a count or bump left to the write needs the one strict statement"
            )
        if head_version is not None:
            head = self.execution_head(execution_id)
            if not running_at(head, head_version):
                raise Conflict(f"execution {execution_id}: head {head} is not running at version {head_version}")
        if not self.insert_events(rows, first_must_be_new=True, new_keys=new_keys):
            return Recorded(False, {})
        return Recorded(True, {scope: self._put_variables(scope, values) for scope, values in variables.items()})

    def _put_variables(self, scope: str, values: dict[str, Any]) -> dict[str, Any]:
        stored = {name: as_stored(limits.cap(secret_registry.mask(value))) for name, value in values.items()}
        self.variables.setdefault(scope, {}).update(stored)
        return {name: copy.deepcopy(value) for name, value in stored.items()}

    def insert_events(
        self, rows: list[dict[str, Any]], *, first_must_be_new: bool = False, new_keys: Sequence[str] = ()
    ) -> bool:
        """Rows in order, each with its id; a row whose key exists is left out (store.events.insert_events)."""
        if not rows:
            return True
        now = clock.now()
        columns: list[dict[str, Any]] = [{c: r.get(c) for c in EVENT_COLUMNS} for r in rows]
        contents = secret_registry.mask([{k: r[k] for k in CONTENT_COLUMNS} for r in columns])
        inserted: set[str] = set()
        for row, content in zip(columns, contents, strict=True):
            key = row["event_id"]
            if row["execution_id"] != self.execution_id:
                raise ValueError(f"row {key!r} is of execution {row['execution_id']}, not of {self.execution_id}")
            if key in self.keys:
                continue
            stored = {
                "id": len(self.events) + 1,
                **row,
                **{k: as_stored(v) for k, v in content.items()},
                "created_at": row["created_at"] or now,
            }
            self.events.append(stored)
            self.keys[key] = stored
            inserted.add(key)
        if first_must_be_new and rows[0]["event_id"] not in inserted:
            return False
        return all(key in inserted for key in new_keys)

    def last_event_id(self) -> int:
        return len(self.events)

    def events_after(self, after_id: int) -> list[dict[str, Any]]:
        """The rows written after row `after_id` (its id), in order; copies."""
        return copy.deepcopy(self.events[after_id:])

    # --- values kept by reference ----------------------------------------------------------

    def put_value(self, execution_id: int, value: Any) -> Any:
        if isinstance(value, Streamed):
            return None  # held whole here: the caller builds the value and keeps it (entries.Streamed)
        form = blobs.stored_form(execution_id, value)
        if not isinstance(form, blobs.Kept):
            return form
        self.values.setdefault((execution_id, form.digest), json.loads(form.raw))
        return form.ref

    def put_collection(self, execution_id: int, items: list[Any], source: Mapping[str, Any] | None = None) -> Any:
        def keep(page: blobs.Kept) -> None:
            self.values.setdefault((execution_id, page.digest), json.loads(page.raw))

        if source is None:
            return blobs.collection_form(execution_id, items, keep)
        raw = blobs.encode(self.fetch(source))[1]  # the stored text, read as the store reads it
        return blobs.stored_collection_form(execution_id, source, blobs.PLAIN, [raw], keep)

    def fetch(self, ref: Mapping[str, Any]) -> Any:
        """The whole value of a reference: one kept here, else the recorded store's."""
        key = (int(ref["execution_id"]), str(ref["sha256"]))
        if key in self.values:
            return self.values[key]
        if self.recorded_values is not None:
            return self.recorded_values(ref)
        raise LookupError(f"the value stored by reference {key[1][:12]} of execution {key[0]} is not held here")

    def value_reader(self) -> Callable[[Mapping[str, Any]], Any]:
        return self.fetch

    # --- loops and joins -----------------------------------------------------------------

    def create_loop(self, values: dict[str, Any]) -> None:
        run_id = values["run_id"]
        if run_id in self.loops:
            return
        self.loops[run_id] = {
            **values,
            "collection": as_stored(values.get("collection")),
            "context": as_stored(values.get("context")),
            "status": "running",
            **dict.fromkeys(("dispatched", "done", "succeeded", "failed", "tolerated", "slots_ended"), 0),
        }

    def _loop(self, run_id: str) -> dict[str, Any]:
        loop = self.loops.get(run_id)
        if loop is None:
            raise LookupError(f"loop {run_id} not found")
        return loop

    def claim_loop_indexes(self, run_id: str, count: int) -> int:
        loop = self.loops.get(run_id)
        if loop is None:
            return 0
        loop["dispatched"] += count
        return int(loop["dispatched"])

    def loop_iteration_done(self, run_id: str, *, ok: bool, tolerated: bool = False) -> dict[str, Any]:
        loop = self._loop(run_id)
        loop["done"] += 1
        loop["succeeded"] += 1 if ok else 0
        loop["failed"] += 0 if ok else 1
        loop["tolerated"] += 1 if tolerated else 0
        return {k: copy.deepcopy(loop[k]) for k in LOOP_COUNTERS}

    def loop_iteration_done_checked(
        self, execution_id: int, run_id: str, *, ok: bool, tolerated: bool = False
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        head = self.execution_head(execution_id, deciding=True)
        if head is None or head["status"] != "running":
            return None, head
        return self.loop_iteration_done(run_id, ok=ok, tolerated=tolerated), head

    def complete_loop(self, run_id: str) -> bool:
        loop = self.loops.get(run_id)
        if loop is None or loop["status"] != "running":
            return False
        loop["status"] = "completed"
        return True

    def end_loop_slot(self, run_id: str) -> dict[str, Any]:
        loop = self._loop(run_id)
        loop["slots_ended"] += 1
        return {k: loop[k] for k in SLOT_COUNTERS}

    def open_join(self, execution_id: int, fork_id: str, join_step: str, width: int) -> None:
        self.joins.setdefault(
            (execution_id, fork_id), {"join_step": join_step, "width": width, "settled": 0, "arrived": 0}
        )

    def settle_join(self, execution_id: int, fork_id: str, *, arrived: bool) -> tuple[int, int, int]:
        join = self.joins.get((execution_id, fork_id))
        if join is None:
            raise LookupError(f"fork {fork_id} of execution {execution_id} not found")
        join["settled"] += 1
        join["arrived"] += 1 if arrived else 0
        return int(join["settled"]), int(join["arrived"]), int(join["width"])

    # --- reads -----------------------------------------------------------------------------

    def reads(self, execution_id: int, connection: Callable[[], Any] | None = None) -> MemoryReads:
        if execution_id != self.execution_id:
            raise LookupError(f"execution {execution_id} is not held here")
        return MemoryReads(self)


class MemoryReads:
    """`Reads` (engine/decision/reads.py) of the execution a `MemoryStore` holds; copies, as a
    read of the store gives."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def count_events(self, event_type: str) -> int:
        return sum(1 for row in self.store.events if row["event_type"] == event_type)

    def event(self, event_id: str) -> dict[str, Any] | None:
        row = self.store.keys.get(event_id)
        return None if row is None else copy.deepcopy(row)

    def event_meta(self, event_id: str) -> dict[str, Any]:
        meta = (self.store.keys.get(event_id) or {}).get("meta")
        return copy.deepcopy(meta) if isinstance(meta, dict) else {}

    def run_events(self, run_id: str, event_type: str, columns: Sequence[str]) -> list[dict[str, Any]]:
        return [
            {c: copy.deepcopy(row.get(c)) for c in columns}
            for row in self.store.events
            if row["run_id"] == run_id and row["event_type"] == event_type
        ]

    def iteration_ends(self, run_id: str) -> Iterator[tuple[int, bool, Any]]:
        for iteration, failed, end in iteration_ends_in(self.store.events, run_id):
            yield iteration, failed, copy.deepcopy(end)

    def run_results(self, run_id: str, event_type: str) -> list[Any]:
        return [row["result"] for row in self.run_events(run_id, event_type, ("result",))]

    def loop(self, run_id: str, *, with_collection: bool = False) -> dict[str, Any] | None:
        loop = self.store.loops.get(run_id)
        if loop is None:
            return None
        return {k: copy.deepcopy(v) for k, v in loop.items() if with_collection or k != "collection"}

    def value(self, reference: Mapping[str, Any]) -> Any:
        return self.store.fetch(reference)

    def read_once(self, reference: Mapping[str, Any]) -> Any:
        return self.store.fetch(reference)

    def execution_link(self) -> dict[str, Any] | None:
        return self.store.execution_link(self.store.execution_id)

    def playbook(self, path: str) -> dict[str, Any] | None:
        entry = self.store.catalog.get(path)
        return None if entry is None else dict(entry)

    def store_key(self) -> str:
        return self.store.key
