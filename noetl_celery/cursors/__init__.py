"""Cursor drivers: how a cursor loop's claim SQL runs against one kind of database.

A driver is one function `claim(ClaimCall) -> Outcome`: run the already-rendered claim SQL once,
binding `%(name)s` parameters from `call.params` (at least `__worker_slot_id`), commit so other
slots see the claim at once, and return `Outcome.ok({"rows": [...]})` with each claimed row as a
mapping of column -> value (zero rows: the slot is over), or an error Outcome carrying the
database's message. Drivers never raise for a failure of the claim itself. Zero rows with
`"again_in": seconds` means none now, but rows a lost claim took come back later: the slot claims
again after that long instead of ending (the nats driver, whose pulls can be lost).

Registered here: `postgres` (noetl_celery/cursors/postgres.py) and `sqlite`
(noetl_celery/cursors/sqlite.py), which run the cursor's claim SQL, and the queue drivers
without SQL, `redis_stream`, `mysql` (a work table, FOR UPDATE SKIP LOCKED) and `nats` (a
JetStream pull consumer): their cursor keys arrive rendered in `call.options`, and `call.done`
lists every row of the slot's previous claim (its frame), their chains over, to acknowledge; they
share `reclaim_seconds` and `wait_seconds` (below) and take up to `call.max_rows` rows per claim
(the frame's `max_rows`, default 1). A further driver is a module that decorates its
claim function with `@register("kind")` (`keys=` its own cursor keys, `needs_claim=False` without
SQL) and is listed in `_load_builtin_drivers`; the validator then accepts `cursor.kind: kind`
and the worker runs it. Keep the contract: one claim = one committed transaction (or its
queue's equivalent), rows as mappings, errors as Outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome
from noetl_celery.tools.base import missing_extra as tools_missing_extra

SLOT_PARAM = "__worker_slot_id"  # bound by every driver: the slot's unique id
DEFAULT_LEASE_SECONDS = 300.0  # a frame without lease_seconds
# A row claimed by another slot is taken over once its claim is older than `reclaim_seconds`
# (a cursor key), by default 2 x lease_seconds + RECLAIM_MARGIN: a live slot's row may wait, on top
# of its chain (each attempt within the lease), for the sweeper to re-publish a lost claim or
# attempt, which it does only after the lease plus its grace (deadlines.lease) and a sweep interval.
RECLAIM_MARGIN = 30.0


@dataclass(frozen=True)
class ClaimCall:
    """One claim: the rendered SQL, its bound parameters, the resolved credential."""

    sql: str
    params: dict[str, Any] = field(default_factory=dict)
    credential: Any = None
    timeout: float | None = None  # seconds
    options: dict[str, Any] = field(default_factory=dict)  # the cursor's own keys (drivers without SQL)
    done: list[Any] = field(default_factory=list)  # rows of the slot's previous claim, their chains over
    max_rows: int = 1  # rows one claim may take (the frame's max_rows): drivers without SQL honour it


def reclaim_seconds(call: ClaimCall) -> float:
    """Seconds after which another slot's unfinished row counts as abandoned (see RECLAIM_MARGIN)."""
    given = call.options.get("reclaim_seconds")
    if given not in (None, ""):
        value = float(given)
        if value <= 0:
            raise ValueError("reclaim_seconds must be above 0")
        return value
    return 2 * (call.timeout or DEFAULT_LEASE_SECONDS) + RECLAIM_MARGIN


def wait_seconds(call: ClaimCall, *aliases: str) -> float:
    """How long an empty claim keeps polling for a new row (`wait_seconds`, default 0: not at all)."""
    for key in ("wait_seconds", *aliases):
        if call.options.get(key) not in (None, ""):
            return max(float(call.options[key]), 0.0)
    return 0.0


def frame_rows(frame: dict[str, Any] | None) -> int:
    """Rows one claim may take: the frame's `max_rows` (a positive integer), else 1."""
    value = (frame or {}).get("max_rows")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return 1
    try:
        return max(int(value), 1)
    except ValueError:
        return 1


ClaimFn = Callable[[ClaimCall], Outcome]
_DRIVERS: dict[str, ClaimFn] = {}
# kind -> (the cursor keys it takes besides kind/auth/claim/retry, whether it needs `claim` SQL)
_OPTIONS: dict[str, tuple[frozenset[str], bool]] = {}
_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {}  # kind -> (its optional extra, the modules it imports)


def register(
    kind: str,
    *,
    keys: frozenset[str] = frozenset(),
    needs_claim: bool = True,
    extra: str | None = None,
    modules: tuple[str, ...] = (),
) -> Callable[[ClaimFn], ClaimFn]:
    def wrap(fn: ClaimFn) -> ClaimFn:
        _DRIVERS[kind] = fn
        _OPTIONS[kind] = (keys, needs_claim)
        if modules:
            _EXTRAS[kind] = (extra or kind, modules)
        return fn

    return wrap


def missing_extra(kind: str) -> str | None:
    """Why driver `kind` cannot run in this installation (its optional extra is missing), or None."""
    _load_builtin_drivers()
    if kind not in _EXTRAS:
        return None
    extra, modules = _EXTRAS[kind]
    return tools_missing_extra(f"cursor kind '{kind}'", extra, modules)


def driver_keys(kind: str) -> frozenset[str]:
    """The cursor keys driver `kind` takes besides kind/auth/claim/retry."""
    _load_builtin_drivers()
    return _OPTIONS.get(kind, (frozenset(), True))[0]


def needs_claim(kind: str) -> bool:
    """Whether driver `kind` runs a `claim` SQL text (an unknown kind: yes)."""
    _load_builtin_drivers()
    return _OPTIONS.get(kind, (frozenset(), True))[1]


_loaded: list[bool] = []  # the built-in drivers were imported (once: not "some driver is registered")


def _load_builtin_drivers() -> None:
    # Importing the modules registers them (lazily: they import the tools they run through). A
    # driver module imported on its own (or a further driver registered) first must not stand
    # in for the rest.
    if _loaded:
        return
    from noetl_celery.cursors import mysql, nats, postgres, redis_stream, sqlite  # noqa: F401

    _loaded.append(True)


def get_driver(kind: str) -> ClaimFn | None:
    _load_builtin_drivers()
    return _DRIVERS.get(kind)


def known_kinds() -> list[str]:
    _load_builtin_drivers()
    return sorted(_DRIVERS)


def claim(kind: str, call: ClaimCall) -> Outcome:
    driver = get_driver(kind)
    if driver is None:
        return Outcome.fail(
            ToolErrorKind.CURSOR, f"no cursor driver for kind {kind!r} (known: {', '.join(known_kinds())})"
        )
    if (missing := missing_extra(kind)) is not None:
        return Outcome.fail(ToolErrorKind.CURSOR, missing)
    try:
        return driver(call)
    except Exception as exc:  # a driver defect must still end as an outcome
        return Outcome.fail(ToolErrorKind.CURSOR, f"{kind} claim failed: {type(exc).__name__}: {exc}")
