"""Resume: a failed or cancelled execution continues where it stopped.

Decides: a resume is the SAME execution in a new epoch (noetl_execution.epoch + 1), not a new
linked one: its ctx, vars, step results, loop counters and event log stay where they are, and
every key already recorded keeps deduplicating redeliveries of the old epoch. In one transaction:
- the execution is running again and an `execution.resumed` row (key `execution.resumed.e<N>`)
  records the decision and carries the dispatch list (with a deadline, like any decision);
- the rows that ended it (`execution.failed` / `execution.cancelled`, and the failed step's
  `step.done`) are kept under an archived key (`<key>.e<N>`), so the step can end again;
- an outcome that was recorded but not acted on (it arrived after the end) is decided now;
- an attempt dispatched without an outcome row is dispatched again (flagged replay: a late
  outcome of the old epoch still wins);
- the attempt whose failure failed a (non-loop) step runs again as its next attempt;
- a collection loop that was stopped (still running, or the loop that failed its step) continues:
  completed iterations keep their results, failed and never-dispatched ones run (engine/recovery/resume_loops.py);
- a sub-playbook task whose child ended with this execution (cancelled or timed out with it,
  error `ended_with`) runs again as its next attempt: a new child; a child that is still running,
  or whose end is on its way, is in flight; a child's end recorded but not acted on is decided now;
- a playbook `timeout:` counts again from the resume (deadline_at: now + the execution's timeout).
Refused: an execution that is running or completed, and a failure that was a decision rather than
an attempt (nothing would run).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Connection

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import ExecutionNotFound, NoetlError
from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine.context import STATE
from noetl_celery.engine.decision.orchestrator import Decider
from noetl_celery.engine.decision.rows import OpenRow, Row
from noetl_celery.engine.decision.subplaybooks import EVENT_DISPATCH
from noetl_celery.engine.messages import Dispatch, TaskMessage
from noetl_celery.engine.recovery.resume_loops import reopen_loops
from noetl_celery.store import recovery as store_recovery
from noetl_celery.store import repo
from noetl_celery.store.db import transaction

OK_TYPES = (ev.ACTION_COMPLETED, ev.ITERATION_COMPLETED, ev.PAGE_COMPLETED)
ENDING_KEYS = (ev.EXECUTION_FAILED, ev.EXECUTION_CANCELLED, ev.EXECUTION_COMPLETED)


class ResumeRefused(NoetlError):
    """The execution cannot be resumed (says why)."""


def resume(url: str, execution_id: int) -> tuple[int, list[Dispatch]]:
    """Resume the execution; returns (its new epoch, the messages to publish after commit)."""
    with transaction(url) as conn:
        status = repo.lock_execution(conn, execution_id)
        if status is None:
            raise ExecutionNotFound(f"no execution {execution_id}")
        if status not in ("failed", "cancelled"):
            raise ResumeRefused(f"execution {execution_id} is {status}: only a failed or cancelled execution resumes")
        execution = repo.get_execution(conn, execution_id) or {}
        epoch = int(execution.get("epoch") or 0) + 1
        events = repo.list_events(conn, execution_id)
        STATE.forget(url, execution_id)
        state = STATE.get(url, execution_id, conn=conn)
        head = repo.execution_head(conn, execution_id) or {}
        decider = Decider(connection=conn, state=state, running=True, version=head.get("state_version", 0))
        timeout = _timeout(execution, {e["event_id"]: e for e in events}, epoch)
        decider.record(
            ev.EXECUTION_RESUMED,
            f"execution.resumed.e{epoch}",
            status="running",
            meta={"epoch": epoch, "from": status, **({"timeout": timeout} if timeout is not None else {})},
        )
        redo = _plan_redo(
            decider, events, epoch, failed_step=execution.get("failed_step") if status == "failed" else None
        )
        children = _plan_children(conn, execution_id, {e["event_id"]: e for e in events}, redo["dispatched"], epoch)
        redo["decide"] += children["decide"]
        loops = reopen_loops(
            decider,
            events,
            {**redo["dispatched"], **children["in_flight"]},
            f"execution.resumed.e{epoch}",
            execution.get("failed_step") if status == "failed" else None,
        )
        _archive(conn, execution_id, epoch, redo["archive"] + loops["archive"])
        store_recovery.reopen_execution(
            conn,
            execution_id,
            epoch=epoch,
            deadline_at=repo.utcnow() + timedelta(seconds=timeout) if timeout is not None else None,
        )
        for message, outcome, stored in redo["decide"]:
            step = decider.plan.steps[message.step]
            row = OpenRow(stored)  # a row of the log decided now: rewritten with what the decision adds
            decider.handle_outcome(step, step.tasks[message.task_index], message, outcome, row)
            _rewrite(conn, execution_id, row.build())
        decider.decision.pending += redo["pending"] + loops["pending"]
        decider.decision.dispatches.extend(redo["dispatch"])
        for message in children["again"]:  # a new child for each task whose child ended with this execution
            decider.dispatch_task(decider.plan.steps[message.step], message)
        if (
            not decider.decision.dispatches
            and not decider.decision.pending
            and not redo["decide"]
            and not children["in_flight"]
        ):
            raise ResumeRefused(
                f"execution {execution_id}: nothing to resume (no attempt was left without an "
                "outcome, and its failure was not an attempt's)"
            )
        dispatches = decider.flush()
    STATE.forget(url, execution_id)
    return epoch, dispatches


def _plan_redo(decider: Decider, events: list[dict[str, Any]], epoch: int, failed_step: str | None) -> dict[str, Any]:
    by_key = {e["event_id"]: e for e in events}
    dispatched: dict[str, Dispatch] = {}
    for event in events:
        for raw in (event.get("meta") or {}).get("dispatch") or []:
            if raw.get("kind", DispatchKind.RUN) != DispatchKind.RUN:
                continue  # an event for on_event (a sub-playbook's start or end), not an attempt
            for dispatch in Dispatch.from_dict(raw).members():  # a batch: each of its iterations
                dispatched[dispatch.attempt_key()] = dispatch
    archive = [k for k in ENDING_KEYS if k in by_key]
    decide: list[tuple[TaskMessage, dict[str, Any], dict[str, Any]]] = []
    again: list[Dispatch] = []
    pending = 0
    for key, dispatch in dispatched.items():
        done = by_key.get(key + ".done")
        message = TaskMessage.from_dict({**dispatch.message, "replay": False, "delayed": False})
        if done is None:
            again.append(
                Dispatch(
                    kind=dispatch.kind,
                    message={**message.to_dict(), "replay": True},
                    label=dispatch.label,
                    timeout=dispatch.timeout,
                )
            )
        elif (done.get("meta") or {}).get("ignored"):
            decide.append((message, _outcome(done), dict(done)))
    if failed_step is not None:
        step = decider.plan.steps.get(failed_step)
        if step is not None and step.loop is not None:
            failed_step = None  # a loop step: engine/recovery/resume_loops.py reopens it
    if failed_step is not None:
        failing = _failing_attempt(by_key, dispatched, failed_step)
        if failing is not None:
            key, dispatch = failing
            message = TaskMessage.from_dict(dispatch.message)
            retry = message.evolve(
                attempt=message.attempt + 1, replay=False, delayed=False, parent_event_id=f"execution.resumed.e{epoch}"
            )
            archive.append(f"{message.run_id}.step.done")
            again.append(
                Dispatch(kind=DispatchKind.RUN, message=retry.to_dict(), label=dispatch.label, timeout=dispatch.timeout)
            )
            pending += 1
    return {"archive": archive, "decide": decide, "dispatch": again, "pending": pending, "dispatched": dispatched}


def _plan_children(
    conn: Connection, execution_id: int, by_key: dict[str, dict[str, Any]], dispatched: dict[str, Dispatch], epoch: int
) -> dict[str, Any]:
    """What becomes of the sub-playbook tasks of the execution: {"decide": outcomes recorded but
    not acted on, "again": the next attempts of tasks whose child ended with the execution,
    "in_flight": attempt key -> Dispatch of every task not settled (for engine/recovery/resume_loops.py)}.
    Only the last attempt of each task position counts (an earlier one was retried already); a
    task sent to a worker with its child's outcome (to run its sink) is an attempt like any other."""
    latest: dict[tuple[Any, ...], tuple[TaskMessage, str, Any]] = {}
    for status, error, parent_task in store_recovery.children(conn, execution_id):
        raw = (parent_task or {}).get("message")
        if not raw:
            continue
        message = TaskMessage.from_dict(raw)
        position = (message.step, message.run_id, message.iteration, message.task_index, message.seq)
        if position not in latest or latest[position][0].attempt < message.attempt:
            latest[position] = (message, status, error)
    out: dict[str, Any] = {"decide": [], "again": [], "in_flight": {}}
    for message, status, error in latest.values():
        key = message.outcome_key()
        done = by_key.get(key)
        if key.removesuffix(".done") in dispatched:
            continue  # its sink runs on a worker: _plan_redo replays or decides it
        if done is not None and not (done.get("meta") or {}).get("ignored"):
            continue  # decided
        out["in_flight"][key.removesuffix(".done")] = Dispatch(kind=EVENT_DISPATCH, message=message.to_dict())
        if done is not None:
            out["decide"].append((message, _outcome(done), dict(done)))
        elif status in ("failed", "cancelled") and isinstance(error, dict) and error.get("ended_with") is not None:
            out["again"].append(
                message.evolve(
                    attempt=message.attempt + 1,
                    replay=False,
                    delayed=False,
                    parent_event_id=f"execution.resumed.e{epoch}",
                )
            )
        # else: the child runs, or its end is on its way (the sweeper delivers it)
    return out


def _timeout(execution: dict[str, Any], by_key: dict[str, dict[str, Any]], epoch: int) -> float | None:
    """The seconds the execution may run (None: no limit): the span its deadline was given at its
    creation (the playbook's or the task's `timeout`), kept in each resume's row for the next."""
    if execution.get("deadline_at") is None:
        return None
    previous = by_key.get(f"execution.resumed.e{epoch - 1}") if epoch > 1 else None
    kept = ((previous or {}).get("meta") or {}).get("timeout")
    if kept is not None:
        return float(kept)
    created = execution.get("created_at")
    return (execution["deadline_at"] - created).total_seconds() if created is not None else None


def _failing_attempt(
    by_key: dict[str, dict[str, Any]], dispatched: dict[str, Dispatch], failed_step: str
) -> tuple[str, Dispatch] | None:
    """The last attempt of `failed_step` that failed and was acted on."""
    best: tuple[int, str, Dispatch] | None = None
    for key, dispatch in dispatched.items():
        done = by_key.get(key + ".done")
        if done is None or done["step"] != failed_step or done["event_type"] in OK_TYPES:
            continue
        if (done.get("meta") or {}).get("ignored"):
            continue
        if best is None or done["id"] > best[0]:
            best = (done["id"], key, dispatch)
    return (best[1], best[2]) if best else None


def _outcome(row: dict[str, Any]) -> dict[str, Any]:
    meta = row.get("meta") or {}
    return {
        "status": "ok" if row["event_type"] in OK_TYPES else "error",
        "data": row.get("result"),
        "error": row.get("error"),
        "http": meta.get("http"),
        "pg": meta.get("pg"),
        "meta": {"sink": meta.get("sink")} if meta.get("sink") else {},
    }


def _archive(conn: Connection, execution_id: int, epoch: int, keys: list[str]) -> None:
    store_recovery.archive_events(conn, execution_id, epoch, keys)


def _rewrite(conn: Connection, execution_id: int, row: Row) -> None:
    """An outcome row decided now: its type and meta as the decision left them."""
    meta = {k: v for k, v in (row.get("meta") or {}).items() if k != "ignored"}
    store_recovery.rewrite_outcome(
        conn, execution_id, row["event_id"], event_type=row["event_type"], result=row.get("result"), meta=meta or None
    )
