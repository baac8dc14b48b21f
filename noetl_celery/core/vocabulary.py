"""The vocabulary of the wire and the log, named once: every `event_type` the engine writes,
the kinds of on_event payloads, of dispatches and of errors.

They are part of the product (docs/events.md lists them): the decider, the loop strategies,
the workers, the store's queries and views, the command line and `watch` use these names and
never spell them inline. Plain strings (`Final`), so what travels and what is stored is exactly
what it was: an old message still decodes.
"""

from __future__ import annotations

from typing import Final

EXECUTION_STARTED: Final = "execution.started"
EXECUTION_COMPLETED: Final = "execution.completed"
EXECUTION_FAILED: Final = "execution.failed"
EXECUTION_CANCELLED: Final = "execution.cancelled"  # runner.cancel (engine/recovery/lifecycle.py)
EXECUTION_RESUMED: Final = "execution.resumed"  # engine/recovery/resume.py, key execution.resumed.e<N>
EXECUTION_ENDS: Final = (EXECUTION_FAILED, EXECUTION_CANCELLED, EXECUTION_COMPLETED)

# what the transport and the sweeper record about an attempt that did not report
ATTEMPT_WORKER_LOST: Final = "attempt.worker_lost"  # a delivery killed its worker process
ATTEMPT_REPUBLISHED: Final = "attempt.republished"  # the sweeper sent a lost attempt again

STEP_STARTED: Final = "step.started"
STEP_COMPLETED: Final = "step.completed"
STEP_FAILED: Final = "step.failed"
STEP_SKIPPED: Final = "step.skipped"
STEP_EVENTS: Final = (STEP_STARTED, STEP_COMPLETED, STEP_FAILED, STEP_SKIPPED)
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

# cursor loops: one event row per claim, one per row processed, a handful per slot and per loop
CURSOR_CLAIMED: Final = "cursor.claimed"  # a claim returned rows
CURSOR_CLAIM_FAILED: Final = "cursor.claim.failed"  # a claim errored (retried, then the step fails)
CURSOR_SLOT_ENDED: Final = "cursor.slot.ended"  # a claim returned no row: the slot is over
CURSOR_CLAIM_WAITING: Final = "cursor.claim.waiting"  # no row now, rows a lost claim took come back later
CURSOR_ITEM_DONE: Final = "cursor.item.done"
CURSOR_ITEM_FAILED: Final = "cursor.item.failed"

# keys of event rows that exist once per execution
START_KEY: Final = EXECUTION_STARTED


class DispatchKind:
    """`Dispatch.kind`: what a decided message is."""

    RUN: Final = "run"  # a task attempt for run_task
    EVENT: Final = "event"  # an event for on_event (a sub-playbook's start or end)


class PayloadKind:
    """The `kind` of an on_event payload."""

    START: Final = "start"  # an execution starts
    OUTCOME: Final = "outcome"  # one attempt's outcome
    BATCH: Final = "batch"  # the outcomes of a batch's iterations, in order
    WAKE: Final = "wake"  # a long countdown's wake-up: the message it holds is published now


class ErrorKind:
    """`error.kind` of the errors the engine writes (tools add their own: `Outcome.fail`)."""

    TEMPLATE: Final = "template"  # a template could not be rendered
    POLICY: Final = "policy"  # a retry policy failed the attempt or named no task
    ROUTING: Final = "routing"  # no arc matched, or steps without work in a cycle
    LIMIT: Final = "limit"  # an execution limit was reached
    LOOP: Final = "loop"  # a loop could not start, or its iterations failed
    CURSOR: Final = "cursor"  # a cursor loop's claims failed
    PLAYBOOK: Final = "playbook"  # a sub-playbook could not start or failed
    TIMEOUT: Final = "timeout"  # a time limit (an attempt's, or the playbook's)
    WORKER_LOST: Final = "worker_lost"  # the attempt kept killing its worker process
    CANCELLED: Final = "cancelled"  # noetl-celery cancel
    STORE_REFUSED: Final = "store_refused"  # the event store refused a value of the event
    INTERNAL: Final = "internal"  # the engine could not decide an event
    INVALID_RESULT: Final = "invalid_result"  # a result the store cannot hold
    LOST: Final = "lost"  # the sweeper gave up on an attempt that never reported


class ToolErrorKind:
    """`error.kind` of the errors a tool call reports (`Outcome.fail` in tools/, cursors/ and the
    worker around them); the kinds the engine writes as well are ErrorKind's."""

    TIMEOUT: Final = ErrorKind.TIMEOUT  # the call ran past its timeout
    INVALID_RESULT: Final = ErrorKind.INVALID_RESULT  # the tool returned a value the store cannot hold
    PLAYBOOK: Final = ErrorKind.PLAYBOOK  # a playbook task reached a worker (on_event starts it)
    TEMPLATE: Final = ErrorKind.TEMPLATE  # the task's config or a claim could not be rendered
    UNKNOWN_TOOL: Final = "unknown_tool"  # no tool of the task's kind
    EXCEPTION: Final = "exception"  # the tool (or the user's code) raised
    INVALID_ARGS: Final = "invalid_args"  # the task's settings or args cannot be used
    CREDENTIAL: Final = "credential"  # the credential could not be resolved
    CONNECTION: Final = "connection"  # no server answered, or the connection broke (retryable)
    AUTHORIZATION: Final = "authorization"  # the server refused the credential
    NOT_FOUND: Final = "not_found"  # what the call names does not exist (HTTP 404 too)
    SQL_ERROR: Final = "sql_error"  # the database refused the statement
    SCRIPT: Final = "script"  # the script's source could not be read
    EXTENSION: Final = "extension"  # a DuckDB extension could not be loaded
    NATS_ERROR: Final = "nats_error"  # any other refusal by a NATS server
    OBJECT_STORE: Final = "object_store"  # any other refusal by S3, GCS or the local file system
    TOO_LARGE: Final = "too_large"  # an object is larger than a result may be (never cut)
    SHELL: Final = "shell"  # a shell command exited non-zero (its output in the error's data)
    CANCELLED: Final = ErrorKind.CANCELLED  # the execution was cancelled while the call ran (shell)
    DISABLED: Final = "disabled"  # the task's tool kind is turned off on this deployment
    CURSOR: Final = ErrorKind.CURSOR  # a cursor claim failed
    SINK: Final = "sink"  # the task's sink failed after the call succeeded
    REQUEST_ERROR: Final = "request_error"  # an HTTP request failed otherwise
    RATE_LIMIT: Final = "rate_limit"  # HTTP 429 (retryable)
    SERVER_ERROR: Final = "server_error"  # HTTP 5xx (retryable)
    AUTH: Final = "auth"  # HTTP 401, 403
    CLIENT_ERROR: Final = "client_error"  # any other HTTP 4xx
