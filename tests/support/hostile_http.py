"""A loopback HTTP server that misbehaves on purpose: it echoes credentials back and sends huge bodies.

- `GET /echo`: answers 200 with the bearer token of the Authorization header as it is, percent-
  encoded, base64-encoded and JSON-quoted, plus an `X-Echo` header holding it percent-encoded.
- `GET /reject`: answers 401 with a body quoting the token percent-encoded.
- `GET /big?mb=N`: streams a JSON body of N MB (a list of 1 KB strings), Content-Length set.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, quote, urlsplit

from tests.support.loopback import serve

ITEM = "x" * 1022  # with its quotes, 1 KB of JSON per item
MB = 1024 * 1024


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: object) -> None:  # quiet
        return

    def _token(self) -> str:
        header = self.headers.get("Authorization") or ""
        return header.split(" ", 1)[1] if " " in header else header

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        url = urlsplit(self.path)
        token = self._token()
        if url.path == "/echo":
            body = {
                "raw": token,
                "quoted": quote(token, safe=""),
                "b64": base64.b64encode(token.encode()).decode(),
                "json": json.dumps({"token": token}),
                "sentence": f"you sent {quote(token, safe='')}!",
            }
            self._send(200, json.dumps(body).encode(), {"X-Echo": quote(token, safe="")})
        elif url.path == "/reject":
            self._send(401, json.dumps({"error": f"token {quote(token, safe='')} is not valid"}).encode())
        elif url.path == "/big":
            megabytes = int(parse_qs(url.query).get("mb", ["100"])[0])
            count = megabytes * MB // (len(ITEM) + 3)
            head, tail = b'{"items": [', b"]}"
            item = json.dumps(ITEM).encode()
            length = len(head) + len(tail) + count * len(item) + (count - 1)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            self.wfile.write(head)
            block = b",".join([item] * 1000)
            written = 0
            while written < count:
                n = min(1000, count - written)
                chunk = block if n == 1000 else b",".join([item] * n)
                self.wfile.write((b"," if written else b"") + chunk)
                written += n
            self.wfile.write(tail)
        else:
            self._send(404, b'{"error": "not found"}')


@contextmanager
def hostile_server() -> Iterator[str]:
    """Serve on a free loopback port; yields the base URL."""
    with serve(_Handler) as url:
        yield url
