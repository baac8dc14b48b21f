"""Loops: the collection strategy (one task per element) and what every loop strategy shares.

A loop strategy decides how a loop step starts (`start`) and what happens when one of its units
is over (`unit_done`): the decider calls only these two. `CollectionLoop` runs a materialised
list with a known total; `CursorLoop` (engine/decision/cursor_loop.py) pulls rows from a database
through slots, with no total known in advance.

Collection loops: on_event fans a loop step out into one task per iteration (or per chunk), at most
`max_in_flight` of them at once (the plan's Loop.max_in_flight; 1 for a sequential loop).

- The collection is rendered once when the loop starts and stored once (noetl_loop.collection;
  above NOETL_MAX_RESULT_BYTES in pages of about 256 kB of JSON, each stored by reference:
  store/blobs.py `collection_form`); each iteration message carries only its own element. A
  loop over a list stored by reference named alone (`in: "{{ fetch }}"`) is paged as the list is
  read, never decoded whole (`stored_source`, store/blobs.py `stored_collection_form`).
  Processes cache what the row holds by run id; the process that dispatches an iteration of a
  paged collection reads the page of its element and keeps the last CACHED_PAGES pages it read,
  so no worker holds a big collection whole after its loop started (its decoded objects take
  several times its JSON: a million small integers about 36 MB).
- At start, min(max_in_flight, total) iterations are dispatched (indexes 0 to max_in_flight - 1),
  and the loop's row keeps max_in_flight (noetl_loop, column `cap`). Each finished iteration
  increments `done` atomically (in the transaction that records its completion row), and the
  completion of index i dispatches index i + max_in_flight if it exists: every index is sent
  once, by the one completion of the index max_in_flight before it, and at most max_in_flight
  are in flight. Which index
  comes next needs no counter, so an iteration that is not the loop's last is counted and
  recorded by one statement (entries.CountIteration, written by write.count_iteration).
- The completion that makes done == total marks the loop completed (a guarded UPDATE: exactly
  once), aggregates the results in collection order from the iteration rows, and finishes the
  step. The rows are read in iteration order as they are consumed (`LoopEnds`,
  Reads.iteration_ends): a result whose JSON is at most the row cap is built whole, as it is
  kept inline; a bigger one is stored by reference as its JSON is written (entries.Streamed), and
  the step's result is that reference, as a big result's always is once written. The process
  completing a loop holds neither every row nor every result at once.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import TemplateError
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.dsl.plan import Step
from noetl_celery.engine.decision.entries import (
    ClaimIndexes,
    CompleteLoop,
    CountIteration,
    CreateLoop,
    PutCollection,
    PutValue,
    Streamed,
)
from noetl_celery.engine.decision.inputs import Bounds, is_paged, is_reference, is_truncated
from noetl_celery.engine.decision.rows import OpenRow, Row
from noetl_celery.engine.decision.units import RunRef, UnitEnd
from noetl_celery.engine.ids import attempt_key
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.templates.render import evaluate_condition, materialise, plain, reading, render_value

if TYPE_CHECKING:
    from noetl_celery.engine.decision.port import DecisionPort

Reader = Callable[[Mapping[str, Any]], Any]  # a reference -> the whole value it names

CACHED_COLLECTIONS = 64  # loop collections (or their references) one process keeps in memory
CACHED_PAGES = 4  # pages of paged loop collections one process keeps decoded (store/blobs.py collection_form)
FAILURES_NAMED = 3  # failed iterations a failed loop step's error names (index + message)

_collections: OrderedDict[str, Any] = OrderedDict()  # run id -> its list, or what its row holds instead
_pages: OrderedDict[tuple[int, str], list[Any]] = OrderedDict()  # a page's (execution id, sha256) -> its elements
_lock = threading.Lock()


def forget_collections() -> None:
    """Drop the cached loop collections (a forked process starts without its parent's)."""
    with _lock:
        _collections.clear()
        _pages.clear()


def _remember(run_id: str, items: Any) -> None:
    with _lock:
        _collections[run_id] = items
        _collections.move_to_end(run_id)
        while len(_collections) > CACHED_COLLECTIONS:
            _collections.popitem(last=False)


def _collection(decider: DecisionPort, run_id: str) -> Any:
    """What the loop row holds for its collection: the list, a reference to it (a loop started
    before collections were paged), or its pages (`is_paged`)."""
    with _lock:
        items = _collections.get(run_id)
    if items is None:
        row = decider.reads.loop(run_id, with_collection=True)
        items = (row or {}).get("collection") or []
        _remember(run_id, items)
    return items


def _total(decider: DecisionPort, run_id: str) -> int:
    """How many elements the loop's collection has."""
    items = _collection(decider, run_id)
    if is_paged(items):
        return int(items["length"])
    if is_reference(items):
        return len(decider.reads.value(items))
    return len(items)


def _element(decider: DecisionPort, run_id: str, index: int) -> Any:
    """Element `index` of the loop's collection. Of a paged one, only its page is read, and this
    process keeps the last CACHED_PAGES pages it read: a loop dispatches its elements in order,
    so a page serves about `per` iterations, and the whole list is never held."""
    items = _collection(decider, run_id)
    if is_paged(items):
        per = int(items["per"])
        return _page(decider, items["pages"][index // per])[index % per]
    if is_reference(items):  # stored whole by reference: the bounded cache of such values holds it
        return cast(list[Any], decider.reads.value(cast(dict[str, Any], items)))[index]
    return items[index]


def _page(decider: DecisionPort, ref: dict[str, Any]) -> list[Any]:
    key = (int(ref["execution_id"]), str(ref["sha256"]))
    with _lock:
        page = _pages.get(key)
        if page is not None:
            _pages.move_to_end(key)
            return page
    page = cast(list[Any], decider.reads.read_once(ref))
    with _lock:
        _pages[key] = page
        while len(_pages) > CACHED_PAGES:
            _pages.popitem(last=False)
    return page


_BARE_NAME = re.compile(r"\s*\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}\s*")


class _Unread:
    """What a trial render reads a stored value as (`stored_source`): the value left unread."""

    def __init__(self) -> None:
        self.refs: list[Mapping[str, Any]] = []

    def __call__(self, ref: Mapping[str, Any]) -> Any:
        self.refs.append(ref)
        return self


def stored_source(step: Step, context: dict[str, Any], bounds: Bounds) -> Mapping[str, Any] | None:
    """The reference of the list stored by reference that is the loop's whole collection, when its
    `in:` is one name alone (`{{ fetch }}`) whose value is such a list and the loop keeps every
    element as it is (no `where`, `limit`, `enumerate` or chunks): the loop's pages are then made
    as that list is read (entries.PutCollection `source`), and no process decodes it whole. None:
    the collection is rendered (`build_items`)."""
    loop = step.loop
    assert loop is not None
    if not isinstance(loop.collection, str) or not _BARE_NAME.fullmatch(loop.collection):
        return None
    if loop.where is not None or loop.limit is not None or loop.enumerate or loop.mode == "chunked":
        return None
    unread = _Unread()
    try:
        with reading(unread):
            value = materialise(render_value(loop.collection, context))
    except Exception:  # noqa: BLE001 - a trial: build_items renders it and says what is wrong
        return None
    if value is not unread or len(unread.refs) != 1:  # the name is not the stored value alone
        return None
    ref = unread.refs[0]
    length, size = ref.get("length"), ref.get("size")
    if ref.get("type") != "list" or not isinstance(length, int) or not isinstance(size, int):
        return None
    if not bounds.max_result_bytes < size <= bounds.max_stored_bytes or length > bounds.max_loop_items.value:
        return None  # kept inline, or refused: build_items says so
    return ref


def build_items(
    step: Step, context: dict[str, Any], bounds: Bounds | None = None, read_once: Reader | None = None
) -> list[Any]:
    """Render the collection once and shape it into the per-task elements (within `bounds`: the
    decision's, or the settings' now). `read_once` reads a value stored by reference that the
    collection names without keeping it in the process's cache (the loop keeps its pages)."""
    bounds = bounds or Bounds.load()
    loop = step.loop
    assert loop is not None
    with reading(read_once) if read_once is not None else contextlib.nullcontext():
        value = materialise(render_value(loop.collection, context))  # a reference is read whole
    if is_truncated(value):
        raise TemplateError(
            f"loop collection of step {step.name!r} is a value that was truncated when stored "
            f"({value.get('size')} bytes, limit {value.get('limit')} bytes, {bounds.max_result_bytes_env}; "
            f"above {bounds.max_stored_bytes_env} a value is not stored by reference either): "
            "it cannot be iterated; move big data through a sink and loop over a reference "
            "(a cursor loop over a table), or raise the limit"
        )
    if isinstance(value, (dict, list)) and len(value) > bounds.max_loop_items.value:
        raise TemplateError(
            f"loop collection of step {step.name!r} has {len(value)} elements, more than "
            f"{bounds.max_loop_items.env} ({bounds.max_loop_items.value}): iterate over big collections "
            "with a cursor loop (`loop: {cursor: ...}`, rows claimed from a table), or raise the limit"
        )
    if isinstance(value, dict):
        value = [{"key": k, "value": v} for k, v in value.items()]
    if not isinstance(value, list):
        raise TemplateError(f"loop collection of step {step.name!r} rendered to {type(value).__name__}, not a list")
    items = plain(value)
    if loop.where is not None:
        items = [el for el in items if evaluate_condition(loop.where, {**context, loop.iterator: el})]
    if loop.limit is not None:
        items = items[: loop.limit]
    if loop.enumerate:
        items = [{"index": i, "value": el} for i, el in enumerate(items)]
    if loop.mode == "chunked":
        size = max(loop.chunk_size or 1, 1)
        items = [items[i : i + size] for i in range(0, len(items), size)]
    return items


class LoopStrategy(Protocol):
    """How one kind of loop starts and counts its finished units (all inside on_event)."""

    def start(self, decider: DecisionPort, step: Step, run: RunRef, parent: str, context: dict[str, Any]) -> None: ...

    def unit_done(
        self, decider: DecisionPort, step: Step, message: TaskMessage, end: UnitEnd, row: OpenRow
    ) -> None: ...


def fail_loop_start(decider: DecisionPort, step: Step, run_id: str, parent: str, err: dict[str, Any]) -> None:
    """A loop that cannot start (its collection or cursor is unusable) fails its step."""
    decider.drop_unit()
    decider.fail_step(step.name, run_id, err, parent)


class CollectionLoop:
    """A rendered list, `max_in_flight` iterations in flight, results aggregated in collection order."""

    def start(self, decider: DecisionPort, step: Step, run: RunRef, parent: str, context: dict[str, Any]) -> None:
        start_loop(decider, step, run, parent, context)

    def unit_done(self, decider: DecisionPort, step: Step, message: TaskMessage, end: UnitEnd, row: OpenRow) -> None:
        failed = end.failed
        ended: Row = row  # the row that ends the iteration
        why = iteration_error(end.error or end.tolerated, step.tasks[message.task_index].label) if failed else None
        if row.get("event_type", "").startswith(ev.ACTION_PREFIX) and row.get("execution_id"):
            columns: dict[str, Any] = {
                "event_type": ev.ITERATION_FAILED if failed else ev.ITERATION_COMPLETED,
                "result": end.data,
            }
            if why is not None:
                columns.update(status="failed", error=why)
            row.end_unit(**columns)
            if end.tolerated is not None:
                row.note(tolerated=True)
        elif why is not None:  # decided inside on_event (a routing-only task): its row is recorded here
            key = attempt_key(message.run_id, message.iteration, message.seq, message.attempt) + ".done"
            decider.record(
                ev.ITERATION_FAILED,
                key,
                status="failed",
                step=step.name,
                task=why["task"],
                run_id=message.run_id,
                attempt=message.attempt,
                iteration=message.iteration,
                parent_event_id=row.get("event_id"),
                result=end.data,
                error=why,
            )
            ended = decider.last_row()
        iteration_done(
            decider,
            step,
            message,
            ok=not failed,
            data=end.data,
            row=ended,
            tolerated=end.tolerated is not None,
            error=why,
        )


def iteration_error(error: Any, task: str) -> dict[str, Any]:
    """What a failed iteration's row says: the error's kind and message, and the failing task."""
    body = dict(error) if isinstance(error, dict) else {"message": str(error) if error is not None else None}
    body.setdefault("kind", "error")
    if not body.get("message"):
        body["message"] = "the iteration failed without a message"
    body["task"] = task
    return body


COLLECTION_LOOP = CollectionLoop()


def loop_max_in_flight(step: Step) -> int:
    """Iterations of a collection loop in flight at most."""
    assert step.loop is not None
    return 1 if step.loop.mode == "sequential" else max(step.loop.max_in_flight, 1)


def start_loop(decider: DecisionPort, step: Step, run: RunRef, parent: str, context: dict[str, Any]) -> None:
    loop = step.loop
    assert loop is not None
    run_id, frames, args = run.run_id, run.frames, run.args
    source = stored_source(step, context, decider.inputs.bounds)
    items: list[Any] | None = None  # None: the first elements are read from the collection's pages
    if source is not None:  # paged as it is read, never decoded whole
        total = int(source["length"])
        try:
            collection = decider.apply(PutCollection([], source))
        except (LookupError, ValueError) as exc:  # gone (pruned?), or not the list its reference says
            message = f"loop collection of step {step.name!r} cannot be read: {exc}"
            fail_loop_start(decider, step, run_id, parent, {"kind": ErrorKind.LOOP, "message": message})
            return
    else:
        try:
            items = build_items(step, context, decider.inputs.bounds, read_once=decider.reads.read_once)
        except TemplateError as exc:
            fail_loop_start(decider, step, run_id, parent, {"kind": ErrorKind.LOOP, "message": str(exc)})
            return
        total = len(items)
        collection = decider.apply(PutCollection(items))  # above the row cap: in pages kept by reference
    max_in_flight = loop_max_in_flight(step)
    decider.apply(
        CreateLoop(
            run_id=run_id,
            step=step.name,
            mode=loop.mode,
            total=total,
            max_in_flight=max_in_flight,
            collection=collection,
            context={"frames": frames, "args": args, "parent": parent},
        )
    )
    _remember(run_id, collection)
    key = decider.record(
        ev.ITERATOR_STARTED,
        f"{run_id}.loop.start",
        status="started",
        step=step.name,
        run_id=run_id,
        parent_event_id=parent,
        meta={"total": total, "mode": loop.mode, "cap": max_in_flight},  # the event's meta: "cap"
    )
    if total == 0:
        finish_loop(decider, step, run_id, key, [], ok_count=0, failed=0)
        return
    first = min(max_in_flight, total)
    decider.apply(ClaimIndexes(run_id, first))
    for index in range(first):
        element = items[index] if items is not None else _element(decider, run_id, index)
        _dispatch_iteration(decider, step, run_id, index, element, frames, args, key)


def _dispatch_iteration(
    decider: DecisionPort,
    step: Step,
    run_id: str,
    index: int,
    element: Any,
    frames: list[list[str]],
    args: dict[str, Any],
    parent: str,
    at: tuple[int, int, int] = (0, 0, 1),
) -> None:
    """Send one iteration; `at` is (task index, seq, attempt): a resumed iteration starts again
    at the attempt after the one that failed it."""
    task_index, seq, attempt = at
    message = TaskMessage(
        execution_id=decider.execution_id,
        run_id=run_id,
        step=step.name,
        task_index=task_index,
        seq=seq,
        attempt=attempt,
        iteration=index,
        element=element,
        frames=frames,
        args=args,
        parent_event_id=parent,
    )
    decider.dispatch_task(step, message)


def dispatch_queued(
    decider: DecisionPort, step: Step, run_id: str, entry: list[Any], context: dict[str, Any], parent: str
) -> None:
    """Send a queued entry [index, task index, seq, attempt(, source)] of a resumed loop. With a
    source (the event whose dispatch list sent the failed attempt), the attempt's own message runs
    again, as its next attempt: earlier tasks' results, page and call stay as they were."""
    index, task_index, seq, attempt = (int(v) for v in entry[:4])
    failed = (
        _failed_message(decider, str(entry[4]), attempt_key(run_id, index, seq, attempt - 1)) if entry[4:] else None
    )
    if failed is not None:
        retry = failed.evolve(attempt=attempt, replay=False, delayed=False, parent_event_id=parent)
        decider.dispatch_task(decider.plan.steps[failed.step], retry)
        return
    _dispatch_iteration(
        decider,
        step,
        run_id,
        index,
        _element(decider, run_id, index),
        context.get("frames", []),
        context.get("args", {}),
        parent,
        at=(task_index, seq, attempt),
    )


def _failed_message(decider: DecisionPort, source: str, key: str) -> TaskMessage | None:
    row = decider.reads.event(source)
    for raw in ((row or {}).get("meta") or {}).get("dispatch") or []:
        for message in TaskMessage.from_dict(raw.get("message") or {}).members():  # a batch: each iteration
            if message.outcome_key().removesuffix(".done") == key:
                return message
    return None


def next_entry(counters: dict[str, Any], iteration: int | None) -> list[Any] | None:
    """What the completion of `iteration` sends next: index iteration + max_in_flight of the collection, or,
    in a resumed loop, entry done + offset of its queue (context "queue", "offset")."""
    context = counters.get("context") or {}
    queue = context.get("queue")
    if queue is None:
        index = int(iteration or 0) + counters["max_in_flight"]
        return [index, 0, 0, 1] if index < counters["total"] else None
    position = counters["done"] + int(context.get("offset", 0))
    return list(queue[position]) if 0 <= position < len(queue) else None


def iteration_done(
    decider: DecisionPort,
    step: Step,
    message: TaskMessage,
    *,
    ok: bool,
    data: Any,
    row: Row,
    tolerated: bool = False,
    error: Any = None,
) -> None:
    """Count the iteration, dispatch the next index, and finish the loop on the last one."""
    shape = (loop_max_in_flight(step), _total(decider, message.run_id))
    counters = decider.apply(CountIteration(message.run_id, ok=ok, tolerated=tolerated, unless_last=shape))
    done, total = counters["done"], counters["total"]
    entry = next_entry(counters, message.iteration)
    if entry is not None and decider.can_dispatch():
        context = {"frames": message.frames, "args": message.args}
        dispatch_queued(decider, step, message.run_id, entry, context, row["event_id"])
    if done is None or done < total:  # None: counted by the decision's last write, never the last
        return
    if not decider.apply(CompleteLoop(message.run_id)):
        return
    stats = loop_stats(total, counters["succeeded"], counters["failed"])
    ends = LoopEnds(decider, message, total, ok=ok, data=data, error=error)
    results = ends.within(decider.inputs.bounds.max_result_bytes)
    result = None
    if results is None:  # above the row cap: stored by reference as its JSON is written
        result = decider.apply(PutValue(Streamed({"results": None, "stats": stats}, "results", ends.results)))
        if result is None:  # not stored by reference after all (above NOETL_MAX_STORED_BYTES): built whole
            results = list(ends.results())
    end_loop(
        decider,
        step,
        message.run_id,
        row.get("event_id"),
        {"results": results, "stats": stats} if result is None else result,
        stats,
        tolerated=counters["tolerated"],
        failures=ends.failures,
    )


class LoopEnds:
    """A completing collection loop's iterations, read in iteration order as they are consumed
    (`Reads.iteration_ends`): never every iteration's end at once. The same rule as
    `_final_rows`, `_ordered_results` and `_first_failures` over rows held at once: an
    iteration's later end wins, one decided in this same event (not written yet) wins over every
    recorded one, and the current iteration's own end wins over both."""

    def __init__(self, decider: DecisionPort, message: TaskMessage, total: int, *, ok: bool, data: Any, error: Any):
        self.decider = decider
        self.message = message
        self.total = total
        self.ok = ok
        self.data = data
        self.error = error
        self.failures: list[dict[str, Any]] = []  # set by each complete pass of `results`

    def ends(self) -> Generator[tuple[int, bool, Any], None, None]:
        """Each iteration's last end, (iteration, failed?, result or error), in iteration order."""
        run_id = self.message.run_id
        decided: dict[int, tuple[bool, Any]] = {}
        for row in self.decider.decided():  # decided in this same event, not written yet
            kind = row.get("event_type")
            if row.get("run_id") == run_id and kind in _ENDS and row.get("iteration") is not None:
                failed = kind == ev.ITERATION_FAILED
                decided[row["iteration"]] = (failed, row.get("error" if failed else "result"))
        waiting = sorted(decided)
        next_decided = 0
        recorded = self.decider.reads.iteration_ends(run_id)
        try:
            for iteration, failed, payload in recorded:
                while next_decided < len(waiting) and waiting[next_decided] < iteration:
                    yield waiting[next_decided], *decided[waiting[next_decided]]
                    next_decided += 1
                if next_decided < len(waiting) and waiting[next_decided] == iteration:
                    next_decided += 1
                    yield iteration, *decided[iteration]
                else:
                    yield iteration, failed, payload
        finally:
            close = getattr(recorded, "close", None)
            if close is not None:
                close()
        for iteration in waiting[next_decided:]:
            yield iteration, *decided[iteration]

    def results(self) -> Generator[Any, None, None]:
        """Every iteration's result in collection order (None: it failed, or has no end); once
        all are yielded, `failures` names the first failed iterations."""
        current = self.message.iteration
        named: list[tuple[int, Any]] = []  # the first failed iterations but the current one
        own: tuple[Any] | None = None  # the current iteration's failure as read
        index = 0
        ends = self.ends()
        try:
            for iteration, failed, payload in ends:
                if failed and iteration == current:
                    own = (payload,)
                elif failed and len(named) < FAILURES_NAMED:
                    named.append((iteration, payload))
                if iteration < index or iteration >= self.total:
                    continue
                while index < iteration:
                    yield self._result(index, None)
                    index += 1
                yield self._result(index, None if failed else payload)
                index += 1
        finally:
            ends.close()
        while index < self.total:
            yield self._result(index, None)
            index += 1
        found = dict(named)
        if current is not None and not self.ok:
            if self.error is not None:
                found[current] = self.error
            elif own is not None:
                found[current] = own[0]
        self.failures = [_named_failure(i, found[i]) for i in sorted(found)[:FAILURES_NAMED]]

    def _result(self, index: int, recorded: Any) -> Any:
        if index == self.message.iteration:
            return self.data if self.ok else None
        return recorded

    def within(self, limit: int) -> list[Any] | None:
        """Every result, when their JSON is at most `limit` bytes (the row cap: the loop's result
        is kept inline then, whole, as before); None, read no further, above it."""
        results: list[Any] = []
        size = 0
        values = self.results()
        try:
            for value in values:
                size += len(json.dumps(value, default=str, ensure_ascii=False).encode("utf-8")) + 2
                if size > limit:
                    return None
                results.append(value)
        finally:
            values.close()
        return results


_ENDS = (ev.ITERATION_COMPLETED, ev.ITERATION_FAILED)


def _named_failure(index: int, raw: Any) -> dict[str, Any]:
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    return {"index": index, "kind": error.get("kind"), "message": error.get("message"), "task": error.get("task")}


# An iteration's last end: (row id, failed?, its result or its error). `_final_rows`,
# `_ordered_results` and `_first_failures` apply the completion's rule to every end held at once;
# the completion itself reads them in order (`LoopEnds`), and the tests hold it to the same value.
End = tuple[float, bool, Any]
_NOT_WRITTEN = float("inf")  # an end decided in this same event outranks every recorded one


def _final_rows(decider: DecisionPort, run_id: str) -> dict[int, End]:
    """Each iteration's last end (a resumed iteration's new end outranks its old failure)."""
    final: dict[int, End] = {}
    for kind, column in ((ev.ITERATION_COMPLETED, "result"), (ev.ITERATION_FAILED, "error")):
        failed = kind == ev.ITERATION_FAILED
        for r in decider.reads.run_events(run_id, kind, ("id", "iteration", column)):
            _keep_later(final, r["iteration"], (r["id"], failed, r[column]))
    for decided in decider.decided():  # decided in this same event, not written yet
        decided_kind = decided.get("event_type")
        if decided.get("run_id") == run_id and decided_kind in (ev.ITERATION_COMPLETED, ev.ITERATION_FAILED):
            failed = decided_kind == ev.ITERATION_FAILED
            _keep_later(
                final, decided["iteration"], (_NOT_WRITTEN, failed, decided.get("error" if failed else "result"))
            )
    return final


def _keep_later(final: dict[int, End], iteration: int | None, end: End) -> None:
    if iteration is not None and (iteration not in final or final[iteration][0] <= end[0]):
        final[iteration] = end


def _first_failures(final: dict[int, End], message: TaskMessage, *, ok: bool, current: Any) -> list[dict[str, Any]]:
    """The failed iterations in index order, at most FAILURES_NAMED: {index, kind, message, task}."""
    found = {i: payload for i, (_, failed, payload) in final.items() if failed}
    if message.iteration is not None:
        if ok:
            found.pop(message.iteration, None)
        elif current is not None:
            found[message.iteration] = current
    return [_named_failure(index, found[index]) for index in sorted(found)[:FAILURES_NAMED]]


def _ordered_results(final: dict[int, End], message: TaskMessage, total: int, *, ok: bool, data: Any) -> list[Any]:
    """Every iteration's result in collection order (the current one is not written yet); a
    failed iteration's is None."""
    results = [None if (end := final.get(i)) is None or end[1] else end[2] for i in range(total)]
    if message.iteration is not None and 0 <= message.iteration < total:
        results[message.iteration] = data if ok else None
    return results


def record_loop_done(
    decider: DecisionPort,
    step: Step,
    run_id: str,
    parent: str | None,
    stats: dict[str, Any],
    *,
    fatal: int,
    tolerated: int,
) -> str:
    """The loop's one `iterator.completed` row (any loop kind); returns its key."""
    return decider.record(
        ev.ITERATOR_COMPLETED,
        f"{run_id}.loop.done",
        status="failed" if fatal else "completed",
        step=step.name,
        run_id=run_id,
        parent_event_id=parent,
        meta={**stats, "tolerated": tolerated} if tolerated else stats,
    )


def finish_loop(
    decider: DecisionPort,
    step: Step,
    run_id: str,
    parent: str | None,
    results: list[Any],
    *,
    ok_count: int,
    failed: int,
    tolerated: int = 0,
    failures: list[dict[str, Any]] | None = None,
) -> None:
    """The loop's result and the step's end. Failures a policy tolerated do not fail the step;
    a failed step's error names the first failed iterations (index and message)."""
    stats = loop_stats(len(results), ok_count, failed)
    end_loop(
        decider,
        step,
        run_id,
        parent,
        {"results": results, "stats": stats},
        stats,
        tolerated=tolerated,
        failures=failures,
    )


def loop_stats(total: int, ok_count: int, failed: int) -> dict[str, Any]:
    return {"total": total, "success": ok_count, "failed": failed}


def end_loop(
    decider: DecisionPort,
    step: Step,
    run_id: str,
    parent: str | None,
    result: Any,
    stats: dict[str, Any],
    *,
    tolerated: int = 0,
    failures: list[dict[str, Any]] | None = None,
) -> None:
    """`finish_loop` of a result already made: `{"results": [...], "stats": stats}`, or its
    reference when it was stored by reference as it was written."""
    loop_row = decider.reads.loop(run_id) or {}
    context = loop_row.get("context") or {}
    total, failed = stats["total"], stats["failed"]
    fatal = failed - tolerated
    key = record_loop_done(decider, step, run_id, parent, stats, fatal=fatal, tolerated=tolerated)
    error: dict[str, Any] | None = None
    if fatal:
        named = "; ".join(f"[{f['index']}] {f['message']}" for f in failures or [])
        error = {
            "kind": ErrorKind.LOOP,
            "message": f"{failed} of {total} iterations failed" + (f": {named}" if named else ""),
            "stats": stats,
        }
        if failures:
            error["failures"] = failures
    run = RunRef(run_id, context.get("frames", []), context.get("args", {}))
    decider.step_done(step, run, UnitEnd(ok=not fatal, parent=key, data=result, error=error), via="loop")
