"""Resume of collection loops: which iterations of a stopped loop run again, and in what order.

Decides, for each collection loop a resume continues (one still running when its execution was
cancelled or failed, and the loop whose failure failed the execution):
- an iteration whose last end row is a completion keeps its result and never runs again;
- an iteration whose last end row is a failure (not one a policy tolerated) runs again, from the
  attempt that failed it, as that attempt's next attempt (so every event key stays new);
- an index never dispatched runs as its first attempt;
- an iteration still in flight (an attempt without an outcome, or an outcome not acted on) is left
  to the resume's replay and decision of it; it finishes once, like any other.
The re-runs and never-dispatched indexes form the loop's queue (context "queue", entries
[index, task index, seq, attempt] and, for a re-run, the event that sent the failed attempt,
whose message runs again); the failures re-run are uncounted (done and failed), the loop is
running again, and the first entries are sent up to its max_in_flight. Each later completion
sends entry done + offset (engine/decision/loops.py next_entry), so max_in_flight holds and no
entry is sent twice. A loop
that had failed its step gets its `loop.done` and `step.done` rows archived, so both end again.
"""

from __future__ import annotations

from typing import Any

from noetl_celery.core import vocabulary as ev
from noetl_celery.engine.decision.loops import dispatch_queued
from noetl_celery.engine.decision.orchestrator import Decider
from noetl_celery.engine.messages import Dispatch
from noetl_celery.store import repo

END_TYPES = (ev.ITERATION_COMPLETED, ev.ITERATION_FAILED)


def reopen_loops(
    decider: Decider,
    events: list[dict[str, Any]],
    dispatched: dict[str, Dispatch],
    parent: str,
    failed_step: str | None,
) -> dict[str, Any]:
    """Reopen the execution's stopped collection loops; returns {"archive": keys, "pending": n,
    "steps": names of failed loop steps reopened}. Sends the first queued entries."""
    by_key = {e["event_id"]: e for e in events}
    archive: list[str] = []
    pending = 0
    steps: list[str] = []
    for loop in repo.execution_loops(decider.conn, decider.execution_id):
        step = decider.plan.steps.get(loop["step"])
        if step is None or step.loop is None or loop["mode"] == "cursor" or not loop["total"]:
            continue
        run_id = loop["run_id"]
        loop_done = by_key.get(f"{run_id}.loop.done")
        failed_loop = (
            loop["status"] == "completed"
            and loop["step"] == failed_step
            and loop_done is not None
            and loop_done["status"] == "failed"
        )
        if loop["status"] != "running" and not failed_loop:
            continue
        queue, rerun, in_flight = _queue(events, by_key, dispatched, run_id, int(loop["total"]))
        if not queue and not in_flight:
            continue
        base = int(loop["done"]) - rerun
        first = max(0, min(int(loop["max_in_flight"]) - in_flight, len(queue)))
        context = {**(loop.get("context") or {}), "queue": queue, "offset": first - base - 1}
        repo.reopen_loop(decider.conn, run_id, rerun=rerun, context=context)
        if failed_loop:
            archive += [f"{run_id}.loop.done", f"{run_id}.step.done"]
            pending += 1
            steps.append(loop["step"])
        for entry in queue[:first]:
            dispatch_queued(decider, step, run_id, entry, context, parent)
    return {"archive": archive, "pending": pending, "steps": steps}


def _queue(
    events: list[dict[str, Any]],
    by_key: dict[str, dict[str, Any]],
    dispatched: dict[str, Dispatch],
    run_id: str,
    total: int,
) -> tuple[list[list[Any]], int, int]:
    """(queue entries in index order, failures re-run, iterations in flight) of one loop."""
    final, seen, last_attempt = _iteration_rows(events, run_id)
    flying = _in_flight(dispatched, by_key, run_id, seen)
    source = _sources(events, run_id)
    entries: list[list[Any]] = []
    rerun = 0
    for index in range(total):
        row = final.get(index)
        if index in flying:
            continue
        if row is not None and row["event_type"] == ev.ITERATION_FAILED:
            if (row.get("meta") or {}).get("tolerated"):
                continue
            key = row["event_id"].removesuffix(".done")
            failing = dispatched.get(key)
            if failing is not None and key in source:
                m = failing.message
                at = [int(m.get("task_index", 0)), int(m.get("seq", 0)), int(m.get("attempt", 1)) + 1]
                entries.append([index, *at, source[key]])
            else:  # decided inside on_event (a routing-only task): the iteration starts over
                entries.append([index, 0, 0, last_attempt.get(index, 1) + 1])
            rerun += 1
        elif index not in seen:
            entries.append([index, 0, 0, 1])
    return entries, rerun, len(flying)


def _iteration_rows(
    events: list[dict[str, Any]], run_id: str
) -> tuple[dict[int, dict[str, Any]], set[int], dict[int, int]]:
    """(each iteration's ending row, the iterations with any row, each one's last attempt)."""
    final: dict[int, dict[str, Any]] = {}
    seen: set[int] = set()
    last_attempt: dict[int, int] = {}
    for event in events:
        index = event.get("iteration")
        if event.get("run_id") != run_id or index is None:
            continue
        seen.add(index)
        last_attempt[index] = max(last_attempt.get(index, 0), int(event.get("attempt") or 0))
        if event["event_type"] in END_TYPES:
            final[index] = event
    return final, seen, last_attempt


def _in_flight(
    dispatched: dict[str, Dispatch], by_key: dict[str, dict[str, Any]], run_id: str, seen: set[int]
) -> set[int]:
    """The iterations with an attempt dispatched and no outcome acted on (`seen` gains them)."""
    flying: set[int] = set()
    for key, dispatch in dispatched.items():
        message = dispatch.message
        if message.get("run_id") != run_id or message.get("iteration") is None:
            continue
        seen.add(message["iteration"])
        done = by_key.get(key + ".done")
        if done is None or (done.get("meta") or {}).get("ignored"):
            flying.add(message["iteration"])
    return flying


def _sources(events: list[dict[str, Any]], run_id: str) -> dict[str, str]:
    """Attempt key -> the event whose dispatch list sent it (each iteration of a batch too)."""
    source: dict[str, str] = {}
    for event in events:
        for raw in (event.get("meta") or {}).get("dispatch") or []:
            message = raw.get("message") or {}
            if message.get("run_id") == run_id and message.get("iteration") is not None:
                for dispatch in Dispatch.from_dict(raw).members():
                    source[dispatch.attempt_key()] = event["event_id"]
    return source
