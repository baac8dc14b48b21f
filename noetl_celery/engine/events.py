"""The event vocabulary: every `event_type` the engine writes, named once.

Event types are part of the product (docs/events.md lists them); the decider, the loop
strategies and the store queries use these names and never spell them inline.
"""

from __future__ import annotations

from typing import Final

EXECUTION_STARTED: Final = "execution.started"
EXECUTION_COMPLETED: Final = "execution.completed"
EXECUTION_FAILED: Final = "execution.failed"

STEP_STARTED: Final = "step.started"
STEP_COMPLETED: Final = "step.completed"
STEP_FAILED: Final = "step.failed"
STEP_SKIPPED: Final = "step.skipped"
JOIN_ARRIVED: Final = "join.arrived"

ACTION_STARTED: Final = "action.started"
ACTION_COMPLETED: Final = "action.completed"
ACTION_FAILED: Final = "action.failed"
ACTION_PREFIX: Final = "action."
RETRY_SCHEDULED: Final = "retry.scheduled"
RETRY_EXHAUSTED: Final = "retry.exhausted"
PAGE_COMPLETED: Final = "page.completed"
SINK_EVENT_LOG: Final = "sink.event_log"

# collection loops
ITERATOR_STARTED: Final = "iterator.started"
ITERATOR_COMPLETED: Final = "iterator.completed"
ITERATION_STARTED: Final = "iteration.started"
ITERATION_COMPLETED: Final = "iteration.completed"
ITERATION_FAILED: Final = "iteration.failed"

# cursor loops: one row per claim, one per row processed, a handful per slot and per loop
CURSOR_CLAIMED: Final = "cursor.claimed"  # a claim returned rows
CURSOR_CLAIM_FAILED: Final = "cursor.claim.failed"  # a claim errored (retried, then the step fails)
CURSOR_SLOT_ENDED: Final = "cursor.slot.ended"  # a claim returned no row: the slot is over
CURSOR_ITEM_DONE: Final = "cursor.item.done"
CURSOR_ITEM_FAILED: Final = "cursor.item.failed"

# keys of event rows that exist once per execution
START_KEY: Final = EXECUTION_STARTED
