"""The ground of the REST API's routes (api.py, gui_api.py, schedules_api.py): `Api`, the base
handler of every JSON route (JSON in and out, writes behind the Bearer token, a body streamed
under its limit), `ApiError`, an answer other than 2xx as JSON, and what the routes share to read
a body (optional, workload, playbook_text, id_value) and to shape an answer (ids as strings,
NoETL's fields of an execution).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import tornado.web
import yaml

from noetl_celery.core.errors import BrokerUnavailable, ConfigurationError, ExecutionNotFound, NoetlError, PlaybookError
from noetl_celery.dashboard import probes
from noetl_celery.dashboard.handlers import Base
from noetl_celery.dsl import nest_dotted
from noetl_celery.dsl.bounded import InputError, parse_json
from noetl_celery.store import views

T = TypeVar("T")
PLAYBOOK = "Playbook"
CREDENTIALS_501 = (
    "credentials are not registered through this server: a stored secret could not be kept as "
    "safe as NOETL_AUTH_* in the workers' environment (see docs/dsl.md, Credentials)"
)


class ApiError(tornado.web.HTTPError):
    """An answer other than 2xx, sent as JSON: {"detail": ..., "field": ...} (field when a body
    value is wrong)."""

    def __init__(
        self, code: int, detail: str, field: str | None = None, headers: dict[str, str] | None = None, **extra: Any
    ):
        super().__init__(code, reason=_reason(code))
        self.headers = headers or {}
        self.body: dict[str, Any] = {"detail": detail, **({"field": field} if field else {}), **extra}


def _reason(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
READS = frozenset({"GET", "HEAD", "OPTIONS"})


@tornado.web.stream_request_body
class Api(Base):
    """JSON in and out; writes behind the Bearer token.

    The body is streamed (tornado.web.stream_request_body): prepare() checks the token of a write
    and the body's declared size before a byte of it is read, so a request without the token, or
    with a body over NOETL_API_MAX_BODY_BYTES, costs the server nothing; data_received keeps at
    most that many bytes of a body sent without Content-Length."""

    # the methods other than reads that need no token (e.g. POST /api/catalog/list, a read)
    open_methods: frozenset[str] = frozenset()

    # set by make_app: whether executions started here run (a broker's workers, or the embedded
    # worker of `noetl-celery server`); a `dashboard` on the embedded default has none
    runs: bool = True

    def initialize(self, settings: Any, templates: Any, runs: bool = True) -> None:  # type: ignore[override]
        super().initialize(settings, templates)
        self.runs = runs

    def check_xsrf_cookie(self) -> None:
        """No cookie or Basic credentials authorise anything here (see require_token), so a write
        a browser could be made to send is refused anyway: no XSRF token to check."""

    def prepare(self) -> None:
        super().prepare()
        self._chunks: list[bytes] = []
        self._received = 0
        method = self.request.method or "GET"
        if method not in READS and method not in self.open_methods and self.implements(method):
            self.require_token()
        limit = self.noetl.api_max_body_bytes
        declared = self.request.headers.get("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise ApiError(413, f"body: {int(declared)} bytes, more than NOETL_API_MAX_BODY_BYTES ({limit})", "body")
        if self.request.connection is not None:
            # past the limit, data_received answers 413; Tornado itself refuses (400) a chunk announced
            # beyond this margin before reading it
            self.request.connection.set_max_body_size(limit + 1_048_576)  # type: ignore[attr-defined]

    def data_received(self, chunk: bytes) -> None:
        if self._finished:
            return  # answered 413 already: the rest is dropped, and the connection closed after it
        self._received += len(chunk)
        limit = self.noetl.api_max_body_bytes
        if self._received > limit:
            error = ApiError(413, f"body: more than NOETL_API_MAX_BODY_BYTES ({limit}) bytes", "body")
            self.send_error(413, exc_info=(ApiError, error, None))
            return
        self._chunks.append(chunk)

    @classmethod
    def implements(cls, method: str) -> bool:
        """Whether this handler answers `method` (not Tornado's default 405)."""
        name = method.lower()
        return getattr(cls, name, None) is not getattr(tornado.web.RequestHandler, name, None)

    def allowed_methods(self) -> list[str]:
        return [m for m in HTTP_METHODS if self.implements(m)]

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if status_code == 405:
            self.set_header("Allow", ", ".join(self.allowed_methods()))
            exc = ApiError(405, f"{self.request.method} is not allowed here: {', '.join(self.allowed_methods())}")
        if isinstance(exc, ApiError):
            body = exc.body
            for name, value in exc.headers.items():
                self.set_header(name, value)
        elif isinstance(exc, tornado.web.HTTPError) and exc.reason:
            body = {"detail": exc.reason}
        elif probes.outage(exc) is not None:
            body = {"detail": probes.outage(exc)}
            self.set_header("Retry-After", "5")
        else:
            body = {"detail": _reason(status_code)}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(ids_as_strings(views.mask(body)), default=str))

    def answer(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(ids_as_strings(views.mask(body)), default=str))

    def require_token(self) -> None:
        token = self.noetl.dashboard_token
        if token is None:
            raise ApiError(403, "writes are disabled: set NOETL_DASHBOARD_TOKEN on the server to allow them")
        scheme, value = self.credentials()
        if scheme != "bearer" or not hmac.compare_digest(value.encode(), token.encode()):
            raise ApiError(
                401,
                "authentication required: Authorization: Bearer <NOETL_DASHBOARD_TOKEN>",
                headers={"WWW-Authenticate": 'Bearer realm="noetl-celery"'},
            )

    def require_runner(self) -> None:
        if not self.runs:
            raise ApiError(
                503,
                "no worker runs executions started here: set NOETL_BROKER_URL for workers, or serve "
                "with `noetl-celery server` (it runs an embedded worker on the embedded default)",
            )

    def json_body(self) -> dict[str, Any]:
        raw = b"".join(self._chunks)
        if not raw.strip():
            return {}
        try:
            body = parse_json(raw, "body")
        except InputError as exc:
            raise ApiError(400, str(exc), "body") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"body: expected a JSON object, got {type(body).__name__}", "body")
        return body

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a runner function on a thread, its errors as answers."""
        import asyncio

        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except ExecutionNotFound as exc:
            raise ApiError(404, str(exc)) from None
        except PlaybookError as exc:
            not_found = [p for p in exc.problems if p.path == "path" and "no playbook registered" in p.message]
            if not_found:
                raise ApiError(404, not_found[0].message, "path") from None
            raise ApiError(400, "invalid playbook", "content", problems=[str(p) for p in exc.problems]) from None
        except (BrokerUnavailable, ConfigurationError) as exc:
            raise ApiError(503, str(exc).splitlines()[0], headers={"Retry-After": "5"}) from None
        except (yaml.YAMLError, UnicodeError) as exc:  # a playbook text the YAML reader refuses
            raise ApiError(400, f"content: not a YAML text: {str(exc).splitlines()[0][:200]}", "content") from None
        except NoetlError as exc:  # refused by the engine (says why)
            raise ApiError(409, str(exc).splitlines()[0]) from None


# Ids are JSON strings in every answer: execution ids are 64-bit (above 2**53, where JavaScript's
# numbers lose digits), and NoETL's server declares them as strings. A value is an id by its key;
# the playbook's own data (workload, results, inputs) keeps its numbers whatever its keys.
ID_KEYS = frozenset(
    {"id", "children", "cancelled_executions", "next_after", "next_cursor", "rerun_of", "before", "after"}
)
USER_DATA = frozenset({"workload", "results", "result", "ctx", "vars", "context", "input", "element", "args", "plan"})


def is_id_key(key: str) -> bool:
    return key in ID_KEYS or key.endswith(("_id", "_ids"))


def ids_as_strings(value: Any, key: str | None = None) -> Any:
    """`value` with every integer under an id key (or in a list under one) as a decimal string."""
    if isinstance(value, dict):
        return {k: v if k in USER_DATA else ids_as_strings(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [ids_as_strings(item, key) for item in value]
    if key is not None and isinstance(value, int) and not isinstance(value, bool) and is_id_key(key):
        return str(value)
    return value


def id_value(body: dict[str, Any], name: str) -> int | None:
    """body[name] as an id: a JSON string of digits (as this server answers them) or a number."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ApiError(
        400, f"{name}: expected an id (a string of digits, or a whole number), got {json.dumps(value)[:80]}", name
    )


def optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str, default: Any = None) -> Any:
    """body[name] when of `kind` (a bool is not a number here), `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ApiError(400, f"{name}: expected {what}, got {json.dumps(value)[:80]}", name)
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def playbook_text(body: dict[str, Any]) -> str:
    """body["content"]: a playbook's YAML text, base64-encoded (as NoETL's client sends it) or as
    it is (as NoETL's GUI sends it). Text that is valid base64 of UTF-8 is taken as base64: a
    playbook's YAML always has a ':' or a space, which base64 has not."""
    content = body.get("content")
    if not isinstance(content, str) or not content.strip():
        raise ApiError(400, "content: expected the playbook's YAML text (as it is, or base64-encoded)", "content")
    try:
        return base64.b64decode(content, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return content


def resource_kind(body: dict[str, Any]) -> None:
    kind = optional(body, "resource_kind", str, "a string")
    if kind is not None and kind.lower() != "playbook":
        raise ApiError(400, f"resource_kind: only playbook runs here, got {kind!r}", "resource_kind")


def workload(body: dict[str, Any]) -> dict[str, Any]:
    """`workload` (NoETL's client; `payload` in older ones) as overrides, dotted keys nested."""
    name = "workload" if "workload" in body else "payload"
    value = optional(body, name, dict, "a JSON object", {})
    try:
        return nest_dotted(value)
    except ValueError as exc:
        raise ApiError(400, f"{name}: {exc}", name) from None


def listed_execution(r: dict[str, Any]) -> dict[str, Any]:
    """One execution of a list: `noetl-celery executions --json`'s fields and NoETL's (path,
    version, start_time, end_time, duration_seconds, duration_human, progress 0-100)."""
    from noetl_celery.observe.watch import _listed

    created, finished = iso_time(r["created_at"]), iso_time(r["finished_at"])
    done, total = r["done"], r["total"]
    progress = 100 if r["status"] == "completed" else (100 * done // total if total else 0)
    return {
        **_listed(r),
        "path": r.get("playbook_path") or r["playbook_name"],
        "version": "1",
        **{k: v for k, v in noetl_fields(r["status"], created, finished).items() if k not in ("completed", "failed")},
        "progress": progress,
        "child_count": r.get("children", 0),
    }


def noetl_fields(status: str, created_at: str | None, finished_at: str | None) -> dict[str, Any]:
    """NoETL's names for an execution's end and times: completed/failed flags, start_time,
    end_time, duration_seconds and duration_human."""
    start = datetime.fromisoformat(created_at) if created_at else None
    end = datetime.fromisoformat(finished_at) if finished_at else None
    now = datetime.now(UTC if start is not None and start.tzinfo is not None else None)
    seconds = views.duration_s(start, end, now)
    return {
        "completed": status != "running",
        "failed": status == "failed",
        "start_time": created_at,
        "end_time": finished_at,
        "duration_seconds": None if seconds is None else round(seconds, 3),
        "duration_human": None if seconds is None else human(seconds),
    }


def human(seconds: float) -> str:
    """12.3 -> "12s", 3723 -> "1h 2m 3s"."""
    total = int(round(seconds))
    parts = [(total // 86400, "d"), (total % 86400 // 3600, "h"), (total % 3600 // 60, "m"), (total % 60, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n]
    return " ".join(shown) or "0s"


def iso_time(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else value
