"""on_event: the only place that decides what runs next, and records every decision.

One call handles one event in one database transaction:
  1. decide (counters of loops and joins are updated atomically as the decision needs them),
  2. record the causing event row with the messages to dispatch (its key is deterministic: a
     redelivered event conflicts on the unique key and the whole transaction rolls back),
  3. record the decision rows, variables and the execution's counters,
  4. after commit, publish the messages. A redelivered event whose row exists re-publishes the
     stored messages (flagged `replay`), so a crash between commit and publish loses nothing.

The decision reads and writes through a `DecisionStore` (store_port.py): the event store in its
transaction (`handle_event`), or a store held in memory (`decide_in`, what replay decides on).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.vocabulary import DispatchKind, ErrorKind, PayloadKind
from noetl_celery.engine.context import STATE, ExecutionState, seed_of
from noetl_celery.engine.decision import core, policy_eval, write
from noetl_celery.engine.decision.inputs import DecisionInputs, Draws
from noetl_celery.engine.decision.outcomes import OutcomeRules
from noetl_celery.engine.decision.sql_store import SqlDecisionStore
from noetl_celery.engine.decision.steps import StepFlow
from noetl_celery.engine.decision.store_port import DecisionStore, HeldStore
from noetl_celery.engine.decision.tasks import TaskFlow
from noetl_celery.engine.decision.write import DuplicateEvent, Redecide
from noetl_celery.engine.messages import BATCH_EVENT, Dispatch, OutcomeEvent, TaskMessage
from noetl_celery.store import blobs, repo
from noetl_celery.store.db import decision_transaction, transaction
from noetl_celery.templates.render import reading

log = logging.getLogger(__name__)

# step runs and inline loop iterations without work one decision may chain (core.py)
MAX_INLINE_DEPTH = core.MAX_INLINE_DEPTH
START_KEY = ev.START_KEY
SEEDED_MESSAGES = 16  # a start that sends more (a loop's first iterations) sends them without a seed
loop_strategy = core.loop_strategy


class Decider(OutcomeRules, TaskFlow, StepFlow):
    """One event's decision: a small coordinator of its roles, each a class of its own module.

    core.DecisionCore: the `Decision` value (value.py) in progress, the head it assumes, its
    records and bounds; outcomes.OutcomeRules: an attempt's outcome, policy, retry and pages;
    tasks.TaskFlow: dispatch, routing-only tasks, the end of a unit; steps.StepFlow: step start
    and end, routing, joins. write.py writes the decision (`flush`). The loop, cursor and
    sub-playbook strategies see the Decider through port.DecisionPort."""

    def inline_bound(self) -> int:
        return MAX_INLINE_DEPTH  # read here, so that a test may lower it on this module


def _deferred_state(url: str, execution_id: int, message: TaskMessage) -> ExecutionState | None:
    """The cached state an attempt's outcome can be decided on without reading the head first
    (None: decide the classic way). The message says which state version its decision saw; the
    head read later in the transaction must confirm the cached version is the newest."""
    state = STATE.peek(url, execution_id, min_version=message.version)
    if state is None or message.step not in state.plan.steps:
        return None
    return state


Outcome = tuple[TaskMessage, dict[str, Any], dict[str, Any]]  # an attempt's message, outcome, report


def outcomes_of(payload: dict[str, Any]) -> list[Outcome]:
    """The attempt outcomes an event reports, in order: one, or a batch's (engine/decision/batching.py).
    A batch message that ended without reporting (lost, worker_lost, timeout) gives its one
    outcome to each of its iterations."""
    if payload["kind"] == BATCH_EVENT:
        return [(TaskMessage.from_dict(e["task"]), e["outcome"], e["report"]) for e in payload["events"]]
    event = OutcomeEvent.from_dict(payload)
    message = TaskMessage.from_dict(event.task)
    return [(member, event.outcome, event.report) for member in message.members()]


def handle_event(url: str, payload: dict[str, Any], *, draws: Draws | None = None) -> list[Dispatch]:
    """Decide on one event; returns what to publish (already recorded). `draws`: the random
    draws the decision takes (replay: the recorded ones; default new ones)."""
    execution_id = int(payload["execution_id"])
    kind = payload["kind"]
    outcomes = outcomes_of(payload) if kind in (PayloadKind.OUTCOME, PayloadKind.BATCH) else []
    deferred = _deferred_state(url, execution_id, outcomes[0][0]) if outcomes else None
    inputs = DecisionInputs.load(draws)
    try:
        with policy_eval.drawing(inputs.draws):
            decided = write.decide_until_current(
                lambda first: _decide(url, payload, outcomes, deferred if first else None, inputs, strict=first),
                forget=lambda: STATE.forget(url, execution_id),
            )
        if decided is None:
            return []
        decider, dispatches = decided
    except DuplicateEvent as dup:
        STATE.forget(url, execution_id)
        ran_by = (payload.get("report") or {}).get("queue_id")  # a redelivered message's Celery task id
        return replay(url, execution_id, str(dup), ran_by=ran_by)
    except Exception:
        STATE.forget(url, execution_id)  # the in-memory state saw writes that were rolled back
        raise
    decider.keep_state(url)
    return dispatches


def _decide(
    url: str,
    payload: dict[str, Any],
    outcomes: list[Outcome],
    state: ExecutionState | None,
    inputs: DecisionInputs,
    *,
    strict: bool,
) -> tuple[Decider, list[Dispatch]] | None:
    """One transaction deciding one event. With `state`, a deferred decision (see Decider).
    `strict`: its last write may commit it, and refuses rows that exist (Redecide): the first
    try of every event. The second, after a Redecide, tells a redelivery (DuplicateEvent) from
    rows that may exist."""
    with decision_transaction(url) as conn, reading(blobs.reader(conn)):  # results stored by reference
        return _decide_on(SqlDecisionStore(conn, url), payload, outcomes, state, inputs, strict=strict)


def _decide_on(
    store: DecisionStore,
    payload: dict[str, Any],
    outcomes: list[Outcome],
    state: ExecutionState | None,
    inputs: DecisionInputs,
    *,
    strict: bool,
) -> tuple[Decider, list[Dispatch]] | None:
    """Decide one event on `store`, inside its transaction (see `_decide`)."""
    execution_id = int(payload["execution_id"])
    kind = payload["kind"]
    if state is not None:
        decider = Decider(
            connection=store.connection,
            store=store,
            state=state,
            running=True,
            version=state.version,
            inputs=inputs,
            deferred=True,
            strict=strict and len(outcomes) == 1 and store.last_write_commits(),
        )
    else:
        head = store.execution_head(execution_id, deciding=True)
        if head is None:
            log.warning("event for unknown execution %s dropped", execution_id)
            return None
        state = store.state(execution_id, head["state_version"])
        decider = Decider(
            connection=store.connection,
            store=store,
            state=state,
            running=head["status"] == "running",
            version=head["state_version"],
            inputs=inputs,
        )
    if kind == PayloadKind.START:
        decider.start_execution()
    elif kind in (PayloadKind.OUTCOME, PayloadKind.BATCH):
        for message, outcome, report in outcomes:
            decider.depth = 0
            decider.on_outcome(message, outcome, report)
        if len(outcomes) == 1 and kind == PayloadKind.OUTCOME:  # its outcome row answers the lease
            decider.decision.settles = outcomes[0][0].lease
    else:
        raise ValueError(f"unknown event kind {kind!r}")
    dispatches = decider.flush(last=strict)
    if decider.deferred:  # nothing was written: impossible, flush inserts the causing row
        raise Redecide()
    return decider, dispatches


def decide_in(store: HeldStore, payload: dict[str, Any], *, draws: Draws | None = None) -> list[Dispatch]:
    """Decide on one event on a store held in memory, as `handle_event` decides on the event
    store: each try in a transaction of `store`, the redecide loop, no process state cache (the
    state is the store's). A redelivery (DuplicateEvent) is dropped: nothing is written and
    nothing published again. Returns what the decision dispatches."""
    execution_id = int(payload["execution_id"])
    kind = payload["kind"]
    outcomes = outcomes_of(payload) if kind in (PayloadKind.OUTCOME, PayloadKind.BATCH) else []
    inputs = DecisionInputs.load(draws)
    try:
        with policy_eval.drawing(inputs.draws):
            decided = write.decide_until_current(
                lambda first: _decide_held(store, payload, outcomes, inputs, strict=first), forget=lambda: None
            )
    except DuplicateEvent:
        log.info("event %s of execution %s decided before: dropped", payload.get("kind"), execution_id)
        return []
    return [] if decided is None else decided[1]


def _decide_held(
    store: HeldStore, payload: dict[str, Any], outcomes: list[Outcome], inputs: DecisionInputs, *, strict: bool
) -> tuple[Decider, list[Dispatch]] | None:
    """One try of `decide_in`, in one transaction of the store (undone by an exception)."""
    with store.transaction(), reading(store.value_reader()):
        return _decide_on(store, payload, outcomes, None, inputs, strict=strict)


def start_new(conn: Connection, state: ExecutionState, create_row: Callable[[int, int], None]) -> list[Dispatch]:
    """Decide the start of an execution that is created in this same transaction
    (runner.submit): `create_row(pending, state_version)` inserts its row when the decision is
    written, with the counters the start leaves. Returns what to publish once it commits.
    In a `db.decision_transaction` the start's rows are the last write, which commits."""
    decider = Decider(connection=conn, state=state, running=True, version=state.version, create_row=create_row)
    decider.start_execution()
    dispatches = decider.flush(last=True)
    seed = None if decider.decision.variables else seed_of(state, decider.written_version, decider.written_pending)
    if seed is None or len(dispatches) > SEEDED_MESSAGES:
        return dispatches
    return [x.seeded(seed) if x.kind == DispatchKind.RUN else x for x in dispatches]


def fail_internally(url: str, payload: dict[str, Any], reason: str, *, kind: str = ErrorKind.INTERNAL) -> None:
    """An event could not be decided (a defect, a lasting outage, a value the store refuses):
    fail the execution, recorded, rather than leave it running forever."""
    execution_id = int(payload["execution_id"])
    error = {"kind": kind, "message": reason[:2000]}
    events: list[dict[str, Any]] = payload.get("events") or [{}]
    task = payload.get("task") or events[0].get("task") or {}
    step = task.get("step")
    try:
        with transaction(url) as conn:
            if repo.finish_execution(conn, execution_id, "failed", error=error, failed_step=step):
                repo.insert_events(
                    conn,
                    [
                        {
                            "execution_id": execution_id,
                            "event_id": ev.EXECUTION_FAILED,
                            "event_type": ev.EXECUTION_FAILED,
                            "status": "failed",
                            "step": step,
                            "error": error,
                        }
                    ],
                )
    except Exception:  # the store itself is gone: nothing more can be recorded
        log.exception("could not record the failure of execution %s", execution_id)
    STATE.forget(url, execution_id)


def replay(url: str, execution_id: int, key: str, *, ran_by: str | None = None) -> list[Dispatch]:
    """A redelivered event: publish again what its first delivery decided (receivers dedupe). A
    message decided with a countdown keeps what is left of it: a retry's backoff still holds.
    `ran_by`: the Celery task id of a redelivered message, which may have run attempts of its own
    decisions itself (engine/transport/eager.py): an attempt recorded with that id as its queue_id is not
    sent again; its decision is replayed in its place, and so on to the attempts not recorded."""
    replayed = []
    followed: set[str] = set()
    with transaction(url) as conn:
        rows = [repo.find_event(conn, execution_id, key)]
        while rows:
            row = rows.pop()
            elapsed = _since(row)
            for stored in ((row or {}).get("meta") or {}).get("dispatch") or []:
                dispatch = Dispatch.from_dict(stored)
                if ran_by is not None and dispatch.kind == DispatchKind.RUN:
                    attempt = dispatch.attempt_key()
                    if attempt in followed:
                        continue
                    outcome = repo.find_event(conn, execution_id, attempt + ".done")
                    if outcome is not None and outcome.get("queue_id") == ran_by:
                        followed.add(attempt)
                        rows.append(outcome)
                        continue
                replayed.append(dispatch.as_replay(countdown=max(dispatch.countdown - elapsed, 0.0)))
    return replayed


def _since(row: dict[str, Any] | None) -> float:
    """Seconds since an event row was decided (infinite when unknown)."""
    decided = (row or {}).get("created_at")
    if not isinstance(decided, datetime):
        return math.inf
    decided = decided if decided.tzinfo is not None else decided.replace(tzinfo=UTC)  # SQLite: naive UTC
    return (repo.utcnow() - decided).total_seconds()


def start_payload(execution_id: int) -> dict[str, Any]:
    return {"kind": PayloadKind.START, "execution_id": execution_id}
