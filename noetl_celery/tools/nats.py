"""The `nats` tool: NoETL's operations on a NATS JetStream key/value bucket, with nats-py.

`operation` is one of:

* `kv_put` (`bucket`, `key`, `value`): a mapping or list is stored as JSON, a string as it is,
  any other value as JSON (`true`, `3`). Data: {status: success, bucket, key, revision}.
* `kv_get` (`bucket`, `key`): the value is parsed as JSON when it is JSON, else the text (bytes
  that are not UTF-8 come back as base64 with `encoding: base64`). Data: {status: success,
  bucket, key, value, revision, created}; a missing or deleted key is not an error:
  {status: not_found, bucket, key, value: null}, as NoETL returns it.
* `kv_delete` (`bucket`, `key`): writes the delete marker. Data: {status: success, bucket, key}.
* `kv_purge` (`bucket`, `key`): removes the key's history too. Same data as kv_delete.
* `kv_keys` (`bucket`, optional `pattern`, a shell glob): Data: {status: success, bucket, keys, count}.
* `js_publish` (`subject`, `data`, optional `headers`): publish to the JetStream stream that
  holds the subject. Data: {status: success, stream, seq, duplicate}.

`ttl` is accepted on kv_put and not applied (NoETL accepts it and does not apply it either).

Connection: `auth:` names a credential: a `nats://` URL (user and password may be in it), or a
mapping {url | nats_url | server | servers, user | username | nats_user, password |
nats_password, token | nats_token}. `nats_url` in the task gives the server when the credential
does not. Each call connects, does its one operation and closes (no reconnect attempts).

Errors: kind "connection" (retryable) when no server answers or the connection breaks;
"authorization" for a refused user/password/token; "not_found" for a bucket or stream that does
not exist; "invalid_args" for a missing or wrong field; "nats_error" for any other refusal by
the server. A password or token never appears in a message: URLs are shown without their
credentials (and the worker masks the credential's secrets in every output anyway).
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings

# operation -> the fields it needs (checked before connecting)
OPERATIONS: dict[str, tuple[str, ...]] = {
    "kv_put": ("bucket", "key", "value"),
    "kv_get": ("bucket", "key"),
    "kv_delete": ("bucket", "key"),
    "kv_purge": ("bucket", "key"),
    "kv_keys": ("bucket",),
    "js_publish": ("subject",),
}
CONNECT_TIMEOUT = 5.0  # seconds to reach the server, unless the call's timeout is shorter
_URL_KEYS = ("url", "nats_url", "server", "servers", "dsn")
_USER_KEYS = ("user", "username", "nats_user")
_PASSWORD_KEYS = ("password", "nats_password")
_TOKEN_KEYS = ("token", "nats_token")


class NatsSettings(ToolSettings):
    operation: Literal["kv_put", "kv_get", "kv_delete", "kv_purge", "kv_keys", "js_publish"] | None = None
    bucket: str | None = None
    key: str | None = None
    pattern: str | None = None
    subject: str | None = None
    headers: dict[str, Any] | None = None
    nats_url: str | None = None
    ttl: int | float | str | None = None


class _Refused(Exception):
    """A failure of the call that becomes an error Outcome of `kind`."""

    def __init__(self, kind: str, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable


def _first(mapping: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((mapping[k] for k in keys if mapping.get(k) not in (None, "")), None)


def shown_url(url: str) -> str:
    """`url` without the user, password or token in it (for messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unreadable URL)"
    if parts.hostname is None:
        return url if "@" not in url else "(a URL)"
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def connection_options(credential: Any, config: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(server URLs, nats.connect options) from the credential and the task's `nats_url`."""
    servers: Any = None
    options: dict[str, Any] = {}
    if isinstance(credential, str):
        if "://" not in credential:
            raise _Refused(
                ToolErrorKind.INVALID_ARGS, "nats: the credential must be a nats:// URL or a mapping with `url`"
            )
        servers = credential
    elif isinstance(credential, dict):
        servers = _first(credential, _URL_KEYS)
        user, password = _first(credential, _USER_KEYS), _first(credential, _PASSWORD_KEYS)
        token = _first(credential, _TOKEN_KEYS)
        if user is not None and password is not None:
            options.update(user=str(user), password=str(password))
        elif token is not None:
            options["token"] = str(token)
    elif credential is not None:
        kind = type(credential).__name__
        raise _Refused(ToolErrorKind.INVALID_ARGS, f"nats: the credential must be a URL or a mapping, not {kind}")
    servers = servers or config.get("nats_url")
    if not servers:
        raise _Refused(
            ToolErrorKind.INVALID_ARGS,
            "nats: no server: name a credential with a `url` in `auth:` or give `nats_url:` in the task",
        )
    urls = [str(s) for s in servers] if isinstance(servers, list) else [s.strip() for s in str(servers).split(",")]
    return urls, options


def _encode(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, default=str).encode("utf-8")


def _decode(raw: bytes | None) -> tuple[Any, str | None]:
    """(value, encoding): JSON when it parses, text when UTF-8, else base64."""
    if not raw:
        return None, None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(raw).decode("ascii"), "base64"
    try:
        return json.loads(text), None
    except ValueError:
        return text, None


def _missing(cfg: dict[str, Any], operation: str) -> str | None:
    """A message naming the fields `operation` needs and `cfg` lacks, or None."""
    missing = [n for n in OPERATIONS[operation] if n not in cfg or (n != "value" and cfg[n] in (None, ""))]
    return f"nats: {operation} needs {', '.join(f'`{n}`' for n in missing)}" if missing else None


async def _bucket(js: Any, name: str, where: str) -> Any:
    from nats.js import errors as js_errors

    try:
        return await js.key_value(name)
    except js_errors.BucketNotFoundError:
        raise _Refused(
            ToolErrorKind.NOT_FOUND,
            f"nats: key/value bucket {name!r} does not exist on {where} (create it: nats kv add {name})",
        ) from None
    except js_errors.InvalidBucketNameError:
        raise _Refused(ToolErrorKind.INVALID_ARGS, f"nats: {name!r} is not a valid key/value bucket name") from None


async def _operate(nc: Any, operation: str, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    from nats.js import errors as js_errors

    js = nc.jetstream()
    if operation == "js_publish":
        subject = str(cfg["subject"])
        headers = {str(k): str(v) for k, v in (cfg.get("headers") or {}).items()} or None
        try:
            ack = await js.publish(subject, _encode(cfg.get("data")), headers=headers)
        except js_errors.NoStreamResponseError:
            raise _Refused(
                ToolErrorKind.NOT_FOUND, f"nats: no JetStream stream holds subject {subject!r} on {where}"
            ) from None
        return {"status": "success", "stream": ack.stream, "seq": ack.seq, "duplicate": bool(ack.duplicate)}
    bucket = str(cfg["bucket"])
    kv = await _bucket(js, bucket, where)
    if operation == "kv_keys":
        try:
            keys = list(await kv.keys())
        except js_errors.NoKeysError:
            keys = []
        if cfg.get("pattern"):
            keys = [k for k in keys if fnmatch.fnmatch(k, str(cfg["pattern"]))]
        return {"status": "success", "bucket": bucket, "keys": keys, "count": len(keys)}
    key = str(cfg["key"])
    try:
        if operation == "kv_put":
            revision = await kv.put(key, _encode(cfg["value"]))
            return {"status": "success", "bucket": bucket, "key": key, "revision": revision}
        if operation == "kv_get":
            try:
                entry = await kv.get(key)
            except js_errors.KeyNotFoundError:  # KeyDeletedError is one
                return {"status": "not_found", "bucket": bucket, "key": key, "value": None}
            value, encoding = _decode(entry.value)
            data = {
                "status": "success",
                "bucket": bucket,
                "key": key,
                "value": value,
                "revision": entry.revision,
                "created": entry.created.isoformat() if getattr(entry, "created", None) else None,
            }
            if encoding:
                data["encoding"] = encoding
            return data
        if operation == "kv_delete":
            await kv.delete(key)
        else:
            await kv.purge(key)
        return {"status": "success", "bucket": bucket, "key": key}
    except js_errors.InvalidKeyError:
        raise _Refused(ToolErrorKind.INVALID_ARGS, f"nats: {key!r} is not a valid key") from None


async def connect(urls: list[str], options: dict[str, Any], timeout: float, what: str = "nats") -> Any:
    """A connected nats-py client (each server tried twice, no reconnection), or _Refused: kind
    `authorization` when the server refused the credential, `connection` (retryable) when none
    answered. `what` starts the messages ("nats", "nats cursor")."""
    from nats import errors as nats_errors
    from nats.aio.client import Client as NATS

    where = ", ".join(shown_url(u) for u in urls)

    async def _quiet(exc: Exception) -> None:  # nats-py logs errors unless a callback takes them
        return None

    nc = NATS()
    try:
        # each server tried twice, then NoServersError (0 attempts would mean: retry for ever)
        await asyncio.wait_for(
            nc.connect(
                urls,
                connect_timeout=max(1, round(timeout)),
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                error_cb=_quiet,
                **options,
            ),
            timeout=2 * timeout * len(urls) + 1,
        )
    except Exception as exc:
        last = nc.last_error or exc
        if isinstance(last, (nats_errors.AuthorizationError, nats_errors.InvalidUserCredentialsError)) or (
            "authorization" in str(last).lower()
        ):
            raise _Refused(
                ToolErrorKind.AUTHORIZATION, f"{what}: the server at {where} refused the credential"
            ) from None
        raise _Refused(
            ToolErrorKind.CONNECTION, f"{what}: cannot reach a NATS server at {where}", retryable=True
        ) from None
    return nc


async def _run(urls: list[str], options: dict[str, Any], operation: str, cfg: dict[str, Any], timeout: float) -> Any:
    from nats import errors as nats_errors
    from nats.js import errors as js_errors

    where = ", ".join(shown_url(u) for u in urls)

    nc = await connect(urls, options, timeout)
    try:
        return await _operate(nc, operation, cfg, where)
    except js_errors.ServiceUnavailableError:
        raise _Refused(ToolErrorKind.NATS_ERROR, f"nats: JetStream is not enabled on {where}") from None
    except js_errors.APIError as exc:
        raise _Refused(
            ToolErrorKind.NATS_ERROR, f"nats: {operation} refused by {where}: {exc.description or exc}"
        ) from None
    except (nats_errors.ConnectionClosedError, nats_errors.TimeoutError, nats_errors.NoRespondersError) as exc:
        raise _Refused(
            ToolErrorKind.CONNECTION, f"nats: {operation} on {where}: {type(exc).__name__}", retryable=True
        ) from None
    finally:
        await nc.close()


@register(
    "nats",
    fields={"operation", "bucket", "key", "value", "ttl", "pattern", "subject", "data", "headers", "nats_url"},
    required=({"operation"},),
    settings=NatsSettings,
    extra="nats",
    modules=("nats",),
)
def run_nats(call: ToolCall) -> Outcome:
    """Connect, do the one operation the config names, close."""
    cfg = call.config
    operation = cfg.get("operation")
    if operation not in OPERATIONS:
        known = ", ".join(OPERATIONS)
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, f"nats: operation must be one of {known}, not {operation!r}")
    missing = _missing(cfg, str(operation))
    if missing:
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, missing)
    timeout = min(CONNECT_TIMEOUT, call.timeout) if call.timeout else CONNECT_TIMEOUT
    try:
        urls, options = connection_options(call.credential, cfg)
        data = asyncio.run(_run(urls, options, str(operation), cfg, timeout))
    except _Refused as refused:
        return Outcome.fail(refused.kind, str(refused), refused.retryable)
    return Outcome.ok(data)
