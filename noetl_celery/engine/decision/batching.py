"""Micro-batching of loop iterations (`loop.spec.batch: N | auto`): several iterations of one
loop in one Celery message.

Decides, when on_event's decision is written (Decider.flush):
- which dispatched messages may travel together: first attempts (first page, no countdown) of
  iterations of one loop run, at the same task, of a step whose loop asks for a batch. Retries,
  later pages, delayed attempts, sub-playbooks and cursor rows always travel alone;
- how many go in one message: N, or with `auto` an eighth of the loop's max_in_flight (at most
  AUTO_MAX), lowered so that a batch's iterations, at the tool-call time of this loop's
  iterations just reported, take about AUTO_TARGET_MS together. Slow iterations so go back to
  one per message and keep the loop's max_in_flight (a batch never grows: it refills the slots
  its own iterations freed);
- the batch message: the first iteration's message plus, in `batch`, each further iteration as
  the fields in which its message differs. Its timeout is the sum of its iterations' timeouts.

Everything else stays per iteration: each iteration records its own `iteration.started` row at
dispatch and its own outcome row, and is retried alone. The worker runs a batch's iterations one
after another (engine/attempt/worker.py) and reports their outcomes in one on_event payload, decided in
one transaction (engine/decision/orchestrator.py): a crash before that commit redelivers the whole batch,
after it the redelivery finds every outcome recorded and only re-publishes what was decided.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.dsl.plan import Loop, Plan
from noetl_celery.engine.messages import BATCH_VERSION, VERSION_FIELD, Dispatch, written_formats

AUTO_MAX = 32  # iterations of one message with `batch: auto`
AUTO_MESSAGES = 8  # with `batch: auto`, the loop's max_in_flight is spread over at least this many messages
AUTO_TARGET_MS = 100.0  # with `batch: auto`, tool-call time one batch should take at most

_SHARED_FIELDS = ("run_id", "step", "task_index", "seq")  # what the iterations of a batch share
# fields of a message that is never batched when they differ from these values
_ALONE_UNLESS = {"attempt": 1, "page": 1, "slot": None, "child": None, "replay": False, "delayed": False}


def batch_size(loop: Loop, durations_ms: list[float]) -> int:
    """Iterations per message for this loop; `durations_ms`: tool-call times of this decision."""
    if loop.batch != "auto":
        return max(int(loop.batch), 1)
    size = min(max(loop.max_in_flight // AUTO_MESSAGES, 1), AUTO_MAX)
    if durations_ms:
        mean = sum(durations_ms) / len(durations_ms)
        size = min(size, max(int(AUTO_TARGET_MS / max(mean, 0.01)), 1))
    return size


def _batchable(plan: Plan, dispatch: Dispatch) -> Loop | None:
    """The loop whose batch setting applies to this dispatch, or None when it travels alone."""
    message = dispatch.message
    step = plan.steps.get(message.get("step", ""))
    loop = step.loop if step is not None else None
    if loop is None or loop.batch == 1:  # the common case, settled first: every decision asks
        return None
    if dispatch.kind != DispatchKind.RUN or dispatch.countdown > 0 or message.get("iteration") is None:
        return None
    if message.get("batch") or message.get("store_tries"):
        return None
    if any(message.get(name, default) != default for name, default in _ALONE_UNLESS.items()):
        return None
    return loop


def group(plan: Plan, dispatches: list[Dispatch], durations_ms: dict[str, list[float]]) -> list[Dispatch]:
    """`dispatches` with the batchable ones sent together (a batch sits where its first was).
    `durations_ms`: per loop run, the tool-call times of the iterations this decision saw end.
    Nothing is batched while a rolling upgrade's older workers read no batch (written_formats)."""
    if written_formats() < BATCH_VERSION:
        return dispatches
    groups: dict[tuple[Any, ...], list[Dispatch]] = {}
    order: list[tuple[Any, ...] | Dispatch] = []
    sizes: dict[tuple[Any, ...], int] = {}
    for dispatch in dispatches:
        loop = _batchable(plan, dispatch)
        if loop is None:
            order.append(dispatch)
            continue
        key = (*(dispatch.message.get(name) for name in _SHARED_FIELDS), dispatch.label, dispatch.timeout)
        if key not in groups:
            groups[key] = []
            sizes[key] = batch_size(loop, durations_ms.get(dispatch.message["run_id"], []))
            order.append(key)
        groups[key].append(dispatch)
    if not groups:
        return dispatches
    result: list[Dispatch] = []
    for entry in order:
        if isinstance(entry, Dispatch):
            result.append(entry)
            continue
        members, size = groups[entry], sizes[entry]
        result += [_combine(members[i : i + size]) for i in range(0, len(members), size)]
    return result


def _combine(members: list[Dispatch]) -> Dispatch:
    """One dispatch for `members` (a single one stays as it is)."""
    first = members[0]
    if len(members) == 1:
        return first
    head = first.message
    diffs = [{k: v for k, v in m.message.items() if head.get(k) != v} for m in members[1:]]
    message = {**head, "batch": diffs, VERSION_FIELD: BATCH_VERSION}
    return replace(first, message=message, timeout=sum(m.timeout for m in members))
