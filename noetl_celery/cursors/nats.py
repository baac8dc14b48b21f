"""The nats cursor driver: a JetStream pull consumer, a frame of messages per claim, with nats-py.

Cursor keys: `stream` (required: the JetStream stream), `consumer` (durable name, default
"noetl"), `subject` (the consumer's filter subject, optional), `max_deliveries` (default 5),
`dead_letter` (a subject, default `noetl.dead.<stream>`), `wait_seconds` (default 0),
`reclaim_seconds` (the consumer's AckWait), `slots_bucket` (default "noetl_cursor_slots").
`auth:` names the server like the nats tool's (a nats:// URL, or a mapping with url and
user/password or token).

The consumer is created on the first claim when missing: explicit acks, AckWait =
`reclaim_seconds` (default 2 x the frame's `lease_seconds` + 30, see cursors.RECLAIM_MARGIN),
MaxDeliver = `max_deliveries` + 1, deliver all. An existing consumer is used as it is.

A claim, in one call:
1. Ack (double ack: the server confirms) the messages of the slot's previous claim (`call.done`,
   its whole frame): the next claim is dispatched only when the previous frame's chains are over,
   so that is "ack when done". The slot's record of them in the `slots_bucket` key/value bucket
   is then deleted.
2. The messages this slot fetched and never finished (its claim's worker died before the engine
   recorded the claim: the slot's record holds messages other than the acked ones; the claim
   sent again carries the same `done`) are returned again, read back from the stream by their
   sequences; they are still unacked, so no other slot has them within AckWait.
3. Else fetch up to n messages (the frame's `max_rows`, default 1: `call.max_rows`) with one pull
   request with no_wait; none available and `wait_seconds` given: one more pull waiting up to
   that long for one message. The server hands a message out again when it is not acked within
   AckWait (its slot gone): the stale-claim reclaim. A message on its (max_deliveries + 1)th
   delivery is a poison message: it is published to the `dead_letter` subject (its data, its
   headers plus Noetl-Source-Stream, Noetl-Source-Sequence, Noetl-Source-Subject,
   Noetl-Deliveries; Nats-Msg-Id dedupes a retry) and acked, and the claim fetches further. When
   no stream holds the dead-letter subject, a stream `<stream>_DEAD` is created for it. The
   fetched messages are recorded as the slot's record before the claim returns them. Before the
   pull, the record is marked `pulling`: a claim whose worker dies between the pull and the
   record leaves messages delivered, unacknowledged and named by no record, which the server
   hands out again only after AckWait.
Every write of the slot's record names the revision it read (JetStream's expected last subject
sequence), so two copies of one claim running at once (the claim delivered again while its first
delivery still runs) never overwrite each other: a copy that finds the record changed before its
pull takes nothing and returns no row with `again_in` (the slot claims again soon); one that
finds it changed after its pull writes its messages beside the other copy's. The engine records
one copy's rows; the slot's next claims return the other's, which that claim's `done` does not
name, and a record's acked messages leave it when the rest are returned.
Nothing available: zero rows, the slot is over (a consumer with no message available at the
moment of the claim ends the slot unless `wait_seconds` keeps it waiting). Except when the
slot's record shows a pull that was never recorded, less than AckWait ago, and the consumer has
messages delivered and unacknowledged: those may be that pull's, so the claim returns zero rows
with `again_in` (seconds, at most ORPHAN_POLL) and the slot claims again then instead of ending,
until the lost pull's messages are past AckWait and so available to a pull (or none is pending).

Claims run on an event loop of the process's own (a thread), where the connection to each server
(and credential) stays open between claims, with the bucket handles and the consumers it found;
any failure makes the next claim look them up again, a lost connection connects again. A forked
child (a prefork pool process) never uses its parent's loop or connections.

A row is {"seq": stream sequence, "subject", "deliveries": n, "data": the payload (JSON parsed
when it is JSON, else text), "headers" (when any), "ack": the message's ack subject}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.cursors import SLOT_PARAM, ClaimCall, reclaim_seconds, register, wait_seconds
from noetl_celery.tools.base import Outcome

DEFAULT_CONSUMER = "noetl"
DEFAULT_MAX_DELIVERIES = 5
DEFAULT_SLOTS_BUCKET = "noetl_cursor_slots"
SLOTS_TTL = 7 * 24 * 3600.0  # seconds a slot's record outlives an execution that never finished it
REQUEST_TIMEOUT = 5.0  # seconds for one JetStream API request
KEYS = frozenset(
    {
        "stream",
        "consumer",
        "subject",
        "max_deliveries",
        "dead_letter",
        "wait_seconds",
        "reclaim_seconds",
        "slots_bucket",
    }
)
HEADER_PREFIX = "Noetl-"
# a slot whose pull may have been lost (its worker died before recording it) claims again this
# often, at most, while those messages may still be pending, instead of ending
ORPHAN_POLL = 5.0
ORPHAN_POLL_MIN = 0.5
RACE_TRIES = 10  # writes of a claim's frame into a record another copy keeps changing
WRONG_LAST_SEQUENCE = (10071, 10164)  # JetStream: the subject's last sequence is not the one expected


class _Raced(Exception):
    """Another copy of this claim wrote the slot's record since this one read it."""


def _raced() -> dict[str, Any]:
    """The outcome of a copy of a claim that found another copy of it writing the slot's record
    (the same claim delivered again while it still runs): no row, and the slot claims again soon;
    that next claim returns what the other copy took."""
    return {"rows": [], "again_in": ORPHAN_POLL_MIN}


class _Refused(Exception):
    def __init__(self, kind: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


def _decode(raw: bytes | None) -> Any:
    if not raw:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def _status(msg: Any) -> str | None:
    return (msg.headers or {}).get("Status") if msg.headers else None


class _Slot:
    """One claim's names and the JetStream calls it makes."""

    def __init__(self, call: ClaimCall) -> None:
        opts = call.options
        stream = opts.get("stream")
        if not isinstance(stream, str) or not stream:
            raise _Refused(ToolErrorKind.INVALID_ARGS, "nats cursor needs `stream:` (the JetStream stream)")
        self.stream = stream
        self.consumer = str(opts.get("consumer") or DEFAULT_CONSUMER)
        self.subject = str(opts["subject"]) if opts.get("subject") else None
        self.dead = str(opts.get("dead_letter") or f"noetl.dead.{stream}")
        self.bucket = str(opts.get("slots_bucket") or DEFAULT_SLOTS_BUCKET)
        try:
            self.limit = int(opts.get("max_deliveries") or DEFAULT_MAX_DELIVERIES)
            self.ack_wait = reclaim_seconds(call)
            self.wait = wait_seconds(call)
        except (TypeError, ValueError) as exc:
            raise _Refused(ToolErrorKind.INVALID_ARGS, f"nats cursor: {exc}") from None
        slot = str(call.params.get(SLOT_PARAM) or "noetl")
        self.key = hashlib.sha1(f"{stream}\0{self.consumer}\0{slot}".encode()).hexdigest()
        self.done = [row for row in call.done if isinstance(row, dict) and row.get("ack")]
        self.count = max(call.max_rows, 1)

    async def _kv(self, conn: _Conn) -> Any:
        from nats.js import errors as js_errors

        kv = conn.buckets.get(self.bucket)
        if kv is not None:
            return kv
        try:
            kv = await conn.js.key_value(self.bucket)
        except js_errors.BucketNotFoundError:
            try:
                kv = await conn.js.create_key_value(bucket=self.bucket, ttl=SLOTS_TTL)
            except js_errors.BadRequestError:  # created meanwhile by another slot
                kv = await conn.js.key_value(self.bucket)
        conn.buckets[self.bucket] = kv
        return kv

    async def _consumer(self, conn: _Conn) -> None:
        from nats.js import api
        from nats.js import errors as js_errors

        if (self.stream, self.consumer) in conn.consumers:
            return
        js = conn.js
        try:
            await js.consumer_info(self.stream, self.consumer, timeout=REQUEST_TIMEOUT)
            conn.consumers.add((self.stream, self.consumer))
            return
        except js_errors.NotFoundError as exc:
            if "stream" in str(exc.description or "").lower():
                raise _Refused(ToolErrorKind.NOT_FOUND, f"nats cursor: no JetStream stream {self.stream!r}") from None
        config = api.ConsumerConfig(
            durable_name=self.consumer,
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            max_deliver=self.limit + 1,
            filter_subject=self.subject,
        )
        try:
            await js.add_consumer(self.stream, config, timeout=REQUEST_TIMEOUT)
        except js_errors.BadRequestError:  # created meanwhile by another slot with the same config
            await js.consumer_info(self.stream, self.consumer, timeout=REQUEST_TIMEOUT)
        conn.consumers.add((self.stream, self.consumer))

    async def _next(self, nc: Any, count: int, wait: float) -> list[Any] | None:
        """Up to `count` messages of the consumer: [] when none is available (within `wait`), None
        when the server did not answer the pull at all (the consumer may be gone)."""
        from nats import errors as nats_errors

        request: dict[str, Any] = {"batch": count}
        if wait > 0:
            request["expires"] = int(wait * 1_000_000_000)
        else:
            request["no_wait"] = True
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        # a subscription of its own: the messages come with their own subjects, which a request's
        # shared reply handler would not match
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        msgs: list[Any] = []
        try:
            await nc.publish(subject, json.dumps(request).encode(), reply=inbox)
            # the server sends up to `count` messages, then (fewer were available) a status: 404 no
            # messages, 408 request over, 409 consumer busy
            while len(msgs) < count:
                try:
                    msg = await sub.next_msg(timeout=wait + REQUEST_TIMEOUT)
                except nats_errors.TimeoutError:
                    if msgs:  # the pull was answered: the rest cannot come once it is over
                        break
                    return None
                status = _status(msg)
                if status in ("404", "408", "409"):
                    break
                if status:
                    headers = (msg.headers or {}).items()
                    description = next((str(v) for k, v in headers if str(k).endswith("Description")), "")
                    raise _Refused(
                        "cursor", f"nats cursor: pull from {self.stream}/{self.consumer}: {status} {description}"
                    )
                msgs.append(msg)
        finally:
            await sub.unsubscribe()
        return msgs

    async def _dead_letter(self, nc: Any, js: Any, msg: Any, deliveries: int, seq: int) -> None:
        from nats.js import api
        from nats.js import errors as js_errors

        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        headers.update(
            {
                f"{HEADER_PREFIX}Source-Stream": self.stream,
                f"{HEADER_PREFIX}Source-Sequence": str(seq),
                f"{HEADER_PREFIX}Source-Subject": msg.subject,
                f"{HEADER_PREFIX}Deliveries": str(deliveries),
                "Nats-Msg-Id": f"{self.stream}:{seq}",
            }
        )
        try:
            await js.publish(self.dead, msg.data, headers=headers, timeout=REQUEST_TIMEOUT)
        except js_errors.NoStreamResponseError:
            with contextlib.suppress(js_errors.BadRequestError):  # created meanwhile
                await js.add_stream(api.StreamConfig(name=f"{self.stream}_DEAD", subjects=[self.dead]))
            await js.publish(self.dead, msg.data, headers=headers, timeout=REQUEST_TIMEOUT)
        await nc.request(msg.reply, b"+ACK", timeout=REQUEST_TIMEOUT)

    def _row(self, msg: Any, seq: int, deliveries: int, reply: str) -> dict[str, Any]:
        row: dict[str, Any] = {
            "seq": seq,
            "subject": msg.subject,
            "deliveries": deliveries,
            "data": _decode(msg.data),
            "ack": reply,
        }
        headers = {k: v for k, v in (msg.headers or {}).items()}
        if headers:
            row["headers"] = headers
        return row

    async def _ack(self, nc: Any, row: dict[str, Any]) -> None:
        # an error: already acked (a repeated claim), or past AckWait: nothing to undo
        with contextlib.suppress(Exception):
            await nc.request(str(row["ack"]), b"+ACK", timeout=REQUEST_TIMEOUT)

    async def _record(self, kv: Any) -> tuple[dict[str, Any], int]:
        """The slot's record: {"held": the messages its last claim took, "pulling": when a claim
        began a pull it had not yet recorded, "orphans_until": until when messages a lost claim
        took may come back}, {} when it has none; and its revision (0: never written), which a
        write of it must still find (`_keep`)."""
        from nats.js import errors as js_errors

        try:
            entry = await kv.get(self.key)
        except js_errors.KeyNotFoundError as exc:  # deleted (a marker with its revision) or never written
            marker = getattr(exc, "entry", None)
            return {}, int(getattr(marker, "revision", 0) or 0)
        if entry is None:
            return {}, 0
        revision = int(entry.revision or 0)
        if not entry.value:
            return {}, revision
        record = json.loads(entry.value)
        if "held" not in record and "ack" in record:  # one message, as an earlier release kept it
            return {"held": [record]}, revision
        return record, revision

    def _acked(self) -> set[str]:
        return {str(row["ack"]) for row in self.done}

    async def _held(self, conn: _Conn, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of the record's messages `items` (those not among the acked ones: a claim
        whose worker died before the engine recorded it), read back from the stream. A claim sent
        again carries the same `done` as the first time, while the record already holds the frame
        that first time fetched: that frame is what it returns."""
        from nats.aio.msg import Msg
        from nats.js import errors as js_errors

        rows = []
        for item in items:
            try:
                raw = await conn.js.get_msg(self.stream, int(item["seq"]))
            except js_errors.NotFoundError:
                continue  # deleted from the stream meanwhile: nothing to do
            fake = Msg(conn.nc, subject=raw.subject or "", data=raw.data or b"", headers=raw.headers)
            rows.append(self._row(fake, int(item["seq"]), int(item["deliveries"]), str(item["ack"])))
        return rows

    def _orphans_until(self, record: dict[str, Any]) -> float:
        """Until when messages of this slot that no record names may still be delivered and
        unacknowledged: a pull the record marks as begun and never recorded (its claim's worker
        died in between) may have taken messages, which the server hands out again only after
        AckWait from their delivery."""
        until = float(record.get("orphans_until") or 0.0)
        if record.get("pulling"):
            until = max(until, float(record["pulling"]) + self.ack_wait + self.wait + REQUEST_TIMEOUT + 1.0)
        return until

    async def _keep(self, kv: Any, record: dict[str, Any], last: int) -> int:
        """Write the slot's record (nothing to keep: delete it) if its revision is still `last`,
        the one this claim read or wrote; its new revision. `_Raced` when another copy of this
        claim (the same claim delivered again while it runs) wrote it meanwhile: nothing is
        written then. The record always has `held`, which is all a worker of an earlier release
        reads in it."""
        from nats.js import errors as js_errors

        try:
            if record:
                return int(await kv.update(self.key, json.dumps({"held": [], **record}).encode(), last=last))
            if last:  # never written: nothing to delete
                await kv.delete(self.key, last=last)
            return 0
        except js_errors.KeyWrongLastSequenceError:
            raise _Raced from None
        except js_errors.APIError as exc:  # a delete's check fails as the stream's own error
            if exc.err_code in WRONG_LAST_SEQUENCE:
                raise _Raced from None
            raise

    async def _record_taken(self, kv: Any, record: dict[str, Any], last: int, mark: float) -> None:
        """Record the messages this claim took (`record["held"]`) in the slot's record. When
        another copy of this claim wrote the record since (`_Raced`), what it holds is kept beside
        them: the engine records one copy's rows, and the slot's next claims return the other's,
        which its `done` does not name, instead of leaving them to AckWait."""
        taken = record["held"]
        for _ in range(RACE_TRIES):
            try:
                await self._keep(kv, record, last)
                return
            except _Raced:
                theirs, last = await self._record(kv)
            acked = self._acked()
            mine = {int(item["seq"]) for item in taken}
            kept = [i for i in theirs.get("held") or [] if str(i["ack"]) not in acked and int(i["seq"]) not in mine]
            record = {"held": kept + taken}
            until = max(float(theirs.get("orphans_until") or 0.0), float(record.get("orphans_until") or 0.0))
            if until > time.time():
                record["orphans_until"] = until
            if theirs.get("pulling") and float(theirs["pulling"]) != mark:  # the other copy's pull, not yet recorded
                record["pulling"] = theirs["pulling"]
        raise _Refused(
            ToolErrorKind.CURSOR,
            f"nats cursor on {self.stream}: the slot's record kept changing under {RACE_TRIES} writes",
            True,
        )

    async def _orphans_pending(self, conn: _Conn) -> bool:
        """Whether the consumer has any message delivered and unacknowledged: without one, no
        lost claim's messages can be waiting for AckWait."""
        info = await conn.js.consumer_info(self.stream, self.consumer, timeout=REQUEST_TIMEOUT)
        return int(info.num_ack_pending) > 0

    async def claim(self, conn: _Conn) -> dict[str, Any]:
        nc = conn.nc
        kv = await self._kv(conn)
        await asyncio.gather(*(self._ack(nc, row) for row in self.done))
        record, revision = await self._record(kv)
        acked = self._acked()
        pending = [item for item in record.get("held") or [] if str(item["ack"]) not in acked]
        if pending:
            held = await self._held(conn, pending)
            if held and len(pending) < len(record["held"]):
                # a record that named two copies' messages: the ones acked now are gone from it,
                # or a later claim, whose done does not name them, would return them again
                try:
                    await self._keep(kv, {**record, "held": pending}, revision)
                except _Raced:
                    return _raced()
            if held:
                return {"rows": held}
        now = time.time()
        until = self._orphans_until(record)
        waiting = {"orphans_until": until} if until > now else {}
        # marked before the pull: a worker that dies after it leaves messages no record names
        try:
            revision = await self._keep(kv, {"pulling": now, **waiting}, revision)
        except _Raced:  # another copy of this claim runs: its frame is in the record for the next claim
            return _raced()
        rows, taken = await self._pull(conn)
        if taken:
            await self._record_taken(kv, {"held": taken, **waiting}, revision, now)
            return {"rows": rows}
        if waiting and await self._orphans_pending(conn):
            # nothing available now, but a lost claim's messages come back: the slot claims again
            with contextlib.suppress(_Raced):  # written meanwhile by another copy: it claims again all the same
                await self._keep(kv, waiting, revision)
            return {"rows": [], "again_in": round(min(max(until - time.time(), ORPHAN_POLL_MIN), ORPHAN_POLL), 3)}
        try:
            await self._keep(kv, {}, revision)
        except _Raced:  # another copy of this claim took messages meanwhile: the slot claims again for them
            return _raced()
        return {"rows": []}

    async def _pull(self, conn: _Conn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Up to the frame's count of messages from the consumer (the poison ones dead-lettered on
        the way): their rows, and what the slot's record keeps of them."""
        nc, js = conn.nc, conn.js
        await self._consumer(conn)
        rows: list[dict[str, Any]] = []
        taken: list[dict[str, Any]] = []
        while len(rows) < self.count:
            msgs = await self._next(nc, self.count - len(rows), 0.0)
            if msgs is None and (self.stream, self.consumer) in conn.consumers:
                # no answer at all: the consumer may be gone since this process last saw it
                conn.consumers.discard((self.stream, self.consumer))
                await self._consumer(conn)
                msgs = await self._next(nc, self.count - len(rows), 0.0)
            if not msgs and self.wait > 0 and not rows:
                msgs = await self._next(nc, 1, self.wait)  # one is enough to stop waiting
            if not msgs:
                break
            poison = 0
            for msg in msgs:
                meta = msg.metadata
                seq, deliveries = int(meta.sequence.stream), int(meta.num_delivered)
                if deliveries > self.limit:
                    await self._dead_letter(nc, js, msg, deliveries, seq)
                    poison += 1
                    continue
                rows.append(self._row(msg, seq, deliveries, msg.reply))
                taken.append({"seq": seq, "deliveries": deliveries, "ack": msg.reply})
            if not poison:  # as many as were available: no use asking again
                break
        return rows, taken


@dataclass
class _Conn:
    """A connection of this process's claim loop, with what it learned: bucket handles and the
    consumers known to exist."""

    nc: Any
    js: Any
    buckets: dict[str, Any] = field(default_factory=dict)
    consumers: set[tuple[str, str]] = field(default_factory=set)


class _Claims:
    """This process's claim loop: one event loop on a thread of its own, where the connections
    live (per server and credential) between claims, so a claim costs its requests only."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.conns: dict[str, _Conn] = {}
        self.lock = threading.Lock()

    def run(self, coro: Any) -> Any:
        with self.lock:
            if self.loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="noetl-nats-cursor", daemon=True).start()
                self.loop = loop
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_claims = _Claims()
_forgotten: list[_Claims] = []  # a parent's claim loops in a forked child: kept, never used


def _forget_after_fork() -> None:
    """A forked child (a prefork pool process) never uses its parent's connections or loop (the
    loop's thread does not exist in the child, the sockets are the parent's): it keeps them
    unused and starts its own on its first claim."""
    global _claims
    _forgotten.append(_claims)
    _claims = _Claims()


os.register_at_fork(after_in_child=_forget_after_fork)


async def _run(call: ClaimCall, slot: _Slot, claims: _Claims) -> dict[str, Any]:
    from nats import errors as nats_errors
    from nats.js import errors as js_errors

    from noetl_celery.tools.nats import _Refused as ToolRefused
    from noetl_celery.tools.nats import connect, connection_options, shown_url

    try:
        urls, options = connection_options(call.credential, {})
    except ToolRefused as exc:
        raise _Refused(exc.kind, str(exc).replace("nats:", "nats cursor:", 1)) from None
    where = ", ".join(shown_url(u) for u in urls)
    key = repr((urls, sorted(options.items())))  # in memory only: it holds the credential
    conn = claims.conns.get(key)
    if conn is not None and not conn.nc.is_connected:
        claims.conns.pop(key, None)
        with contextlib.suppress(Exception):
            await conn.nc.close()
        conn = None
    if conn is None:
        try:
            nc = await connect(urls, options, REQUEST_TIMEOUT, "nats cursor")
        except ToolRefused as exc:
            raise _Refused(exc.kind, str(exc), exc.retryable) from None
        conn = claims.conns[key] = _Conn(nc, nc.jetstream(timeout=REQUEST_TIMEOUT))
    try:
        try:
            return await slot.claim(conn)
        except BaseException:
            # what this connection learned may be out of date (a bucket or consumer gone): learn again
            conn.buckets.clear()
            conn.consumers.clear()
            raise
    except js_errors.ServiceUnavailableError:
        raise _Refused(ToolErrorKind.CURSOR, f"nats cursor: JetStream is not enabled on {where}") from None
    except js_errors.APIError as exc:
        raise _Refused(ToolErrorKind.CURSOR, f"nats cursor on {slot.stream}: {exc.description or exc}") from None
    except (nats_errors.ConnectionClosedError, nats_errors.TimeoutError, nats_errors.NoRespondersError) as exc:
        if claims.conns.get(key) is conn:  # the next claim connects again
            del claims.conns[key]
            with contextlib.suppress(Exception):
                await conn.nc.close()
        raise _Refused(ToolErrorKind.CONNECTION, f"nats cursor on {where}: {type(exc).__name__}", True) from None


@register("nats", keys=KEYS, needs_claim=False, extra="nats", modules=("nats",))
def claim_nats(call: ClaimCall) -> Outcome:
    try:
        slot = _Slot(call)
        claims = _claims
        data = claims.run(_run(call, slot, claims))
    except _Refused as refused:
        return Outcome.fail(refused.kind, str(refused), refused.retryable)
    return Outcome.ok(data)
