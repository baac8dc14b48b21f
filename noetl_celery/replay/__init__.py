"""`noetl-celery replay`: an execution's recorded outcomes decided again by this version's code.

Temporal's Replayer for this engine. The recorded log of an execution holds every decision's
cause: the start, and each attempt's outcome row (`action.completed`, `iteration.failed`, ...),
whose columns are the outcome and the report the worker sent, and whose task message is in the
dispatch list (`meta.dispatch`) of the decision that sent it. `replay` reads the execution's row
(its stored plan and workload), its rows and the catalog from the recorded store, and holds the
execution in memory (memory_store.MemoryStore: its head, rows, variables, loops, joins and values
kept by reference; no database, no file). It decides the start there, then rebuilds each
outcome's on_event payload, in the recorded order, and calls `orchestrator.decide_in` on the
store in memory: the decisions of the code that runs now, in-process, with no tool run and
nothing written to the store being replayed (whose values kept by reference are read when a
decision needs one). After each decision the rows it wrote and the messages it dispatched are
compared with the recorded ones (not ids, timestamps or deadlines); the first decision that
differs is reported.

What cannot be decided again is refused rather than guessed: an execution that was resumed
(resume archives and rewrites rows), and a rerun (engine/recovery/rerun.py: its start is not on_event's).
An end from outside the decisions (a cancel, a playbook timeout, an internal failure) is
applied to the store in memory where the log has it, so that the outcomes after it are decided as
they were: recorded and ignored. A cursor claim's rows are read from the item message its
decision sent (a claim that ran its first row: from that row's record and what it sent next);
an iteration's outcome from `meta.reported` where its row shows the iteration's
end. A jittered retry delay is compared as the range the new code draws it from
(the decision's inputs draw the recorded delays, `inputs.RecordedDraws`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import ExecutionNotFound, NoetlError
from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine.decision import orchestrator
from noetl_celery.engine.decision.inputs import RecordedDraws
from noetl_celery.engine.decision.units import REPORTED_META
from noetl_celery.engine.messages import BATCH_EVENT, BatchEvent, Dispatch, OutcomeEvent, TaskMessage
from noetl_celery.replay.memory_store import MemoryStore
from noetl_celery.store import blobs, db, repo

# the rows that are an attempt's outcome (the cause of a decision, or one more outcome of a batch)
OUTCOME_TYPES = frozenset(
    {
        ev.ACTION_COMPLETED,
        ev.ACTION_FAILED,
        ev.PAGE_COMPLETED,
        ev.ITERATION_COMPLETED,
        ev.ITERATION_FAILED,
        ev.CURSOR_ITEM_DONE,
        ev.CURSOR_ITEM_FAILED,
    }
)
CLAIM_TYPES = frozenset({ev.CURSOR_CLAIMED, ev.CURSOR_SLOT_ENDED, ev.CURSOR_CLAIM_WAITING, ev.CURSOR_CLAIM_FAILED})
CANCELLED = ev.EXECUTION_CANCELLED  # runner.cancel's row (engine/recovery/lifecycle.py)
RESUMED = ev.EXECUTION_RESUMED  # engine/recovery/resume.py's row: rows before it were rewritten
# rows written beside the decisions, read by none: the sweeper's and the worker-loss records
RECORDS = frozenset({ev.ATTEMPT_REPUBLISHED, ev.ATTEMPT_WORKER_LOST})
# the columns compared: what a decision decides (not ids, timestamps, deadlines, durations)
COMPARED = (
    "event_type",
    "event_id",
    "parent_event_id",
    "status",
    "step",
    "task",
    "run_id",
    "attempt",
    "iteration",
    "page",
    "context",
    "result",
    "error",
    "meta",
)
# meta keys left out: the dispatch list (compared on its own) and a new child execution's id
UNCOMPARED_META = ("dispatch", "child_execution_id")
# the fields of a task message compared per dispatched attempt
RECENT_DECISIONS = 8  # decisions whose rows a later one's may interleave with (see recorded_decisions)
MESSAGE_FIELDS = ("step", "run_id", "task_index", "seq", "iteration", "attempt", "page", "element", "call", "iter_vars")


class ReplayError(NoetlError):
    """The execution cannot be replayed (what and where is in the message)."""


@dataclass
class Decision:
    """One recorded decision: its cause (the on_event payload rebuilt from the log, or an end
    from outside) and the rows it wrote, in order."""

    rows: list[dict[str, Any]]
    payload: dict[str, Any] | None  # None: an end from outside the decisions (`rows[0]`)

    @property
    def cause(self) -> dict[str, Any]:
        return self.rows[0]


@dataclass
class Difference:
    """The first decision the code that runs now makes otherwise."""

    event_id: str  # the causing row's key
    event_type: str
    row: int  # the causing row's id in the recorded store
    reason: str
    recorded_rows: list[dict[str, Any]]
    new_rows: list[dict[str, Any]]
    recorded_dispatches: list[dict[str, Any]]
    new_dispatches: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Report:
    execution_id: int
    decisions: int = 0  # decisions made again and compared (the one that differs included)
    difference: Difference | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "execution_id": self.execution_id,
            "decisions": self.decisions,
            "same": self.difference is None,
            "difference": self.difference.to_dict() if self.difference else None,
        }


def replay(url: str, execution_id: int) -> Report:
    """Decide execution `execution_id` of the store at `url` again, on the execution held in
    memory; the report names the first decision that differs. Reads `url` only."""
    with db.transaction(url) as conn:
        execution = repo.get_execution(conn, execution_id)
        if execution is None:
            raise ExecutionNotFound(f"no execution {execution_id} in the event store")
        rows = repo.list_events(conn, execution_id)
        catalog = [dict(r) for r in conn.execute(select(repo.CATALOG)).mappings()]  # sub-playbooks by path
        report = Report(execution_id)
        decisions = recorded_decisions(conn, rows)
    store = MemoryStore(execution, catalog=catalog, values=blobs.url_reader(url))
    for decision in decisions:
        difference = _decide_again(store, decision)
        if decision.payload is not None:
            report.decisions += 1
        if difference is not None:
            report.difference = difference
            break
    return report


# --- the recorded decisions ---------------------------------------------------------------


def recorded_decisions(conn: Any, rows: list[dict[str, Any]]) -> list[Decision]:
    """The log cut into decisions, each with the payload that caused it.

    A decision's rows follow its causing row: one decision is one transaction, and the decisions
    of one execution are serialized by its row or its loop's. Two that are not (two retries of
    one loop, on PostgreSQL) may have their rows' ids interleaved: a row whose parent is a row of
    one of the last few decisions belongs to that one, any other to the latest."""
    messages = _dispatched(rows)
    decisions: list[Decision] = []
    current: Decision | None = None
    owner: dict[str, Decision] = {}  # event key -> the decision that wrote it
    recent: deque[Decision] = deque(maxlen=RECENT_DECISIONS)
    batches: dict[str, Decision] = {}  # a batch's further outcome keys -> the decision reporting them
    for row in rows:
        kind, key = row["event_type"], row["event_id"]
        if kind == RESUMED:
            raise ReplayError(
                f"execution {row['execution_id']} was resumed (row {row['id']}): resume archives and "
                "rewrites the rows of what it runs again, so the log no longer holds the decisions made"
            )
        if kind == ev.EXECUTION_STARTED and (row.get("meta") or {}).get("rerun_of") is not None:
            raise ReplayError(
                f"execution {row['execution_id']} is a rerun of {row['meta']['rerun_of']}: its start (the "
                "results it kept, the step it started at) was made by the rerun, not decided by on_event"
            )
        if kind in RECORDS:
            continue
        if kind in (CANCELLED, ev.EXECUTION_FAILED) and row["parent_event_id"] is None:
            current = None  # cancel, a playbook timeout, a decision that failed internally
            decisions.append(Decision([row], None))
            continue
        decision: Decision | None
        if kind in OUTCOME_TYPES and key in batches:
            decision = batches.pop(key)
            assert decision.payload is not None
            decision.payload["events"].append(_event(conn, row, messages).to_dict())
            decision.rows.append(row)
        elif kind == ev.EXECUTION_STARTED or ((kind in OUTCOME_TYPES or kind in CLAIM_TYPES) and _reported(row)):
            decision = current = Decision([row], _payload(conn, row, messages))
            if current.payload is not None and current.payload["kind"] == BATCH_EVENT:
                batches.update((member, current) for member in _message_of(conn, row, messages)[1][1:])
            decisions.append(current)
            recent.append(current)
        else:
            decision = owner.get(row["parent_event_id"])
            if decision is None or not any(decision is d for d in recent):
                decision = current
            if decision is None:
                raise ReplayError(
                    f"row {row['id']} ({kind} {key!r}) follows no decision the log records: "
                    "a log written by something other than the engine?"
                )
            decision.rows.append(row)
        owner[key] = decision
    return decisions


def _payload(conn: Any, row: dict[str, Any], messages: Messages) -> dict[str, Any]:
    """The on_event payload of a causing row, as the wire carries it: the start, an attempt's
    outcome (OutcomeEvent), or the first of a batch's outcomes (BatchEvent; the others are added
    as their rows come)."""
    execution_id = row["execution_id"]
    if row["event_type"] == ev.EXECUTION_STARTED:
        return orchestrator.start_payload(execution_id)
    _, members = _message_of(conn, row, messages)
    event = _event(conn, row, messages)
    if members and members[0] == row["event_id"]:
        return BatchEvent(execution_id, [event.to_dict()]).to_dict()
    return event.to_dict()


def _reported(row: dict[str, Any]) -> bool:
    """An outcome a worker (or the sweeper, or a finished child) reported, not one a decision
    made itself (a sub-playbook task that failed to start has no report)."""
    return row["queue_id"] is not None or row["worker"] is not None


Messages = dict[str, tuple[dict[str, Any], list[str]]]  # outcome key -> (task message, its batch's outcome keys)


def _dispatched(rows: list[dict[str, Any]]) -> Messages:
    """Every attempt the log's decisions dispatched: its task message, by its outcome row's key."""
    found: Messages = {}
    for row in rows:
        for stored in (row.get("meta") or {}).get("dispatch") or []:
            dispatch = Dispatch.from_dict(stored)
            if dispatch.kind != DispatchKind.RUN:
                continue
            members = [TaskMessage.from_dict(m.message) for m in dispatch.members()]
            keys = [m.outcome_key() for m in members]
            for member, key in zip(members, keys, strict=True):
                found.setdefault(key, (member.to_dict(), keys if len(keys) > 1 else []))
    return found


def _message_of(conn: Any, row: dict[str, Any], messages: Messages) -> tuple[dict[str, Any], list[str]]:
    """The task message an outcome row reports on, and the outcome keys of its batch."""
    found = messages.get(row["event_id"])
    if found is not None:
        return found
    child = ((row.get("meta") or {}).get("child") or {}).get("execution_id")
    if child is not None:  # a sub-playbook's end: the parent's task message is kept on the child
        link = repo.execution_link(conn, int(child)) or {}
        parent_task = link.get("parent_task") or {}
        if parent_task.get("message"):
            return parent_task["message"], []
    raise ReplayError(
        f"row {row['id']} ({row['event_type']} {row['event_id']!r}): no decision of the log dispatched "
        "this attempt, so its task message is unknown"
    )


def _event(conn: Any, row: dict[str, Any], messages: Messages) -> OutcomeEvent:
    """The on_event payload of one outcome row: its task message, the outcome and the report."""
    message, _ = _message_of(conn, row, messages)
    meta = row.get("meta") or {}
    if row["event_type"] in CLAIM_TYPES:
        return OutcomeEvent(row["execution_id"], message, _claim_outcome(row), _report(row))
    if (message.get("slot") or {}).get("phase") == "claim":  # the claim ran its first row: that row reported
        message = _claimed_row(message, row)
    # a loop's iteration (a cursor's item) row shows the unit's end; what the attempt reported
    # where it differs is in meta.reported
    reported = {
        "status": row["status"],
        "result": row["result"],
        "error": row["error"],
        **(meta.get(REPORTED_META) or {}),
    }
    outcome = {
        "status": "ok" if reported["status"] == "completed" else "error",
        "data": reported["result"],
        "error": reported["error"],
        "http": meta.get("http"),
        "pg": meta.get("pg"),
        "meta": {k: meta[k] for k in ("sink", "input", "stdout", "stderr", "log", "child") if meta.get(k)},
    }
    return OutcomeEvent(row["execution_id"], message, outcome, _report(row))


def _report(row: dict[str, Any]) -> dict[str, Any]:
    started = row["started_at"]
    if isinstance(started, datetime) and started.tzinfo is None:
        started = started.replace(tzinfo=UTC)  # SQLite: naive UTC
    return {
        "queue_id": row["queue_id"],
        "worker": row["worker"],
        "started_at": started.isoformat() if isinstance(started, datetime) else None,
        "duration_ms": row["duration_ms"],
        "pid": (row.get("meta") or {}).get("pid"),
    }


def _claimed_row(claim: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The message of a row its claim ran in the claim's own attempt (TaskMessage.claimed_row),
    rebuilt from the row's record: the claimed row (`meta.row`), and the rest of the claim's
    frame from the row's meta.frame (a row of an earlier release: from the messages its decision
    sent for the same slot and claim)."""
    meta = row.get("meta") or {}
    if isinstance(meta.get("frame"), list):  # the frame, kept once by this row
        message = TaskMessage.from_dict(claim).claimed_row(list(meta["frame"]), 1)  # its iteration: the row's
        return message.evolve(iteration=row["iteration"]).to_dict()
    first = meta.get("row")
    if isinstance(first, dict) and first.get("truncated") is True:
        raise ReplayError(
            f"row {row['id']} ({row['event_type']} {row['event_id']!r}): the row its claim took is kept "
            f"truncated ({first.get('size')} characters), so the claim's outcome is unknown"
        )
    count = int((meta.get("claimed") or {}).get("rows") or 1)
    slot = claim.get("slot") or {}
    rest: list[Any] | None = [] if count == 1 else None
    for stored in [] if rest is not None else meta.get("dispatch") or []:  # a row of an earlier release
        sent = Dispatch.from_dict(stored).message
        other = sent.get("slot") or {}
        if other.get("phase") == "row" and (other.get("id"), other.get("claim")) == (slot.get("id"), slot.get("claim")):
            later = list(other.get("rows") or [])
            rest = later if sent.get("iteration") == row["iteration"] else [sent.get("element"), *later]
            break
    if rest is None or len(rest) != count - 1:
        raise ReplayError(
            f"row {row['id']} ({row['event_type']} {row['event_id']!r}): its claim took {count} rows, "
            "and the log does not hold the rest of them"
        )
    message = TaskMessage.from_dict(claim).claimed_row([first, *rest], 1)  # its iteration: the row's
    return message.evolve(iteration=row["iteration"]).to_dict()


def _claim_outcome(row: dict[str, Any]) -> dict[str, Any]:
    """A cursor claim's outcome: none with when to claim again (`cursor.claim.waiting`), or the
    frame its row keeps (meta.frame, a frame of more than one row). Otherwise its decision sent
    the one row it took as the slot's next item's element (or, a row of an earlier release, the
    first row and the rest of the frame in its `slot`); a decision that sent nothing (the
    execution had ended) used only their number."""
    if row["event_type"] == ev.CURSOR_CLAIM_FAILED:
        return {"status": "error", "error": row["error"]}
    meta = row.get("meta") or {}
    if row["event_type"] == ev.CURSOR_CLAIM_WAITING:  # no row, and when to claim again
        return {"status": "ok", "data": {"rows": [], "again_in": meta.get("again_in")}}
    if isinstance(meta.get("frame"), list):  # the frame, kept once by this row
        return {"status": "ok", "data": {"rows": list(meta["frame"])}}
    rows: list[Any] = [None] * int(meta.get("rows") or 0)
    for stored in meta.get("dispatch") or []:
        message = Dispatch.from_dict(stored).message
        slot = message.get("slot") or {}
        if slot.get("phase") == "row" and slot.get("id") == meta.get("slot") and slot.get("claim") == meta.get("claim"):
            rows = [message.get("element"), *(slot.get("rows") or [])]
            break
    return {"status": "ok", "data": {"rows": rows}}


# --- deciding again -----------------------------------------------------------------------


def _decide_again(store: MemoryStore, decision: Decision) -> Difference | None:
    """Make one recorded decision again on the store in memory; the difference, if any."""
    before = store.last_event_id()
    if decision.payload is None:  # an end from outside: applied as it was
        cause = decision.cause
        with store.transaction():
            store.finish_execution(store.execution_id, cause["status"], error=cause["error"])
            store.insert_events([{k: cause[k] for k in repo.EVENT_COLUMNS if k in cause}])
        return None
    recorded_rows = [_comparable(r) for r in decision.rows]
    recorded_dispatches = _dispatches(decision.cause)
    delays = [d for r in decision.rows for d in _drawn_delays(r)]
    reason = None
    try:
        orchestrator.decide_in(store, decision.payload, draws=RecordedDraws(delays))
    except Exception as exc:  # the code that runs now fails on this event
        reason = f"deciding it raised {type(exc).__name__}: {exc}"
    written = store.events_after(before)
    new_rows = [_comparable(r) for r in written]
    new_dispatches = _dispatches(written[0]) if written else []
    if reason is None and not written:
        reason = "the decision wrote no row (its causing row existed: decided before?)"
    if reason is None and new_rows != recorded_rows:
        reason = _rows_reason(recorded_rows, new_rows)
    if reason is None and not _same_dispatches(recorded_dispatches, new_dispatches):
        reason = "it dispatches other messages"
    if reason is None:
        return None
    cause = decision.cause
    return Difference(
        event_id=cause["event_id"],
        event_type=cause["event_type"],
        row=cause["id"],
        reason=reason,
        recorded_rows=recorded_rows,
        new_rows=new_rows,
        recorded_dispatches=recorded_dispatches,
        new_dispatches=new_dispatches,
    )


def _drawn_delays(row: dict[str, Any]) -> list[float]:
    meta = row.get("meta") or {}
    values = [meta.get("delay")] if row["event_type"] == ev.RETRY_SCHEDULED else [meta.get("retry_in")]
    return [float(v) for v in values if isinstance(v, (int, float))]


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    """The columns of a row a decision decides."""
    kept = {name: row.get(name) for name in COMPARED}
    meta = {k: v for k, v in (row.get("meta") or {}).items() if k not in UNCOMPARED_META}
    kept["meta"] = meta or None
    return kept


def _dispatches(row: dict[str, Any]) -> list[dict[str, Any]]:
    """What a decision dispatched (its causing row's `meta.dispatch`), one entry per attempt."""
    found = []
    for stored in (row.get("meta") or {}).get("dispatch") or []:
        dispatch = Dispatch.from_dict(stored)
        if dispatch.kind != DispatchKind.RUN:  # a sub-playbook's start or end: an event for on_event
            message = dispatch.message
            task = message.get("task") or {}
            found.append(
                {
                    "kind": dispatch.kind,
                    "event": message.get("kind"),
                    "step": task.get("step"),
                    "attempt": task.get("attempt"),
                    "status": (message.get("outcome") or {}).get("status"),
                    "countdown": dispatch.countdown,
                    "label": dispatch.label,
                }
            )
            continue
        members = dispatch.members()
        for member in members:
            message = member.message
            found.append(
                {
                    "kind": dispatch.kind,
                    **{name: message.get(name) for name in MESSAGE_FIELDS},
                    "countdown": dispatch.countdown,
                    "label": dispatch.label,
                    "timeout": member.timeout,
                    "batch": len(members),
                }
            )
    return found


def _same_dispatches(recorded: list[dict[str, Any]], new: list[dict[str, Any]]) -> bool:
    if len(recorded) != len(new):
        return False
    for old, now in zip(recorded, new, strict=True):
        if {k: v for k, v in old.items() if k not in ("countdown", "timeout")} != {
            k: v for k, v in now.items() if k not in ("countdown", "timeout")
        }:
            return False
        for name in ("countdown", "timeout"):
            if not math.isclose(float(old.get(name) or 0), float(now.get(name) or 0), abs_tol=1e-3):
                return False
    return True


def _rows_reason(recorded: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
    """Where two decisions' rows part."""
    for index, (old, now) in enumerate(zip(recorded, new, strict=False)):
        if old != now:
            columns = [name for name in COMPARED if old.get(name) != now.get(name)]
            where = f"{old['event_type']} {old['event_id']!r}"
            return f"row {index + 1} of the decision differs ({where}: {', '.join(columns)})"
    if len(new) > len(recorded):
        return f"it writes {len(new) - len(recorded)} more row(s) ({new[len(recorded)]['event_type']} first)"
    return f"it writes {len(recorded) - len(new)} fewer row(s) (no {recorded[len(new)]['event_type']})"


# --- output -------------------------------------------------------------------------------


def describe(report: Report) -> list[str]:
    """The report as the command prints it."""
    lines = [f"execution {report.execution_id}: {report.decisions} decision(s) made again"]
    difference = report.difference
    if difference is None:
        lines.append("no decision differs")
        return lines
    lines.append(
        f"first difference: the decision on row {difference.row} ({difference.event_type} "
        f"{difference.event_id!r}): {difference.reason}"
    )
    for title, rows in (("recorded rows", difference.recorded_rows), ("new rows", difference.new_rows)):
        lines.append(f"  {title}:")
        lines += [f"    {_row_line(r)}" for r in rows] or ["    (none)"]
    for title, dispatches in (
        ("recorded dispatches", difference.recorded_dispatches),
        ("new dispatches", difference.new_dispatches),
    ):
        lines.append(f"  {title}:")
        lines += [f"    {_dispatch_line(d)}" for d in dispatches] or ["    (none)"]
    return lines


def _row_line(row: dict[str, Any]) -> str:
    where = " ".join(
        f"{name}={row[name]}" for name in ("step", "task", "iteration", "attempt", "page") if row.get(name) is not None
    )
    detail = row.get("error") or row.get("meta")
    text = f"{row['event_type']:20} {row['event_id']}  status={row['status']} {where}"
    return text + (f"  {detail}" if detail else "")


def _dispatch_line(dispatch: dict[str, Any]) -> str:
    shown = ("step", "iteration", "attempt", "page", "seq", "event", "countdown", "batch")
    return f"{dispatch['kind']} " + " ".join(f"{k}={dispatch[k]}" for k in shown if dispatch.get(k) is not None)
