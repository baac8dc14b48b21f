"""What the worker's main process does when an attempt ends without reporting.

Decides, for a run_task message:
- its pool process died (os._exit, a segfault, an OOM kill): the delivery is counted as an
  `attempt.worker_lost` row (when the message's own attempt is recorded, it died in an attempt
  the message ran eagerly, engine/transport/eager.py: that attempt, as the process noted it, gets
  the row, and the message goes back to the queue uncounted);
  below NOETL_MAX_DELIVERIES the message goes back to the queue (a killed process must not lose
  the task), at the limit it is acknowledged and the attempt gets the outcome `worker_lost` (an
  ordinary failed attempt: the retry policy applies);
- its hard time limit killed the pool process: the attempt gets the outcome `timeout`;
- the worker's cold shutdown ended the pool process in the middle of the attempt (a second
  SIGTERM, engine/transport/process.py): counted and requeued as a lost delivery, its reason says so. The
  tool never reports that interruption as the attempt's own error (tools/python.py).
If the event store cannot be reached here, Celery's own handling applies (requeue on loss); the
sweeper ends what stays without an outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.worker.request import Request

from noetl_celery.config.settings import Settings
from noetl_celery.core import vocabulary as ev
from noetl_celery.core.errors import AttemptFailed
from noetl_celery.core.vocabulary import ErrorKind
from noetl_celery.engine.attempt.worker import already_done
from noetl_celery.engine.messages import TaskMessage
from noetl_celery.engine.recovery.sweeper import lost_outcome
from noetl_celery.engine.transport import eager
from noetl_celery.store import recovery as store_recovery
from noetl_celery.store.db import transaction
from noetl_celery.store.events import insert_events

log = logging.getLogger(__name__)

WORKER_LOST = ev.ATTEMPT_WORKER_LOST
MAX_COUNTED = 50  # delivery rows looked at for one attempt


@dataclass
class Hooks:
    """What a lost attempt needs from the app that runs it, installed by that app (app.py) when it
    defines its tasks: the settings in force, and how an outcome is decided (on_event's body).
    The transport never imports the app back."""

    settings: Callable[[], Settings] | None = None
    report: Callable[[dict[str, Any]], object] | None = None


HOOKS = Hooks()


def install(*, settings: Callable[[], Settings], report: Callable[[dict[str, Any]], object]) -> None:
    HOOKS.settings = settings
    HOOKS.report = report


def count_loss(url: str, message: dict[str, Any], reason: str) -> int:
    """Record one delivery that killed its process; returns how many are recorded now."""
    attempt = TaskMessage.from_dict(message)  # on the wire, fields at their default are left out
    key = attempt.outcome_key().removesuffix(".done")
    execution_id = int(message["execution_id"])
    candidates = [f"{key}.lost.{n}" for n in range(1, MAX_COUNTED + 1)]
    with transaction(url) as conn:
        seen = store_recovery.existing_keys(conn, execution_id, candidates)
        count = len(seen) + 1
        insert_events(
            conn,
            [
                {
                    "execution_id": execution_id,
                    "event_id": f"{key}.lost.{count}",
                    "event_type": WORKER_LOST,
                    "status": "lost",
                    "step": attempt.step,
                    "run_id": attempt.run_id,
                    "attempt": attempt.attempt,
                    "iteration": attempt.iteration,
                    "page": attempt.page,
                    "parent_event_id": attempt.parent_event_id,
                    "error": {"kind": ErrorKind.WORKER_LOST, "message": reason[:500]},
                    "meta": {"delivery": count, **_batch_of(attempt)},
                }
            ],
        )
    return count


def _batch_of(attempt: TaskMessage) -> dict[str, Any]:
    """For a batch (engine/decision/batching.py): the iterations the lost delivery carried."""
    if not attempt.batch:
        return {}
    return {"batch": [member.iteration for member in attempt.members()]}


def _shutting_down() -> bool:
    """Whether this worker is in its warm or cold shutdown (its pool processes are being ended)."""
    from celery.worker import state

    # each holds the exit code once set (0 for a warm shutdown)
    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


class AttemptRequest(Request):
    """run_task's request in the worker's main process (see the module docstring)."""

    def _attempt_message(self) -> dict[str, Any] | None:
        kwargs = self.kwargs or {}
        message = kwargs.get("message")
        return message if isinstance(message, dict) else None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        lost = isinstance(exc, WorkerLostError) or (
            isinstance(exc, (SystemExit, KeyboardInterrupt)) and not (self._already_cancelled or self._already_revoked)
        )
        message = self._attempt_message()
        reason = f"{type(exc).__name__}: {exc}"
        if _shutting_down():
            reason = f"the worker was shutting down ({reason})"
        if lost and message is not None and self._give_up(message, reason):
            self.acknowledge()
            return None
        if isinstance(exc, AttemptFailed):
            # the playbook failed, not the engine: Flower's traceback is the user's code's (or the
            # error line), not the frames of the engine that raised AttemptFailed
            shown = getattr(exc, "user_traceback", None) or f"{type(exc).__name__}: {exc}"
            exc_info.traceback = shown
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        message = self._attempt_message()
        if not soft and message is not None:
            reason = f"the attempt ran past its time limit of {timeout:g} s and its process was killed"
            self._report(lost_outcome(message, ErrorKind.TIMEOUT, reason, "time-limit"))
        super().on_timeout(soft, timeout)

    def _give_up(self, message: dict[str, Any], reason: str) -> bool:
        """Count the lost delivery; True when the attempt has been reported as `worker_lost`."""
        assert HOOKS.settings is not None, "worker_loss.install() was not called"
        settings = HOOKS.settings()
        eager_attempt = eager.died_in(self.id)  # the attempt it ran for this message, if any
        try:
            if already_done(settings.database_url, TaskMessage.from_dict(message)):
                # it died in an attempt the message went on to run (engine/transport/eager.py): that attempt's
                # delivery is counted, the message requeued uncounted; its redelivery sends that
                # attempt again (as a message of its own, counted from there on)
                self._count_eager(settings.database_url, eager_attempt, reason)
                return False
            count = count_loss(settings.database_url, message, reason)
        except Exception as err:
            log.warning("could not count a lost delivery (%s); the message is requeued", err)
            return False
        if count < settings.max_deliveries:
            log.warning(
                "attempt %s killed its worker process (delivery %d of %d); requeued",
                message.get("step"),
                count,
                settings.max_deliveries,
            )
            return False
        reason = f"the attempt killed its worker process {count} times (last: {reason})"
        return self._report(lost_outcome(message, ErrorKind.WORKER_LOST, reason, "worker"))

    @staticmethod
    def _count_eager(url: str, message: dict[str, Any] | None, reason: str) -> None:
        """Record the lost delivery of the eager attempt a dead process was in (not one that was
        recorded meanwhile). The limit of deliveries is left to that attempt's own message."""
        if message is None or already_done(url, TaskMessage.from_dict(message)):
            return
        count = count_loss(url, message, f"{reason} (in an attempt run eagerly)")
        log.warning("attempt %s, run eagerly, killed its worker process (delivery %d)", message.get("step"), count)

    def _report(self, payload: dict[str, Any]) -> bool:
        assert HOOKS.report is not None, "worker_loss.install() was not called"
        try:
            HOOKS.report(payload)
            return True
        except Exception as err:  # the sweeper ends it when its deadline passes
            log.warning("could not record the end of an attempt: %s", err)
            return False
