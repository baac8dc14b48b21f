"""The redis_stream cursor driver: a consumer group on a Redis stream, a frame of entries per claim.

Cursor keys: `stream` (required), `group` (default "noetl"; created at the stream's start, with
the stream, when missing), `dead_letter` (default "<stream>:dead"), `max_deliveries` (default 5),
`wait_seconds` (or `block_seconds`, default 0), `reclaim_seconds`. `auth:` names a redis:// URL
(or a mapping with `url`). The consumer is the slot (`__worker_slot_id`), so each slot's entries
are its own in the group's pending list.

A claim, in one call:
1. XACK the entries of the slot's previous claim (`call.done`, its whole frame): the next claim is
   dispatched only when the previous frame's chains are over (done or failed), so that is "XACK
   when done".
2. Up to n entries (the frame's `max_rows`, default 1: `call.max_rows`): first the entries this
   slot was given and never finished (its claim's worker died before the engine recorded the
   claim), then entries of any consumer idle past `reclaim_seconds` (default 2 x the frame's
   `lease_seconds` + 30: see cursors.RECLAIM_MARGIN) with XAUTOCLAIM: a slot that is gone (its
   execution ended or lost) no longer holds its entries.
3. The rest with XREADGROUP of new entries (`>`), waiting up to `wait_seconds` (alias
   `block_seconds`) when it is above 0.
An entry taken back whose delivery count is past `max_deliveries` is a poison entry: it is added
to the dead-letter stream (its fields plus `source_id`, `source_stream`, `deliveries`) and acked
in one MULTI/EXEC, and the claim looks further. Nothing found: zero rows, the slot is over (an
empty stream at the moment of the claim ends the slot unless `wait_seconds` keeps it waiting).

A row is `{"id": entry id, "deliveries": n, **fields}` (field names and values as text).

The client (its connection pool) is kept per process and URL, and the group is created once per
process and stream (again when a claim finds it gone); a forked child starts without them.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import redis

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.cursors import SLOT_PARAM, ClaimCall, reclaim_seconds, register, wait_seconds
from noetl_celery.tools.base import Outcome

DEFAULT_GROUP = "noetl"
DEFAULT_MAX_DELIVERIES = 5
KEYS = frozenset(
    {"stream", "group", "dead_letter", "max_deliveries", "block_seconds", "wait_seconds", "reclaim_seconds"}
)

_clients: dict[str, Any] = {}  # by URL: a client and its connection pool, per process
_groups: set[tuple[str, str, str]] = set()  # (url, stream, group) known to exist
_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child (a prefork pool process) starts without its parent's clients (redis-py's
    pool would also notice the new pid, but the lock may have been held at the fork)."""
    global _lock
    _clients.clear()
    _groups.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _url(credential: Any) -> str:
    value = credential.get("url") or credential.get("dsn") if isinstance(credential, dict) else credential
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("redis_stream cursor needs `auth:` naming a redis:// URL (or a mapping with `url`)")
    return value


def _client(url: str) -> Any:  # redis-py's stubs do not follow decode_responses
    with _lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(url, decode_responses=True, socket_timeout=30)
        return client


def _group(r: Any, url: str, stream: str, group: str, again: bool = False) -> None:
    """Create the group (and the stream) when missing: once per process and stream, or `again`
    when a claim found it gone."""
    if (url, stream, group) in _groups and not again:
        return
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    _groups.add((url, stream, group))


def _row(entry_id: str, fields: dict[str, str] | None, deliveries: int) -> dict[str, Any]:
    return {**(fields or {}), "id": entry_id, "deliveries": deliveries}


def _deliveries(r: Any, stream: str, group: str, ids: list[str]) -> dict[str, int]:
    """How many times each of `ids` was delivered (one round trip)."""
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
    return {i: int(p[0]["times_delivered"]) if p else 1 for i, p in zip(ids, pipe.execute(), strict=True)}


def _dead_letter(r: Any, stream: str, group: str, dead: str, entry_id: str, fields: Any, n: int) -> None:
    pipe = r.pipeline(transaction=True)
    pipe.xadd(dead, {**(fields or {}), "source_id": entry_id, "source_stream": stream, "deliveries": n})
    pipe.xack(stream, group, entry_id)
    pipe.execute()


@dataclass
class _Take:
    """One claim's names and the entries it has taken so far."""

    r: Any
    stream: str
    group: str
    consumer: str
    dead: str
    limit: int
    count: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return len(self.rows) >= self.count

    def keep(self, claimed: list[Any]) -> None:
        """Entries now this consumer's: rows, or dead letters past the delivery limit. An entry
        deleted from the stream meanwhile (no fields) is acked: nothing to do."""
        gone = [entry[0] for entry in claimed if entry[1] is None]
        if gone:
            self.r.xack(self.stream, self.group, *gone)
        entries = [entry for entry in claimed if entry[1] is not None]
        if not entries:
            return
        counts = _deliveries(self.r, self.stream, self.group, [e[0] for e in entries])
        for entry_id, fields in entries:
            n = counts.get(entry_id, 1)
            if n > self.limit:
                _dead_letter(self.r, self.stream, self.group, self.dead, entry_id, fields, n)
            else:
                self.rows.append(_row(entry_id, fields, n))

    def own(self) -> None:
        """The entries this slot was given and never finished (its claim's worker died before the
        engine recorded the claim)."""
        r, stream, group = self.r, self.stream, self.group
        own = r.xpending_range(stream, group, min="-", max="+", count=self.count, consumername=self.consumer)
        if not own:
            return
        ids = [p["message_id"] for p in own]
        # XCLAIM counts a delivery; it returns no entry for an id deleted from the stream
        claimed = {e[0]: e[1] for e in self.r.xclaim(self.stream, self.group, self.consumer, 0, ids)}
        self.keep([(i, claimed.get(i)) for i in ids])

    def stale(self, lease_ms: int) -> None:
        """Entries of any consumer idle past the lease (XAUTOCLAIM scans 10 pending entries per
        COUNT 1: go on to the end of the pending list)."""
        start = "0-0"
        while not self.full:
            reply = self.r.xautoclaim(
                self.stream, self.group, self.consumer, lease_ms, start_id=start, count=self.count - len(self.rows)
            )
            start = reply[0]
            self.keep([(e[0], e[1]) for e in reply[1] if e])
            deleted = reply[2] if len(reply) > 2 else []  # Redis 7: ids deleted from the stream
            if deleted:
                self.r.xack(self.stream, self.group, *deleted)
            if start == "0-0":
                return

    def new(self, block_ms: int) -> None:
        if self.full:
            return
        read = self.r.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=self.count - len(self.rows), block=block_ms or None
        )
        for entry_id, fields in read[0][1] if read else []:
            self.rows.append(_row(entry_id, fields, 1))


@register("redis_stream", keys=KEYS, needs_claim=False)
def claim_redis_stream(call: ClaimCall) -> Outcome:
    opts = call.options
    stream = opts.get("stream")
    if not isinstance(stream, str) or not stream:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "redis_stream cursor needs `stream:` (the stream's key)")
    group = str(opts.get("group") or DEFAULT_GROUP)
    dead = str(opts.get("dead_letter") or f"{stream}:dead")
    try:
        limit = int(opts.get("max_deliveries") or DEFAULT_MAX_DELIVERIES)
        block_ms = int(wait_seconds(call, "block_seconds") * 1000)
        lease_ms = int(reclaim_seconds(call) * 1000)
        url = _url(call.credential)
    except (TypeError, ValueError) as exc:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"redis_stream cursor: {exc}")
    consumer = str(call.params.get(SLOT_PARAM) or "noetl")
    done = [row["id"] for row in call.done if isinstance(row, dict) and row.get("id")]
    r = _client(url)
    try:
        for tries in (1, 2):
            try:
                _group(r, url, stream, group, again=tries > 1)
                if done:
                    r.xack(stream, group, *done)
                take = _Take(r, stream, group, consumer, dead, limit, max(call.max_rows, 1))
                take.own()
                take.stale(lease_ms)
                take.new(block_ms)
                break
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc) or tries > 1:  # the group gone meanwhile: made again
                    raise
    except redis.ConnectionError as exc:
        return Outcome.fail(ToolErrorKind.CONNECTION, f"redis_stream cursor: cannot reach Redis: {exc}", True)
    except redis.RedisError as exc:
        return Outcome.fail(ToolErrorKind.CURSOR, f"redis_stream cursor on {stream!r}: {exc}")
    return Outcome.ok({"rows": take.rows})
