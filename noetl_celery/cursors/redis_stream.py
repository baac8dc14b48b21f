"""The redis_stream cursor driver: a consumer group on a Redis stream, one entry per claim.

Cursor keys: `stream` (required), `group` (default "noetl"; created at the stream's start, with
the stream, when missing), `dead_letter` (default "<stream>:dead"), `max_deliveries` (default 5),
`wait_seconds` (or `block_seconds`, default 0), `reclaim_seconds`. `auth:` names a redis:// URL
(or a mapping with `url`). The consumer is the slot (`__worker_slot_id`), so each slot's entries
are its own in the group's pending list.

A claim, in one call:
1. XACK the entries of the slot's previous claim (`call.done`): the next claim is dispatched only
   when the previous row's chain is over (done or failed), so that is "XACK when done".
2. Take back an entry this slot was given and never finished (its claim's worker died before the
   engine recorded the claim), then an entry of any consumer idle past `reclaim_seconds` (default
   2 x the frame's `lease_seconds` + 30: see cursors.RECLAIM_MARGIN) with XAUTOCLAIM: a slot
   that is gone (its execution ended or lost) no longer holds its entry.
3. Else XREADGROUP one new entry (`>`), waiting up to `wait_seconds` (alias `block_seconds`) when
   it is above 0.
An entry taken back whose delivery count is past `max_deliveries` is a poison entry: it is added
to the dead-letter stream (its fields plus `source_id`, `source_stream`, `deliveries`) and acked
in one MULTI/EXEC, and the claim looks further. Nothing found: zero rows, the slot is over (an
empty stream at the moment of the claim ends the slot unless `wait_seconds` keeps it waiting).

A row is `{"id": entry id, "deliveries": n, **fields}` (field names and values as text).
"""

from __future__ import annotations

import threading
from typing import Any

import redis

from noetl_celery.cursors import SLOT_PARAM, ClaimCall, reclaim_seconds, register, wait_seconds
from noetl_celery.tools.base import Outcome
from noetl_celery.vocabulary import ToolErrorKind

DEFAULT_GROUP = "noetl"
DEFAULT_MAX_DELIVERIES = 5
KEYS = frozenset(
    {"stream", "group", "dead_letter", "max_deliveries", "block_seconds", "wait_seconds", "reclaim_seconds"}
)

_clients: dict[str, Any] = {}
_lock = threading.Lock()


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


def _row(entry_id: str, fields: dict[str, str] | None, deliveries: int) -> dict[str, Any]:
    return {**(fields or {}), "id": entry_id, "deliveries": deliveries}


def _deliveries(r: Any, stream: str, group: str, entry_id: str) -> int:
    pending = r.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
    return int(pending[0]["times_delivered"]) if pending else 1


def _dead_letter(r: Any, stream: str, group: str, dead: str, entry_id: str, fields: Any, n: int) -> None:
    pipe = r.pipeline(transaction=True)
    pipe.xadd(dead, {**(fields or {}), "source_id": entry_id, "source_stream": stream, "deliveries": n})
    pipe.xack(stream, group, entry_id)
    pipe.execute()


def _take_back(r: Any, stream: str, group: str, consumer: str, lease_ms: int, limit: int, dead: str) -> Any:
    """An entry this slot or a vanished consumer left unfinished (within the delivery limit), or None."""
    while True:
        own = r.xpending_range(stream, group, min="-", max="+", count=1, consumername=consumer)
        if own:
            entry_id = own[0]["message_id"]
            claimed = r.xclaim(stream, group, consumer, 0, [entry_id])  # counts a delivery
        else:
            start, claimed = "0-0", []
            while not claimed:  # XAUTOCLAIM scans 10 pending entries per COUNT 1: go on to the end
                reply = r.xautoclaim(stream, group, consumer, lease_ms, start_id=start, count=1)
                start, claimed = reply[0], [e for e in reply[1] if e and e[1] is not None]
                if start == "0-0":
                    break
            if not claimed:
                return None
            entry_id = claimed[0][0]
        if not claimed:
            r.xack(stream, group, entry_id)  # the entry was deleted from the stream: nothing to do
            continue
        entry_id, fields = claimed[0]
        n = _deliveries(r, stream, group, entry_id)
        if n > limit:
            _dead_letter(r, stream, group, dead, entry_id, fields, n)
            continue
        return _row(entry_id, fields, n)


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
    r = _client(url)
    try:
        done = [row["id"] for row in call.done if isinstance(row, dict) and row.get("id")]
        if done:
            r.xack(stream, group, *done)
        try:
            r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        row = _take_back(r, stream, group, consumer, lease_ms, limit, dead)
        if row is None:
            read = r.xreadgroup(group, consumer, {stream: ">"}, count=1, block=block_ms or None)
            entries = read[0][1] if read else []
            row = _row(entries[0][0], entries[0][1], 1) if entries else None
    except redis.ConnectionError as exc:
        return Outcome.fail(ToolErrorKind.CONNECTION, f"redis_stream cursor: cannot reach Redis: {exc}", True)
    except redis.RedisError as exc:
        return Outcome.fail(ToolErrorKind.CURSOR, f"redis_stream cursor on {stream!r}: {exc}")
    return Outcome.ok({"rows": [row] if row else []})
