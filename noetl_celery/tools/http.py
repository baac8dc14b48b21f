"""The `http` tool: one HTTP request with `requests`, its response as the outcome.

Config (already rendered): method (default GET), url (alias endpoint), params, headers,
payload / json (a JSON body), body / data (a raw body), timeout (alias timeout_seconds, NoETL's
Rust tool name: seconds, default 30; the call's timeout wins), connect_timeout (seconds to connect,
from a task's `spec.timeout: {connect, read}`), verify (alias verify_ssl: bool or CA bundle path),
allow_redirects (default true).

Body rules: `json` is always sent as a JSON body. `payload` is a JSON body for POST/PUT/PATCH;
for other methods (GET, DELETE, ...) `payload` is sent as the query string when `params` is
absent, else as a JSON body. `body`/`data`: str/bytes are sent as they are, a mapping is
form-encoded, anything else is sent as JSON text. Boolean query parameters are sent as
`true`/`false`.

Outcome data: {status_code, headers (response headers, lower-case keys), url (final), elapsed
(seconds), data (parsed JSON body, else text, None when empty; a body larger than
NOETL_MAX_RESULT_BYTES is streamed, hashed and replaced by a truncation marker)}; Outcome.http = {status,
headers}. Status >= 400 is an error outcome (kind rate_limit/server_error/auth/not_found/
client_error, with status and retry_after) that still carries the same data and http.

The credential (a dict: {type: bearer, token} | {type: basic, username, password} |
{type: header|api_key, name|header, value} | {headers: {...}}; a bare string is a bearer token)
is applied to the request only: it never appears in the outcome. This module does not retry
(the engine's policy does) and does not log.
"""

from __future__ import annotations

import base64
import hashlib
import http.cookiejar
import json as jsonlib
import os
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from pydantic import Field

from noetl_celery.config import limits
from noetl_celery.core.lazy import lazy_module
from noetl_celery.core.vocabulary import ToolErrorKind
from noetl_celery.tools.base import Outcome, ToolCall, register
from noetl_celery.tools.settings import ToolSettings

if TYPE_CHECKING:
    import requests
else:  # imported on the first call: a command that only reads a playbook starts without it
    requests = lazy_module("requests")

DEFAULT_TIMEOUT = 30.0  # seconds
BODY_CHUNK = 65536  # most bytes read at a time while checking the call's deadline
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
ERROR_BODY_SNIPPET = 500  # characters of an error response's body quoted in the error message
BODY_CHUNK = 64 * 1024  # bytes read at a time from a response body

_session: tuple[int, requests.Session] | None = None


def _get_session() -> requests.Session:
    """The process's Session (connection pooling), created lazily and re-created after a fork.

    It keeps no cookies: a cookie set for one execution must never be sent for another.
    """
    global _session
    pid = os.getpid()
    if _session is None or _session[0] != pid:
        session = requests.Session()
        session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        _session = (pid, session)
    return _session[1]


class CredentialShapeError(ValueError):
    """The credential given to the http tool has a shape the tool does not know."""


def basic_auth_value(username: Any, password: Any) -> str:
    """The Authorization header value of HTTP basic authentication."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
    return f"Basic {token}"


def auth_headers(credential: Any) -> dict[str, str]:
    """Headers that apply `credential` to a request (see the module docstring for the shapes)."""
    if credential is None:
        return {}
    if isinstance(credential, str):
        return {"Authorization": f"Bearer {credential}"}
    if not isinstance(credential, dict):
        raise CredentialShapeError(
            f"http credential must be a mapping or a token string, not {type(credential).__name__}"
        )
    headers = {str(k): str(v) for k, v in (credential.get("headers") or {}).items()}
    kind = str(credential.get("type") or "").lower()
    if kind == "bearer" or (not kind and "token" in credential):
        if "token" not in credential:
            raise CredentialShapeError("bearer credential has no `token`")
        headers["Authorization"] = f"Bearer {credential['token']}"
    elif kind == "basic" or (not kind and "username" in credential and "password" in credential):
        headers["Authorization"] = basic_auth_value(credential.get("username", ""), credential.get("password", ""))
    elif kind in ("header", "api_key", "apikey") or (not kind and "value" in credential):
        name = credential.get("name") or credential.get("header") or ("X-API-Key" if kind != "header" else None)
        if not name or "value" not in credential:
            raise CredentialShapeError(f"{kind or 'header'} credential needs `name` (or `header`) and `value`")
        headers[str(name)] = str(credential["value"])
    elif not headers:
        keys = ", ".join(sorted(str(k) for k in credential)) or "(none)"
        raise CredentialShapeError(f"http credential of type {kind or '(none)'!r} is not supported (keys: {keys})")
    return headers


def _query_params(params: Any) -> Any:
    if not isinstance(params, dict):
        return params
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, dict):
            value = jsonlib.dumps(value)
        out[key] = value
    return out


class BodyDeadline(Exception):
    """The response body did not arrive completely within the call's timeout."""


def _read_body(response: requests.Response, deadline: float, limit: int) -> tuple[int, str | None]:
    """Read the body by `deadline` (time.monotonic), however slowly it trickles (the `timeout` of
    requests bounds each read, not the call; `read1` returns what has arrived), keeping at most
    `limit` bytes: past the limit it is only counted and hashed, never held whole.
    Returns (its full size, its SHA-256 when over the limit, else None)."""
    kept = bytearray()
    size = 0
    digest = hashlib.sha256()
    raw = response.raw
    try:
        while True:
            if time.monotonic() > deadline:
                raise BodyDeadline()
            chunk = raw.read1(BODY_CHUNK, decode_content=True) if hasattr(raw, "read1") else raw.read(BODY_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            digest.update(chunk)
            if len(kept) <= limit:
                kept += chunk[: limit + 1 - len(kept)]
    except BodyDeadline:
        response.close()
        raise
    response._content = bytes(kept[:limit])  # what requests itself keeps once the body is read
    response._content_consumed = True  # type: ignore[attr-defined]
    return size, (digest.hexdigest() if size > limit else None)


def _parse_body(response: requests.Response, size: int, sha256: str | None, limit: int) -> Any:
    if sha256 is not None:
        preview = response.content[: limits.PREVIEW_CHARS].decode(response.encoding or "utf-8", "replace")
        return limits.marker(size, sha256, preview, limit)
    if not response.content:
        return None
    text = response.text
    content_type = response.headers.get("content-type", "").lower()
    if "json" in content_type or text.lstrip()[:1] in ("{", "["):
        try:
            return response.json()
        except ValueError:
            return text
    return text


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _error_kind(status: int) -> tuple[str, bool]:
    if status == 429:
        return ToolErrorKind.RATE_LIMIT, True
    if status >= 500:
        return ToolErrorKind.SERVER_ERROR, True
    if status in (401, 403):
        return ToolErrorKind.AUTH, False
    if status == 404:
        return ToolErrorKind.NOT_FOUND, False
    return ToolErrorKind.CLIENT_ERROR, False


class HttpSettings(ToolSettings):
    method: str | None = None
    url: str | None = None
    endpoint: str | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, Any] | None = None
    timeout: float | None = Field(default=None, ge=0)
    timeout_seconds: float | None = Field(default=None, ge=0)  # NoETL's Rust http tool name for timeout
    connect_timeout: float | None = Field(default=None, gt=0)  # from spec.timeout: {connect, read}
    verify: bool | str | None = None
    verify_ssl: bool | str | None = None  # NoETL's name for verify
    allow_redirects: bool | None = None


@register(
    "http",
    fields={
        "method",
        "url",
        "endpoint",
        "params",
        "headers",
        "payload",
        "json",
        "body",
        "data",
        "timeout",
        "timeout_seconds",
        "connect_timeout",
        "verify",
        "verify_ssl",
        "allow_redirects",
    },
    required=({"url", "endpoint"},),
    settings=HttpSettings,
)
def run_http(call: ToolCall) -> Outcome:
    """Send the request described by the call's config and describe the response."""
    cfg = call.config
    url = cfg.get("url") or cfg.get("endpoint")
    if not url or not isinstance(url, str):
        return Outcome.fail(ToolErrorKind.INVALID_ARGS, "http: `url` (or `endpoint`) must be a non-empty string")
    method = str(cfg.get("method") or "GET").upper()
    params = cfg.get("params")
    headers = {str(k): str(v) for k, v in (cfg.get("headers") or {}).items()}
    try:
        headers.update(auth_headers(call.credential))
    except CredentialShapeError as exc:
        return Outcome.fail(ToolErrorKind.CREDENTIAL, f"http: {exc}")

    request: dict[str, Any] = {}
    if "json" in cfg and cfg["json"] is not None:
        request["json"] = cfg["json"]
    payload = cfg.get("payload")
    if payload is not None and "json" not in request:
        if method in BODY_METHODS or params is not None:
            request["json"] = payload
        else:
            params = payload
    raw = cfg.get("body", cfg.get("data"))
    if raw is not None and "json" not in request:
        if isinstance(raw, (str, bytes, dict)):
            request["data"] = raw.encode("utf-8") if isinstance(raw, str) else raw
        else:
            request["data"] = jsonlib.dumps(raw).encode("utf-8")
            headers.setdefault("Content-Type", "application/json")

    timeout = call.timeout if call.timeout is not None else cfg.get("timeout", cfg.get("timeout_seconds"))
    timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT
    connect = cfg.get("connect_timeout")
    phases = (min(float(connect), timeout), timeout) if isinstance(connect, (int, float)) else timeout
    verify = cfg.get("verify", cfg.get("verify_ssl"))
    allow_redirects = cfg.get("allow_redirects")

    started = time.monotonic()
    try:
        response = _get_session().request(
            method,
            url,
            params=_query_params(params),
            headers=headers,
            timeout=phases,
            verify=True if verify is None else verify,
            allow_redirects=True if allow_redirects is None else bool(allow_redirects),
            stream=True,
            **request,
        )
        limit = limits.max_result_bytes()
        size, sha256 = _read_body(response, started + timeout, limit)
    except BodyDeadline:
        return Outcome.fail(
            ToolErrorKind.TIMEOUT, f"{method} {url} timed out after {timeout:g}s: the body was still arriving", True
        )
    except requests.Timeout as exc:
        return Outcome.fail(
            ToolErrorKind.TIMEOUT, f"{method} {url} timed out after {timeout:g}s: {type(exc).__name__}", True
        )
    except requests.ConnectionError as exc:
        return Outcome.fail(ToolErrorKind.CONNECTION, f"{method} {url} could not connect: {exc}", True)
    except requests.RequestException as exc:
        return Outcome.fail(ToolErrorKind.REQUEST_ERROR, f"{method} {url} failed: {type(exc).__name__}: {exc}")
    elapsed = time.monotonic() - started

    response_headers = {k.lower(): v for k, v in response.headers.items()}
    data = {
        "status_code": response.status_code,
        "headers": response_headers,
        "url": response.url,
        "elapsed": round(elapsed, 6),
        "data": _parse_body(response, size, sha256, limit),
    }
    http_info = {"status": response.status_code, "headers": response_headers}
    if response.status_code < 400:
        return Outcome.ok(data, http=http_info)

    kind, retryable = _error_kind(response.status_code)
    snippet = response.content[:ERROR_BODY_SNIPPET].decode(response.encoding or "utf-8", "replace").strip()
    message = f"HTTP {response.status_code} {response.reason or ''} from {method} {response.url}".rstrip()
    if snippet:
        message += f": {snippet}"
    error: dict[str, Any] = {"status": response.status_code}
    retry_after = _retry_after(response.headers.get("retry-after"))
    if retry_after is not None:
        error["retry_after"] = retry_after
    return Outcome.fail(kind, message, retryable, data=data, http=http_info, **error)
