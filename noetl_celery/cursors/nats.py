"""The nats cursor driver: a JetStream pull consumer, one message per claim, with nats-py.

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
1. Ack (double ack: the server confirms) the message of the slot's previous claim (`call.done`):
   the next claim is dispatched only when the previous row's chain is over, so that is "ack when
   done". The slot's record in the `slots_bucket` key/value bucket is then deleted.
2. A message this slot fetched and never finished (its claim's worker died before the engine
   recorded the claim: the slot's record is still there) is returned again, read back from the
   stream by its sequence; it is still unacked, so no other slot has it within AckWait.
3. Else fetch one message (a pull request with no_wait, or waiting up to `wait_seconds`). The
   server hands a message out again when it is not acked within AckWait (its slot gone): the
   stale-claim reclaim. A message on its (max_deliveries + 1)th delivery is a poison message: it is
   published to the `dead_letter` subject (its data, its headers plus Noetl-Source-Stream,
   Noetl-Source-Sequence, Noetl-Source-Subject, Noetl-Deliveries; Nats-Msg-Id dedupes a retry)
   and acked, and the claim fetches further. When no stream holds the dead-letter subject, a
   stream `<stream>_DEAD` is created for it.
Nothing available: zero rows, the slot is over (a consumer with no message available at the
moment of the claim ends the slot unless `wait_seconds` keeps it waiting).

A row is {"seq": stream sequence, "subject", "deliveries": n, "data": the payload (JSON parsed
when it is JSON, else text), "headers" (when any), "ack": the message's ack subject}.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from typing import Any

from noetl_celery.cursors import SLOT_PARAM, ClaimCall, reclaim_seconds, register, wait_seconds
from noetl_celery.tools.base import Outcome
from noetl_celery.vocabulary import ToolErrorKind

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

    async def _kv(self, js: Any) -> Any:
        from nats.js import errors as js_errors

        try:
            return await js.key_value(self.bucket)
        except js_errors.BucketNotFoundError:
            try:
                return await js.create_key_value(bucket=self.bucket, ttl=SLOTS_TTL)
            except js_errors.BadRequestError:  # created meanwhile by another slot
                return await js.key_value(self.bucket)

    async def _consumer(self, js: Any) -> None:
        from nats.js import api
        from nats.js import errors as js_errors

        try:
            await js.consumer_info(self.stream, self.consumer, timeout=REQUEST_TIMEOUT)
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

    async def _next(self, nc: Any) -> Any:
        """One message of the consumer, or None when none is available (within `wait`)."""
        from nats import errors as nats_errors

        request: dict[str, Any] = {"batch": 1}
        if self.wait > 0:
            request["expires"] = int(self.wait * 1_000_000_000)
        else:
            request["no_wait"] = True
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        # a subscription of its own: the message comes with its own subject, which a request's
        # shared reply handler would not match
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(subject, json.dumps(request).encode(), reply=inbox)
            try:
                msg = await sub.next_msg(timeout=self.wait + REQUEST_TIMEOUT)
            except nats_errors.TimeoutError:
                return None
        finally:
            await sub.unsubscribe()
        status = _status(msg)
        if status in ("404", "408", "409"):  # no messages / request expired / consumer busy
            return None
        if status:
            description = next((str(v) for k, v in (msg.headers or {}).items() if str(k).endswith("Description")), "")
            raise _Refused(
                ToolErrorKind.CURSOR, f"nats cursor: pull from {self.stream}/{self.consumer}: {status} {description}"
            )
        return msg

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

    async def claim(self, nc: Any) -> dict[str, Any] | None:
        from nats.aio.msg import Msg
        from nats.js import errors as js_errors

        js = nc.jetstream(timeout=REQUEST_TIMEOUT)
        kv = await self._kv(js)
        for row in self.done:
            # an error: already acked (a repeated claim), or past AckWait: nothing to undo
            with contextlib.suppress(Exception):
                await nc.request(str(row["ack"]), b"+ACK", timeout=REQUEST_TIMEOUT)
        if self.done:
            await kv.delete(self.key)
        try:
            entry = await kv.get(self.key)
        except js_errors.KeyNotFoundError:
            entry = None
        if entry is not None and entry.value:
            held = json.loads(entry.value)
            try:
                raw = await js.get_msg(self.stream, int(held["seq"]))
            except js_errors.NotFoundError:
                raw = None  # deleted from the stream meanwhile: nothing to do
            if raw is not None:
                fake = Msg(nc, subject=raw.subject or "", data=raw.data or b"", headers=raw.headers)
                return self._row(fake, int(held["seq"]), int(held["deliveries"]), str(held["ack"]))
            await kv.delete(self.key)
        await self._consumer(js)
        while True:
            msg = await self._next(nc)
            if msg is None:
                return None
            meta = msg.metadata
            seq, deliveries = int(meta.sequence.stream), int(meta.num_delivered)
            if deliveries > self.limit:
                await self._dead_letter(nc, js, msg, deliveries, seq)
                continue
            await kv.put(self.key, json.dumps({"seq": seq, "deliveries": deliveries, "ack": msg.reply}).encode())
            return self._row(msg, seq, deliveries, msg.reply)


async def _run(call: ClaimCall, slot: _Slot) -> dict[str, Any] | None:
    from nats import errors as nats_errors
    from nats.js import errors as js_errors

    from noetl_celery.tools.nats import _Refused as ToolRefused
    from noetl_celery.tools.nats import connect, connection_options, shown_url

    try:
        urls, options = connection_options(call.credential, {})
    except ToolRefused as exc:
        raise _Refused(exc.kind, str(exc).replace("nats:", "nats cursor:", 1)) from None
    where = ", ".join(shown_url(u) for u in urls)

    try:
        nc = await connect(urls, options, REQUEST_TIMEOUT, "nats cursor")
    except ToolRefused as exc:
        raise _Refused(exc.kind, str(exc), exc.retryable) from None
    try:
        return await slot.claim(nc)
    except js_errors.ServiceUnavailableError:
        raise _Refused(ToolErrorKind.CURSOR, f"nats cursor: JetStream is not enabled on {where}") from None
    except js_errors.APIError as exc:
        raise _Refused(ToolErrorKind.CURSOR, f"nats cursor on {slot.stream}: {exc.description or exc}") from None
    except (nats_errors.ConnectionClosedError, nats_errors.TimeoutError, nats_errors.NoRespondersError) as exc:
        raise _Refused(ToolErrorKind.CONNECTION, f"nats cursor on {where}: {type(exc).__name__}", True) from None
    finally:
        await nc.close()


@register("nats", keys=KEYS, needs_claim=False)
def claim_nats(call: ClaimCall) -> Outcome:
    try:
        slot = _Slot(call)
        row = asyncio.run(_run(call, slot))
    except _Refused as refused:
        return Outcome.fail(refused.kind, str(refused), refused.retryable)
    return Outcome.ok({"rows": [row] if row else []})
