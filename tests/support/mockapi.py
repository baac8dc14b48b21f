"""Mock HTTP API used by the project's tests and demos (see shared/spec/MOCK-API.md).

Stdlib only: a ``ThreadingHTTPServer`` with daemon threads that answers JSON.  Run it in a
background thread with :func:`start_mock_api` (``with start_mock_api() as srv: srv.url``) or in the
foreground with ``python -m tests.support.mockapi --host 127.0.0.1 --port 5555``.

Endpoints and the decisions taken where the spec leaves room:

* Data sets have ``TOTAL_ITEMS`` (35) items, ids 1..35; default page size ``DEFAULT_PAGE_SIZE`` (10).
  Page sizes are read from ``pageSize`` or ``page_size`` and clamped to 1..``MAX_PAGE_SIZE``; a page
  below 1 counts as page 1; a non-numeric number parameter gives 400 ``{error, status}``.
* ``GET /health`` -> ``{"status": "ok"}``.
* ``/api/v1/assessments?page&pageSize`` -> ``{data: [{id, name, score}], paging: {hasMore, page,
  pageSize, total}}``; a page past the end gives ``data: []`` and ``hasMore: false`` (not 404).
* ``/api/v1/users?offset&limit`` -> ``{users: [{id, username, email}], has_more, offset, limit,
  total}``.  When ``page`` is given the request is page-style (offset = (page-1)*pageSize, the size
  from pageSize/page_size/limit) and the body also carries ``data`` (same list as ``users``) and
  ``paging: {hasMore, page, pageSize, total}``, so page-number playbooks see all 35 users too.
* ``/api/v1/events?cursor&limit`` -> ``{events: [{id, type, timestamp}], next_cursor, limit,
  has_more}``.  The cursor is base64 of the page number; empty or undecodable cursors mean page 1;
  ``next_cursor`` is ``null`` on the last page (and past the end).
* ``/api/v1/flaky?page&fail_on=2,3`` -> attempt counts are kept per (page, fail_on set) per server
  instance; a page listed in fail_on answers 500 on its first attempt only (other pages always
  succeed).  Success body ``{data, paging: {hasMore, page, pageSize, total, attempt}}`` with the
  assessments items.  ``POST /api/v1/flaky/reset`` (or ``MockAPI.reset()``) forgets the counts.
* ``/api/v1/errors?error_type=T``: rate_limit|429 -> 429 + Retry-After (``retry_after``, default
  ``DEFAULT_RETRY_AFTER``); server_error|500 -> 500; unavailable|503 -> 503 + Retry-After;
  timeout -> sleeps ``delay``/``timeout_seconds``/``delay_seconds`` (default 1 s, capped at
  ``MAX_TIMEOUT_DELAY``) then answers a normal page; auth|401, forbidden|403, not_found|404 give
  that status.  Anything else answers a normal assessments page.  Error bodies: ``{error, status}``.
* ``/api/v1/rate-limited?requests_per_second=N`` (default 2): one sliding 1 s window per server
  instance; only accepted requests enter the window.  Over the rate: 429 with Retry-After (whole
  seconds until the window frees a slot, at least 1) and ``{error, requests_in_window, limit,
  status}``; else an assessments page plus ``rate_limit: {limit, requests_in_window}`` (counting
  this request).
* ``/api/v1/concurrency/probe?delay_seconds=0.2`` holds the request (delay capped at
  ``MAX_PROBE_DELAY``) while counting active requests; answers ``{ok, delay_seconds, active,
  params}`` echoing every query parameter.  ``GET /api/v1/concurrency/stats`` or
  ``.../probe/stats`` -> ``{max_active, total, active}``; ``POST .../reset`` or ``.../probe/reset``
  zeroes them (max_active and total; requests in flight still finish normally).
* ``/api/v1/patient/{assessments,conditions,medications,vital_signs}?patientId&page&pageSize``:
  the page count is ``1 + (patient_id * 7 + type_offset) % 4`` (1..4 pages; a non-numeric patient
  id is hashed with crc32); body ``{data: [{id, patientId, type, page, value}], paging: {hasMore:
  page < total, page, pageSize, total}}``; every page is full (pageSize items); 404 past the last
  page, 400 without patientId (``patient_id`` is accepted too).
* ``/api/v1/patient/demographics?patientId`` -> one record ``{patientId, firstName, lastName, dob,
  gender, status}``, deterministic per patient id.  ``/api/v1/mds/assessment_ids?patientId`` ->
  ``{patientId, assessmentIds: ["MDS-<id>-001", ...], count}`` (2..5 ids, deterministic);
  ``/api/v1/mds/assessment/<assessment_id>`` -> ``{assessmentId, status: "completed", sections}``
  (3 sections of 3 questions, deterministic per id).  ``patient_hits`` and ``mds_hits`` count the
  requests answered, per (data type, patient id, page) and per assessment id.
* POST is accepted on every data endpoint; a JSON object body is merged over the query parameters.
  Resets also accept GET.  Unknown paths give 404 JSON; other methods give 405 JSON.
* Quiet: request logging is switched off.  The server uses daemon threads and never waits for
  in-flight requests on ``stop()``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

TOTAL_ITEMS = 35
DEFAULT_PAGE_SIZE = 10
MAX_PAGE_SIZE = 1000
DEFAULT_RETRY_AFTER = 5
DEFAULT_TIMEOUT_DELAY = 1.0
MAX_TIMEOUT_DELAY = 30.0
DEFAULT_REQUESTS_PER_SECOND = 2
RATE_WINDOW_SECONDS = 1.0
DEFAULT_PROBE_DELAY = 0.2
MAX_PROBE_DELAY = 10.0
PATIENT_PAGE_MULTIPLIER = 7
PATIENT_MAX_PAGES = 4
MDS_MIN_IDS, MDS_EXTRA_IDS = 2, 4  # 2 + (patient * 3) % 4 assessment ids per patient: 2..5
MDS_SECTIONS = MDS_QUESTIONS = 3
MDS_PREFIX = "/api/v1/mds/assessment/"
FIRST_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus")
LAST_NAMES = ("Moss", "Reyes", "Stone", "Ito", "Khan")
PATIENT_TYPE_OFFSETS = {"assessments": 0, "conditions": 1, "medications": 2, "vital_signs": 3}
EVENT_TYPES = ("click", "view", "purchase", "signup")
ERROR_ALIASES = {
    "rate_limit": 429,
    "429": 429,
    "server_error": 500,
    "500": 500,
    "unavailable": 503,
    "503": 503,
    "auth": 401,
    "401": 401,
    "forbidden": 403,
    "403": 403,
    "not_found": 404,
    "404": 404,
}
RETRY_AFTER_STATUSES = (429, 503)

Params = dict[str, str]
Body = dict[str, Any]
Route = tuple[tuple[str, ...], Callable[[Params], Body]]


class HTTPError(Exception):
    """Raised by a route to answer ``{error, status}`` with the given status."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.headers, self.extra = headers or {}, extra or {}


def _int(params: Params, names: tuple[str, ...], default: int, lo: int = 1, hi: int | None = None) -> int:
    for name in names:
        raw = params.get(name, "").strip()
        if raw:
            try:
                value = int(float(raw))
            except ValueError:
                raise HTTPError(400, f"parameter {name!r} must be a number, got {raw!r}") from None
            return max(lo, min(value, hi) if hi is not None else value)
    return default


def _float(params: Params, names: tuple[str, ...], default: float, cap: float) -> float:
    for name in names:
        raw = params.get(name, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise HTTPError(400, f"parameter {name!r} must be a number, got {raw!r}") from None
            return max(0.0, min(value, cap)) if math.isfinite(value) else cap
    return default


def _page_args(params: Params) -> tuple[int, int]:
    page = _int(params, ("page",), 1)
    size = _int(params, ("pageSize", "page_size"), DEFAULT_PAGE_SIZE, hi=MAX_PAGE_SIZE)
    return page, size


def _ids(offset: int, count: int) -> range:
    return range(offset + 1, min(offset + count, TOTAL_ITEMS) + 1)


def _assessment(i: int) -> Body:
    return {"id": i, "name": f"Assessment {i}", "score": (i * 37) % 101}


def _user(i: int) -> Body:
    return {"id": i, "username": f"user{i}", "email": f"user{i}@example.com"}


def _event(i: int) -> Body:
    return {
        "id": i,
        "type": EVENT_TYPES[i % len(EVENT_TYPES)],
        "timestamp": f"2025-01-01T{i // 60:02d}:{i % 60:02d}:00Z",
    }


def _assessments_page(params: Params) -> Body:
    page, size = _page_args(params)
    data = [_assessment(i) for i in _ids((page - 1) * size, size)]
    paging = {"hasMore": page * size < TOTAL_ITEMS, "page": page, "pageSize": size, "total": TOTAL_ITEMS}
    return {"data": data, "paging": paging}


def _encode_cursor(page: int) -> str:
    return base64.b64encode(str(page).encode()).decode()


def _decode_cursor(cursor: str) -> int:
    try:
        page = int(base64.b64decode(cursor + "=" * (-len(cursor) % 4), validate=True).decode())
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return 1
    return max(page, 1)


def _patient_number(raw: str) -> int:
    try:
        return abs(int(raw))
    except ValueError:
        return zlib.crc32(raw.encode())


class MockAPI:
    """Per-instance state: flaky attempt counts, concurrency probe counters, rate-limit window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.flaky_attempts: dict[tuple[int, tuple[int, ...]], int] = {}
        self.active = self.max_active = self.total = 0
        self._window: deque[float] = deque()
        # requests answered by the patient endpoints, by (data type, patient id, page)
        self.patient_hits: Counter[tuple[str, str, int]] = Counter()
        self.mds_hits: Counter[str] = Counter()

    def reset(self) -> None:
        with self._lock:
            self.flaky_attempts.clear()
            self.patient_hits.clear()
            self.mds_hits.clear()
            self.active = self.max_active = self.total = 0
            self._window.clear()

    def reset_concurrency(self) -> None:
        with self._lock:
            self.max_active = self.total = 0

    def concurrency_stats(self) -> dict[str, int]:
        with self._lock:
            return {"max_active": self.max_active, "total": self.total, "active": self.active}

    # -- routes: each takes the merged params and returns a JSON body (or raises HTTPError) --

    def health(self, params: Params) -> Body:
        return {"status": "ok"}

    def assessments(self, params: Params) -> Body:
        return _assessments_page(params)

    def users(self, params: Params) -> Body:
        page_style = bool(params.get("page", "").strip())
        if page_style:
            page = _int(params, ("page",), 1)
            limit = _int(params, ("pageSize", "page_size", "limit"), DEFAULT_PAGE_SIZE, hi=MAX_PAGE_SIZE)
            offset = (page - 1) * limit
        else:
            limit = _int(params, ("limit", "pageSize", "page_size"), DEFAULT_PAGE_SIZE, hi=MAX_PAGE_SIZE)
            offset = _int(params, ("offset",), 0, lo=0)
        users = [_user(i) for i in _ids(offset, limit)]
        has_more = offset + limit < TOTAL_ITEMS
        body: dict[str, Any] = {
            "users": users,
            "has_more": has_more,
            "offset": offset,
            "limit": limit,
            "total": TOTAL_ITEMS,
        }
        if page_style:
            body["data"] = users
            body["paging"] = {"hasMore": has_more, "page": page, "pageSize": limit, "total": TOTAL_ITEMS}
        return body

    def events(self, params: Params) -> Body:
        limit = _int(params, ("limit", "pageSize", "page_size"), DEFAULT_PAGE_SIZE, hi=MAX_PAGE_SIZE)
        page = _decode_cursor(params.get("cursor", "").strip())
        has_more = page * limit < TOTAL_ITEMS
        return {
            "events": [_event(i) for i in _ids((page - 1) * limit, limit)],
            "next_cursor": _encode_cursor(page + 1) if has_more else None,
            "limit": limit,
            "has_more": has_more,
        }

    def flaky(self, params: Params) -> Body:
        page, _ = _page_args(params)
        fail_on = tuple(
            sorted({int(p) for p in params.get("fail_on", "").replace(" ", "").split(",") if p.lstrip("-").isdigit()})
        )
        with self._lock:
            key = (page, fail_on)
            attempt = self.flaky_attempts[key] = self.flaky_attempts.get(key, 0) + 1
        if page in fail_on and attempt == 1:
            raise HTTPError(500, f"simulated failure on page {page} (attempt {attempt})")
        body = _assessments_page(params)
        body["paging"]["attempt"] = attempt
        return body

    def flaky_reset(self, params: Params) -> Body:
        with self._lock:
            self.flaky_attempts.clear()
        return {"status": "reset"}

    def errors(self, params: Params) -> Body:
        error_type = params.get("error_type", "").strip().lower()
        if error_type == "timeout":
            time.sleep(
                _float(params, ("delay", "timeout_seconds", "delay_seconds"), DEFAULT_TIMEOUT_DELAY, MAX_TIMEOUT_DELAY)
            )
            return _assessments_page(params)
        status = ERROR_ALIASES.get(error_type)
        if status is None:
            return _assessments_page(params)
        headers: dict[str, str] = {}
        if status in RETRY_AFTER_STATUSES:
            headers["Retry-After"] = str(_int(params, ("retry_after",), DEFAULT_RETRY_AFTER, lo=0))
        raise HTTPError(status, f"simulated {error_type} error", headers)

    def rate_limited(self, params: Params) -> Body:
        limit = _int(params, ("requests_per_second",), DEFAULT_REQUESTS_PER_SECOND)
        body = _assessments_page(params)
        with self._lock:
            now = time.monotonic()
            while self._window and now - self._window[0] >= RATE_WINDOW_SECONDS:
                self._window.popleft()
            in_window = len(self._window)
            if in_window >= limit:
                wait = self._window[in_window - limit] + RATE_WINDOW_SECONDS - now
                raise HTTPError(
                    429,
                    "rate limit exceeded",
                    {"Retry-After": str(max(1, math.ceil(wait)))},
                    {"requests_in_window": in_window, "limit": limit},
                )
            self._window.append(now)
            in_window += 1
        body["rate_limit"] = {"limit": limit, "requests_in_window": in_window}
        return body

    def probe(self, params: Params) -> Body:
        delay = _float(params, ("delay_seconds", "delay"), DEFAULT_PROBE_DELAY, MAX_PROBE_DELAY)
        with self._lock:
            self.active += 1
            self.total += 1
            self.max_active = max(self.max_active, self.active)
            active = self.active
        try:
            time.sleep(delay)
        finally:
            with self._lock:
                self.active -= 1
        return {"ok": True, "delay_seconds": delay, "active": active, "params": dict(params)}

    def probe_stats(self, params: Params) -> Body:
        return self.concurrency_stats()

    def probe_reset(self, params: Params) -> Body:
        self.reset_concurrency()
        return {"status": "reset", **self.concurrency_stats()}

    def patient(self, data_type: str, params: Params) -> Body:
        raw_id = (params.get("patientId") or params.get("patient_id") or "").strip()
        if not raw_id:
            raise HTTPError(400, "patientId is required")
        page, size = _page_args(params)
        number = _patient_number(raw_id)
        total = 1 + (number * PATIENT_PAGE_MULTIPLIER + PATIENT_TYPE_OFFSETS[data_type]) % PATIENT_MAX_PAGES
        if page > total:
            raise HTTPError(404, f"page {page} past the end ({total} pages) for patient {raw_id}")
        with self._lock:
            self.patient_hits[(data_type, raw_id, page)] += 1
        data = [
            {
                "id": (page - 1) * size + i,
                "patientId": raw_id,
                "type": data_type,
                "page": page,
                "value": f"{data_type}-{raw_id}-{page}-{i}",
            }
            for i in range(1, size + 1)
        ]
        return {"data": data, "paging": {"hasMore": page < total, "page": page, "pageSize": size, "total": total}}

    def demographics(self, params: Params) -> Body:
        raw_id = (params.get("patientId") or params.get("patient_id") or "").strip()
        if not raw_id:
            raise HTTPError(400, "patientId is required")
        n = _patient_number(raw_id)
        with self._lock:
            self.patient_hits[("demographics", raw_id, 1)] += 1
        return {
            "patientId": raw_id,
            "firstName": FIRST_NAMES[n % len(FIRST_NAMES)],
            "lastName": LAST_NAMES[n % len(LAST_NAMES)],
            "dob": f"19{40 + n % 60:02d}-{1 + n % 12:02d}-{1 + n % 28:02d}",
            "gender": "F" if n % 2 else "M",
            "status": "active",
        }

    def mds_assessment_ids(self, params: Params) -> Body:
        raw_id = (params.get("patientId") or params.get("patient_id") or "").strip()
        if not raw_id:
            raise HTTPError(400, "patientId is required")
        count = MDS_MIN_IDS + (_patient_number(raw_id) * 3) % MDS_EXTRA_IDS
        return {
            "patientId": raw_id,
            "assessmentIds": [f"MDS-{raw_id}-{i:03d}" for i in range(1, count + 1)],
            "count": count,
        }

    def mds_assessment(self, assessment_id: str) -> Body:
        with self._lock:
            self.mds_hits[assessment_id] += 1
        seed = zlib.crc32(assessment_id.encode())
        sections = [
            {
                "sectionId": f"S{s + 1}",
                "questions": [
                    {"key": f"S{s + 1}Q{q + 1}", "responses": [{"responseValue": str((seed >> (s * 3 + q)) % 5)}]}
                    for q in range(MDS_QUESTIONS)
                ],
            }
            for s in range(MDS_SECTIONS)
        ]
        return {"assessmentId": assessment_id, "status": "completed", "sections": sections}

    def routes(self) -> dict[str, Route]:
        data = ("GET", "POST")
        routes: dict[str, Route] = {
            "/health": (("GET",), self.health),
            "/api/v1/assessments": (data, self.assessments),
            "/api/v1/users": (data, self.users),
            "/api/v1/events": (data, self.events),
            "/api/v1/flaky": (data, self.flaky),
            "/api/v1/flaky/reset": (data, self.flaky_reset),
            "/api/v1/errors": (data, self.errors),
            "/api/v1/rate-limited": (data, self.rate_limited),
            "/api/v1/concurrency/probe": (data, self.probe),
            "/api/v1/patient/demographics": (data, self.demographics),
            "/api/v1/mds/assessment_ids": (data, self.mds_assessment_ids),
        }
        for prefix in ("/api/v1/concurrency", "/api/v1/concurrency/probe"):
            routes[f"{prefix}/stats"] = (("GET",), self.probe_stats)
            routes[f"{prefix}/reset"] = (data, self.probe_reset)
        for data_type in PATIENT_TYPE_OFFSETS:
            routes[f"/api/v1/patient/{data_type}"] = (data, partial(self.patient, data_type))
        return routes


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], state: MockAPI) -> None:
        self.state = state
        self.routes = state.routes()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet by default
        pass

    def _handle(self) -> None:
        self._dispatch(self.command)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        try:
            params: Params = dict(parse_qsl(url.query, keep_blank_values=True))
            params.update(self._body_params())
            route = self.server.routes.get(path)
            if route is None and path.startswith(MDS_PREFIX) and len(path) > len(MDS_PREFIX):
                assessment_id = path[len(MDS_PREFIX) :]
                route = (("GET", "POST"), lambda _p: self.server.state.mds_assessment(assessment_id))
            if route is None:
                raise HTTPError(404, f"no such endpoint: {path}")
            methods, handler = route
            if method not in methods:
                raise HTTPError(405, f"method {method} not allowed on {path}", {"Allow": ", ".join(methods)})
            self._send(200, handler(params), {})
        except HTTPError as exc:
            self._send(exc.status, {"error": exc.message, "status": exc.status, **exc.extra}, exc.headers)
        except Exception as exc:  # a bug in a route must still answer JSON
            self._send(500, {"error": f"internal error: {exc!r}", "status": 500}, {})

    def _body_params(self) -> Params:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise HTTPError(400, "invalid Content-Length") from None
        raw = self.rfile.read(length) if length > 0 else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            return dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
        if not isinstance(body, dict):
            return {}
        return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in body.items()}

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)


class MockServer:
    """A running mock API; ``url``, ``state`` and ``stop()``; usable as a context manager."""

    def __init__(self, httpd: _Server, thread: threading.Thread | None) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.host, self.port = str(host), int(port)
        self.url = f"http://{self.host}:{self.port}"
        self.state: MockAPI = httpd.state

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> MockServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_mock_api(host: str = "127.0.0.1", port: int = 0, state: MockAPI | None = None) -> MockServer:
    """Start the mock API in a daemon thread and return the running server."""
    httpd = _Server((host, port), state or MockAPI())
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="noetl-mockapi", daemon=True
    )
    thread.start()
    return MockServer(httpd, thread)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="NoETL mock HTTP API for tests and demos")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5555)
    args = parser.parse_args(argv)
    httpd = _Server((args.host, args.port), MockAPI())
    print(f"mock API listening on {MockServer(httpd, None).url}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    main()
