"""The write of a decision: how what the Decider decided reaches the event store in one round trip.

The Decider (orchestrator.py) decides *what* happens: rows, dispatches, variables, counter
changes, the end of the execution. This module owns *how* it is written: the execution
counters' update (or the new execution's insert), the one-statement write of rows and
variables (`record_decision`), the optimistic concurrency of a decision made on a cached
head (a moved head raises Redecide, and `decide_until_current` decides again the classic way), the
duplicate check of a redelivered event (DuplicateEvent), and the process's state cache after
the commit. Every write goes through the decision's `DecisionStore` (store_port.py): the
event store in its transaction (sql_store.py), or replay's store held in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine import deadlines
from noetl_celery.engine.context import STATE, ExecutionState
from noetl_celery.engine.decision import batching, subplaybooks
from noetl_celery.engine.decision import entries as en
from noetl_celery.engine.decision.inputs import DecisionInputs
from noetl_celery.engine.decision.store_port import DecisionStore
from noetl_celery.engine.decision.value import Decision
from noetl_celery.engine.messages import Dispatch
from noetl_celery.store import repo

IterationCount = repo.IterationCount  # an iteration's count left to the decision's last write


class DuplicateEvent(Exception):
    """The causing event was recorded before: this delivery is a redelivery."""


class Redecide(Exception):
    """A decision made on the cached head turned out stale (the execution is not running any
    more, or its state is newer than the cached one): roll back and decide the classic way."""


class Decided(Protocol):
    """The decision in progress as the write reads it: its `Decision` value and the head it assumed."""

    store: DecisionStore
    state: ExecutionState
    running: bool
    decision: Decision
    version: int
    deferred: bool
    written: dict[str, dict[str, Any]]
    written_version: int | None
    written_pending: int | None
    create_row: Callable[[int, int], None] | None
    strict: bool
    later_count: IterationCount | None
    inputs: DecisionInputs

    @property
    def execution_id(self) -> int: ...

    @property
    def plan(self) -> Any: ...

    def record(self, event_type: str, key: str, **fields: Any) -> str: ...


T = TypeVar("T")


# --- the head a decision assumed, and the writes strategies ask for (entries.py) -----------------


def checked(d: Decided) -> DecisionStore:
    """The decision's store; a deferred decision reads (and locks) the execution head before
    the first statement that uses it, and a head that moved on raises Redecide."""
    if d.deferred:
        d.deferred = False
        check_head(d, d.store.execution_head(d.execution_id, deciding=True))
    return d.store


def check_head(d: Decided, head: dict[str, Any] | None) -> None:
    """Redecide unless the execution still runs at the version the decision assumed."""
    if not repo.running_at(head, d.version):
        raise Redecide()


def count_iteration(d: Decided, entry: en.CountIteration) -> dict[str, Any]:
    """Count one finished loop iteration (`repo.loop_iteration_done`); in a deferred decision
    the same statement reads and locks the execution head.

    `entry.unless_last`: the loop's (max_in_flight, total) as this process knows them. A strict deferred
    decision then leaves the count to its last write, which refuses it when the iteration is
    the loop's last (Redecide: the classic decision finishes the loop); the counters returned
    have `done` None, and the caller goes on as for an iteration that is not the last."""
    run_id, ok, tolerated = entry.run_id, entry.ok, entry.tolerated
    if entry.unless_last is not None and d.strict and d.deferred and d.later_count is None:
        max_in_flight, total = entry.unless_last
        d.later_count = IterationCount(run_id, ok, tolerated, max_in_flight, total)
        return {"done": None, "max_in_flight": max_in_flight, "total": total, "context": None}
    if not d.deferred:
        return checked(d).loop_iteration_done(run_id, ok=ok, tolerated=tolerated)
    d.deferred = False
    counters, head = d.store.loop_iteration_done_checked(d.execution_id, run_id, ok=ok, tolerated=tolerated)
    check_head(d, head)
    assert counters is not None
    return counters


def _create_loop(d: Decided, entry: en.CreateLoop) -> None:
    checked(d).create_loop(
        {
            "run_id": entry.run_id,
            "execution_id": d.execution_id,
            "step": entry.step,
            "mode": entry.mode,
            "total": entry.total,
            "max_in_flight": entry.max_in_flight,
            "collection": entry.collection,
            "context": entry.context,
        },
    )


def _create_child(d: Decided, entry: en.CreateChildExecution) -> None:
    checked(d).create_execution(
        execution_id=entry.execution_id,
        plan=entry.plan,
        workload=entry.workload,
        parent_execution_id=d.execution_id,
        parent_event_id=entry.parent_event_id,
        parent_task=entry.parent_task,
        depth=entry.depth,
        timeout=entry.timeout,
    )


_APPLY: dict[type, Callable[[Decided, Any], Any]] = {
    en.PutValue: lambda d, e: checked(d).put_value(d.execution_id, e.value),
    en.PutCollection: lambda d, e: checked(d).put_collection(d.execution_id, e.items, e.source),
    en.CreateLoop: _create_loop,
    en.ClaimIndexes: lambda d, e: checked(d).claim_loop_indexes(e.run_id, e.count),
    en.CountIteration: count_iteration,
    en.CompleteLoop: lambda d, e: checked(d).complete_loop(e.run_id),
    en.EndCursorSlot: lambda d, e: checked(d).end_loop_slot(e.run_id),
    en.OpenJoin: lambda d, e: checked(d).open_join(d.execution_id, e.fork_id, e.join_step, e.width),
    en.SettleJoin: lambda d, e: checked(d).settle_join(d.execution_id, e.fork_id, arrived=e.arrived),
    en.CreateChildExecution: _create_child,
}


def apply_entry(d: Decided, entry: en.Entry) -> Any:
    """Write one entry a strategy decided (entries.py), in the decision's transaction, and return
    what the strategy needs of it. The only place the strategies' writes reach the store."""
    return _APPLY[type(entry)](d, entry)


def child_end(conn: Connection, execution_id: int, status: str, results: dict[str, Any], error: Any) -> Dispatch | None:
    """The outcome event a finished child sends its parent (None for a top-level execution)."""
    return subplaybooks.child_end(repo.execution_link(conn, execution_id), execution_id, status, results, error)


def decide_until_current(decide: Callable[[bool], T], *, forget: Callable[[], None]) -> T:
    """The redecide loop of one event: `decide(True)` first, strict (on the cached head when
    there is one; its last write may commit, and refuses rows that exist); when that decision
    turns out stale (Redecide), the process's cached state is forgotten (`forget`) and the event
    is decided once more, `decide(False)`: the classic way, reading the head, which tells a
    redelivery (DuplicateEvent) from rows that may exist."""
    try:
        return decide(True)
    except Redecide:
        forget()
        return decide(False)


def flush(d: Decided, *, last: bool = False) -> list[Dispatch]:
    """Write everything decided; raises DuplicateEvent (and rolls back) on a redelivery.

    `last`: nothing follows in the transaction; the write may commit it, and then refuses a
    row that exists, raising Redecide (see `repo.record_decision`)."""
    version, finished, bump = _counters(d, last)
    if d.decision.failure is not None:
        checked(d).finish_execution(
            d.execution_id,
            "failed",
            error=d.decision.failure["error"],
            failed_step=d.decision.failure["step"],
        )
    dispatches = _dispatches(d, version, finished)
    # the causing row is built last, with the decision's dispatch list (rows.py)
    d.decision.seal_cause(
        [x.stored() for x in dispatches],  # task messages in their wire form
        deadlines.decision_deadline(d.inputs.clock(), dispatches) if dispatches else None,
    )
    _record(d, last, bump)
    return _answering(d, dispatches)


def _answering(d: Decided, dispatches: list[Dispatch]) -> list[Dispatch]:
    """A decision's only message, a plain attempt (not a batch, not another execution's), carries
    the decision row's key: its outcome's decision deletes the lease it answers (TaskMessage.lease),
    which the sweeper then never reads. Any other lease waits for the sweeper, and each of its
    attempts' messages carries the key as the lease it shares (TaskMessage.shares), so that a
    worker that takes one late moves it on."""
    ours = [x.kind == DispatchKind.RUN and x.message.get("execution_id") == d.execution_id for x in dispatches]
    if not any(ours):
        return dispatches
    key = d.decision.rows[0]["event_id"]
    if len(dispatches) == 1 and not dispatches[0].message.get("batch"):
        return [dispatches[0].answering(key)]
    return [x.sharing(key) if mine else x for x, mine in zip(dispatches, ours, strict=True)]


def _counters(d: Decided, last: bool) -> tuple[int, bool, repo.Bump | None]:
    """The execution counters' change (pending units, state version), and the execution's end
    when no unit is pending any more: (the version written, whether it finished, the bump the
    last write makes instead of a statement now)."""
    if not _changes_counters(d):
        return d.version, False, None
    pending, version, bump = _bump_counters(d, last, 1 if d.decision.variables else 0)
    d.written_version = version
    d.written_pending = None if bump is not None and bump.expected is None else pending
    finished = False
    if d.running and d.decision.failure is None and pending <= 0:
        finished = _complete(d, bump)
    return version, finished, bump


def _changes_counters(d: Decided) -> bool:
    """The decision changes the execution's row: a new one, pending units, variables, a failure."""
    decision = d.decision
    return d.create_row is not None or bool(decision.pending or decision.variables) or decision.failure is not None


def _bump_counters(d: Decided, last: bool, step: int) -> tuple[int, int, repo.Bump | None]:
    """Move the counters by the decision (a new row's insert, the last write's bump, or an update
    now that reads the head): (pending, version, the bump left to the last write)."""
    deferred, d.deferred = d.deferred, False
    if d.create_row is not None:
        d.create_row(d.decision.pending, d.version + step)
        return d.decision.pending, d.version + step, None
    if deferred and (bump := _bump_for_write(d, last, step)) is not None:
        d.deferred = True  # the write checks the head
        pending = 1 if bump.expected is None else bump.expected + bump.pending
        return pending, d.version + step, bump
    pending, version, status = (d.store if deferred else checked(d)).bump_execution(
        d.execution_id, pending=d.decision.pending, version=step
    )
    if deferred and (status != "running" or version != d.version + step):
        raise Redecide()  # the update read the head: it moved on since the cached state
    return pending, version, None


def _complete(d: Decided, bump: repo.Bump | None) -> bool:
    """No unit is pending any more: the execution's end row; whether this write finished it."""
    d.record(
        ev.EXECUTION_COMPLETED,
        ev.EXECUTION_COMPLETED,
        status="completed",
        parent_event_id=d.decision.rows[-1]["event_id"] if d.decision.rows else None,
    )
    if bump is not None:
        return bump.finish  # the write completes it
    return bool(checked(d).finish_execution(d.execution_id, "completed"))


def _dispatches(d: Decided, version: int, finished: bool) -> list[Dispatch]:
    """The messages to publish: grouped into batches, stamped with the state version, and a
    child execution's end for its parent."""
    if not d.running:
        return []
    dispatches = [
        x.with_version(version) for x in batching.group(d.plan, d.decision.dispatches, d.decision.durations_ms)
    ]
    if d.state.parent_execution_id is not None and (finished or d.decision.failure is not None):
        status = "failed" if d.decision.failure is not None else "completed"
        link = checked(d).execution_link(d.execution_id)
        end = subplaybooks.child_end(
            link, d.execution_id, status, d.state.results, (d.decision.failure or {}).get("error")
        )
        if end is not None:
            dispatches.append(end)
    return dispatches


def _record(d: Decided, last: bool, bump: repo.Bump | None) -> None:
    """The one-statement write of rows and variables (the head checked in it when no statement
    read it, or when it counts an iteration)."""
    head_version = d.version if d.deferred or d.later_count is not None else None
    d.deferred = False
    try:
        recorded = d.store.record_decision(
            d.decision.writable_rows(),
            d.decision.variables,
            new_keys=d.decision.later_causes,
            last=last,
            head_version=head_version,
            count=d.later_count,
            bump=bump,
            settles=d.decision.settles,
        )
    except repo.Conflict as exc:
        raise Redecide() from exc
    if not recorded.new:
        raise DuplicateEvent(d.decision.rows[0]["event_id"])
    d.written = recorded.stored
    if bump is not None and d.decision.variables:  # read back after the commit
        if recorded.stored:
            d.written_pending = recorded.pending
        else:  # a later decision came first: keep_state leaves the state to be read again
            d.written_version = None


def _bump_for_write(d: Decided, last: bool, step: int) -> repo.Bump | None:
    """The execution counters' update the decision's strict last write can make (None: it is
    made first, and returns the head). A decision that could end the execution needs the
    pending count: the cached one is expected, and a wrong guess is refused by the write."""
    if not (last and d.strict and d.decision.failure is None and d.later_count is None):
        return None
    if d.decision.pending >= 0:  # an outcome's unit was pending: the count stays above 0
        return repo.Bump(d.decision.pending, step)
    known = d.state.pending
    if known is None or known + d.decision.pending < 0:
        return None
    if known + d.decision.pending > 0:
        return repo.Bump(d.decision.pending, step, expected=known)
    if d.state.parent_execution_id is not None or d.decision.dispatches:  # a child's end reads its parent
        return None
    return repo.Bump(d.decision.pending, step, expected=known, finish=True)


def keep_state(d: Decided, url: str) -> None:
    """After the commit: the process's cached state becomes what this decision wrote when it
    moved the execution exactly one version on from the state it read (no other decision
    came between them); otherwise it is dropped, and read again when next needed."""
    if not d.decision.variables:
        return
    if d.written_version == d.version + 1 and d.state.version == d.version:
        STATE.advance(url, d.state, d.written_version, d.written, d.written_pending)
    else:
        STATE.forget(url, d.execution_id)
