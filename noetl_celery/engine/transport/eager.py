"""Eager attempts: the worker that decided an attempt runs it itself, without a broker hop.

With NOETL_EAGER_WINDOW above 0, a run_task message whose decision dispatches an attempt due now
goes on to run that attempt in the same job, then the attempt that one's decision dispatches, and
so on while the message is younger than the window. A zero-delay retry, the next step of a chain
and a loop's next iteration then cost a decision and no broker round trip. On by default (2 s;
NOETL_EAGER_WINDOW=0 turns it off).

Decides which dispatch of a decision is run here (`Window.take`):
- a `run` dispatch due now (no countdown) of one attempt: not a batch, not a sub-playbook's
  end, not a replay (a cursor slot's claim or row is taken as any attempt: a claim run again
  after its process died takes its rows back, engine/attempt/cursor_claim.py);
- while the message is younger than the window, and its pool process was not asked to stop (a
  SIGTERM to the worker's process group: engine/transport/process.py);
- when the attempt's own soft limit fits in what is left of the message's. A message's time
  limits are raised by the window when it is published (deadlines.time_limits), so an attempt
  of the same timeout fits for the whole window; an attempt may then be stopped up to the window
  later than its timeout says.
The first such dispatch is taken; the decision's other dispatches are published as before.

Each eager attempt is decided and recorded like any other; its rows carry the message's Celery
task id as `queue_id`. Celery (and Flower) see one task per message, with the verdict of the
message's own attempt. The message is acknowledged when its job ends: a process that dies during
an eager attempt leaves it to be delivered again, and its redelivery, whose own attempt is
recorded, replays the decisions of the attempts this message ran, up to the first one without an
outcome, which is sent again (orchestrator.replay, `ran_by`).

While it runs eager attempts, the pool process notes the one it is in (`Mark`: a small file named
by the message's Celery task id, rewritten in place for each attempt). When the process dies, the
worker's main process reads it (`died_in`) and records the delivery lost for that attempt, as it
does for a message's own attempt (engine/transport/worker_loss.py): the history shows which
attempt was killed, and a deadly attempt reaches its delivery limit counting this death too.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from noetl_celery.core.vocabulary import DispatchKind
from noetl_celery.engine.deadlines import SOFT_LIMIT_GRACE
from noetl_celery.engine.messages import Dispatch, wire
from noetl_celery.engine.transport.process import stop_requested

log = logging.getLogger(__name__)

# where pool processes note their eager attempt (one directory per user: workers of different
# users on one machine do not share it)
MARKS = Path(tempfile.gettempdir()) / f"noetl-eager-{os.getuid()}"


def eligible(dispatch: Dispatch) -> bool:
    """A dispatch this process could run itself: one attempt, due now, of this execution."""
    message = dispatch.message
    return (
        dispatch.kind == DispatchKind.RUN
        and dispatch.countdown <= 0
        and not message.get("batch")
        and message.get("child") is None
        and not message.get("replay")
        and not message.get("delayed")
    )


@dataclass(frozen=True)
class Window:
    """One message's eager window: since when it runs (time.monotonic()), for how many seconds it
    may take more attempts, and its soft time limit (None: it has none, as on an embedded worker)."""

    started: float
    seconds: float
    soft_limit: float | None

    def take(self, dispatches: list[Dispatch]) -> Dispatch | None:
        """The dispatch to run here next, if any."""
        elapsed = time.monotonic() - self.started
        if elapsed >= self.seconds or stop_requested():
            return None  # out of time, or the worker is being stopped: other workers take it
        for dispatch in dispatches:
            if not eligible(dispatch):
                continue
            if self.soft_limit is None or elapsed + dispatch.timeout + SOFT_LIMIT_GRACE <= self.soft_limit:
                return dispatch
        return None


def window_of(request: Any, seconds: float, started: float) -> Window | None:
    """The window of a run_task request (None when eager attempts are off)."""
    if seconds <= 0:
        return None
    limits = getattr(request, "timelimit", None) or (None, None)
    soft = limits[1] if len(limits) > 1 else None
    return Window(started=started, seconds=seconds, soft_limit=float(soft) if soft else None)


class Mark:
    """A pool process's note of the eager attempt it runs for one message (see the module
    docstring). Best effort: a note that cannot be written is skipped, never the attempt."""

    def __init__(self, task_id: str):
        self.path = MARKS / _file_name(task_id)
        self.fd: int | None = None
        self.size: int | None = None  # bytes of the note in the file (None: not known)

    def note(self, message: dict[str, Any]) -> None:
        """The attempt of `message` starts now."""
        data = json.dumps(wire(message), default=str).encode()
        try:
            if self.fd is None:
                self.fd, self.size = _open_note(self.path), 0
            os.pwrite(self.fd, data, 0)
            if self.size is None or len(data) < self.size:  # cut what is left of a longer note
                os.ftruncate(self.fd, len(data))
            self.size = len(data)
        except OSError as exc:
            self.size = None
            log.debug("eager attempt not noted: %s", exc)

    def close(self) -> None:
        """The message's eager attempts are over (each recorded, or left to its redelivery)."""
        if self.fd is None:
            return
        os.close(self.fd)
        self.fd = None
        self.path.unlink(missing_ok=True)


def _open_note(path: Path) -> int:
    """The note's file, made (its directory too, the first time: no mkdir for every message)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:  # no directory yet (or it was removed)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        return os.open(path, flags, 0o600)


def died_in(task_id: str) -> dict[str, Any] | None:
    """The task message of the eager attempt a dead pool process was running for the message with
    Celery task id `task_id` (None: it ran none, or the note is unreadable); the note is removed."""
    path = MARKS / _file_name(task_id)
    try:
        data = path.read_bytes()
        path.unlink(missing_ok=True)
    except OSError:
        return None
    try:
        message = json.loads(data)
    except ValueError:  # the process died writing it
        return None
    return message if isinstance(message, dict) else None


STALE_NOTE = 86_400.0  # seconds: a note this old was left by a worker killed whole


def clear_stale_notes(now: float | None = None) -> int:
    """Remove the notes that jobs ended with their whole worker left behind (a day old or more:
    a live job rewrites its note at each attempt); returns how many. At a worker's start."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(MARKS.iterdir())
    except OSError:  # no note was ever written here
        return 0
    for path in entries:
        try:
            if now - path.stat().st_mtime >= STALE_NOTE:
                path.unlink()
                removed += 1
        except OSError:  # removed meanwhile, or not ours to remove
            continue
    return removed


def _file_name(task_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in task_id)
