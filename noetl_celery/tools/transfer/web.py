"""HTTP endpoints of `transfer`: a JSON source (one request; `data_path` picks the list of rows
out of the body, as NoETL's `data_path: data.items`) and a JSON target (each chunk POSTed as
a JSON array of row objects, or under `body_key` as {body_key: [...]}).

Decides: the request (method GET for a source and POST for a target unless `method` says,
`headers`, `params`, `timeout`), and how the side's credential becomes headers: a string is a
bearer token, a mapping gives `headers` and/or `token`/`bearer` (Authorization: Bearer) or
`api_key` with `header` (default X-API-Key). A source body is read whole (a JSON document has
to be); a response other than 2xx fails the copy naming the status. An http target has no key:
a retried copy sends its chunks again (the receiver must be idempotent, or use a database).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from noetl_celery.core.jsonable import to_jsonable
from noetl_celery.tools.transfer.plan import Endpoint, PlanError
from noetl_celery.tools.transfer.rows import Chunk, chunks_of_objects

DEFAULT_TIMEOUT = 60.0  # seconds per request


class HttpError(Exception):
    """The server answered with an error or could not be reached (retryable unless 4xx)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


def auth_headers(credential: Any, secrets: set[str]) -> dict[str, str]:
    if credential is None:
        return {}
    if isinstance(credential, str):
        secrets.add(credential)
        return {"Authorization": f"Bearer {credential}"}
    if not isinstance(credential, dict):
        return {}
    headers = {str(k): str(v) for k, v in (credential.get("headers") or {}).items()}
    secrets.update(headers.values())
    token = credential.get("token") or credential.get("bearer") or credential.get("access_token")
    if token:
        secrets.add(str(token))
        headers["Authorization"] = f"Bearer {token}"
    if credential.get("api_key"):
        secrets.add(str(credential["api_key"]))
        headers[str(credential.get("header") or "X-API-Key")] = str(credential["api_key"])
    return headers


def _request(endpoint: Endpoint, method: str, headers: dict[str, str], body: Any = None) -> Any:
    import requests

    url = endpoint.text("url", "endpoint")
    all_headers = {**{str(k): str(v) for k, v in (endpoint.get("headers") or {}).items()}, **headers}
    try:
        response = requests.request(
            method,
            str(url),
            headers=all_headers,
            params=endpoint.get("params"),
            json=body,
            timeout=float(endpoint.get("timeout") or DEFAULT_TIMEOUT),
        )
    except requests.RequestException as exc:
        raise HttpError(f"{endpoint.side}: request to {url} failed: {type(exc).__name__}", None) from None
    if not 200 <= response.status_code < 300:
        raise HttpError(f"{endpoint.side}: {method} {url} answered HTTP {response.status_code}", response.status_code)
    return response


def read_chunks(endpoint: Endpoint, headers: dict[str, str], size: int, strict: bool) -> Iterator[Chunk]:
    method = (endpoint.text("method") or "GET").upper()
    response = _request(endpoint, method, headers, endpoint.get("body", "json", "data"))
    try:
        data = response.json()
    except ValueError:
        raise PlanError(f"source: {endpoint.text('url')} did not answer JSON") from None
    path = endpoint.text("data_path", "path")
    for part in (path or "").split("."):
        if part and isinstance(data, dict):
            data = data.get(part, [])
    rows = data if isinstance(data, list) else [data]
    yield from chunks_of_objects(rows, size, "source", strict)


class HttpWriter:
    """POSTs each chunk as a JSON array of objects (or {body_key: [...]})."""

    def __init__(self, endpoint: Endpoint, headers: dict[str, str]) -> None:
        self.endpoint, self.headers = endpoint, headers
        self.method = (endpoint.text("method") or "POST").upper()
        self.body_key = endpoint.text("body_key")

    def write(self, chunk: Chunk) -> int:
        objects = [to_jsonable(dict(zip(chunk.columns, row, strict=True))) for row in chunk.rows]
        _request(self.endpoint, self.method, self.headers, {self.body_key: objects} if self.body_key else objects)
        return len(objects)

    def finish(self) -> None:
        """Every chunk was sent as it came."""
