"""Loops: on_event fans a loop step out into one task per iteration (or per chunk), under a cap.

- The collection is rendered once when the loop starts and stored once (noetl_loop.collection);
  each iteration message carries only its own element. Processes cache the collection by run id.
- At start, min(cap, total) iterations are dispatched. Each finished iteration increments `done`
  atomically (in the transaction that records its completion row); the k-th completion dispatches
  index cap + k - 1 if it exists, so exactly `cap` iterations are in flight, none twice.
- The completion that makes done == total marks the loop completed (a guarded UPDATE: exactly
  once), aggregates the results in collection order from the iteration rows, and finishes the step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from noetl_celery.dsl.plan import Step
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.errors import TemplateError
from noetl_celery.store import repo
from noetl_celery.templating import evaluate_condition, plain, render_value

if TYPE_CHECKING:
    from noetl_celery.engine.orchestrator import Decider

CACHED_COLLECTIONS = 64  # loop collections one process keeps in memory

_collections: OrderedDict[str, list[Any]] = OrderedDict()
_lock = threading.Lock()


def _remember(run_id: str, items: list[Any]) -> None:
    with _lock:
        _collections[run_id] = items
        _collections.move_to_end(run_id)
        while len(_collections) > CACHED_COLLECTIONS:
            _collections.popitem(last=False)


def _collection(decider: Decider, run_id: str) -> list[Any]:
    with _lock:
        items = _collections.get(run_id)
    if items is None:
        row = repo.get_loop(decider.conn, run_id, with_collection=True)
        items = list((row or {}).get("collection") or [])
        _remember(run_id, items)
    return items


def build_items(step: Step, context: dict[str, Any]) -> list[Any]:
    """Render the collection once and shape it into the per-task elements."""
    loop = step.loop
    assert loop is not None
    value = render_value(loop.collection, context)
    if isinstance(value, dict):
        value = [{"key": k, "value": v} for k, v in value.items()]
    if not isinstance(value, list):
        raise TemplateError(f"loop collection of step {step.name!r} rendered to {type(value).__name__}, "
                            "not a list")
    items = plain(value)
    if loop.where is not None:
        items = [el for el in items if evaluate_condition(loop.where, {**context, loop.iterator: el})]
    if loop.limit is not None:
        items = items[: loop.limit]
    if loop.enumerate:
        items = [{"index": i, "value": el} for i, el in enumerate(items)]
    if loop.mode == "chunked":
        size = max(loop.chunk_size or 1, 1)
        items = [items[i: i + size] for i in range(0, len(items), size)]
    return items


def start_loop(decider: Decider, step: Step, run_id: str, parent: str, frames: list[list[str]],
               args: dict[str, Any], context: dict[str, Any]) -> None:
    loop = step.loop
    assert loop is not None
    try:
        items = build_items(step, context)
    except TemplateError as exc:
        err = {"kind": "loop", "message": str(exc)}
        decider.pending -= 1
        decider.record("step.failed", f"{run_id}.step.done", status="failed", step=step.name, run_id=run_id,
                       error=err, parent_event_id=parent)
        decider.fail_execution(step.name, err, f"{run_id}.step.done")
        return
    cap = 1 if loop.mode == "sequential" else max(loop.max_in_flight, 1)
    total = len(items)
    repo.create_loop(decider.conn, {
        "run_id": run_id, "execution_id": decider.execution_id, "step": step.name, "mode": loop.mode,
        "total": total, "cap": cap, "collection": items,
        "context": {"frames": frames, "args": args, "parent": parent},
    })
    _remember(run_id, items)
    key = decider.record("iterator.started", f"{run_id}.loop.start", status="started", step=step.name,
                         run_id=run_id, parent_event_id=parent,
                         meta={"total": total, "mode": loop.mode, "cap": cap})
    if total == 0:
        finish_loop(decider, step, run_id, key, [], ok_count=0, failed=0)
        return
    first = min(cap, total)
    repo.claim_loop_indexes(decider.conn, run_id, first)
    for index in range(first):
        _dispatch_iteration(decider, step, run_id, index, items[index], frames, args, key)


def _dispatch_iteration(decider: Decider, step: Step, run_id: str, index: int, element: Any,
                        frames: list[list[str]], args: dict[str, Any], parent: str) -> None:
    message = TaskMessage(execution_id=decider.execution_id, run_id=run_id, step=step.name, iteration=index,
                          element=element, frames=frames, args=args, parent_event_id=parent)
    decider.dispatch_task(step, message)


def iteration_done(decider: Decider, step: Step, message: TaskMessage, *, ok: bool, data: Any, error: Any,
                   row: dict[str, Any], tolerated: bool = False) -> None:
    """Count the iteration, dispatch the next index, and finish the loop on the last one."""
    counters = repo.loop_iteration_done(decider.conn, message.run_id, ok=ok, tolerated=tolerated)
    done, total, cap = counters["done"], counters["total"], counters["cap"]
    next_index = cap + done - 1
    if next_index < total and decider.running and decider.failure is None:
        items = _collection(decider, message.run_id)
        _dispatch_iteration(decider, step, message.run_id, next_index, items[next_index], message.frames,
                            message.args, row.get("event_id"))
    if done < total:
        return
    if not repo.complete_loop(decider.conn, message.run_id):
        return
    results = _ordered_results(decider, message, total, ok=ok, data=data)
    finish_loop(decider, step, message.run_id, row.get("event_id"), results,
                ok_count=counters["succeeded"], failed=counters["failed"], tolerated=counters["tolerated"])


def _ordered_results(decider: Decider, message: TaskMessage, total: int, *, ok: bool, data: Any) -> list[Any]:
    """Every iteration's result in collection order (the current one is not written yet)."""
    by_index: dict[int, Any] = {}
    for kind in ("iteration.completed", "iteration.failed"):
        for r in repo.run_events(decider.conn, decider.execution_id, message.run_id, kind,
                                 columns=("iteration", "result")):
            by_index[r["iteration"]] = r["result"] if kind == "iteration.completed" else None
    by_index[message.iteration] = data if ok else None  # type: ignore[index]
    return [by_index.get(i) for i in range(total)]


def finish_loop(decider: Decider, step: Step, run_id: str, parent: str | None, results: list[Any], *,
                ok_count: int, failed: int, tolerated: int = 0) -> None:
    """The loop's result and the step's end. Failures a policy tolerated do not fail the step."""
    loop_row = repo.get_loop(decider.conn, run_id) or {}
    context = loop_row.get("context") or {}
    total = len(results)
    stats = {"total": total, "success": ok_count, "failed": failed}
    fatal = failed - tolerated
    key = decider.record("iterator.completed", f"{run_id}.loop.done", status="failed" if fatal else "completed",
                         step=step.name, run_id=run_id, parent_event_id=parent,
                         meta={**stats, "tolerated": tolerated} if tolerated else stats)
    result = {"results": results, "stats": stats}
    error = None if not fatal else {"kind": "loop", "message": f"{failed} of {total} iterations failed",
                                    "stats": stats}
    decider.step_done(step, run_id, ok=not fatal, data=result, error=error, frames=context.get("frames", []),
                      args=context.get("args", {}), task_results={}, parent=key, via="loop")

