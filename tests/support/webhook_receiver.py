"""A webhook receiver on loopback: records every POST (path, headers, JSON body) and answers with
the next status of a script per path (then 200), so a test can refuse the first delivery."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.support.loopback import serve


@dataclass
class Receiver:
    url: str = ""
    script: dict[str, list[int]] = field(default_factory=dict)  # path -> statuses to answer first
    calls: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c for c in self.calls if c["path"] == path]


@contextmanager
def receiver(script: dict[str, list[int]] | None = None) -> Iterator[Receiver]:
    state = Receiver(script={k: list(v) for k, v in (script or {}).items()})

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: object) -> None:
            return

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with state.lock:
                queue = state.script.get(self.path) or []
                status = queue.pop(0) if queue else 200
                state.calls.append(
                    {
                        "path": self.path,
                        "headers": dict(self.headers),
                        "body": json.loads(raw),
                        "raw": raw,
                        "status": status,
                        "at": time.monotonic(),
                    }
                )
            body = b'{"ok": true}' if status < 300 else b'{"ok": false}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serve(Handler) as url:
        state.url = url
        yield state
