"""Cursor loops: slots pull rows from a database until a claim comes back empty.

Everything here runs inside on_event; workers only run claims and the rows' tasks.
- Start: `max_in_flight` slots, each dispatched as a claim task (one Celery task per claim) with
  a unique slot id (`__worker_slot_id`).
- A claim that returns rows (a frame of up to `max_rows`) starts the step's task chain for the
  first row, exactly as a collection iteration (policy, retries, pagination, sinks: each attempt
  its own task). When the step's first task is a worker's, the claim's own attempt runs that
  row's first task (`run`; TaskMessage.claimed_row) and reports its outcome, recorded under the
  claim's key: the claim costs no task and no row of its own. When a row is over, the slot's
  next row of the frame runs, or the slot's next claim is dispatched. No task loops or blocks.
- A claim that returns no row with `again_in` (its driver knows rows a lost claim took come back
  later, cursors/nats.py) is recorded (`cursor.claim.waiting`) and the slot's next claim is
  dispatched with that countdown: the slot does not end.
- A claim that returns no row ends its slot (`noetl_loop.slots_ended` counts it, in the same
  transaction that records the claim's outcome row, whose key is deterministic: a redelivery
  counts nothing twice). The claim that ends the last slot (slots_ended == max_in_flight)
  completes the loop (a guarded UPDATE:
  exactly once) and the step's arcs run with `event.name == "loop.done"`.
- A failed row is recorded (`cursor.item.failed`), counted, and its slot goes on claiming. A claim
  that errors is retried (`cursor.retry`, in a task retry's words; by default CLAIM_RETRY), then
  fails the step with the database's message.
- `loop.aggregate: true` adds `results` (every done row's result, in completion order, read back
  from the item rows) to the loop's result; without it the result is the stats alone, since a
  cursor loop may be unbounded.
- Event rows: one per row processed (`cursor.item.done` / `cursor.item.failed`: the last
  attempt's outcome row, built as the item's: no start rows), one per claim without rows
  (`cursor.slot.ended` / `cursor.claim.waiting` / `cursor.claim.failed`) and per claim that did
  not run its first row (`cursor.claimed`), plus step and loop start/end.
- Unit ids: row `index` of slot `s` of a loop of `max_in_flight` slots is iteration
  `index * max_in_flight + s` (unique in the run, no counter needed).
- A claim's outcome is decided by the first of the named rules `CLAIM_RULES` that applies: `rows`
  (the slot's next row runs), `again` (claim again after `again_in`, or after a failed claim's
  backoff), `slot_ended`, `fail`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from noetl_celery import cursors
from noetl_celery.core import vocabulary as ev
from noetl_celery.core.bounded_cache import SizeBoundedCache
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Action, Step
from noetl_celery.engine import deadlines
from noetl_celery.engine.decision.entries import CompleteLoop, CountIteration, CreateLoop, EndCursorSlot
from noetl_celery.engine.decision.inputs import is_reference, is_truncated
from noetl_celery.engine.decision.loops import fail_loop_start, record_loop_done
from noetl_celery.engine.decision.policy_eval import next_backoff
from noetl_celery.engine.decision.rows import OpenRow
from noetl_celery.engine.decision.subplaybooks import PLAYBOOK_KIND
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.ids import claim_key, cursor_iteration
from noetl_celery.engine.messages import FRAME_VERSION, Dispatch, TaskMessage, row_slot, sanitize, written_formats
from noetl_celery.tools.base import get_tool

if TYPE_CHECKING:
    from noetl_celery.engine.decision.port import DecisionPort

# How a claim that errors is tried again unless the cursor says (`cursor.retry`): 3 tries in
# all, 0.5 s before the second and doubled for each further one; then the step fails with the
# database's message.
CLAIM_RETRY = Action(do="retry", attempts=3, delay=0.5, backoff="exponential", max_delay=60.0)
MAX_AGAIN_IN = 3600.0  # seconds: the longest a slot waits to claim again when its driver asks


def _run_ref(decider: DecisionPort, run_id: str) -> RunRef:
    context = (decider.reads.loop(run_id) or {}).get("context") or {}
    return RunRef(run_id, context.get("frames", []), context.get("args", {}))


class CursorLoop:
    """The pull-model loop strategy: `max_in_flight` slots, no known total."""

    def start(self, decider: DecisionPort, step: Step, run: RunRef, parent: str, context: dict[str, Any]) -> None:
        loop = step.loop
        assert loop is not None and loop.cursor is not None
        max_in_flight = max(loop.max_in_flight, 1)  # slots
        if cursors.needs_claim(str(loop.cursor.get("kind"))) and not isinstance(loop.cursor.get("claim"), str):
            fail_loop_start(
                decider,
                step,
                run.run_id,
                parent,
                {"kind": ErrorKind.LOOP, "message": "cursor loop without a claim SQL"},
            )
            return
        decider.apply(
            CreateLoop(
                run_id=run.run_id,
                step=step.name,
                mode="cursor",
                total=0,
                max_in_flight=max_in_flight,
                collection=None,
                context={"frames": run.frames, "args": run.args, "parent": parent},
            )
        )
        key = decider.record(
            ev.ITERATOR_STARTED,
            f"{run.run_id}.loop.start",
            status="started",
            step=step.name,
            run_id=run.run_id,
            parent_event_id=parent,
            meta={"mode": "cursor", "slots": max_in_flight, "kind": loop.cursor.get("kind")},
        )
        for slot in range(max_in_flight):
            dispatch_claim(decider, step, run, slot=slot, claim=0, index=0, parent=key)

    def unit_done(self, decider: DecisionPort, step: Step, message: TaskMessage, end: UnitEnd, row: OpenRow) -> None:
        """A row's chain is over: record it as the item's row, count it, go on with the slot."""
        assert message.slot is not None
        slot = message.slot
        failed = end.failed
        if row.get("execution_id"):  # a recorded attempt row (not an inline routing task)
            columns: dict[str, Any] = {
                "event_type": ev.CURSOR_ITEM_FAILED if failed else ev.CURSOR_ITEM_DONE,
                "result": end.data,
            }
            if failed and row.get("error") is None:
                columns["error"] = end.error or end.tolerated
            noted = "row" in (row.get("meta") or {})  # by the outcome of the claim that ran it
            row.end_unit(**columns)
            row.note(
                slot=slot["id"],
                index=slot["index"],
                claim=slot["claim"],
                outcome="failed" if failed else "done",
                **({} if noted else sanitize({"row": message.element}) or {}),
                **({"tolerated": True} if end.tolerated is not None else {}),
            )
        decider.apply(CountIteration(message.run_id, ok=not failed, tolerated=end.tolerated is not None))
        if not decider.can_dispatch():
            return
        run = RunRef(message.run_id, message.frames, message.args)
        parent = row.get("event_id") or message.parent_event_id or ""
        frame, pos, at = _frame(decider, message)
        if at is not None and written_formats() < FRAME_VERSION:  # a rolling upgrade's older workers
            at = None
        if pos + 1 < len(frame):
            place = {"at": at, "size": len(frame), "pos": pos + 1} if at is not None else None
            dispatch_row(
                decider,
                step,
                run,
                slot=slot["id"],
                claim=slot["claim"],
                index=slot["index"] + 1,
                element=frame[pos + 1],
                parent=parent,
                frame=place,
                legacy=None if place is not None else (frame[pos + 2 :], frame[: pos + 1]),
            )
        else:  # the next claim acknowledges the frame's rows (drivers that acknowledge: redis_stream, mysql, nats)
            dispatch_claim(
                decider,
                step,
                run,
                slot=slot["id"],
                claim=slot["claim"] + 1,
                index=slot["index"] + 1,
                parent=parent,
                done=frame,
            )


CURSOR_LOOP = CursorLoop()

FRAME_CACHE_BYTES = 32 * 1024 * 1024  # JSON bytes of the frames a process keeps read, at most


# the frames a process read, by (store, execution, the row keeping it)
_frames = SizeBoundedCache(lambda: FRAME_CACHE_BYTES)


def _frame(decider: DecisionPort, message: TaskMessage) -> tuple[list[Any], int, str | None]:
    """A cursor row's frame (every row its claim took, in order), the row's place in it, and the
    key of the event row that keeps it (None: none does; the frame goes on inline, as a message
    of an earlier release carried it).

    By reference (`slot.frame`): read from that row's meta.frame, kept per process. Inline: the
    first row of a claim that ran it carries the rest of the frame, which its outcome row keeps
    (outcomes.py: under the claim attempt's key); a message of an earlier release carries the
    rest and the rows over."""
    slot = message.slot or {}
    place = slot.get("frame")
    if place is not None:
        return _read_frame(decider, place["at"], int(place["size"])), int(place["pos"]), place["at"]
    done = list(slot.get("done") or [])
    frame = [*done, message.element, *(slot.get("rows") or [])]
    if len(frame) == 1 or "via" not in slot:
        return frame, len(done), None
    at = claim_key(message.run_id, slot["id"], slot["claim"], slot["via"]) + ".done"
    if message.ran_with_claim or "frame" in decider.reads.event_meta(at):
        return frame, len(done), at  # recorded by this decision, or kept by the claim's outcome row
    return frame, len(done), None  # that row was decided by an earlier release, which kept no frame


def _read_frame(decider: DecisionPort, at: str, size: int) -> list[Any]:
    """The frame kept by the row `at` (meta.frame), of `size` rows: from this process's cache
    (the frames read last, FRAME_CACHE_BYTES of them at most), else read from the store."""
    key = (decider.reads.store_key(), decider.execution_id, at)
    kept = _frames.lookup(key)
    if kept is not None:
        return kept
    frame = decider.reads.event_meta(at).get("frame")
    if not isinstance(frame, list) or len(frame) != size:
        raise RuntimeError(
            f"execution {decider.execution_id}: the cursor frame kept by row {at!r} is missing or not "
            f"{size} rows; the slot cannot go on"
        )
    _frames.hold(key, len(json.dumps(frame, default=str)), frame)
    return frame


def claim_retry(step: Step) -> Action:
    return (step.loop.claim_retry if step.loop else None) or CLAIM_RETRY


def lease_seconds(step: Step) -> float | None:
    """The frame's lease_seconds: how long a claim (and a row's attempt without its own timeout)
    may run before the sweeper re-publishes it. None when the frame gives none."""
    lease = ((step.loop.frame if step.loop else None) or {}).get("lease_seconds")
    if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0:
        return float(lease)
    return None


def runs_with_claim(step: Step) -> bool:
    """Whether a claim of this step runs its first row's first task in the same attempt: when
    that task is a worker's (not routing-only, not a sub-playbook)."""
    task = step.tasks[0]
    spec = get_tool(task.kind)
    if task.kind == PLAYBOOK_KIND or spec is None:
        return False
    return not (spec.routing_only and task.sink is None)


def row_timeout(step: Step, task_index: int = 0) -> float:
    """The seconds a cursor row's task may run: its own timeout, else the frame's lease."""
    task = step.tasks[task_index]
    timeout = deadlines.timeout_of(task.kind, task.config)
    return timeout if "timeout" in task.config else lease_seconds(step) or timeout


def dispatch_claim(
    decider: DecisionPort,
    step: Step,
    run: RunRef,
    *,
    slot: int,
    claim: int,
    index: int,
    parent: str,
    attempt: int = 1,
    countdown: float = 0.0,
    done: list[Any] | None = None,
) -> None:
    """A slot's next claim. When the step's first task is a worker's, the claim runs its first
    row's first task in the same attempt (`run`): one task and one outcome row for that row."""
    ran = runs_with_claim(step)
    message = TaskMessage(
        execution_id=decider.execution_id,
        run_id=run.run_id,
        step=step.name,
        attempt=attempt,
        frames=run.frames,
        args=run.args,
        parent_event_id=parent,
        slot={
            "id": slot,
            "claim": claim,
            "phase": "claim",
            "index": index,
            **({"done": done} if done else {}),
            **({"run": True} if ran else {}),
        },
    )
    timeout = lease_seconds(step) or deadlines.DEFAULT_TIMEOUT
    decider.send(
        Dispatch.task(
            message,
            countdown=countdown,
            label=f"{step.name}:claim",
            timeout=timeout + row_timeout(step) if ran else timeout,
        )
    )


def dispatch_row(
    decider: DecisionPort,
    step: Step,
    run: RunRef,
    *,
    slot: int,
    claim: int,
    index: int,
    element: Any,
    parent: str,
    frame: dict[str, Any] | None = None,
    legacy: tuple[list[Any], list[Any]] | None = None,
) -> None:
    """A cursor row's first attempt: its frame by reference (`frame`: {at, size, pos}; None: a
    frame of one row), or, for a frame no row keeps (`legacy`: the rest of it and its rows over),
    inline, as an earlier release sent it."""
    max_in_flight = max(step.loop.max_in_flight, 1) if step.loop else 1
    shape = row_slot(slot, claim, index, frame=frame)
    if legacy is not None:
        rest, done = legacy
        shape = {**shape, "rows": rest, **({"done": done} if done else {})}
    message = TaskMessage(
        execution_id=decider.execution_id,
        run_id=run.run_id,
        step=step.name,
        iteration=cursor_iteration(slot, index, max_in_flight),
        element=element,
        frames=run.frames,
        args=run.args,
        parent_event_id=parent,
        slot=shape,
    )
    decider.dispatch_task(step, message, record_start=False)


def _again_in(outcome: dict[str, Any]) -> float:
    """Seconds after which a claim that took no row wants its slot to claim again (0: the slot is
    over). A value that is not a positive number ends the slot, as an earlier release would."""
    data = outcome.get("data") if outcome["status"] == "ok" else None
    again = data.get("again_in") if isinstance(data, dict) else None
    if isinstance(again, bool) or not isinstance(again, (int, float)) or not again > 0:
        return 0.0
    return min(float(again), MAX_AGAIN_IN)


def _claimed(decider: DecisionPort, outcome: dict[str, Any], slot: int) -> tuple[dict[str, Any], list[Any]]:
    """A claim's outcome as it is decided, and the rows it took. Rows above NOETL_MAX_RESULT_BYTES
    came by reference (store/blobs.py) and are read whole; rows the store had to cut (above
    NOETL_MAX_STORED_BYTES) make a failed claim, never a claim of no rows, which would end the
    slot with its frame taken and never run."""
    if outcome["status"] != "ok":
        return outcome, []
    data = outcome.get("data")
    if isinstance(data, dict) and is_reference(data):
        data = decider.reads.value(data)
    rows = data.get("rows") if isinstance(data, dict) else None
    if is_truncated(data) or is_truncated(rows):
        error = {
            "kind": ErrorKind.LIMIT,
            "message": f"cursor claim of slot {slot} took rows above "
            f"{decider.inputs.bounds.max_stored_bytes_env}, which were cut: lower the frame's max_rows",
        }
        return {**outcome, "status": "error", "error": error}, []
    return outcome, list(rows or [])


def claim_done(decider: DecisionPort, message: TaskMessage, outcome: dict[str, Any], report: dict[str, Any]) -> None:
    """A claim's outcome: rows start the slot's next row, none ends the slot (or, with `again_in`,
    claims again then), an error retries."""
    assert message.slot is not None
    step = decider.plan.steps[message.step]
    outcome, rows = _claimed(decider, outcome, message.slot["id"])
    claim = _Claim.of(step, message, outcome, rows, decider.can_dispatch())
    key = _record_claim(decider, claim, report)
    if not decider.can_dispatch():
        return
    for rule in CLAIM_RULES:
        if rule.applies(claim):
            rule.apply(decider, claim, key)
            return


@dataclass(frozen=True)
class _Claim:
    """A claim's outcome as its rules see it: the rows it took, whether it is tried again, when
    the slot claims again (`again_in`)."""

    step: Step
    message: TaskMessage
    outcome: dict[str, Any]
    rows: list[Any]
    again: float  # seconds until the slot claims again (0: not waiting)
    retried: bool  # a failed claim tried again (its row says when, built once with the rest of it)
    delay: float  # the backoff of a claim tried again (drawn once)

    @classmethod
    def of(
        cls, step: Step, message: TaskMessage, outcome: dict[str, Any], rows: list[Any], may_dispatch: bool
    ) -> _Claim:
        ok = outcome["status"] == "ok"
        again = 0.0 if rows else _again_in(outcome)
        retried = not ok and may_dispatch and message.attempt < (claim_retry(step).attempts or 1)
        delay = next_backoff(claim_retry(step), message.attempt) if retried else 0.0
        return cls(step, message, outcome, rows, again, retried, delay)

    @property
    def slot(self) -> dict[str, Any]:
        assert self.message.slot is not None
        return self.message.slot

    @property
    def ok(self) -> bool:
        return bool(self.outcome["status"] == "ok")

    @property
    def kind(self) -> str:
        if self.rows:
            return ev.CURSOR_CLAIMED
        if self.ok:
            return ev.CURSOR_CLAIM_WAITING if self.again else ev.CURSOR_SLOT_ENDED
        return ev.CURSOR_CLAIM_FAILED


def _record_claim(decider: DecisionPort, claim: _Claim, report: dict[str, Any]) -> str:
    """The claim's row; returns its key."""
    rows, again = claim.rows, claim.again
    return decider.record(
        claim.kind,
        claim.message.outcome_key(),
        status="completed" if claim.ok else "failed",
        step=claim.step.name,
        task="claim",
        run_id=claim.message.run_id,
        attempt=claim.message.attempt,
        parent_event_id=claim.message.parent_event_id,
        queue_id=report.get("queue_id"),
        worker=report.get("worker"),
        duration_ms=report.get("duration_ms"),
        error=claim.outcome.get("error"),
        meta={
            "slot": claim.slot["id"],
            "claim": claim.slot["claim"],
            "rows": len(rows),
            **({"frame": rows} if len(rows) > 1 else {}),  # kept once: its rows' messages name this row
            **({"retry_in": claim.delay} if claim.retried else {}),
            **({"again_in": again} if again else {}),
        },
    )


def _claim_rows(decider: DecisionPort, claim: _Claim, key: str) -> None:
    """`rows`: the claim took rows: the slot's first row runs (the rest by reference, or inline)."""
    rows, slot = claim.rows, claim.slot
    by_reference = len(rows) > 1 and written_formats() >= FRAME_VERSION
    dispatch_row(
        decider,
        claim.step,
        RunRef(claim.message.run_id, claim.message.frames, claim.message.args),
        slot=slot["id"],
        claim=slot["claim"],
        index=slot["index"],
        element=rows[0],
        parent=key,
        frame={"at": key, "size": len(rows), "pos": 0} if by_reference else None,
        legacy=None if by_reference or len(rows) == 1 else (rows[1:], []),
    )


def _claim_again(decider: DecisionPort, claim: _Claim, key: str) -> None:
    """`again`: the slot's next claim after again_in, or this one tried again after its backoff."""
    slot, again = claim.slot, claim.again
    dispatch_claim(
        decider,
        claim.step,
        RunRef(claim.message.run_id, claim.message.frames, claim.message.args),
        slot=slot["id"],
        claim=slot["claim"] + 1 if again else slot["claim"],
        index=slot["index"],
        parent=key,
        attempt=1 if again else claim.message.attempt + 1,
        countdown=again or claim.delay,
        done=None if again else slot.get("done"),  # a claim with again_in acknowledged its frame
    )


def _claim_slot_ended(decider: DecisionPort, claim: _Claim, key: str) -> None:
    """`slot_ended`: no rows and no `again_in`: the slot is over (and the loop with its last)."""
    _slot_ended(decider, claim.step, claim.message.run_id, key)


def _claim_failed(decider: DecisionPort, claim: _Claim, key: str) -> None:
    """`fail`: a claim failed past its retries: the loop fails (once, by whoever completes it)."""
    message, slot = claim.message, claim.slot
    if not decider.apply(CompleteLoop(message.run_id)):
        return
    reason = (claim.outcome.get("error") or {}).get("message") or "claim failed"
    error = {
        "kind": ErrorKind.CURSOR,
        "message": f"cursor claim of slot {slot['id']} failed after {message.attempt} attempts: {reason}",
        "slot": slot["id"],
    }
    decider.step_done(
        claim.step, _run_ref(decider, message.run_id), UnitEnd(ok=False, parent=key, error=error), via="loop"
    )


@dataclass(frozen=True)
class ClaimRule:
    """A named rule of a claim's outcome: the first that `applies` decides it."""

    name: str
    applies: Callable[[_Claim], bool]
    apply: Callable[[DecisionPort, _Claim, str], None]


# A claim's outcome as an ordered list of named rules.
CLAIM_RULES: tuple[ClaimRule, ...] = (
    ClaimRule("rows", lambda c: bool(c.rows), _claim_rows),
    ClaimRule("again", lambda c: bool(c.again) or c.retried, _claim_again),
    ClaimRule("slot_ended", lambda c: c.ok, _claim_slot_ended),
    ClaimRule("fail", lambda c: True, _claim_failed),
)


def _slot_ended(decider: DecisionPort, step: Step, run_id: str, parent: str) -> None:
    counters = decider.apply(EndCursorSlot(run_id))
    if counters["slots_ended"] < counters["max_in_flight"] or not decider.apply(CompleteLoop(run_id)):
        return
    stats = {"processed": counters["done"], "failed": counters["failed"], "slots": counters["max_in_flight"]}
    fatal = counters["failed"] - counters["tolerated"]
    key = record_loop_done(decider, step, run_id, parent, stats, fatal=fatal, tolerated=counters["tolerated"])
    data: dict[str, Any] = {"stats": stats}
    if step.loop is not None and step.loop.aggregate:  # asked for: read back from the item rows
        data["results"] = decider.reads.run_results(run_id, ev.CURSOR_ITEM_DONE)
    error = (
        None
        if not fatal
        else {"kind": ErrorKind.LOOP, "message": f"{fatal} of {stats['processed']} cursor rows failed", "stats": stats}
    )
    decider.step_done(
        step,
        _run_ref(decider, run_id),
        UnitEnd(ok=not fatal, parent=key, data=data, error=error),
        via="loop",
    )
