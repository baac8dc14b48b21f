"""What travels through the broker: task messages, dispatch orders, on_event payloads, and what
event rows keep of them.

A task message carries its own iteration element, never the loop's collection, and no tool
configuration (workers read the plan, cached per process, by execution id; a new execution's
first messages name it by digest, `seed`, so that a process that ran the plan before reads
nothing).

Every message says which format it is written in (`message_version`). Decoding is tolerant, so
old and new workers can share one queue during a rolling upgrade: a field this version does not
know is ignored (and logged once), a missing optional field takes its default, and a message
of a newer format than READ_VERSION is refused with MessageTooNew, which fails its
execution with a clear error rather than losing it. Adding a field: give it a default; write a
new format only when an old reader would misread the message by ignoring the field.

Formats: 1 is every ordinary message. 2 (BATCH_VERSION) is a batched loop message (`batch`: the
iterations after the first, engine/decision/batching.py) and the on_event payload of its outcomes: a
format-1 reader would run only the first iteration, so such messages say 2 and are written only
by code that reads them. 3 (FRAME_VERSION) is a cursor row message that names its frame by
reference (`slot.frame`: the row keeping the frame's rows, engine/decision/cursor_loop.py)
instead of carrying the rest of it: an older reader would take the frame for over after this row.
Everything else stays format 1, readable by older workers. During a rolling upgrade,
NOETL_MESSAGE_FORMAT caps the formats written (`written_formats`) at the newest the release being
replaced reads: frames then travel inline and iterations unbatched, as that release sends them.

On the wire (`TaskMessage.to_wire`, `wire`) a task message leaves out every optional field that
has its default: readers of any version fill the defaults back in, so this needs no new format
version. A loop iteration's message is then about 8 fields instead of 24. In memory and in the
stored dispatch lists (`meta.dispatch`) messages stay complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from noetl_celery.config import settings
from noetl_celery.core.errors import NoetlError
from noetl_celery.core.vocabulary import DispatchKind, PayloadKind
from noetl_celery.engine.deadlines import DEFAULT_TIMEOUT
from noetl_celery.engine.ids import attempt_key, claim_key, cursor_iteration

log = logging.getLogger(__name__)

CONTEXT_VALUE_LIMIT = 2048  # characters of one value kept in an event row's `context`
MESSAGE_VERSION = 1  # the format this code writes for every message but batches
BATCH_VERSION = 2  # the format of a batched loop message and of its outcomes' payload
FRAME_VERSION = 3  # the format of a cursor row message that names its frame by reference
READ_VERSION = FRAME_VERSION  # the newest format this code reads (settings.NEWEST_MESSAGE_FORMAT)
VERSION_FIELD = "message_version"  # absent: a message from before formats were versioned (read as 0)


class MessageError(NoetlError):
    """A message that cannot be decoded (a required field is missing, or it is not an object)."""


class MessageTooNew(MessageError):
    """A message written in a newer format than this worker reads."""


_T = TypeVar("_T")
_logged_unknown: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def written_formats() -> int:
    """The newest format this process writes: READ_VERSION, or less during a rolling upgrade
    (NOETL_MESSAGE_FORMAT: the newest format the release being replaced reads). Below
    FRAME_VERSION a cursor frame travels inline; below BATCH_VERSION iterations are not batched."""
    return min(int(settings.limit(settings.MESSAGE_FORMAT_ENV)), READ_VERSION)


def check_version(data: dict[str, Any], what: str) -> int:
    """The message's format version; MessageTooNew when this code is too old to read it."""
    raw = data.get(VERSION_FIELD, 0)
    try:
        version = int(raw)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"{what}: {VERSION_FIELD} must be a whole number, got {raw!r}") from exc
    if version > READ_VERSION:
        raise MessageTooNew(
            f"{what} is in message format {version}, newer than this worker reads ({READ_VERSION}): "
            "upgrade every worker before sending work to it"
        )
    return version


def _note_unknown(what: str, names: set[str]) -> None:
    with _logged_lock:
        fresh = sorted(n for n in names if (what, n) not in _logged_unknown)
        _logged_unknown.update((what, n) for n in fresh)
    if fresh:
        log.warning("%s: ignoring field(s) this version does not know: %s", what, ", ".join(fresh))


_MISSING = dataclasses.MISSING
# per dataclass: its field names, the required ones, and each optional field's default value
_shapes: dict[type, tuple[frozenset[str], tuple[str, ...], dict[str, Any]]] = {}


def _shape(cls: type) -> tuple[frozenset[str], tuple[str, ...], dict[str, Any]]:
    shape = _shapes.get(cls)
    if shape is None:
        fields = dataclasses.fields(cls)
        required = tuple(f.name for f in fields if f.default is _MISSING and f.default_factory is _MISSING)
        defaults = {
            f.name: f.default if f.default is not _MISSING else f.default_factory()  # type: ignore[misc,operator]
            for f in fields
            if f.name not in required
        }
        shape = _shapes[cls] = (frozenset(f.name for f in fields), required, defaults)
    return shape


def decode(cls: type[_T], data: Any, what: str) -> _T:
    """An instance of the dataclass `cls` from a message dict: version checked, unknown fields
    ignored (logged once per field), a missing required field named."""
    if not isinstance(data, dict):
        raise MessageError(f"{what}: expected an object, got {type(data).__name__}")
    check_version(data, what)
    known, required, _ = _shape(cls)
    unknown = data.keys() - known - {VERSION_FIELD}
    if unknown:
        _note_unknown(what, set(unknown))
    missing = [name for name in required if name not in data]
    if missing:
        raise MessageError(f"{what}: missing field(s) {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in known})


def wire(message: dict[str, Any]) -> dict[str, Any]:
    """A task message dict as it is sent: optional fields at their default are left out (every
    reader fills them back in), the format version is kept."""
    _, required, defaults = _shape(TaskMessage)
    kept = {k: v for k, v in message.items() if k in required or k not in defaults or v != defaults[k]}
    kept[VERSION_FIELD] = written_version(message)
    return kept


def written_version(message: dict[str, Any]) -> int:
    """The format a task message dict is written in: FRAME_VERSION when it names its cursor frame
    by reference, BATCH_VERSION when it carries a batch."""
    return _format(message.get("batch"), message.get("slot"))


def _format(batch: Any, slot: Any) -> int:
    if isinstance(slot, dict) and slot.get("frame") is not None:
        return FRAME_VERSION
    return BATCH_VERSION if batch else MESSAGE_VERSION


def stamp(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` marked with the format it is written in (a batch's outcomes: BATCH_VERSION)."""
    return {**payload, VERSION_FIELD: BATCH_VERSION if payload.get("kind") == BATCH_EVENT else MESSAGE_VERSION}


BATCH_EVENT = PayloadKind.BATCH  # on_event payload kind: the outcomes of a batch's iterations, in order


@dataclass(frozen=True)
class OutcomeEvent:
    """The on_event payload of one attempt's outcome (`kind: outcome`), built here only: by the
    worker that ran it, by the sweeper or the transport for an attempt that never reported, and
    by a child execution's end for its parent's `playbook` task. On the wire it is the plain dict
    of `to_dict` (the same keys as ever); `from_dict` reads any payload of that kind, old ones too.

    `task` is the attempt's task message as it travels (`TaskMessage.to_wire`, or the dict it was
    stored as); `outcome` the tool's outcome (status, data, error, http, pg, meta); `report` where
    and when it ran (queue_id, worker, pid, started_at, duration_ms)."""

    execution_id: int
    task: dict[str, Any]
    outcome: dict[str, Any]
    report: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PayloadKind.OUTCOME,
            "execution_id": self.execution_id,
            "task": self.task,
            "outcome": self.outcome,
            "report": self.report,
        }

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> OutcomeEvent:
        return cls(payload["execution_id"], payload["task"], payload["outcome"], payload["report"])


@dataclass(frozen=True)
class BatchEvent:
    """The on_event payload of a batch's outcomes (`kind: batch`), one OutcomeEvent dict per
    iteration, in order (engine/decision/batching.py)."""

    execution_id: int
    events: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": PayloadKind.BATCH, "execution_id": self.execution_id, "events": self.events}


@dataclass(frozen=True)
class TaskMessage:
    """One attempt of one task of one step run (or of one loop iteration)."""

    execution_id: int
    run_id: str
    step: str
    task_index: int = 0
    seq: int = 0  # hops within the unit: next task, jump, next page
    attempt: int = 1
    page: int = 1
    iteration: int | None = None
    element: Any = None
    iter_vars: dict[str, Any] = field(default_factory=dict)
    prev: Any = None
    args: dict[str, Any] = field(default_factory=dict)
    from_step: str | None = None  # the step whose arc started this run: its result is `result`
    call: dict[str, Any] = field(default_factory=dict)  # pagination: next_call overrides
    task_results: dict[str, Any] = field(default_factory=dict)
    frames: list[list[str]] = field(default_factory=list)  # open forks: [fork_id, join_step]
    version: int = 0  # execution state version the decision saw
    parent_event_id: str | None = None
    replay: bool = False
    delayed: bool = False  # sent with a countdown: checks the execution still runs when due
    store_tries: int = 0  # times the worker found the event store unreachable for this message
    # cursor loops: {"id": slot number, "claim": claim number, "phase": "claim" | "row",
    # "index": rows this slot finished, a row's "frame": {"at": the key of the event row that
    # keeps the claimed frame in its meta.frame, "size": its rows, "pos": this row's place in it}
    # (absent: a frame of one row), a claim's "done": the previous frame's rows, for the driver to
    # acknowledge, a claim's "run": its first row's first task runs in the same attempt
    # (claimed_row), that row's "via": the claim attempt it ran in and, in that row's messages
    # only, the rest of the frame inline ("rows"; a message of an earlier release also carries
    # "rows" and the frame's rows over, "done")}
    slot: dict[str, Any] | None = None
    # sub-playbooks: the finished child's outcome, when the parent's task still has a sink to run
    child: dict[str, Any] | None = None
    # a batch (engine/decision/batching.py): the iterations after this one, each as the fields in which
    # its message differs from this one; this message is the batch's first iteration
    batch: list[dict[str, Any]] | None = None
    # a new execution's first messages: its state as the start left it, by reference
    # (context.Seed: the plan's digest, the state version and pending count), so that a worker
    # process that ran the same plan before needs no read of the store to run them. Never stored.
    seed: dict[str, Any] | None = None
    # the key of the decision row whose lease this message alone answers (it was that decision's
    # only message): the decision that records its outcome deletes that lease in the same write,
    # and the sweeper never reads it (store/leases.py). Never stored; an older worker ignores it.
    lease: str | None = None
    # the key of the decision row whose lease this message shares with that decision's other
    # messages (a loop's first iterations, a fan-out): a worker that takes it late moves that lease
    # on (store/leases.py `taken`); its outcome never settles it. Never stored; an older worker
    # ignores it.
    shares: str | None = None

    def members(self) -> list[TaskMessage]:
        """The iterations this message runs: itself, or the messages of its batch, in order."""
        if not self.batch:
            return [self]
        first = replace(self, batch=None, replay=False)
        return [first, *(replace(first, **diff) for diff in self.batch)]

    @property
    def is_claim(self) -> bool:
        return self.slot is not None and self.slot.get("phase") == "claim"

    @property
    def ran_with_claim(self) -> bool:
        """The first attempt of a row's first task, run in its claim's attempt (claimed_row)."""
        return self.slot is not None and "via" in self.slot and self.seq == 0 and self.attempt == 1

    def outcome_key(self) -> str:
        """The deterministic key of this attempt's outcome row. A row's first attempt run with
        its claim is recorded under the claim attempt's key: the one outcome of that attempt."""
        if self.is_claim or self.ran_with_claim:
            assert self.slot is not None
            attempt = self.slot["via"] if self.ran_with_claim else self.attempt
            return claim_key(self.run_id, self.slot["id"], self.slot["claim"], attempt) + ".done"
        return attempt_key(self.run_id, self.iteration, self.seq, self.attempt) + ".done"

    def claimed_row(self, rows: list[Any], max_in_flight: int) -> TaskMessage:
        """A claim that runs its first row (`slot.run`; `max_in_flight`: the loop's): the message of that
        row's first attempt, as cursor_loop.dispatch_row would send it, marked with the claim
        attempt (`via`)."""
        assert self.slot is not None and rows
        slot = self.slot
        return replace(
            self,
            iteration=cursor_iteration(slot["id"], slot["index"], max_in_flight),
            element=rows[0],
            attempt=1,
            seq=0,
            task_index=0,
            replay=False,
            delayed=False,
            store_tries=0,
            seed=None,
            slot=row_slot(slot["id"], slot["claim"], slot["index"], rest=rows[1:], via=self.attempt),
        )

    def evolve(self, **changes: Any) -> TaskMessage:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field (values shared with this message, not copied: messages are not mutated)."""
        data = {name: getattr(self, name) for name in _FIELD_ORDER}
        data[VERSION_FIELD] = _format(self.batch, self.slot)
        return data

    def to_wire(self) -> dict[str, Any]:
        """The message as it travels: the fields that differ from their defaults (see `wire`)."""
        _, required, defaults = _shape(TaskMessage)
        kept = {name: getattr(self, name) for name in required}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                kept[name] = value
        kept[VERSION_FIELD] = _format(self.batch, self.slot)
        return kept

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskMessage:
        return decode(cls, data, "task message")

    def describe(self) -> str:
        """Shown in Flower's args column: which attempt of which unit this is."""
        from noetl_celery.compiler.names import attempt_argsrepr

        text = attempt_argsrepr(self.execution_id, self.step, self.attempt, self.iteration, self.page)
        if self.slot is not None:
            text += f" slot={self.slot['id']}" + (" claim" if self.is_claim else "")
        if self.batch:
            last = self.batch[-1].get("iteration", self.iteration)
            text += f" batch of {len(self.batch) + 1} (to iteration {last})"
        return text


@dataclass(frozen=True)
class Dispatch:
    """An order to publish: a task attempt for a worker (`run`), after `countdown` seconds.
    `timeout`: the seconds the attempt may run; its time limits and its lease derive from it
    (engine/deadlines.py)."""

    kind: str
    message: dict[str, Any]
    countdown: float = 0.0
    label: str = ""
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def task(
        cls, message: TaskMessage, *, countdown: float = 0.0, label: str = "", timeout: float = DEFAULT_TIMEOUT
    ) -> Dispatch:
        if countdown > 0:
            message = message.evolve(delayed=True)
        return cls(kind=DispatchKind.RUN, message=message.to_dict(), countdown=countdown, label=label, timeout=timeout)

    def with_version(self, version: int) -> Dispatch:
        return replace(self, message={**self.message, "version": version})

    def seeded(self, seed: dict[str, Any]) -> Dispatch:
        """This dispatch with its task message carrying `seed` (TaskMessage.seed)."""
        return replace(self, message={**self.message, "seed": seed})

    def answering(self, lease: str) -> Dispatch:
        """This dispatch with its task message carrying the lease it alone answers (TaskMessage.lease)."""
        return replace(self, message={**self.message, "lease": lease})

    def sharing(self, lease: str) -> Dispatch:
        """This dispatch with its task message carrying the lease it shares (TaskMessage.shares)."""
        return replace(self, message={**self.message, "shares": lease})

    def as_replay(self, countdown: float = 0.0) -> Dispatch:
        """This dispatch sent again, flagged `replay` (its receiver skips an attempt that is
        recorded), due in `countdown` seconds (what is left of its own wait; 0: now)."""
        return replace(self, message={**self.message, "replay": True}, countdown=countdown)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "countdown": self.countdown,
            "label": self.label,
            "timeout": self.timeout,
            VERSION_FIELD: MESSAGE_VERSION,
        }

    def stored(self) -> dict[str, Any]:
        """The dispatch as a decision row keeps it (`meta.dispatch`): a task message in its wire
        form, its fields at their default and its `seed`, `lease` and `shares` left out, and so are the dispatch's own
        (`countdown` 0, `label` "", `timeout` the default) and the format version 1, the
        message's and the dispatch's (an absent version is read as the oldest). `from_dict`, of
        this version or an earlier one, fills them back in."""
        data: dict[str, Any] = {"kind": self.kind, "message": self.message}
        if self.countdown:
            data["countdown"] = self.countdown
        if self.label:
            data["label"] = self.label
        if self.timeout != DEFAULT_TIMEOUT:
            data["timeout"] = self.timeout
        if self.kind == DispatchKind.RUN:
            message = wire(self.message)
            message.pop("seed", None)  # the store is read where it is wanted again
            message.pop("lease", None)  # a message sent again from the store leaves its lease to the sweeper
            message.pop("shares", None)
            if message[VERSION_FIELD] == MESSAGE_VERSION:  # a batch's 2, a frame's 3 stay: older readers refuse them
                del message[VERSION_FIELD]
            data["message"] = message
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Dispatch:
        """A dispatch as it was sent or stored; a task message comes back with every field."""
        dispatch = decode(cls, data, "dispatch")
        if dispatch.kind == DispatchKind.RUN and not all(name in dispatch.message for name in _FIELD_ORDER):
            dispatch = replace(dispatch, message=TaskMessage.from_dict(dispatch.message).to_dict())
        return dispatch

    def members(self) -> list[Dispatch]:
        """One dispatch per attempt: itself, or a batch's iterations, each with its share of the
        batch's timeout (what resume and the loop's bookkeeping read per iteration)."""
        batch = self.message.get("batch")
        if not batch or self.kind != DispatchKind.RUN:
            return [self]
        messages = TaskMessage.from_dict(self.message).members()
        share = self.timeout / len(messages)
        return [replace(self, message=m.to_dict(), timeout=share) for m in messages]

    def attempt_key(self) -> str:
        """The key of the dispatched attempt (its outcome row is this key + `.done`)."""
        return TaskMessage.from_dict(self.message).outcome_key().removesuffix(".done")


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(TaskMessage))


def row_slot(
    slot: int,
    claim: int,
    index: int,
    *,
    frame: dict[str, Any] | None = None,
    rest: list[Any] | None = None,
    via: int | None = None,
) -> dict[str, Any]:
    """A cursor row message's `slot`: its slot, claim and index, its frame by reference
    ({"at", "size", "pos"}; None: a frame of one row), the rest of its frame inline (`rest`: the
    first row of a claim that ran it, whose frame is recorded with its outcome), and the claim
    attempt it ran in (when it did)."""
    return {
        "id": slot,
        "claim": claim,
        "phase": "row",
        "index": index,
        **({"frame": frame} if frame is not None else {}),
        **({"rows": rest} if rest else {}),
        **({"via": via} if via is not None else {}),
    }


def _truncate(value: Any) -> Any:
    text = json.dumps(value, default=str)
    if len(text) <= CONTEXT_VALUE_LIMIT:
        return value
    return {"truncated": True, "size": len(text), "preview": text[:200]}


def sanitize(values: dict[str, Any]) -> dict[str, Any] | None:
    """Values for an event row's `context`: Nones dropped, large values replaced by their size."""
    kept = {k: _truncate(v) for k, v in values.items() if v is not None}
    return kept or None
